"""The training step from a config: the model, the optimizer and its schedule, and the ZeRO-1 step on a mesh.

One place below everything that needs the step as a run would build it: `zerolm train`, `zerolm comms`,
`zerolm compile`, the planner's exact bytes and the benchmarks. No data, no checkpoints, no I/O.
"""

from __future__ import annotations

import functools

import jax
from jax.sharding import Mesh

from zerolm import model as gpt_model
from zerolm.config import Config, ConfigError
from zerolm.zero import Zero1, make_optimizer


def build_step(cfg: Config, mesh: Mesh) -> tuple[gpt_model.GPT, Zero1, functools.partial]:
    """The model, its ZeRO-1 step on `mesh` and its init function, as the config says (vocab resolved;
    the model's `auto` dtype and attention for the mesh's devices, which may be a TPU slice compiled for
    ahead of time)."""
    device = mesh.devices.flat[0]
    if (why := gpt_model.unrunnable_attention(cfg.model, device)) is not None:
        raise ConfigError(why)
    model = gpt_model.GPT(gpt_model.for_device(cfg.model, device))
    init_fn = functools.partial(gpt_model.init_params, model)
    tx, schedule = make_optimizer(cfg.train)
    zero = Zero1(mesh, functools.partial(gpt_model.lm_loss, model), tx, jax.eval_shape(init_fn, jax.random.key(0)),
                 logical_axes=gpt_model.logical_axes(model), grad_reduce=cfg.zero.grad_reduce, lr_schedule=schedule,
                 precision=cfg.zero.precision, accumulate_dtype=cfg.zero.accumulate_dtype,
                 scatter=cfg.zero.scatter)
    return model, zero, init_fn
