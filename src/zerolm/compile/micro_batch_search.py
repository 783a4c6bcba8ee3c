"""The largest micro-batch that fits a TPU slice or a GPU, by the compiler: the planner's advice, checked.

`zerolm plan` advises a micro-batch from its model of the step's peak with a safety margin
(plan.SAFETY_MARGIN), so its advice is never more than the compiler fits but may be less. `search`
starts from that advice and compiles the step (aot.compile_for) up the micro-batches that divide a
rank's sequences while they fit, or down from the advice until one fits: usually two compiles (of the
gradient's program; the others, which no micro-batch changes, once).
"""

from __future__ import annotations

import dataclasses
import shlex
from collections.abc import Callable, Sequence
from typing import Any

from zerolm.compile import aot
from zerolm.compile.aot import PRESETS, preset_for
from zerolm.core.hardware import GPU_TYPES, GPUS_PER_HOST
from zerolm.data.dataset import load_planned
from zerolm.parallel.build import SharedPrograms
from zerolm.plan import SAFETY_MARGIN


@dataclasses.dataclass
class MicroBatchSearch:
    config: str
    target: str
    dp: int
    per_rank: int  # sequences per dp rank per step: the micro-batch divides it
    preset: str | None  # the planner's device preset for the target (None: it has none)
    advised: int | None  # the planner's largest micro-batch (None: none fits it, or no preset)
    largest: int | None  # the compiler's: the largest that fits (None: not even the smallest)
    compiled: dict[int, dict[str, Any]]  # micro-batch -> {"peak_bytes", "fits", "accum_steps"}
    usable_bytes: int

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def planned(config: str, sets: list[str], target: aot.Target, dp: int, tp: int) -> int | None:
    """The planner's largest micro-batch for `config` on `target`'s device preset (what `zerolm plan
    --device PRESET --dp DP` advises); None without a preset, or if none fits."""
    from zerolm.core.hardware import preset
    from zerolm.plan import Parallelism, Planner, PlanSettings, from_config

    name = preset_for(target)
    if name is None:
        return None
    cfg = load_planned(config, [*sets, f"mesh.dp={dp}", f"mesh.tp={tp}", "train.micro_batch_size=1"])
    model, factory = from_config(cfg, dp, tp)
    planner = Planner(model, factory, preset(name), Parallelism(dp, tp, cfg.train.global_batch_size, cfg.mesh.slices),
                      PlanSettings(cfg.zero.precision, stage=cfg.zero.stage))
    fitting = [b for b in planner.micro_batches() if planner.step_peak(b, cfg.zero.stage)["fits"]]
    return max(fitting) if fitting else None


def search(config: str, sets: list[str], target: aot.Target,
           on_compile: Callable[[int, aot.CompileReport], None] = lambda b, r: None,
           known: dict[int, dict[str, Any]] | None = None) -> MicroBatchSearch:
    """The largest micro-batch of `config` (with `sets`) whose step the compiler fits on `target`.
    `on_compile(micro, report)` is called after each compile; `known` gives results already compiled
    (micro-batch -> {"peak_bytes", "fits", "accum_steps"}: benchmarks/compiler/plan_vs_compile.py's cache)."""
    devices = aot.run_devices(target, config, sets)
    base = load_planned(config, [*sets, "train.micro_batch_size=1"], device_count=len(devices))
    dp, tp = base.dp, base.mesh.tp
    per_rank = base.train.global_batch_size // base.data_ranks
    candidates = [b for b in range(1, per_rank + 1) if per_rank % b == 0]
    advised = planned(config, [*sets, f"mesh.dp={dp}", "train.micro_batch_size=1"], target, dp, tp)
    compiled: dict[int, dict[str, Any]] = {}
    shared = SharedPrograms()  # only the gradient's program depends on the micro-batch: the others compile once

    def fits(b: int) -> bool:
        if known and b in known:
            compiled[b] = known[b]
            return known[b]["fits"]
        cfg = load_planned(config, [*sets, f"train.micro_batch_size={b}"], device_count=len(devices))
        report = aot.compile_for(cfg, target, devices, shared=shared)
        compiled[b] = {"peak_bytes": report.peak_bytes_per_device, "fits": report.fits,
                       "accum_steps": report.accum_steps}
        on_compile(b, report)
        return report.fits

    start = candidates.index(advised) if advised is not None else 0
    largest = None
    if fits(candidates[start]):
        largest = candidates[start]
        for b in candidates[start + 1:]:
            if not fits(b):
                break
            largest = b
    else:
        for b in reversed(candidates[:start]):
            if fits(b):
                largest = b
                break
    return MicroBatchSearch(base.name, target.name, dp, per_rank, preset_for(target), advised, largest,
                            compiled,
                            aot.usable_bytes(target, devices[0]))


def compile_target(preset: str, devices: int) -> str | None:
    """The `zerolm compile --target` of `devices` of the planner's device `preset` (`v3-core` × 32: v3-32;
    `h100` × 8: h100-8), or None where there is none (v3-chip; GPUs beyond one host)."""
    gpu = next((g.name for g in GPU_TYPES.values() if g.preset == preset), None)
    if gpu is not None:
        return None if devices > GPUS_PER_HOST else gpu if devices == 1 else f"{gpu}-{devices}"
    generation = next((g for g, p in PRESETS.items() if p == preset), None)
    for n in (devices, 2 * devices) if generation else ():
        try:
            if aot.parse_target(f"{generation}-{n}").devices == devices:
                return f"{generation}-{n}"
        except aot.TargetError:
            pass
    return None


def fastest_command(config: str, sets: Sequence[str], preset: str, devices: int, slices: int = 1) -> str | None:
    """The `zerolm compile --fastest` of `config` (with `sets`) on `devices` of `preset` in all (`slices` slices of
    them): what `zerolm plan` points at for the fastest plan that fits, by the compiler (zerolm.compile.fastest_plan);
    None without a target."""
    target = compile_target(preset, devices // slices)
    if target is None:
        return None
    return shlex.join(["zerolm", "compile", "--config", config, "--target", target,
                       *(["--slices", str(slices)] if slices > 1 else []), "--fastest",
                       *(a for kv in sets for a in ("--set", kv))])


def describe(s: MicroBatchSearch) -> list[str]:
    gib = lambda n: f"{n / 2**30:.2f} GiB"  # noqa: E731
    compiled = "; ".join(f"{b}: {gib(c['peak_bytes'])} {'fits' if c['fits'] else 'does not fit'}"
                         for b, c in sorted(s.compiled.items()))
    advised = (f"{s.advised}" if s.advised is not None else "none") + f" (zerolm plan --device {s.preset} " \
        f"--dp {s.dp}: its step peak with a {SAFETY_MARGIN:.0%} margin)" if s.preset else "nothing (no device preset)"
    lines = [f"largest micro-batch of {s.config} on {s.target} (dp {s.dp}, {s.per_rank} sequences per rank): "
             f"{s.largest if s.largest is not None else 'none fits'}",
             f"  compiled: {compiled} (usable {gib(s.usable_bytes)} per device)",
             f"  the planner advises {advised}"]
    if s.largest is not None:
        lines.append(f"  set train.micro_batch_size={s.largest}")
    return lines

