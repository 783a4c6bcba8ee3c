"""What collectives a compiled program runs, over which mesh axis, and whether any sits inside a loop.

Reads the optimized HLO text of `jitted.lower(...).compile()`: the ground truth for "one gradient
reduction per optimizer step". A collective's replica groups (listed, XLA's iota form
`[4,2]<=[8]` / `[2,4]<=[4,2]T(1,0)`, or its mesh-axes form `mesh['axis_0'=4,'axis_1'=2] {'axis_0'}`,
with `device_ids=([4,2]T(1,0))` where the mesh's devices are not in order; any
other form is refused, not guessed) are positions in the mesh's device order, so `axis_of` names the
mesh axes a collective runs over. Used by the tests and the benchmarks.

The TPU compiler writes a reduce-scatter on v4 and v5p as a fusion named `all-reduce-scatter`: an
all-reduce of the (padded) whole followed by the slice each device keeps, run as one collective that
sends a reduce-scatter's bytes. It is read as the reduce-scatter it is, of the fusion's result.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re

import numpy as np

from zerolm.model.attention import TRIANGULAR_LOOP
from zerolm.parallel.mesh import axis_share

COLLECTIVE_OPS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")

_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_INSTRUCTION = re.compile(r"=\s+(.+?)\s+(" + "|".join(COLLECTIVE_OPS) + r")(-start)?\(")
_CALLED = re.compile(r"(?:body|condition|calls|to_apply|branch_computations)=\{?([%\w.\-, ]+)\}?")
_WHILE_BODY = re.compile(r"\bwhile\(.*\bbody=%?([\w.\-]+)")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_WHILE_CONDITION = re.compile(r"\bwhile\(.*\bcondition=%?([\w.\-]+)")
_COUNTER_BELOW = re.compile(r"^\s*ROOT \S+ = pred\[\]\S* compare\(%?[\w.\-]+, %?([\w.\-]+)\), direction=LT")
_S32_CONSTANT = re.compile(r"^\s*%?([\w.\-]+) = s32\[\]\S* constant\((\d+)\)")
_ARRAY = re.compile(r"(pred|[a-z]+\d+)\[([\d,]*)\]")
_GROUPS_LISTED = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
# XLA's mesh-axes form: mesh['axis_0'=4,'axis_1'=2] {'axis_0'}: the devices in mesh order (or as an iota
# `device_ids=([4,2]T(1,0))` orders them), grouped over the named axes (whole axes only: a sub-axis such
# as 'axis_0':(1)2 is not read)
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[((?:'[^']+'=\d+,?)+)\]"
                          r"(?:, device_ids=\(\[([\d,]+)\](?:<=\[([\d,]+)\])?(?:T\(([\d,]+)\))?\))? "
                          r"\{((?:'[^']+',?)*)\}[,\s]")
_ROOT = re.compile(r"^\s*ROOT \S+ = (\S+) ")
_REDUCE_SCATTER_FUSION = "all-reduce-scatter"  # the TPU compiler's reduce-scatter (v4, v5p)
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
          "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}


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
        return sum(math.prod(int(d) for d in dims.split(",") if d) for _, dims in _ARRAY.findall(self.result_type))

    @property
    def bytes(self) -> int:
        return _bytes_of(self.result_type)


def _bytes_of(result_type: str) -> int:
    return sum(_BYTES.get(t, 4) * math.prod(int(d) for d in dims.split(",") if d) for t, dims in _ARRAY.findall(result_type))


def _computations(hlo_text: str) -> dict[str, list[str]]:
    comps: dict[str, list[str]] = {}
    current = None
    for line in hlo_text.splitlines():
        if current is None:
            m = _COMPUTATION.match(line)
            if m:
                current = m.group(1)
                comps[current] = []
        elif line.startswith("}"):
            current = None
        else:
            comps[current].append(line)
    return comps


def collectives(hlo_text: str) -> list[Collective]:
    comps = _computations(hlo_text)
    callees = _callees(comps)
    in_loop = _loop_computations(comps, callees)
    runs = _runs(hlo_text, comps, callees)
    continuations = _async_continuations(comps)
    found = []
    for name, lines in comps.items():
        if name in continuations:
            continue
        for line in lines:
            m = _INSTRUCTION.search(line)
            if m and name.startswith(_REDUCE_SCATTER_FUSION) and m.group(2) == "all-reduce":
                root = next(r.group(1) for r in map(_ROOT.search, lines) if r)
                found.append(Collective("reduce-scatter", name, name in in_loop, root, _groups(line), runs.get(name)))
            elif m:
                result = _start_output(m.group(1)) if m.group(3) and m.group(2) != "all-reduce" else m.group(1)
                found.append(Collective(m.group(2), name, name in in_loop, result, _groups(line), runs.get(name)))
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


def _async_continuations(comps: dict[str, list[str]]) -> frozenset[str]:
    """The computations that continue a collective the TPU compiler made asynchronous (its asynchronous
    collective fusion): it splits one collective into a start, steps fused beside a matmul
    (`async_collective_fusion.N`) and a done, and each of the three computations holds the collective again.
    It is counted once, where it starts."""
    done = {c.strip().lstrip("%") for lines in comps.values() for line in lines
            if re.match(r"^\s*(?:ROOT )?%async-collective-done", line)
            for m in _CALLED.finditer(line) for c in m.group(1).split(",")}
    return frozenset(done | {name for name in comps if name.startswith("async_collective_fusion")})


def _callees(comps: dict[str, list[str]]) -> dict[str, set[str]]:
    return {name: {c.strip().lstrip("%") for m in _CALLED.finditer("\n".join(lines)) for c in m.group(1).split(",")
                   if c.strip()} for name, lines in comps.items()}


def _loop_computations(comps: dict[str, list[str]], callees: dict[str, set[str]]) -> set[str]:
    in_loop: set[str] = set()
    stack = [m.group(1) for lines in comps.values() for line in lines for m in [_WHILE_BODY.search(line)] if m]
    while stack:
        name = stack.pop()
        if name not in in_loop:
            in_loop.add(name)
            stack.extend(callees.get(name, ()))
    return in_loop


_OP_NAME = re.compile(r'op_name="([^"]*)"')


def runs(hlo_text: str) -> dict[str, float | None]:
    """Times each computation of a compiled program runs per execution of it (`_runs`), by name."""
    comps = _computations(hlo_text)
    return _runs(hlo_text, comps, _callees(comps))


def triangular_loops(hlo_text: str) -> int:
    """How many while loops of a compiled program are counted at the mean of a triangular trip count
    (`_is_triangular`)."""
    return sum(_is_triangular(line) for lines in _computations(hlo_text).values() for line in lines
               if _WHILE_BODY.search(line))


def _is_triangular(while_line: str) -> bool:
    """A while loop in the name scope of a loop whose trip count is its enclosing loop's index + 1 (over that
    loop's N iterations: 1, 2, ..., N; zerolm.model.attention.TRIANGULAR_LOOP), whose trip count the compiler does
    not state."""
    name = _OP_NAME.search(while_line)
    return name is not None and f"/{TRIANGULAR_LOOP}/" in f"/{name.group(1)}/" and not _TRIP_COUNT.search(while_line)


def _runs(hlo_text: str, comps: dict[str, list[str]], callees: dict[str, set[str]]) -> dict[str, float | None]:
    """Times each computation runs per execution of the entry computation: a while body runs its trip count
    (`_trip_count`) times per run of its caller; a triangular loop (`_is_triangular`) the mean of its trip
    counts, (N + 1) / 2 inside a loop of N iterations; unknown: None."""
    entry = next((m.group(1) for line in hlo_text.splitlines() if line.startswith("ENTRY")
                  for m in [_COMPUTATION.match(line)] if m), None)
    runs: dict[str, float | None] = {}
    # (computation, its runs, the trip count of the innermost loop around it: what a triangular loop's mean needs)
    stack: list[tuple[str, float | None, int | None]] = [(entry, 1, None)] if entry else []
    while stack:
        name, times, around = stack.pop()
        if name in runs:
            continue
        runs[name] = times
        bodies: dict[str, tuple[float | None, int | None]] = {}
        for line in comps.get(name, ()):
            if m := _WHILE_BODY.search(line):
                trip = _trip_count(line, comps)
                mean: float | None = trip
                if trip is None and _is_triangular(line) and around is not None:
                    mean = (around + 1) / 2
                bodies[m.group(1)] = (None if times is None or mean is None else times * mean, trip)
        stack.extend((body, body_runs, trip) for body, (body_runs, trip) in bodies.items())
        stack.extend((callee, times, around) for callee in callees.get(name, ()) if callee not in bodies)
    return runs


def _trip_count(while_line: str, comps: dict[str, list[str]]) -> int | None:
    """A while loop's trip count: the compiler's `known_trip_count` (the CPU and GPU compilers state it), else
    read from its condition in the form JAX's scans and fori_loops take, a counter from 0 compared `< N` with
    a constant N (the TPU compiler states no trip count); None if neither."""
    if trip := _TRIP_COUNT.search(while_line):
        return int(trip.group(1))
    condition = _WHILE_CONDITION.search(while_line)
    lines = comps.get(condition.group(1), []) if condition else []
    constants = {m.group(1): int(m.group(2)) for m in map(_S32_CONSTANT.match, lines) if m}
    below = next((m.group(1) for m in map(_COUNTER_BELOW.match, lines) if m), None)
    return constants.get(below) if below else None


_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")


def _iota(reshape: str, perm: str | None) -> np.ndarray:
    """XLA's iota device list: 0..n-1 laid out as `reshape` ("4,2"), transposed by `perm` ("1,0") if given."""
    ids = np.arange(math.prod(int(d) for d in reshape.split(","))).reshape([int(d) for d in reshape.split(",")])
    return ids.transpose([int(d) for d in perm.split(",")]) if perm else ids


def _groups(line: str) -> tuple[frozenset[int], ...]:
    if m := _PAIRS.search(line):  # a collective-permute: the devices its pairs connect, as groups
        groups: list[set[int]] = []
        for a, b in re.findall(r"\{(\d+),(\d+)\}", m.group(1)):
            joined = [g for g in groups if int(a) in g or int(b) in g]
            groups = [g for g in groups if g not in joined] + [set().union({int(a), int(b)}, *joined)]
        return tuple(frozenset(g) for g in groups)
    if m := _GROUPS_IOTA.search(line):
        rows = _iota(m.group(2), m.group(3)).reshape(int(m.group(1).split(",")[0]), -1)
        return tuple(frozenset(int(i) for i in row) for row in rows)
    if m := _GROUPS_LISTED.search(line):
        return tuple(frozenset(int(i) for i in g.split(",") if i) for g in re.findall(r"\{([\d,]*)\}", m.group(1)))
    if m := _GROUPS_MESH.search(line):
        sizes = {name: int(n) for name, n in re.findall(r"'([^']+)'=(\d+)", m.group(1))}
        grouped = [list(sizes).index(name) for name in re.findall(r"'([^']+)'", m.group(5))]
        kept = [i for i in range(len(sizes)) if i not in grouped]
        # the device order: as listed by an iota ([dims], or [dims]<=[reshape]; then T(perm)), else in order
        ids = _iota(m.group(3) or m.group(2), m.group(4)) if m.group(2) else np.arange(math.prod(sizes.values()))
        ids = ids.reshape(list(sizes.values())).transpose(kept + grouped)
        return tuple(frozenset(int(i) for i in row) for row in ids.reshape(-1, math.prod(ids.shape[len(kept):])))
    if m := re.search(r"replica_groups=\S+", line):  # a form this reader does not know (e.g. a sub-axis of the
        # mesh-axes form): refuse rather than count the collective as spanning every device
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


def compiled_text(jitted, *args) -> str:
    return jitted.lower(*args).compile().as_text()


@dataclasses.dataclass(frozen=True)
class AsyncCollective:
    """A collective the scheduler split into a start and a done, so that work runs while it moves."""

    ops: tuple[str, ...]  # the collectives it runs (an async collective fusion may run more than one)
    computation: str
    in_loop: bool
    result_type: str  # of its done: what it delivers
    overlaps: tuple[str, ...]  # the compute scheduled between start and done: each matmul's op path (its
    # `dot_general` in the model, e.g. "h/attn/c_attn"), "loop:<path>" for a loop (the blockwise attention)
    called: str = ""  # an asynchronous collective fusion's computation: where collectives() finds its collectives

    @property
    def bytes(self) -> int:
        return _bytes_of(self.result_type)


_START = re.compile(r"^\s*(?:ROOT )?(%[\w.\-]+) = .*?\b((?:" + "|".join(COLLECTIVE_OPS) + r")-start|fusion)\(")
_OP_PATH = re.compile(r'op_name="([^"]*)"')
_MODEL_OP = re.compile(r"(?:closed_call|remat|checkpoint)/((?:[\w]+/)*?[\w]+)/(?:dot_general|while)$")


def async_collectives(hlo_text: str) -> list[AsyncCollective]:
    """Every asynchronous collective of a scheduled program and the compute between its start and its done:
    XLA's `all-gather-start`/`-done` pairs (and the other collectives'), and the TPU compiler's asynchronous
    collective fusions (`async-collective-start.N` ... `async-collective-done.N`, made with its
    `--xla_tpu_enable_async_collective_fusion` flags). Synchronous collectives are not listed."""
    comps = _computations(hlo_text)
    in_loop = _loop_computations(comps, _callees(comps))
    found = []
    for name, lines in comps.items():
        for i, line in enumerate(lines):
            m = _START.match(line)
            if not m or (m.group(2) == "fusion" and not m.group(1).startswith("%async-collective-start")):
                continue
            start = m.group(1)
            fused = ""
            if m.group(2) == "fusion":
                done = re.compile(r"^\s*(?:ROOT )?" + re.escape(start.replace("-start", "-done")) + r" = (\S+) ")
                called = _CALLED.search(line)
                fused = called.group(1).split(",")[0].strip().lstrip("%") if called else ""
                inner = "\n".join(comps.get(fused, []))
                ops = tuple(op for op in COLLECTIVE_OPS if f" {op}(" in inner)
            else:
                done = re.compile(r"^\s*(?:ROOT )?%[\w.\-]+ = (\S+) \S+-done\(" + re.escape(start) + r"\)")
                ops = (m.group(2).removesuffix("-start"),)
            between, result = [], ""
            for later in lines[i + 1:]:
                if d := done.match(later):
                    result = d.group(1)
                    break
                if " while(" in later or " convolution(" in later or " fusion(" in later or " custom-call(" in later:
                    path = _OP_PATH.search(later)
                    op = _MODEL_OP.search(path.group(1)) if path else None
                    if op:
                        label = ("loop:" if " while(" in later else "") + op.group(1)
                        if label not in between:
                            between.append(label)
            found.append(AsyncCollective(ops, name, name in in_loop, result, tuple(between), fused))
    return found
