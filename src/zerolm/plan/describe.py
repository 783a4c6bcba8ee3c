"""A plan's report: JSON (`zerolm plan --json`) and the lines `zerolm plan` prints."""

from __future__ import annotations

import dataclasses
from typing import Any

from zerolm.core.hardware import Device, gpu_memory_fraction


@dataclasses.dataclass(frozen=True)
class PlanReport:
    """Everything `zerolm plan` says, as JSON-ready values (zerolm.plan.Planner.report)."""

    model: dict[str, Any]
    device: dict[str, Any]
    zerolm_step: dict[str, Any]  # zerolm's own step at its ZeRO stage: each program's peak, the largest micro-batch
    attention: str
    layout: dict[str, int]  # dp, tp, devices, global_batch
    precision: str
    efficiency: float
    memory_fraction: float | None
    usable_bytes: int
    safety_margin: float  # a planned peak fits when (1 + safety_margin) × it <= usable_bytes
    flash_attention: bool
    micro_batch: int
    stages: dict[str, dict[str, Any]]  # ZeRO stage -> memory per device and the largest micro-batch
    step: dict[str, Any]  # the step time
    scaling: list[dict[str, Any]]
    # `zerolm compile --fastest` for this config and target (zerolm.compile.micro_batch_search)
    fastest_command: str | None = None
    # train.context_stages: zerolm's step at each staged context (steps, seq_len, rows per device, its peak)
    contexts: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _gib(n: float) -> str:
    """A byte count in the unit that shows it (a tiny model's states are KiB, not "0.00 GiB")."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:8.2f} {unit}"
    return f"{n:8.0f} B  "


def _ms(s: float) -> str:
    return f"{s * 1e3:9.2f} ms"


def _verdict(step: dict, r: dict) -> str:
    """Whether zerolm's step fits: a planned peak under the device but not under its margin is said as such
    (the planner over-counts some steps that the compiler fits: BENCHMARKS.md)."""
    if step["fits"]:
        return ""
    if step["total_bytes"] <= r["usable_bytes"]:
        return (f" DOES NOT FIT with the {r['safety_margin']:.0%} margin (under the device's "
                f"{r['usable_bytes'] / 2**30:.2f} GiB without it: `zerolm compile --target` says)")
    return " DOES NOT FIT"


def describe(report: PlanReport) -> list[str]:
    """What `zerolm plan` prints: the model and layout, zerolm's own step, the ZeRO stages, the step time, the
    scaling table, the pointer to the compiler's fastest plan, the device."""
    r = report.to_json()
    lines = [*_head(r), "", *_zerolm_step(r), "", *_stages(r), "", *_step_time(r), "", *_scaling(r)]
    if r["fastest_command"]:
        lines += ["", "the fastest plan that fits (ZeRO stage × micro-batch × remat × attention block, compiled and "
                      f"timed): {r['fastest_command']}"]
    return [*lines, "", f"device: {Device(**r['device']).describe()}"]


def _head(r: dict) -> list[str]:
    m, lay, dev = r["model"], r["layout"], r["device"]
    usable = (f"{r['memory_fraction']:.0%} of {dev['memory'] / 2**30:.1f} GiB)" if r["memory_fraction"] is not None
              else "what the TPU compiler allows, as `zerolm compile` checks)" if dev["usable"] is not None
              else f"{gpu_memory_fraction():.0%} of {dev['memory'] / 2**30:.1f} GiB: JAX's allocator share, "
                   "XLA_PYTHON_CLIENT_MEM_FRACTION)")
    return [f"plan: {m['source']}: {m['params']:,} params, {m['n_layer']} layers × {m['d_model']}, "
            f"{m['n_head']} heads, seq_len {m['seq_len']}, vocab {m['vocab']} (padded)",
            f"on {lay['devices']} × {dev['name']} ("
            + (f"{lay['slices']} slices × " if lay.get("slices", 1) > 1 else "")
            + f"dp={lay['dp']} tp={lay['tp']}), global batch {lay['global_batch']} "
            f"sequences, precision {r['precision']}, micro-batch {r['micro_batch']}, "
            f"{r['attention']} attention, remat {m['remat']}",
            f"fits means at most {r['usable_bytes'] / 2**30:.2f} GiB per device (" + usable
            + f", after a {r['safety_margin']:.0%} margin on the planned peak (more than the planner's largest measured "
              "under-count against the compiler: BENCHMARKS.md)"]


def _zerolm_step(r: dict) -> list[str]:
    m, z = r["model"], r["zerolm_step"]
    b = z["largest_micro_batch"]
    return [f"zerolm's step (ZeRO-{z['stage']} at {m['param_bytes'] * 8}-bit params, {r['attention']} attention, remat "
            f"{m['remat']}), per device by `zerolm compile`'s rule (`zerolm compile --target` is the exact check):",
            "  " + "   ".join(f"{name} {_gib(v).strip()}" for name, v in z["programs"].items())
            + f"   peak {_gib(z['total_bytes']).strip()} ({z['program']}){_verdict(z, r)}; "
            + (f"largest micro-batch that fits: {b}" if b else "no micro-batch fits"),
            *(["  (never more than the compiler fits, sometimes less: `zerolm compile --target SLICE "
               "--largest-micro-batch` compiles up from it)"] if r["device"]["usable"] is not None else []),
            *(f"  context stage, steps {c['steps']}: {c['seq_len']} tokens, {c['micro_rows']} rows per device per "
              f"micro-step: peak {_gib(c['total_bytes']).strip()} ({c['program']}){_verdict(c, r)}"
              for c in r["contexts"])]


def _stages(r: dict) -> list[str]:
    lines = ["ZeRO stages (the paper's accounting; activations: the minimal set the backward pass needs, after "
             "Korthikanti et al.)",
             "per-device memory    params        grads     optimizer   activations (no remat / full remat)      total"
             "   largest micro-batch"]
    for s, row in r["stages"].items():
        b = row["largest_micro_batch"]
        fit = f"{b} (accum {row['accum_steps']})" if b else "none fits"
        lines.append(f"  ZeRO-{s}   {_gib(row['params_bytes'])} {_gib(row['grads_bytes'])} {_gib(row['optimizer_bytes'])} "
                     f"{_gib(row['activation_bytes'])} ({_gib(row['activation_bytes_no_remat']).strip()} / "
                     f"{_gib(row['activation_bytes_full_remat']).strip()}) {_gib(row['total_bytes'])}"
                     f"{'' if row['fits'] else ' DOES NOT FIT'}   {fit}")
    return lines


def _step_time(r: dict) -> list[str]:
    st, dev = r["step"], r["device"]
    return [f"step time, ZeRO-{st['stage']}, micro-batch {st['micro_batch']} × "
            f"{st['accum_steps']} accumulation step(s), compute at {r['efficiency']:.0%} of "
            f"{dev['flops'] / 1e12:.0f} TFLOP/s" + ("" if st["fits"] else " (nothing fits: shown at the "
                                                    "configured micro-batch)"),
            f"  compute {_ms(st['compute_s'])}   tp all-reduces {_ms(st['tp_comm_s'])}",
            f"  gradient reduction {_ms(st['grad_comm_s'])} (ring; as one all-reduce: ring "
            f"{_ms(st['grad_allreduce_ring_s']).strip()}, tree {_ms(st['grad_allreduce_tree_s']).strip()})   "
            f"param all-gather {_ms(st['param_gather_s'])}",
            *([f"  across slices {_ms(st['dcn_s'])}: each device's {st['dcn_bytes'] / 1e9:.3f} GB over the "
               f"data-center network at {dev['dcn_bw'] / 1e9:.2f} GB/s (its share of its host's)"]
              if st.get("dcn_bytes") else []),
            f"  step {_ms(st['step_s'])} (MFU {st['mfu']:.1%}), "
            + ("reduction after the loop as zerolm does" if st["stage"] < 2 else "no collective overlapped"),
            f"  step {_ms(st['overlapped_s'])} (MFU {st['mfu_overlapped']:.1%}) "
            + (f"if the last backward pass overlapped a bucketed reduction: bucket {st['bucket_bytes'] / 2**20:.0f} "
               f"MiB ({st['buckets']} buckets; docs/design.md)" if st["stage"] < 2 else
               f"if each layer's collectives overlapped the layers' compute ({st['buckets']} per step of "
               f"{st['bucket_bytes'] / 2**20:.0f} MiB; docs/zero-stages.md)")]


def _scaling(r: dict) -> list[str]:
    lines = ["scaling (dp doubles, tp fixed; largest micro-batch that fits):",
             "     dp devices  micro accum      compute         comm         step   overlapped   tokens/s    MFU"]
    for row in r["scaling"]:
        if row["micro_batch"] is None:
            lines.append(f"  {row['dp']:5d} {row['devices']:7d}  does not fit")
            continue
        lines.append(f"  {row['dp']:5d} {row['devices']:7d} {row['micro_batch']:6d} {row['accum_steps']:5d} "
                     f"{_ms(row['compute_s'])} {_ms(row['comm_s'])} {_ms(row['step_s'])} {_ms(row['overlapped_s'])} "
                     f"{row['tokens_per_s']:10.0f} {row['mfu']:6.1%}")
    return lines
