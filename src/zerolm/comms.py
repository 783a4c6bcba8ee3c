"""What the compiler really did to the training step: every collective of its three programs.

The gradient step, the reshard and the update are lowered and compiled for the run's mesh (the same
programs the loop runs: JAX keeps the executables, so the loop does not compile them again), and
their optimized HLO is read by `zerolm.hlo`: each collective's kind, result bytes per device, the
mesh axes it runs over, and whether it sits inside the accumulation loop.

`zerolm comms` does this for a config without training: on the real devices when there are enough,
else on fake CPU devices (the same partitioner, but the CPU backend's own collective passes), and
puts the planner's predicted bytes (zerolm.plan.predicted_traffic) beside what was found.
"""

from __future__ import annotations

import collections
import functools
import dataclasses

import jax
import numpy as np

from zerolm import hlo
from zerolm.zero import Zero1

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
        return hlo.axis_names(self.span)

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "axes": list(self.axes), "span": list(self.span)}


def compiled_texts(zero: Zero1, micro_batch: int, seq_len: int, accum_steps: int) -> dict[str, str]:
    """The optimized HLO of the step's programs, compiled for abstract inputs of the run's shapes."""
    return {name: executable.as_text() for name, executable in zero.compiled(micro_batch, seq_len, accum_steps).items()}


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


def naive_text(zero: Zero1, loss_fn, micro_batch: int, seq_len: int, accum_steps: int) -> str:
    """The optimized HLO of the naive single-jit baseline (zerolm.zero.naive_data_parallel_step) on
    zero's mesh: params and optimizer state replicated, the batch split over dp."""
    from zerolm.zero import naive_data_parallel_step

    def replicated(tree):
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=zero.replicated), tree)

    batch = jax.ShapeDtypeStruct((accum_steps, zero.dp * micro_batch, seq_len + 1), np.int32,
                                 sharding=zero.batch_sharding)
    return hlo.compiled_text(naive_data_parallel_step(zero.mesh, loss_fn, zero.tx), replicated(zero.abstract_params),
                             replicated(jax.eval_shape(zero.tx.init, zero.abstract_params)), batch)


def report(cfg, devices: list[jax.Device], step: str = "zerolm") -> dict:
    """Compile `cfg`'s step on `devices` and put every collective beside the planner's prediction."""
    from zerolm import model as gpt_model
    from zerolm import plan
    from zerolm.mesh import make_mesh
    from zerolm.step import build_step

    mesh = make_mesh(cfg.dp, cfg.mesh.tp, devices)
    model, zero, _ = build_step(cfg, mesh)
    micro, seq, accum = cfg.train.micro_batch_size, cfg.model.seq_len, cfg.accum_steps
    if step == "naive":
        if cfg.mesh.tp > 1:
            raise ValueError("--step naive: the naive baseline is data parallel only; set mesh.tp=1")
        texts = {"step": naive_text(zero, functools.partial(gpt_model.lm_loss, model), micro, seq, accum)}
        predicted = plan.predicted_naive_traffic(zero.abstract_params, accum)
    else:
        texts = compiled_texts(zero, micro, seq, accum)
        predicted = predicted_traffic(cfg, model, zero)
    rows = [r.as_dict() for r in traffic(texts, dict(mesh.shape))]
    attach_predictions(rows, predicted)
    return {"config": cfg.name, "step": step, "backend": devices[0].platform, "device_kind": devices[0].device_kind,
            "devices": len(devices), "mesh": dict(mesh.shape), "grad_reduce": cfg.zero.grad_reduce,
            "micro_batch": micro, "accum_steps": accum, "collectives": [{k: v for k, v in r.items() if k != "predicted"}
                                                                         for r in rows],
            "predicted": predicted, "_rows": rows}


def predicted_traffic(cfg, model, zero) -> list[dict]:
    """`zerolm plan`'s count of the collectives of `zero`'s step (`model` and `zero` built from `cfg` by
    zerolm.step.build_step: the model's dtype is the one resolved for the mesh's devices)."""
    import jax.numpy as jnp

    from zerolm import plan

    activation = (cfg.train.micro_batch_size * cfg.model.seq_len * cfg.model.d_model
                  * jnp.dtype(model.cfg.dtype).itemsize)
    return plan.predicted_traffic(zero.table, cfg.zero.grad_reduce, cfg.accum_steps, activation, cfg.model.n_layer,
                                  cfg.model.remat == "full", param_bytes=zero.param_dtype.itemsize,
                                  scatter=zero.scatter, inner=zero.scatter_inner)


def attach_predictions(rows: list[dict], predicted: list[dict]) -> None:
    """Each prediction beside the rows it predicts (by what a replica group spans; span None: any rows over
    dp): its found bytes."""
    for p in predicted:
        mine = [r for r in rows if (r["program"], r["op"], r["in_loop"]) == (p["program"], p["op"], p["in_loop"])
                and (r["span"] == p["span"] if p["span"] is not None else "dp" in r["axes"])]
        p["found_bytes"] = sum(r["bytes"] for r in mine) if mine else None
        p["found_bytes_per_step"] = None if not mine or any(r["bytes_per_run"] is None for r in mine) else \
            sum(r["bytes_per_run"] for r in mine)
        for r in mine:
            r["predicted"] = p


def describe_report(r: dict) -> list[str]:
    lines = [f"comms: {r['config']}: the {r['step']} step compiled for {r['devices']} {r['backend']} device(s) "
             f"({r['device_kind']}), mesh {' × '.join(f'{k}={v}' for k, v in r['mesh'].items())}, "
             f"{r['accum_steps']} accumulation step(s) of {r['micro_batch']}, grad_reduce={r['grad_reduce']}",
             "bytes are per device: of the HLO instructions once, and per optimizer step (times their loops' trip counts)",
             f"  {'program':8s} {'collective':18s} {'axes':8s} {'where':14s} {'count':>5s} {'bytes':>12s} "
             f"{'bytes/step':>13s}   predicted by zerolm plan (bytes, bytes/step)"]
    shown = set()
    for c in r["_rows"]:
        p = c.get("predicted")
        if p is None:
            verdict = "-"
        elif id(p) in shown:
            verdict = "(in the row above)"
        else:
            shown.add(id(p))
            summed = "" if p["span"] is not None else " summed over the dp rows"
            verdict = f"{p['bytes']:,}, {p['bytes_per_step']:,}{summed}: " + _verdict(p)
        per_step = "?" if c["bytes_per_run"] is None else f"{c['bytes_per_run']:,}"
        lines.append(f"  {c['program']:8s} {c['op']:18s} {'+'.join(c['span']) or '-':8s} "
                     f"{'IN a loop' if c['in_loop'] else 'once':14s} {c['count']:5d} {c['bytes']:12,} {per_step:>13s}   "
                     f"{verdict}")
    for p in r["predicted"]:
        if p["found_bytes"] is None:
            lines.append(f"  predicted but NOT in the compiled step: {p['program']} {p['op']} over "
                         f"{'+'.join(p['span'] or ['dp'])}{' in a loop' if p['in_loop'] else ''}, {p['bytes']:,} bytes")
    lines.append("  (-: not predicted: the update's norms and counters, a few scalars)")
    reductions = [c for c in r["_rows"] if "dp" in c["axes"] and c["op"] in ("all-reduce", "reduce-scatter")
                  and c["program"] in ("grad", "step") and c["bytes"] > 4]
    if reductions:
        inside = [c for c in reductions if c["in_loop"]]
        lines.append("gradient reduction over dp: " + (
            f"INSIDE the accumulation loop: every micro-step ({sum(c['count'] for c in inside)} HLO collective(s) "
            "in loops)" if inside else "once per step, after the accumulation loop"))
    return lines


def _verdict(p: dict) -> str:
    if p.get("at_least"):
        return "at least that: yes" if (p["found_bytes_per_step"] or 0) >= p["bytes_per_step"] else "LESS"
    same = p["found_bytes"] == p["bytes"] and p["found_bytes_per_step"] == p["bytes_per_step"]
    return "equal" if same else "DIFFERENT"
