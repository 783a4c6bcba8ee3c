"""The fastest plan that fits a target, by the compiler: `zerolm compile --fastest`.

Searches ZeRO stage × micro-batch × remat policy, then the attention block of the best, for a config on a
TPU slice or a GPU host. The planner prunes first: micro-batches from its advice (zerolm.compile.micro_batch_search.planned)
halved and doubled (those that divide a rank's sequences), and any candidate whose planned memory exceeds
the usable memory by PRUNE_MARGIN (its estimate without remat for remat none, with full remat, the least
any policy keeps, for the others). At dp = 1 the stages shard nothing, so only stage 1 is compiled. Each
remaining candidate is compiled (zerolm.parallel.build.build_and_compile, as `zerolm compile` does; the reshard
and update programs, which only the stage changes, once per stage: SharedPrograms), from the smallest
micro-batch up; a micro-batch that does not fit ends its (stage, remat) row. Each compiled step is timed by
zerolm.compile.step_time's model, and the fastest that fits wins. Where the attention is blockwise or Pallas's,
the winner's attention block is then tried at half and twice its size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from zerolm.compile import aot, step_time
from zerolm.compile.aot import preset_for
from zerolm.compile.micro_batch_search import planned
from zerolm.core.errors import ZerolmError
from zerolm.parallel.auto import REMAT_ORDER
from zerolm.parallel.build import SharedPrograms

__all__ = ["REMAT_ORDER", "STAGES", "REMATS", "search", "compile_plan", "describe"]

STAGES = (1, 2, 3)
REMATS = ("none", "dots_attention", "dots", "full")
PRUNE_MARGIN = 1.5  # the planner's memory over the usable memory beyond which a candidate is not compiled
BLOCKED = ("blockwise", "pallas")  # attentions with a block size to search


class NoPreset(ZerolmError):
    """A target the planner has no device preset for (no peak or link bandwidth to time it with)."""


@dataclasses.dataclass
class Candidate:
    stage: int
    micro: int
    remat: str
    block: int | None  # model.attention_block, where the attention is blockwise or Pallas's
    peak_bytes: int | None  # None: the compiler refused a program for its size
    fits: bool
    model: step_time.StepModel | None  # None: a program was refused

    def sets(self) -> list[str]:
        return [f"zero.stage={self.stage}", f"train.micro_batch_size={self.micro}", f"model.remat={self.remat}"] + \
            ([f"model.attention_block={self.block}"] if self.block is not None else [])


@dataclasses.dataclass
class Search:
    config: str
    target: str
    usable_bytes: int
    candidates: list[Candidate]  # compiled, in order
    pruned: int  # candidates the planner ruled out without compiling

    @property
    def winner(self) -> Candidate | None:
        fitting = [c for c in self.candidates if c.fits and c.model is not None]
        return min(fitting, key=lambda c: c.model.step_s) if fitting else None  # type: ignore[union-attr]


def _micro_batches(per_rank: int, advised: int | None) -> list[int]:
    divisors = [b for b in range(1, per_rank + 1) if per_rank % b == 0]
    around = advised or 1
    return [b for b in divisors if around // 2 <= b <= around * 2] or divisors[:1]


def _planned_bytes(config: str, sets: list[str], target: aot.Target, dp: int, tp: int) -> Callable[[int, int, str], float]:
    """(stage, micro, remat) -> the planner's step memory per device (its `memory`)."""
    from zerolm.core.hardware import preset
    from zerolm.data.dataset import load_planned
    from zerolm.plan import Parallelism, Planner, PlanSettings, from_config

    device = preset(preset_for(target) or "")

    def planned_bytes(stage: int, micro: int, remat: str) -> float:
        cfg = load_planned(config, [*sets, f"mesh.dp={dp}", f"mesh.tp={tp}", "train.micro_batch_size=1",
                                    f"model.remat={'none' if remat == 'none' else 'full'}"])
        model, factory = from_config(cfg, dp, tp)
        planner = Planner(model, factory, device, Parallelism(dp, tp, cfg.train.global_batch_size, cfg.mesh.slices),
                          PlanSettings(cfg.zero.precision, stage=stage))
        return planner.memory(stage, micro)["total_bytes"]

    return planned_bytes


def compile_plan(config: str, sets: list[str], target: aot.Target, devices: list | None = None,
                 usable: int | None = None, shared: SharedPrograms | None = None) -> tuple[Candidate, str]:
    """One candidate compiled (`sets` name its stage, micro-batch, remat and block) and its attention: what
    the search compiles for each, and times by zerolm.compile.step_time. `shared`: the search's programs that
    only the stage changes (SharedPrograms)."""
    from zerolm.core.hardware import preset
    from zerolm.data.dataset import load_planned
    from zerolm.parallel.build import build_and_compile, step_peak
    from zerolm.parallel.mesh import make_mesh

    devices = devices or aot.run_devices(target, config, sets)
    usable = usable if usable is not None else aot.usable_bytes(target, devices[0])
    cfg = load_planned(config, sets, device_count=len(devices))
    built = build_and_compile(cfg, make_mesh(cfg.dp, cfg.mesh.tp, devices, cfg.mesh.slices), usable, shared=shared)
    peak = step_peak(built.compiled, built.zero, built.cfg)
    m = None if built.compiled.refused else step_time.of_step(built, preset(preset_for(target) or ""))
    attention = built.model.cfg.attention
    c = built.cfg
    return Candidate(c.zero.stage, c.train.micro_batch_size, c.model.remat,
                     c.model.attention_block if attention in BLOCKED else None,
                     peak, peak is not None and peak <= usable, m), attention


def search(config: str, sets: list[str], target: aot.Target, *, stages=STAGES, remats=REMATS,
           on_compile: Callable[[Candidate], None] = lambda c: None) -> Search:
    """The fastest plan of `config` (with `sets`) that fits `target` (see the module docstring)."""
    from zerolm.data.dataset import load_planned

    if preset_for(target) is None:
        raise NoPreset(f"--fastest: the planner has no device preset for {target.name} (its peak and links time "
                       "the step); targets with one: TPU v3, v4, v5e, v5p; h100, h200, a100-80g")
    devices = aot.run_devices(target, config, sets)
    usable = aot.usable_bytes(target, devices[0])
    base = load_planned(config, [*sets, "train.micro_batch_size=1"], device_count=len(devices))
    dp, tp = base.dp, base.mesh.tp
    advised = planned(config, [*sets, f"mesh.dp={dp}", "train.micro_batch_size=1"], target, dp, tp)
    micros = _micro_batches(base.train.global_batch_size // base.data_ranks, advised)
    planned_bytes = _planned_bytes(config, sets, target, dp, tp)
    found: list[Candidate] = []
    pruned = 0
    attention = None
    shared = SharedPrograms()  # the reshard and update programs: once per stage, not once per candidate
    for stage in (stages if dp > 1 else stages[:1]):
        for remat in sorted(remats, key=REMAT_ORDER.index):
            for i, micro in enumerate(micros):
                if planned_bytes(stage, micro, remat) > PRUNE_MARGIN * usable:
                    pruned += len(micros) - i
                    break
                c, attention = compile_plan(config, [*sets, f"zero.stage={stage}", f"train.micro_batch_size={micro}",
                                                 f"model.remat={remat}"], target, devices, usable, shared)
                found.append(c)
                on_compile(c)
                if not c.fits:
                    break
    result = Search(base.name, target.name, usable, found, pruned)
    best = result.winner
    if best is not None and best.block is not None and attention in BLOCKED:
        for block in (best.block // 2, best.block * 2):
            if 0 < block <= base.model.seq_len:
                try:
                    c, _ = compile_plan(config, [*sets, *dataclasses.replace(best, block=block).sets()], target, devices,
                                        usable, shared)
                except ZerolmError:  # a block the attention refuses (Pallas's lanes): not a candidate
                    continue
                found.append(c)
                on_compile(c)
    return result


def _gib(n: int | None) -> str:
    return "refused" if n is None else f"{n / 2**30:.2f}"


def row(c: Candidate) -> str:
    m = c.model
    timing = (f"{m.flops_ratio:9.3f} {m.sent_bytes / 1e9:7.3f} {m.exposed_bytes / 1e9:10.3f} {m.step_s:9.3g} "
              f"{m.tokens_per_s:12,.0f} {f'{m.mfu:.1%}' if m.mfu is not None else '-':>6s}"
              if m else f"{'-':>9s} {'-':>7s} {'-':>10s} {'-':>9s} {'-':>12s} {'-':>6s}")
    return (f"  {c.stage:5d} {c.micro:5d} {c.remat:>14s} {c.block if c.block is not None else '-':>5} "
            f"{_gib(c.peak_bytes):>8s} {'yes' if c.fits else 'no':>4s} {timing}")


HEADER = (f"  {'stage':>5s} {'micro':>5s} {'remat':>14s} {'block':>5s} {'peak GiB':>8s} {'fits':>4s} "
          f"{'FLOPs/mdl':>9s} {'sent GB':>7s} {'exposed GB':>10s} {'step s':>9s} {'tokens/s':>12s} {'MFU':>6s}")


def describe(s: Search, table: bool = True) -> list[str]:
    """The search's summary, its table (unless `table` is False: printed row by row as it ran) and the winner."""
    lines = [f"fastest plan of {s.config} on {s.target} (usable {s.usable_bytes / 2**30:.2f} GiB per device): "
             f"{len(s.candidates)} compiles, {s.pruned} candidates pruned by the planner's memory (over "
             f"{PRUNE_MARGIN}x the usable)", *([HEADER, *map(row, s.candidates)] if table else []),
             "  (FLOPs/mdl: the compiled matmul FLOPs per token over the model's 6·N + 12·L·d·T; sent GB: every "
             "collective's bytes per device per step; exposed GB: those the schedule does not overlap; step s: "
             "zerolm.compile.step_time's model, a lower bound; MFU: at that step, an upper bound, '-' where it exceeds 100%)"]
    best = s.winner
    if best is None:
        lines.append("no candidate fits")
    else:
        lines.append(f"fastest that fits: {' '.join('--set ' + x for x in best.sets())}")
    return lines
