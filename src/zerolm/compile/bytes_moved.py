"""Where a compiled program's bytes go: a census of the kernels it runs, read from its optimized HLO.

Every instruction a device runs as a kernel (a fusion, a custom call such as a cuBLAS GEMM or cuDNN's attention, a
copy, a collective, ...) is counted once per execution of the program: inside a while loop, times the loop's trip
count, as zerolm.compile.hlo counts it for every reader (the FLOPs of zerolm.compile.step_time too: a causal key-block
loop at its mean trip count; a loop whose trip count is unknown counts once, and the census says so). Its bytes are
what it reads and writes: its operands and its result, except where XLA works on a slice of a buffer in place: a
dynamic-update-slice (alone, or at the root of a fusion, into one of the fusion's parameters) writes only its update
and does not read the buffer it updates; a slice or a dynamic-slice reads only its slice; a `send` to the host
(Multislice's transfers between slices, zerolm.compile.collectives.read_dcn) reads its buffer and a `recv` writes its
own, not the tuples they return. Bookkeeping (parameters, constants, tuples, bitcasts, the loops themselves) moves
nothing. It is a rough measure, the roofline's: what a kernel reuses from a cache, or reads twice, is not seen.
Without a profiler, it shows the copies, the slices of stacked buffers and the reductions a step spends its memory
bandwidth on (`zerolm compile --census`; benchmarks/compiler/census.py compares layer loops).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable

from zerolm.compile import hlo
from zerolm.compile.hlo import Instruction, array_bytes, operand_name

# Instructions that move no bytes of their own.
BOOKKEEPING = frozenset({
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call",
    "after-all", "partition-id", "replica-id", "opt-barrier", "add-dependency", "domain",
    "all-reduce-done", "all-gather-done", "collective-permute-done", "async-done", "async-update", "copy-done",
    "send-done", "recv-done"})
_CALLS = re.compile(r"\bcalls=%?([\w.\-]+)")
_KIND = re.compile(r"\bkind=(k\w+)")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')


@dataclasses.dataclass
class Row:
    kind: str  # e.g. "fusion (loop) -> dynamic-update-slice" (its root), "custom-call __cublas$lt$matmul", "copy"
    instructions: int  # distinct instructions of this kind
    executions: int  # times they run per execution of the program
    bytes: int  # bytes read and written per execution of the program


@dataclasses.dataclass
class Census:
    rows: list[Row]  # by bytes, largest first
    unknown_trip_counts: int  # while loops without a known trip count (each counted as running once)

    @property
    def bytes(self) -> int:
        return sum(r.bytes for r in self.rows)

    def of(self, prefix: str) -> int:
        """Bytes of the kinds that start with `prefix` (e.g. "copy", "fusion", "custom-call")."""
        return sum(r.bytes for r in self.rows if r.kind.startswith(prefix))

    def to_json(self) -> dict:
        return {"bytes": self.bytes, "unknown_trip_counts": self.unknown_trip_counts,
                "rows": [dataclasses.asdict(r) for r in self.rows]}


def typed(instructions: list[Instruction]) -> list[Instruction]:
    """The instructions with each operand's type written out (the GPU compiler prints operands by name
    only): looked up among the computation's own results."""
    types = {ins.name: ins.result for ins in instructions}
    return [dataclasses.replace(ins, operands=tuple(
        op if "[" in op.split("%", 1)[0] else f"{types.get(operand_name(op), '')} {op}" for op in ins.operands))
        for ins in instructions]


def _fusion_bytes(ins: Instruction, fused: list[Instruction]) -> int:
    """A fusion's operands and result, with slices of its parameters read and updated in place counted as
    the slices (see the module docstring)."""
    by_name = {f.name: f for f in fused}
    params = {f.name: int(f.operands[0]) for f in fused if f.opcode == "parameter" and f.operands}
    users: dict[str, list[Instruction]] = {}
    for f in fused:
        for op in f.operands:
            users.setdefault(operand_name(op), []).append(f)
    root = fused[-1] if fused else None
    roots = [by_name.get(operand_name(op)) for op in root.operands] if root and root.opcode == "tuple" else [root]
    read = [array_bytes(op) for op in ins.operands]
    written = array_bytes(ins.result)
    for r in roots:
        if r is not None and r.opcode == "dynamic-update-slice" and operand_name(r.operands[0]) in params:
            read[params[operand_name(r.operands[0])]] = 0  # updated in place, not read
            written += array_bytes(r.operands[1]) - array_bytes(r.result)
    for name, index in params.items():
        uses = users.get(name, [])
        if uses and all(u.opcode in ("slice", "dynamic-slice") and operand_name(u.operands[0]) == name for u in uses):
            read[index] = min(read[index], sum(array_bytes(u.result) for u in uses))
    return sum(read) + written


def kind_of(ins: Instruction, comps: dict[str, list[Instruction]]) -> str:
    if ins.opcode == "fusion":
        kind = _KIND.search(ins.attributes)
        called = _CALLS.search(ins.attributes)
        fused = comps.get(called.group(1), []) if called else []
        root = fused[-1].opcode if fused else "?"
        if root == "tuple":
            by_name = {f.name: f.opcode for f in fused}
            root = "+".join(sorted({by_name.get(operand_name(op), "?") for op in fused[-1].operands}))
        return f"fusion ({kind.group(1)[1:].lower() if kind else '?'}) -> {root}"
    if ins.opcode == "custom-call":
        target = _TARGET.search(ins.attributes)
        return f"custom-call {target.group(1) if target else '?'}"
    return ins.opcode.removesuffix("-start")


def bytes_of(ins: Instruction, comps: dict[str, list[Instruction]]) -> int:
    if ins.opcode == "fusion" and (called := _CALLS.search(ins.attributes)):
        return _fusion_bytes(ins, comps.get(called.group(1), []))
    if ins.opcode == "dynamic-update-slice":
        return 2 * array_bytes(ins.operands[1])
    if ins.opcode in ("slice", "dynamic-slice"):
        return 2 * array_bytes(ins.result)
    if ins.opcode == "send":  # (its buffer, a context, a token): the buffer again, not a second write
        return sum(array_bytes(op) for op in ins.operands)
    if ins.opcode == "recv":  # the buffer it fills, the first of (buffer, context, token); its operand is a token
        return array_bytes(m.group(0)) if (m := hlo.ARRAY.search(ins.result)) else 0
    return sum(array_bytes(op) for op in ins.operands) + array_bytes(ins.result)


def census(hlo_text: str) -> Census:
    """The census of one compiled program (its optimized HLO text)."""
    program = hlo.program(hlo_text)
    comps = {name: typed(instructions) for name, instructions in program.computations.items()}
    rows: dict[str, Row] = {}
    for name in program.executed:
        times = program.runs.get(name)
        for ins in comps[name]:
            if ins.opcode in BOOKKEEPING or ins.opcode == "async-start":
                continue
            kind = kind_of(ins, comps)
            row = rows.setdefault(kind, Row(kind, 0, 0, 0))
            row.instructions += 1
            row.executions += round(times or 1)
            row.bytes += round((times or 1) * bytes_of(ins, comps))
    return Census(sorted(rows.values(), key=lambda r: -r.bytes), program.unknown_loops)


def merge(censuses: Iterable[Census]) -> Census:
    """Several programs' censuses as one (a step's grad, reshard and update)."""
    rows: dict[str, Row] = {}
    unknown = 0
    for c in censuses:
        unknown += c.unknown_trip_counts
        for r in c.rows:
            into = rows.setdefault(r.kind, Row(r.kind, 0, 0, 0))
            into.instructions += r.instructions
            into.executions += r.executions
            into.bytes += r.bytes
    return Census(sorted(rows.values(), key=lambda r: -r.bytes), unknown)


def describe(c: Census, top: int = 12) -> list[str]:
    """The census as lines: each kind of kernel with its executions and bytes, the largest first."""
    total = c.bytes or 1
    lines = [f"bytes moved per step: {c.bytes / 1e9:,.1f} GB (operands and results of every kernel, times its "
             "loops' trip counts; zerolm.compile.bytes_moved)",
             f"  {'kernel':44s} {'instructions':>12s} {'executions':>11s} {'GB':>10s} {'share':>6s}"]
    for r in c.rows[:top]:
        lines.append(f"  {r.kind[:44]:44s} {r.instructions:12,d} {r.executions:11,d} {r.bytes / 1e9:10,.1f} "
                     f"{r.bytes / total:6.1%}")
    if len(c.rows) > top:
        rest = c.rows[top:]
        lines.append(f"  {'(' + str(len(rest)) + ' other kinds)':44s} {sum(r.instructions for r in rest):12,d} "
                     f"{sum(r.executions for r in rest):11,d} {sum(r.bytes for r in rest) / 1e9:10,.1f} "
                     f"{sum(r.bytes for r in rest) / total:6.1%}")
    if c.unknown_trip_counts:
        lines.append(f"  ({c.unknown_trip_counts} loop(s) without a known trip count: counted as running once)")
    return lines
