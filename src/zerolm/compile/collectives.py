"""What the compiler really did to the training step: every collective of its three programs.

The gradient step, the reshard and the update are lowered and compiled for the run's mesh (the same
programs the loop runs: JAX keeps the executables, so the loop does not compile them again), and
their optimized HLO is read by `zerolm.compile.hlo`: each collective's kind, result bytes per device, the
mesh axes it runs over, and whether it sits inside the accumulation loop.

`zerolm comms` does this for a config without training: on the real devices when there are enough,
else on fake CPU devices (the same partitioner, but the CPU backend's own collective passes), and
puts the planner's predicted bytes (zerolm.plan.traffic) beside what was found.
"""

from __future__ import annotations

import collections
import dataclasses
import functools

import jax

from zerolm.compile import hlo
from zerolm.core.errors import UsageError
from zerolm.parallel.mesh import axis_names
from zerolm.plan.traffic import Prediction, naive_predictions, step_predictions

PROGRAMS = ("grad", "reshard", "update")


@dataclasses.dataclass(frozen=True)
class Traffic:
    """The collectives of one kind, over one set of mesh axes, in or out of the loop, of one program."""

    program: str  # grad | reshard | update
    op: str  # all-reduce, reduce-scatter, all-gather, ...
    span: tuple[str, ...]  # what one replica group spans: whole mesh axes ("dp",), or a share ("dp(8/32)",)
    in_loop: bool
    count: int
    bytes: int  # result bytes per device, summed over the `count` collectives
    bytes_per_run: int | None  # ... each times it runs per program execution (loops' trip counts); None: unknown

    @property
    def axes(self) -> tuple[str, ...]:
        """The mesh axes the replica groups run along, whole or in part, e.g. ("dp",)."""
        return axis_names(self.span)

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "axes": list(self.axes), "span": list(self.span)}


def traffic(texts: dict[str, str], mesh_shape: dict[str, int]) -> list[Traffic]:
    rows: dict[tuple, list] = collections.defaultdict(lambda: [0, 0, 0])
    for program, text in texts.items():
        for c in hlo.collectives(text):
            key = (program, c.op, hlo.axes_label(c, mesh_shape), c.in_loop)
            rows[key][0] += 1
            rows[key][1] += c.bytes
            rows[key][2] = None if rows[key][2] is None or c.runs is None else rows[key][2] + c.bytes * c.runs
    return [Traffic(p, op, span, in_loop, count, nbytes, per_run)
            for (p, op, span, in_loop), (count, nbytes, per_run) in sorted(rows.items(), key=lambda kv: (
                _order(kv[0][0]), kv[0][3], kv[0][1], kv[0][2]))]


def _order(program: str) -> int:
    return PROGRAMS.index(program) if program in PROGRAMS else len(PROGRAMS)  # e.g. the naive "step"


def describe(rows: list[Traffic], programs=PROGRAMS) -> list[str]:
    """One line per program (those the step runs: mixed precision has no reshard): its collectives, grouped."""
    lines = []
    for program in programs:
        mine = [r for r in rows if r.program == program]
        if not mine:
            lines.append(f"{program}: no collective")
            continue
        parts = [f"{r.count} {r.op} over {'+'.join(r.span) or 'no axis'} ({_mib(r.bytes)}) "
                 + ("INSIDE a loop: every micro-step" if r.in_loop else "once per step") for r in mine]
        lines.append(f"{program}: " + "; ".join(parts))
    return lines


def _mib(n: int) -> str:
    if n >= 2**20:
        return f"{n / 2**20:.2f} MiB"
    return f"{n / 2**10:.1f} KiB" if n >= 2**10 else f"{n} B"


def compare(rows: list[Traffic], predicted: list[Prediction]) -> dict[int, Prediction]:
    """Each prediction beside the rows it predicts (by what a replica group spans; span None: any rows
    over dp): its found bytes are set, and the prediction of each row is returned, by the row's index."""
    of_row: dict[int, Prediction] = {}
    for p in predicted:
        mine = [i for i, r in enumerate(rows) if (r.program, r.op, r.in_loop) == (p.program, p.op, p.in_loop)
                and (list(r.span) == p.span if p.span is not None else "dp" in r.axes)]
        p.found_bytes = sum(rows[i].bytes for i in mine) if mine else None
        p.found_bytes_per_step = (None if not mine or any(rows[i].bytes_per_run is None for i in mine) else
                                  sum(rows[i].bytes_per_run or 0 for i in mine))
        of_row.update({i: p for i in mine})
    return of_row


@dataclasses.dataclass
class CommsReport:
    """What `zerolm comms` says: the compiled step's collectives beside the planner's predictions."""

    config: str
    step: str  # zerolm | naive
    backend: str
    device_kind: str
    devices: int
    mesh: dict[str, int]
    grad_reduce: str
    stage: int
    micro_batch: int
    accum_steps: int
    collectives: list[Traffic]
    predicted: list[Prediction]

    def to_json(self) -> dict:
        return {**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)},
                "collectives": [r.as_dict() for r in self.collectives],
                "predicted": [p.to_json() for p in self.predicted]}


def report(cfg, devices: list[jax.Device], step: str = "zerolm") -> CommsReport:
    """Compile `cfg`'s step on `devices` and put every collective beside the planner's prediction."""
    from zerolm.model import losses
    from zerolm.parallel import naive_step as naive
    from zerolm.parallel.build import build_step, compile_step
    from zerolm.parallel.mesh import make_mesh

    mesh = make_mesh(cfg.dp, cfg.mesh.tp, devices)
    model, zero, _ = build_step(cfg, mesh)
    micro, seq, accum = cfg.train.micro_batch_size, cfg.model.seq_len, cfg.accum_steps
    if step == "naive":
        if cfg.mesh.tp > 1:
            raise UsageError("--step naive: the naive baseline is data parallel only; set mesh.tp=1")
        texts = {"step": naive.naive_text(zero, functools.partial(losses.lm_loss, model), micro, seq, accum)}
        predicted = naive_predictions(zero.abstract_params, accum)
    else:
        texts = compile_step(zero, micro, seq, accum).texts
        predicted = step_predictions(cfg, model, zero)
    rows = traffic(texts, dict(mesh.shape))
    compare(rows, predicted)
    return CommsReport(cfg.name, step, devices[0].platform, devices[0].device_kind, len(devices), dict(mesh.shape),
                       cfg.zero.grad_reduce, cfg.zero.stage, micro, accum, rows, predicted)


def describe_report(r: CommsReport) -> list[str]:
    lines = [f"comms: {r.config}: the {r.step} step compiled for {r.devices} {r.backend} device(s) "
             f"({r.device_kind}), mesh {' × '.join(f'{k}={v}' for k, v in r.mesh.items())}, "
             f"{r.accum_steps} accumulation step(s) of {r.micro_batch}, ZeRO-{r.stage}, grad_reduce={r.grad_reduce}",
             "bytes are per device: of the HLO instructions once, and per optimizer step (times their loops' trip counts)",
             f"  {'program':8s} {'collective':18s} {'axes':8s} {'where':14s} {'count':>5s} {'bytes':>12s} "
             f"{'bytes/step':>13s}   predicted by zerolm plan (bytes, bytes/step)"]
    of_row = compare(r.collectives, r.predicted)
    shown: set[int] = set()
    for i, c in enumerate(r.collectives):
        p = of_row.get(i)
        if p is None:
            verdict = "-"
        elif id(p) in shown:
            verdict = "(in the row above)"
        else:
            shown.add(id(p))
            summed = "" if p.span is not None else " summed over the dp rows"
            verdict = f"{p.bytes:,}, {p.bytes_per_step:,}{summed}: " + _verdict(p)
        per_step = "?" if c.bytes_per_run is None else f"{c.bytes_per_run:,}"
        lines.append(f"  {c.program:8s} {c.op:18s} {'+'.join(c.span) or '-':8s} "
                     f"{'IN a loop' if c.in_loop else 'once':14s} {c.count:5d} {c.bytes:12,} {per_step:>13s}   "
                     f"{verdict}")
    for p in r.predicted:
        if p.found_bytes is None:
            lines.append(f"  predicted but NOT in the compiled step: {p.program} {p.op} over "
                         f"{'+'.join(p.span or ['dp'])}{' in a loop' if p.in_loop else ''}, {p.bytes:,} bytes")
    lines.append("  (-: not predicted: the update's norms and counters, a few scalars)")
    reductions = [c for c in r.collectives if "dp" in c.axes and c.op in ("all-reduce", "reduce-scatter")
                  and c.program in ("grad", "step") and c.bytes > 4]
    if reductions:
        inside = [c for c in reductions if c.in_loop]
        n_inside = sum(c.count for c in inside)
        if not inside:
            where = "once per step, after the accumulation loop"
        elif r.stage > 1 and r.step == "zerolm":  # by design: each layer's gradient where the backward pass makes it
            where = (f"INSIDE the layers' loop: each layer's gradient as the backward pass makes it ({n_inside} HLO "
                     f"collective(s) in loops) (ZeRO-{r.stage}: by design)")
        else:
            where = f"INSIDE the accumulation loop: every micro-step ({n_inside} HLO collective(s) in loops)"
        lines.append("gradient reduction over dp: " + where)
    return lines


def _verdict(p: Prediction) -> str:
    if p.at_least:
        return "at least that: yes" if (p.found_bytes_per_step or 0) >= p.bytes_per_step else "LESS"
    same = p.found_bytes == p.bytes and p.found_bytes_per_step == p.bytes_per_step
    if same or not p.within:
        return "equal" if same else "DIFFERENT"
    near = all(v is not None and (1 - p.within) * want <= v <= want
               for v, want in ((p.found_bytes, p.bytes), (p.found_bytes_per_step, p.bytes_per_step)))
    return f"at most, within {p.within:.0%}: yes" if near else "DIFFERENT"
