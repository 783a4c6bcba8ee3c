"""What the compiler really did to the training step: every collective of its three programs.

The gradient step, the reshard and the update are lowered and compiled for the run's mesh (the same
programs the loop runs: JAX keeps the executables, so the loop does not compile them again), and
their optimized HLO is read by `zerolm.hlo`: each collective's kind, result bytes per device, the
mesh axes it runs over, and whether it sits inside the accumulation loop.
"""

from __future__ import annotations

import collections
import dataclasses

import jax
import numpy as np

from zerolm import hlo
from zerolm.sharding import abstract_views, with_shardings
from zerolm.zero import Zero1

PROGRAMS = ("grad", "reshard", "update")


@dataclasses.dataclass(frozen=True)
class Traffic:
    """The collectives of one kind, over one set of mesh axes, in or out of the loop, of one program."""

    program: str  # grad | reshard | update
    op: str  # all-reduce, reduce-scatter, all-gather, ...
    axes: tuple[str, ...]  # mesh axes the replica groups span, e.g. ("dp",)
    in_loop: bool
    count: int
    bytes: int  # result bytes per device, summed over the `count` collectives

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "axes": list(self.axes)}


def compiled_texts(zero: Zero1, micro_batch: int, seq_len: int, accum_steps: int) -> dict[str, str]:
    """The optimized HLO of the step's programs, compiled for abstract inputs of the run's shapes."""
    params = with_shardings(zero.abstract_params, zero.param_shardings)
    batch = jax.ShapeDtypeStruct((accum_steps, zero.dp * micro_batch, seq_len + 1), np.int32,
                                 sharding=zero.batch_sharding)
    views = with_shardings(abstract_views(zero.layouts, zero.abstract_params), zero.view_shardings)
    opt_state = with_shardings(jax.eval_shape(zero.tx.init, views), zero.opt_shardings)
    step = jax.ShapeDtypeStruct((), np.int32, sharding=zero.replicated)
    return {"grad": hlo.compiled_text(zero.grad, params, batch),
            "reshard": hlo.compiled_text(zero.reshard, params),
            "update": hlo.compiled_text(zero.update, views, views, opt_state, step)}


def traffic(texts: dict[str, str], mesh_shape: dict[str, int]) -> list[Traffic]:
    rows: dict[tuple, list[int]] = collections.defaultdict(lambda: [0, 0])
    for program, text in texts.items():
        for c in hlo.collectives(text):
            key = (program, c.op, hlo.axes_label(c, mesh_shape), c.in_loop)
            rows[key][0] += 1
            rows[key][1] += c.bytes
    return [Traffic(p, op, axes, in_loop, count, nbytes)
            for (p, op, axes, in_loop), (count, nbytes) in sorted(rows.items(), key=lambda kv: (
                PROGRAMS.index(kv[0][0]), kv[0][3], kv[0][1], kv[0][2]))]


def describe(rows: list[Traffic]) -> list[str]:
    """One line per program: its collectives, grouped."""
    lines = []
    for program in PROGRAMS:
        mine = [r for r in rows if r.program == program]
        if not mine:
            lines.append(f"{program}: no collective")
            continue
        parts = [f"{r.count} {r.op} over {'+'.join(r.axes) or 'no axis'} ({_mib(r.bytes)}) "
                 + ("INSIDE a loop: every micro-step" if r.in_loop else "once per step") for r in mine]
        lines.append(f"{program}: " + "; ".join(parts))
    return lines


def _mib(n: int) -> str:
    if n >= 2**20:
        return f"{n / 2**20:.2f} MiB"
    return f"{n / 2**10:.1f} KiB" if n >= 2**10 else f"{n} B"
