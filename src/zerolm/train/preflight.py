"""What a run says before its first step: its sizes, per-device bytes, FLOPs, the compiled step's collectives,
its memory against the device and the remat auto chose; and the facts of the run its metrics record."""

from __future__ import annotations

from typing import Any

import jax

import zerolm
from zerolm.compile import collectives as comms
from zerolm.config.tree import Config
from zerolm.core import tpu_flags
from zerolm.model.decoder import count_params
from zerolm.model.flops import flops_per_token
from zerolm.observe.mfu import Accounting
from zerolm.parallel.build import BuiltStep, describe_remat_choice
from zerolm.parallel.sharding import abstract_views, shard_bytes, with_shardings
from zerolm.parallel.zero import Zero


def accounting_for(cfg: Config, zero: Zero) -> Accounting:
    """The run's FLOP accounting (6·N + 12·L·d·T per token, N what a matmul reads: model.count_params) on these devices."""
    n = count_params(zero.abstract_params, matmul_only=True)
    return Accounting(flops_per_token(n, cfg.model.n_layer, cfg.model.d_model, cfg.model.seq_len),
                      jax.device_count(), jax.devices()[0].device_kind)


def run_facts(cfg: Config, zero: Zero, accounting: Accounting) -> dict[str, Any]:
    """What metrics.jsonl's header and wandb's run config record of the run beside its config."""
    return {"params": count_params(zero.abstract_params), "devices": jax.device_count(),
            "device_kind": accounting.device_kind, "processes": jax.process_count(),
            "mesh": {"dp": cfg.dp, "tp": cfg.mesh.tp, "slices": cfg.mesh.slices}, "accum_steps": cfg.accum_steps,
            "tokens_per_step": cfg.train.global_batch_size * cfg.model.seq_len,
            "flops_per_token": accounting.flops_per_token, "zerolm_version": zerolm.__version__}


def describe_step(built: BuiltStep, accounting: Accounting, memory: str | None, limit: int | None) -> list[str]:
    """The header's lines about the step: sizes, bytes per device, FLOPs, documents, collectives per step,
    the compiled peak against the device (`memory`, zerolm.parallel.build.check_fits) and remat auto's choice."""
    lines = _sizes(built, accounting)
    if jax.devices()[0].platform == "tpu" and (flags := tpu_flags.applied()):
        lines.append(flags.line())
    if built.cfg.model.document_mask:
        m = built.cfg.model
        lines.append(f"documents: attention stays inside each document of a sample (end-of-text {m.eot_id}), "
                     f"positions {'restart per document' if m.document_positions == 'restart' else 'continue'}")
    texts = built.compiled.texts
    try:
        traffic = comms.traffic(texts, dict(built.zero.mesh.shape))
        lines += ["collectives per step: " + line for line in comms.describe(traffic, list(texts))]
    except ValueError as e:  # HLO this zerolm cannot read: the header says so, the run goes on
        lines.append(f"collectives per step: not read ({e})")
    if memory:
        lines.append(memory)
    if remat := describe_remat_choice(built, limit):
        lines.append(remat)
    return lines


def _stage_trade(stage: int, accum_steps: int) -> list[str]:
    """What a stage above 1 pays for its memory, in the header's words (docs/zero-stages.md)."""
    if stage == 1:
        return []
    per = (f"each layer's gradient reduce-scattered every micro-step, {accum_steps} times per step where ZeRO-1 reduces "
           "once" if accum_steps > 1 else "each layer's gradient reduce-scattered once per step (one micro-step), as "
           "ZeRO-1 reduces")
    if stage == 2:
        return [f"ZeRO-2: the gradient split over dp, {per}; the update all-gathers the params"]
    return [f"ZeRO-3: params and gradient split over dp; each layer's params all-gathered twice per micro-step "
            f"(forward, and again for its backward pass), {per}; no all-gather in the update"]


def _sizes(built: BuiltStep, accounting: Accounting) -> list[str]:
    cfg, zero = built.cfg, built.zero
    table = zero.table
    params = with_shardings(zero.working_params, table.param_shardings)
    opt = with_shardings(jax.eval_shape(zero.tx.init, abstract_views(table.layouts, zero.abstract_params)),
                         table.opt_shardings)
    # Stage 1 accumulates whole over dp (as the params are at 1 and 2), stages 2 and 3 in the optimizer layout.
    held = params if zero.stage == 1 else with_shardings(abstract_views(table.layouts, zero.working_params),
                                                         table.view_shardings)
    accumulator = shard_bytes(jax.tree.map(
        lambda p: jax.ShapeDtypeStruct(p.shape, cfg.zero.accumulate_dtype, sharding=p.sharding), held))
    tokens = cfg.train.global_batch_size * cfg.model.seq_len
    scatter = f" ({zero.scatter})" if cfg.zero.grad_reduce == "reduce_scatter" and zero.scatter != "collective" else ""
    mib = lambda n: f"{n / 2**20:,.1f} MiB"  # noqa: E731
    slices = f"slices={cfg.mesh.slices} × " if cfg.mesh.slices > 1 else ""
    return [f"zerolm: {cfg.name}: {count_params(zero.abstract_params) / 1e6:.2f}M params, {jax.device_count()} "
            f"{accounting.device_kind} device(s) in {jax.process_count()} process(es), mesh {slices}dp={cfg.dp} "
            f"tp={cfg.mesh.tp}, {cfg.accum_steps} accumulation step(s) of {cfg.train.micro_batch_size} sequence(s) "
            f"per device, {cfg.train.global_batch_size} sequences = {tokens:,} tokens per step, "
            f"ZeRO-{zero.stage}, grad_reduce={cfg.zero.grad_reduce}{scatter}, precision={cfg.zero.precision}, "
            f"attention {built.model.cfg.attention}",
            *_stage_trade(zero.stage, cfg.accum_steps),
            f"per device: params {mib(shard_bytes(params))}, gradient accumulator {mib(accumulator)}, optimizer state "
            f"{mib(shard_bytes(opt))} (1/{cfg.dp * cfg.mesh.tp} of it, plus padding"
            + (f"; each of the {cfg.mesh.slices} slices holds all of it" if cfg.mesh.slices > 1 else "")
            + (", master weights included" if zero.mixed else "")
            + (", the params' moving average (train.ema) included" if cfg.train.ema is not None else "")
            + "); activations not counted",
            accounting.describe()]
