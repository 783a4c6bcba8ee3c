"""What the compiler really did to the training step: every collective of its three programs.

The gradient step, the reshard and the update are lowered and compiled for the run's mesh (the same
programs the loop runs: JAX keeps the executables, so the loop does not compile them again), and
their optimized HLO is read by `zerolm.compile.hlo`: each collective's kind, result bytes per device, the
mesh axes it runs over, and whether it sits inside the accumulation loop.

`zerolm comms` does this for a config without training: on the real devices when there are enough,
else on fake CPU devices (the same partitioner, but the CPU backend's own collective passes), and
puts the planner's predicted bytes (zerolm.plan.traffic) beside what was found.

Reading them (`read`, `read_async`): a collective's replica groups (listed, XLA's iota form `[4,2]<=[8]` /
`[2,4]<=[4,2]T(1,0)`, or its mesh-axes form `mesh['axis_0'=4,'axis_1'=2] {'axis_0'}`, with
`device_ids=([4,2]T(1,0))` where the mesh's devices are not in order; any other form is refused, not guessed) are
positions in the mesh's device order, so `axis_of` names the mesh axes a collective runs over; how often it runs
is zerolm.compile.hlo's count. The TPU compiler writes a reduce-scatter on v4 and v5p as a fusion named
`all-reduce-scatter`: an all-reduce of the (padded) whole followed by the slice each device keeps, run as one
collective that sends a reduce-scatter's bytes. It is read as the reduce-scatter it is, of the fusion's result.

Across slices (Cloud TPU Multislice; zerolm.compile.aot.target_devices with slices > 1) the TPU compiler builds one
program per slice: its collectives' replica groups stay inside the slice (ICI), and what crosses slices over the
data-center network (DCN) is written as host transfers to the Megascale runtime, a `send` and a `recv` (each with
its `-done`) per transfer. `read_dcn` reads them (`DcnTransfer`), `link_bytes` gives a program's ICI and DCN bytes
per device apart.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import math
import re

import jax
import numpy as np

from zerolm.compile import hlo
from zerolm.compile.hlo import COLLECTIVE_OPS
from zerolm.core.errors import UsageError
from zerolm.parallel.mesh import axis_names, axis_share
from zerolm.plan.traffic import Prediction, naive_predictions, step_predictions

PROGRAMS = ("grad", "reshard", "update")


@dataclasses.dataclass(frozen=True)
class Collective:
    op: str  # e.g. "all-reduce"
    computation: str  # the HLO computation it sits in
    in_loop: bool  # inside a while body (or something a while body calls)
    result_type: str
    groups: tuple[frozenset[int], ...] = ()  # replica groups; () = all devices in one group
    runs: float | None = 1  # times it runs per execution of the program (the enclosing loops' trip counts); None: unknown

    @property
    def elements(self) -> int:
        return sum(math.prod(int(d) for d in dims.split(",") if d) for _, dims in hlo.ARRAY.findall(self.result_type))

    @property
    def bytes(self) -> int:
        return hlo.array_bytes(self.result_type)


_REDUCE_SCATTER_FUSION = "all-reduce-scatter"  # the TPU compiler's reduce-scatter (v4, v5p)


def read(hlo_text: str) -> list[Collective]:
    """Every collective a compiled program runs (a TPU reduce-scatter fusion as one reduce-scatter, an asynchronous
    one where it starts), with its replica groups and how many times it runs."""
    p = hlo.program(hlo_text)
    continuations = _async_continuations(p)
    found = []
    for name, instructions in p.computations.items():
        if name in continuations:
            continue
        for ins in instructions:
            op = ins.opcode.removesuffix("-start")
            if op not in COLLECTIVE_OPS:
                continue
            if name.startswith(_REDUCE_SCATTER_FUSION) and op == "all-reduce":
                root = next(i for i in instructions if i.root)
                found.append(Collective("reduce-scatter", name, name in p.in_loop, root.result, _groups(ins.attributes),
                                        p.runs.get(name)))
                continue
            result = _start_output(ins.result) if ins.opcode.endswith("-start") and op != "all-reduce" else ins.result
            found.append(Collective(op, name, name in p.in_loop, result, _groups(ins.attributes), p.runs.get(name)))
    return found


def _start_output(result_type: str) -> str:
    """What an asynchronous all-gather, reduce-scatter or collective-permute delivers: its `-start` (the GPU
    compiler's form) returns (operands, outputs[, context]); the outputs are the second element. (An
    all-reduce-start returns its outputs alone.)"""
    elements, depth, start = [], 0, 1
    for i, ch in enumerate(result_type):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if (ch == "," and depth == 1) or (ch == ")" and depth == 0):
            elements.append(result_type[start:i])
            start = i + 1
    return elements[1] if result_type.startswith("(") and len(elements) > 1 else result_type


def _async_continuations(p: hlo.Program) -> frozenset[str]:
    """The computations that continue a collective the TPU compiler made asynchronous (its asynchronous
    collective fusion): it splits one collective into a start, steps fused beside a matmul
    (`async_collective_fusion.N`) and a done, and each of the three computations holds the collective again.
    It is counted once, where it starts."""
    done = {callee for _, ins in p.instructions() if ins.name.startswith("async-collective-done")
            for _, callee in ins.called()}
    return frozenset(done | {name for name in p.computations if name.startswith("async_collective_fusion")})


_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
_GROUPS_LISTED = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
# XLA's mesh-axes form: mesh['axis_0'=4,'axis_1'=2] {'axis_0'}: the devices in mesh order (or as an iota
# `device_ids=([4,2]T(1,0))` orders them), grouped over the named axes (whole axes only: a sub-axis such
# as 'axis_0':(1)2 is not read)
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[((?:'[^']+'=\d+,?)+)\]"
                          r"(?:, device_ids=\(\[([\d,]+)\](?:<=\[([\d,]+)\])?(?:T\(([\d,]+)\))?\))? "
                          r"\{((?:'[^']+',?)*)\}(?:[,\s]|$)")


def _iota(reshape: str, perm: str | None) -> np.ndarray:
    """XLA's iota device list: 0..n-1 laid out as `reshape` ("4,2"), transposed by `perm` ("1,0") if given."""
    ids = np.arange(math.prod(int(d) for d in reshape.split(","))).reshape([int(d) for d in reshape.split(",")])
    return ids.transpose([int(d) for d in perm.split(",")]) if perm else ids


def _groups(attributes: str) -> tuple[frozenset[int], ...]:
    if m := _PAIRS.search(attributes):  # a collective-permute: the devices its pairs connect, as groups
        groups: list[set[int]] = []
        for a, b in re.findall(r"\{(\d+),(\d+)\}", m.group(1)):
            joined = [g for g in groups if int(a) in g or int(b) in g]
            groups = [g for g in groups if g not in joined] + [set().union({int(a), int(b)}, *joined)]
        return tuple(frozenset(g) for g in groups)
    if m := _GROUPS_IOTA.search(attributes):
        rows = _iota(m.group(2), m.group(3)).reshape(int(m.group(1).split(",")[0]), -1)
        return tuple(frozenset(int(i) for i in row) for row in rows)
    if m := _GROUPS_LISTED.search(attributes):
        return tuple(frozenset(int(i) for i in g.split(",") if i) for g in re.findall(r"\{([\d,]*)\}", m.group(1)))
    if m := _GROUPS_MESH.search(attributes):
        sizes = {name: int(n) for name, n in re.findall(r"'([^']+)'=(\d+)", m.group(1))}
        grouped = [list(sizes).index(name) for name in re.findall(r"'([^']+)'", m.group(5))]
        kept = [i for i in range(len(sizes)) if i not in grouped]
        # the device order: as listed by an iota ([dims], or [dims]<=[reshape]; then T(perm)), else in order
        ids = _iota(m.group(3) or m.group(2), m.group(4)) if m.group(2) else np.arange(math.prod(sizes.values()))
        ids = ids.reshape(list(sizes.values())).transpose(kept + grouped)
        return tuple(frozenset(int(i) for i in row) for row in ids.reshape(-1, math.prod(ids.shape[len(kept):])))
    if m := re.search(r"replica_groups=\S+", attributes):  # a form this reader does not know (e.g. a sub-axis of
        # the mesh-axes form): refuse rather than count the collective as spanning every device
        raise ValueError(f"unknown replica-group format in the compiled HLO: {m.group(0)[:120]}")
    return ()


def axis_of(collective: Collective, mesh_shape: dict[str, int]) -> tuple[str, ...]:
    """The mesh axes (in mesh order) whose devices each replica group spans; e.g. ("dp",) or ("tp",)."""
    names = list(mesh_shape)
    ids = np.arange(math.prod(mesh_shape.values())).reshape(list(mesh_shape.values()))
    groups = set(collective.groups) or {frozenset(range(ids.size))}
    for r in range(len(names) + 1):
        for axes in itertools.combinations(range(len(names)), r):
            kept = [i for i in range(len(names)) if i not in axes]
            moved = np.moveaxis(ids, kept, list(range(len(kept)))).reshape(math.prod(ids.shape[i] for i in kept) or 1, -1)
            if {frozenset(int(i) for i in row) for row in moved} == groups:
                return tuple(names[i] for i in axes)
    raise ValueError(f"replica groups {sorted(map(sorted, groups))} span no set of mesh axes")


def axes_label(collective: Collective, mesh_shape: dict[str, int]) -> tuple[str, ...]:
    """`axis_of`, or, for replica groups that span only part of an axis (a collective the compiler split
    into stages), the axes they vary along, each marked with the share of it one group covers: `dp(2/4)`."""
    try:
        return axis_of(collective, mesh_shape)
    except ValueError:
        pass
    ids = np.arange(math.prod(mesh_shape.values())).reshape(list(mesh_shape.values()))
    coords = {int(ids[idx]): idx for idx in np.ndindex(ids.shape)}
    group = sorted(collective.groups[0])
    labels = []
    for a, (name, size) in enumerate(mesh_shape.items()):
        spread = len({coords[d][a] for d in group})
        if spread > 1:
            labels.append(axis_share(name, spread, size))
    return tuple(labels)


@dataclasses.dataclass(frozen=True)
class AsyncCollective:
    """A collective the scheduler split into a start and a done, so that work runs while it moves."""

    ops: tuple[str, ...]  # the collectives it runs (an async collective fusion may run more than one)
    computation: str
    in_loop: bool
    result_type: str  # of its done: what it delivers
    overlaps: tuple[str, ...]  # the compute scheduled between start and done: each matmul's op path (its
    # `dot_general` in the model, e.g. "h/attn/c_attn"), "loop:<path>" for a loop (the blockwise attention)
    called: str = ""  # an asynchronous collective fusion's computation: where `read` finds its collectives

    @property
    def bytes(self) -> int:
        return hlo.array_bytes(self.result_type)


_MODEL_OP = re.compile(r"(?:closed_call|remat|checkpoint)/((?:[\w]+/)*?[\w]+)/(?:dot_general|while)$")
_COMPUTE = ("while", "convolution", "fusion", "custom-call")


def read_async(hlo_text: str) -> list[AsyncCollective]:
    """Every asynchronous collective of a scheduled program and the compute between its start and its done:
    XLA's `all-gather-start`/`-done` pairs (and the other collectives'), and the TPU compiler's asynchronous
    collective fusions (`async-collective-start.N` ... `async-collective-done.N`, made with its
    `--xla_tpu_enable_async_collective_fusion` flags). Synchronous collectives are not listed."""
    p = hlo.program(hlo_text)
    found = []
    for name, instructions in p.computations.items():
        for i, ins in enumerate(instructions):
            fusion = ins.opcode == "fusion" and ins.name.startswith("async-collective-start")
            if not fusion and not (ins.opcode.endswith("-start") and ins.opcode[:-6] in COLLECTIVE_OPS):
                continue
            fused = dict(ins.called()).get("calls", "") if fusion else ""
            ops = tuple(op for op in COLLECTIVE_OPS if any(f.opcode == op for f in p.computations.get(fused, ()))) \
                if fusion else (ins.opcode[:-6],)
            between, result = [], ""
            for later in instructions[i + 1:]:
                if _is_done(later, ins, fusion):
                    result = later.result
                    break
                if later.opcode in _COMPUTE and (path := later.op_name) and (op := _MODEL_OP.search(path)):
                    label = ("loop:" if later.opcode == "while" else "") + op.group(1)
                    if label not in between:
                        between.append(label)
            found.append(AsyncCollective(ops, name, name in p.in_loop, result, tuple(between), fused))
    return found


def _is_done(later: hlo.Instruction, start: hlo.Instruction, fusion: bool) -> bool:
    """Whether `later` is the done of the asynchronous collective `start` (an async collective fusion's by name)."""
    if fusion:
        return later.name == start.name.replace("-start", "-done")
    return later.opcode.endswith("-done") and start.name in later.operand_names()


@dataclasses.dataclass(frozen=True)
class DcnTransfer:
    """One transfer between slices over the data-center network: the Megascale runtime's `send` (its `recv`, and
    both `-done`s, belong to the same transfer and are not counted again)."""

    kind: str  # the runtime's transfer type (`_xla_megascale_transfer_type`): ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER
    computation: str
    in_loop: bool
    operand_type: str  # what this device sends: its part of the transfer
    slices: int | None  # the slices taking part (read from `_xla_megascale_target`); None: not read
    runs: float | None = 1  # times it runs per execution of the program, as for `Collective`; None: unknown

    @property
    def bytes(self) -> int:
        return hlo.array_bytes(self.operand_type)


_MEGASCALE = 'handler_name="xla_megascale_runtime"'
_TRANSFER_TYPE = re.compile(r'_xla_megascale_transfer_type="(\w+)"')
# `{1,2}x{0:7}` as libtpu writes it for two slices of 8 devices: the slices (listed, or `a:b` ranges) x each one's devices
_TARGET = re.compile(r'_xla_megascale_target="\{([\d,:]*)\}x')


def read_dcn(hlo_text: str) -> list[DcnTransfer]:
    """Every transfer a compiled program sends to other slices over the data-center network, with how many times
    it runs (zerolm.compile.hlo's count, as for the collectives: a loop's trip count, its callers).

    The bytes are the send's operand, per device: what one device hands the network for one transfer, whatever the
    runtime does with it on the wire. So an ALL_REDUCE is the device's part of the reduction (after the reduce-scatter
    inside the slice, 1/n of the buffer of n devices), an ALL_GATHER its own piece, a REDUCE_SCATTER the whole buffer
    it reduces. MaxText counts Multislice data parallelism the same way: 0.046 GB per device per step for a 1.3B model on
    2 × v5e-64, each device's 1/64 of the bf16 gradient all-reduced across the slices."""
    p = hlo.program(hlo_text)
    found = []
    for name, ins in p.instructions():
        if ins.opcode != "send" or _MEGASCALE not in ins.attributes:
            continue
        kind = _TRANSFER_TYPE.search(ins.attributes)
        operand = p.by_name[name].get(ins.operand_names()[0]) if ins.operands else None
        # the operand's type (the compiler writes its name only), else the first of the send's (operand, context, token)
        first = hlo.ARRAY.search(ins.result)
        sent = operand.result if operand is not None else first.group(0) if first else ""
        found.append(DcnTransfer(kind.group(1) if kind else "", name, name in p.in_loop, sent,
                                 _target_slices(ins.attributes), p.runs.get(name)))
    return found


def _target_slices(attributes: str) -> int | None:
    m = _TARGET.search(attributes)
    if m is None:
        return None
    count = 0
    for item in filter(None, m.group(1).split(",")):
        first, _, last = item.partition(":")
        count += int(last) - int(first) + 1 if last else 1
    return count


@dataclasses.dataclass(frozen=True)
class LinkBytes:
    """A program's bytes per device per execution (its loops' trip counts counted), on each link."""

    ici: int = 0  # its collectives' result bytes (`read`: the convention of zerolm.compile.step_time and `traffic`)
    dcn: int = 0  # its transfers to other slices, each its send's operand (`read_dcn`)
    unknown_runs: int = 0  # collectives and transfers in a loop of unknown trip count: counted once each

    def __add__(self, other: LinkBytes) -> LinkBytes:
        return LinkBytes(self.ici + other.ici, self.dcn + other.dcn, self.unknown_runs + other.unknown_runs)


def link_bytes(hlo_text: str) -> LinkBytes:
    """The bytes a compiled program moves per device on the slice's own links (ICI) and between slices (DCN), apart.
    A step's: `sum((link_bytes(t) for t in texts.values()), LinkBytes())`."""
    ici = [(c.bytes, c.runs) for c in read(hlo_text)]
    dcn = [(t.bytes, t.runs) for t in read_dcn(hlo_text)]
    return LinkBytes(round(sum(b * (r or 1) for b, r in ici)), round(sum(b * (r or 1) for b, r in dcn)),
                     sum(r is None for _, r in ici + dcn))


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
    link: str = "ici"  # "dcn": transfers between slices (`read_dcn`: each its send's operand bytes), over `slice`

    @property
    def axes(self) -> tuple[str, ...]:
        """The mesh axes the replica groups run along, whole or in part, e.g. ("dp",)."""
        return axis_names(self.span)

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "axes": list(self.axes), "span": list(self.span)}


def traffic(texts: dict[str, str], mesh_shape: dict[str, int]) -> list[Traffic]:
    """The programs' collectives grouped by (program, op, span, in a loop). On a mesh with a `slice` axis compiled
    for TPU slices, libtpu builds one program per slice: its collectives' replica groups number one slice's devices
    (read against the mesh less its slice axis), and what crosses slices are `read_dcn`'s transfers, rows over
    `slice` of link "dcn"; compiled as one program (the CPU) the slice axis is a mesh axis like the others."""
    per_slice = "slice" in mesh_shape and any(read_dcn(t) for t in texts.values())
    shape = {k: v for k, v in mesh_shape.items() if k != "slice"} if per_slice else mesh_shape
    rows: dict[tuple, list] = collections.defaultdict(lambda: [0, 0, 0])

    def add(key, nbytes, runs):
        rows[key][0] += 1
        rows[key][1] += nbytes
        rows[key][2] = None if rows[key][2] is None or runs is None else rows[key][2] + nbytes * runs

    for program, text in texts.items():
        for c in read(text):
            add((program, c.op, axes_label(c, shape), c.in_loop, "ici"), c.bytes, c.runs)
        for t in read_dcn(text):
            add((program, t.kind.lower().replace("_", "-"), ("slice",), t.in_loop, "dcn"), t.bytes, t.runs)
    return [Traffic(p, op, span, in_loop, count, nbytes, per_run, link)
            for (p, op, span, in_loop, link), (count, nbytes, per_run) in sorted(rows.items(), key=lambda kv: (
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
        parts = [f"{r.count} {r.op} over {'+'.join(r.span) or 'no axis'}{' (DCN)' if r.link == 'dcn' else ''} "
                 f"({_mib(r.bytes)}) "
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

    mesh = make_mesh(cfg.dp, cfg.mesh.tp, devices, cfg.mesh.slices)
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
    across = [c for c in r.collectives if "slice" in c.axes and c.program in ("grad", "step") and c.bytes > 4]
    if across:
        looped = sum(c.count for c in across if c.in_loop)
        sent = sum(c.bytes_per_run or 0 for c in across)
        lines.append("gradient reduction across slices: " + (
            f"once per step, after the loop: {sent:,} bytes per device (its block of the gradient, and the loss)"
            if not looped
            else f"INSIDE a loop ({looped} HLO collective(s)): {sent:,} bytes per device per step"))
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
