"""The one reader of a compiled program: its optimized HLO text (`jitted.lower(...).compile().as_text()`) as
computations of instructions, the call graph between them, and how many times each computation runs per execution
of the program. Everything zerolm reads off a compiled program goes through a `Program`: its collectives
(zerolm.compile.collectives), its bytes (zerolm.compile.bytes_moved) and its FLOPs (zerolm.compile.step_time), so
that they count the same loops the same way.

Parsing: an instruction is one logical line, `[ROOT] %name = type opcode(operands), attributes`. A string in its
attributes may hold raw newlines (a Pallas kernel's `backend_config` does, in some compilers' text): the physical
lines are joined while a string is open, so a line of such a string is never taken for an instruction, a
computation's header (`... {`) or its end (`}`).

Runs: the entry computation runs once; a while loop's body runs its trip count times per run of the computation
that holds the loop (its condition once more), anything else a computation calls (a fusion's computation, a
conditional's branches, an async computation, a reducer) as often as its caller. A computation called from several
places runs the sum. A trip count is the compiler's `known_trip_count` (the CPU and GPU compilers state it); else it
is read from the loop itself, in the form JAX's scans and fori_loops take: a counter compared `<` a constant N in the
condition, starting where the loop's initial tuple sets it (0, or 1 after the compiler peeled the first iteration
out of the loop: N − 1 then). A loop in the blockwise attention's key-block scope whose bound is its enclosing
loop's index + 1 (zerolm.model.attention.TRIANGULAR_LOOP) runs the mean of its trip counts, (N + 1) / 2 inside a
loop of N iterations. Any other loop's trip count is unknown: its body's runs are None, and `unknown_loops` says
how many such loops there are.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Iterator

from zerolm.model.attention import TRIANGULAR_LOOP

COLLECTIVE_OPS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")

_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_LINE = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([a-z][\w\-]*)\((.*)$", re.S)
_ESCAPED = re.compile(r"\\.", re.S)
ARRAY = re.compile(r"\b(pred|[a-z]+\d+)\[([\d,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
          "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
_ONE = re.compile(r"\b(body|condition|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_INDEX = re.compile(r"\bindex=(\d+)")
_DIRECTION = re.compile(r"\bdirection=(\w+)")
_CONSTANT = re.compile(r"^\s*(-?\d+)\s*$")
_PASS_THROUGH = ("copy", "bitcast", "convert", "copy-done")  # an instruction that hands its operand's value on
# Edges along which a computation runs as code of its own (not as a fusion's body or a reducer): what the bytes
# census walks.
_EXECUTED = {("while", "body"), ("while", "condition"), ("conditional", "branch"), ("conditional", "true_computation"),
             ("conditional", "false_computation"), ("call", "to_apply"), ("async-start", "calls")}


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    result: str  # the result type's text
    opcode: str
    operands: tuple[str, ...]  # each operand's text: its type (where the compiler writes it) and its name
    attributes: str  # the rest of the line
    root: bool = False

    def operand_names(self) -> list[str]:
        return [operand_name(op) for op in self.operands]

    def called(self) -> list[tuple[str, str]]:
        """(how, computation) of each computation it calls: ("body", ...), ("calls", ...), ("branch", ...)."""
        found = [(m.group(1), m.group(2)) for m in _ONE.finditer(self.attributes)]
        for m in _BRANCHES.finditer(self.attributes):
            found += [("branch", c.strip().lstrip("%")) for c in m.group(1).split(",") if c.strip()]
        return found

    @property
    def op_name(self) -> str | None:
        m = _OP_NAME.search(self.attributes)
        return m.group(1) if m else None


def operand_name(operand: str) -> str:
    return operand.rsplit(" ", 1)[-1].lstrip("%")


def array_bytes(text: str) -> int:
    """Bytes of every array type written in `text` (a result type, an operand)."""
    return sum(_BYTES.get(t, 4) * math.prod(int(d) for d in dims.split(",") if d) for t, dims in ARRAY.findall(text))


def array_dims(text: str) -> list[int]:
    """The dimensions of the first array type written in `text`."""
    m = ARRAY.search(text)
    return [int(d) for d in m.group(2).split(",") if d] if m else []


class Program:
    """One compiled program's HLO: `computations` (name -> its instructions, in order), `entry`, `runs`
    (name -> times it runs per execution of the program; None under a loop of unknown trip count), `in_loop` (the
    computations a while body runs, directly or through what it calls), `executed` (those that run as code of
    their own: the entry, loop bodies and conditions, branches, calls; not fusions' bodies), `unknown_loops` and
    `triangular_loops` (see the module's docstring)."""

    def __init__(self, text: str):
        self.computations, self.entry = _parse(text)
        self.by_name = {c: {ins.name: ins for ins in instructions} for c, instructions in self.computations.items()}
        self.runs: dict[str, float | None] = {}
        self.executed: set[str] = set()
        self._unknown: set[tuple[str, str]] = set()  # (computation, while loop)
        self._triangular: set[tuple[str, str]] = set()
        if self.entry is not None:
            self._count(self.entry, 1, None, True)
        self.unknown_loops, self.triangular_loops = len(self._unknown), len(self._triangular)
        self.in_loop = frozenset(self._under_loops())

    def instructions(self) -> Iterator[tuple[str, Instruction]]:
        for name, instructions in self.computations.items():
            for ins in instructions:
                yield name, ins

    def trip_count(self, computation: str, loop: Instruction) -> int | None:
        """A while loop's trip count (see the module's docstring), or None."""
        if m := _TRIP_COUNT.search(loop.attributes):
            return int(m.group(1))
        condition = dict(loop.called()).get("condition")
        bound = self._bound(condition) if condition else None
        if bound is None:
            return None
        index, limit = bound
        start = self._tuple_element(computation, loop.operand_names()[0], index) if loop.operands else None
        return max(limit - (start or 0), 0)

    def _count(self, name: str, times: float | None, around: int | None, executed: bool) -> None:
        """Adds `times` runs of computation `name` (and of what it calls); `around`: the trip count of the
        innermost loop around it (what a triangular loop's mean needs)."""
        before = self.runs.get(name, 0)
        self.runs[name] = None if times is None or before is None else before + times
        if executed:
            self.executed.add(name)
        for ins in self.computations.get(name, ()):
            trip: int | None = None
            mean: float | None = None
            if ins.opcode == "while":
                trip = mean = self.trip_count(name, ins)
                if trip is None and is_triangular(ins) and around is not None:
                    mean = (around + 1) / 2
                    self._triangular.add((name, ins.name))
                elif trip is None:
                    self._unknown.add((name, ins.name))
            for how, callee in ins.called():
                kind = (ins.opcode, "branch" if how == "branch" else how)
                if ins.opcode == "while" and how == "body":
                    self._count(callee, None if times is None or mean is None else times * mean, trip or around, True)
                elif ins.opcode == "while" and how == "condition":
                    self._count(callee, None if times is None or mean is None else times * (mean + 1), around, True)
                else:
                    self._count(callee, times, around, executed and kind in _EXECUTED)

    def _under_loops(self) -> set[str]:
        inside: set[str] = set()
        stack = [callee for _, ins in self.instructions() if ins.opcode == "while"
                 for how, callee in ins.called() if how == "body"]
        while stack:
            name = stack.pop()
            if name not in inside:
                inside.add(name)
                stack.extend(callee for ins in self.computations.get(name, ()) for _, callee in ins.called())
        return inside

    def _bound(self, condition: str) -> tuple[int, int] | None:
        """(the counter's index in the loop's tuple, N) of a condition `counter < N` (or `N > counter`), the compare
        at its root or in a fusion there (the CPU compiler wraps it)."""
        root = next((ins for ins in self.computations.get(condition, ()) if ins.root), None)
        operands = root.operand_names() if root is not None else []
        if root is not None and root.opcode == "fusion":  # the compare inside, of the fusion's parameters
            fused = dict(root.called()).get("calls", "")
            root = next((ins for ins in self.computations.get(fused, ()) if ins.root), None)
            parameters = {ins.name: int(ins.operands[0]) for ins in self.computations.get(fused, ())
                          if ins.opcode == "parameter" and ins.operands and ins.operands[0].isdigit()}
            if root is None or any(n not in parameters for n in root.operand_names()):
                return None
            operands = [operands[parameters[n]] for n in root.operand_names()]
        if root is None or root.opcode != "compare" or len(operands) != 2:
            return None
        direction = _DIRECTION.search(root.attributes)
        lhs, rhs = (self._resolve(condition, n) for n in operands)
        if direction and direction.group(1) == "GT":
            lhs, rhs = rhs, lhs
        elif not direction or direction.group(1) != "LT":
            return None
        counter, limit = lhs, rhs
        if counter is None or limit is None or counter.opcode != "get-tuple-element" or limit.opcode != "constant":
            return None
        index, value = _INDEX.search(counter.attributes), _CONSTANT.match(limit.operands[0] if limit.operands else "")
        return (int(index.group(1)), int(value.group(1))) if index and value else None

    def _resolve(self, computation: str, name: str) -> Instruction | None:
        """The instruction whose value `name` hands on (through copies, bitcasts and converts)."""
        ins = self.by_name.get(computation, {}).get(name)
        while ins is not None and ins.opcode in _PASS_THROUGH and ins.operands:
            ins = self.by_name[computation].get(ins.operand_names()[0])
        return ins

    def _tuple_element(self, computation: str, name: str, index: int) -> int | None:
        """The constant element `index` of the tuple `name` (a loop's initial value), or None."""
        made = self._resolve(computation, name)
        if made is None or made.opcode != "tuple" or index >= len(made.operands):
            return None
        element = self._resolve(computation, made.operand_names()[index])
        value = _CONSTANT.match(element.operands[0]) if element is not None and element.opcode == "constant" and \
            element.operands else None
        return int(value.group(1)) if value else None


def is_triangular(loop: Instruction) -> bool:
    """A while loop in the scope of the blockwise attention's key-block loops, whose bound is its enclosing loop's
    index + 1 (1, 2, ..., N over that loop's N iterations), and whose trip count the compiler does not state."""
    name = loop.op_name
    return name is not None and f"/{TRIANGULAR_LOOP}/" in f"/{name}/" and not _TRIP_COUNT.search(loop.attributes)


def _logical_lines(text: str) -> Iterator[str]:
    """The text's lines, those of a string left open at a line's end joined to the next (see the docstring)."""
    pending: list[str] = []
    in_string = False
    for line in text.splitlines():
        pending.append(line)
        if '"' in line:
            in_string ^= _ESCAPED.sub("", line).count('"') % 2 == 1
        if not in_string:
            yield "\n".join(pending)
            pending = []
    if pending:
        yield "\n".join(pending)


def _parse(text: str) -> tuple[dict[str, list[Instruction]], str | None]:
    comps: dict[str, list[Instruction]] = {}
    current, entry = None, None
    for line in _logical_lines(text):
        if current is None:
            if m := _HEADER.match(line):
                current = m.group(1)
                comps[current] = []
                entry = current if line.startswith("ENTRY") else entry
        elif line.startswith("}"):
            current = None
        elif m := _LINE.match(line):
            operands, attributes = _split_operands(m.group(5))
            comps[current].append(Instruction(m.group(2), m.group(3), m.group(4), operands, attributes,
                                              m.group(1) is not None))
    return comps, entry


def _split_operands(rest: str) -> tuple[tuple[str, ...], str]:
    """The operand list that opens `rest` (up to its matching parenthesis), split at top-level commas."""
    depth, start, parts = 0, 0, []
    for i, ch in enumerate(rest):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:
                parts.append(rest[start:i])
                return tuple(p.strip() for p in parts if p.strip()), rest[i + 1:]
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(rest[start:i])
            start = i + 1
    return tuple(p.strip() for p in parts if p.strip()), ""


@functools.lru_cache(maxsize=8)
def program(text: str) -> Program:
    """The Program of an HLO text, parsed once however many readers ask (the last few texts are kept)."""
    return Program(text)


def runs(hlo_text: str) -> dict[str, float | None]:
    """Times each computation of a compiled program runs per execution of it (`Program.runs`), by name."""
    return program(hlo_text).runs


def compiled_text(jitted, *args) -> str:
    return jitted.lower(*args).compile().as_text()
