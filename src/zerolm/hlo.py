"""What collectives a compiled program runs, and whether any sits inside a loop.

Reads the optimized HLO text of `jitted.lower(...).compile()`: the ground truth for "one gradient
reduction per optimizer step". Used by the tests and the benchmark.
"""

from __future__ import annotations

import dataclasses
import math
import re

COLLECTIVE_OPS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")

_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_INSTRUCTION = re.compile(r"=\s+(.+?)\s+(" + "|".join(COLLECTIVE_OPS) + r")(-start)?\(")
_CALLED = re.compile(r"(?:body|condition|calls|to_apply|branch_computations)=\{?([%\w.\-, ]+)\}?")
_WHILE_BODY = re.compile(r"\bwhile\(.*\bbody=%?([\w.\-]+)")
_ARRAY = re.compile(r"(pred|[a-z]+\d+)\[([\d,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
          "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}


@dataclasses.dataclass(frozen=True)
class Collective:
    op: str  # e.g. "all-reduce"
    computation: str  # the HLO computation it sits in
    in_loop: bool  # inside a while body (or something a while body calls)
    result_type: str

    @property
    def elements(self) -> int:
        return sum(math.prod(int(d) for d in dims.split(",") if d) for _, dims in _ARRAY.findall(self.result_type))

    @property
    def bytes(self) -> int:
        return sum(_BYTES.get(t, 4) * math.prod(int(d) for d in dims.split(",") if d)
                   for t, dims in _ARRAY.findall(self.result_type))


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
    callees = {name: {c.strip().lstrip("%") for m in _CALLED.finditer("\n".join(lines))
                      for c in m.group(1).split(",") if c.strip()}
               for name, lines in comps.items()}
    in_loop: set[str] = set()
    stack = [m.group(1) for lines in comps.values() for line in lines for m in [_WHILE_BODY.search(line)] if m]
    while stack:
        name = stack.pop()
        if name not in in_loop:
            in_loop.add(name)
            stack.extend(callees.get(name, ()))
    found = []
    for name, lines in comps.items():
        for line in lines:
            m = _INSTRUCTION.search(line)
            if m:
                found.append(Collective(m.group(2), name, name in in_loop, m.group(1)))
    return found


def compiled_text(jitted, *args) -> str:
    return jitted.lower(*args).compile().as_text()
