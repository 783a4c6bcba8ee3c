"""The package's floors: commands above, the library below, imports one way and no circle.

Read from the source with `ast` (imports inside functions included), so a lazy import cannot hide
an arrow. Each check fails on the tree of the landed main before the commands/ package: `train.py`
imported `cli`, `launch.py` imported `train`'s parser, and cli ↔ train ↔ comms ↔ launch was a circle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
COMMAND_FLOOR = ("zerolm.commands", "zerolm.cli")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(source: str, name: str, modules: set[str]) -> set[str]:
    """The zerolm modules that module `name` imports, anywhere in it (`from zerolm import x` names x)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("zerolm")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("zerolm"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in modules else node.module)
    return {m for m in found if m in modules} - {name}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in SRC.rglob("*.py")}
    return {name: imports_of(path.read_text(), name, set(paths)) for name, path in paths.items()}


def is_command(module: str) -> bool:
    return module.startswith(COMMAND_FLOOR)


def test_no_library_module_imports_a_command(graph):
    wrong = {m: sorted(filter(is_command, deps)) for m, deps in graph.items() if not is_command(m)}
    assert not {m: d for m, d in wrong.items() if d}


def test_no_library_module_parses_flags():
    wrong = [p.name for p in SRC.rglob("*.py") if not is_command(module_name(p))
             and any(isinstance(n, (ast.Import, ast.ImportFrom)) and "argparse" in ast.dump(n)
                     for n in ast.walk(ast.parse(p.read_text())))]
    assert not wrong, f"argparse belongs in zerolm.commands: {wrong}"


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """A circle of imports, by depth-first search for a back edge (a package and its own submodules
    import each other by design and are not one)."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = "open"
        stack.append(m)
        for d in sorted(graph[m]):
            if d.startswith(m + ".") or m.startswith(d + "."):
                continue
            if state.get(d) == "open":
                return stack[stack.index(d):] + [d]
            if d not in state and (circle := visit(d)):
                return circle
        state[m] = "done"
        stack.pop()
        return None

    for m in sorted(graph):
        if m not in state and (circle := visit(m)):
            return circle
    return None


def test_imports_have_no_circle(graph):
    circle = find_circle(graph)
    assert circle is None, " -> ".join(circle)


def test_the_checks_see_the_old_circle_and_wrong_arrow(graph):
    """The checks are live: the landed main's train.py (it imported cli's parser and comms) is caught."""
    old_train = "from zerolm.cli import OneLineParser\nfrom zerolm import comms\n"
    arrows = imports_of(old_train, "zerolm.train", set(graph))
    assert arrows == {"zerolm.cli", "zerolm.comms"} and any(map(is_command, arrows))
    old = {"zerolm.cli": {"zerolm.train"}, "zerolm.train": {"zerolm.comms"}, "zerolm.comms": {"zerolm.train"}}
    assert find_circle(old) == ["zerolm.train", "zerolm.comms", "zerolm.train"]


# The floors, top to bottom (docs/layout.md): a module imports only from its own floor or below. A module
# takes the floor of the longest prefix named here.
FLOORS = {
    "commands": ("zerolm.cli", "zerolm.commands", "zerolm.lm_eval_cli"),
    "run": ("zerolm.train", "zerolm.resume", "zerolm.preemption", "zerolm.metrics", "zerolm.profiling",
            "zerolm.compilation_cache", "zerolm.library_log", "zerolm.launch", "zerolm.evaluate", "zerolm.sample",
            "zerolm.export", "zerolm.hf_layouts", "zerolm.restored", "zerolm.plot", "zerolm.aot", "zerolm.advice", "zerolm.comms",
            "zerolm.census", "zerolm.plan", "zerolm.checkpoint", "zerolm.header", "zerolm.run_data", "zerolm.warm_start",
            "zerolm.grow", "zerolm.import_hf", "zerolm.step_time", "zerolm.fastest", "zerolm.report", "zerolm.launches",
            "zerolm.harness", "zerolm.downstream", "zerolm.tasks"),
    "step": ("zerolm.step", "zerolm.zero", "zerolm.sharded_grad", "zerolm.scatter", "zerolm.optim", "zerolm.naive",
             "zerolm.model", "zerolm.losses", "zerolm.device_policy"),
    "parts": ("zerolm", "zerolm.config", "zerolm.storage", "zerolm.mesh", "zerolm.sharding", "zerolm.attention",
              "zerolm.runlock", "zerolm.hardware", "zerolm.checkpoint_meta", "zerolm.hlo", "zerolm.mfu",
              "zerolm.interrupts", "zerolm.exitcodes", "zerolm.errors", "zerolm.data"),
}
ORDER = list(FLOORS)  # index 0 is the top


def floor_of(module: str) -> str:
    named = [(prefix, floor) for floor, prefixes in FLOORS.items() for prefix in prefixes
             if module == prefix or module.startswith(prefix + ".")]
    return max(named, key=lambda pf: len(pf[0]))[1]


def upward(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """Each module's imports from a floor above its own."""
    wrong = {m: sorted(d for d in deps if ORDER.index(floor_of(d)) < ORDER.index(floor_of(m)))
             for m, deps in graph.items()}
    return {m: d for m, d in wrong.items() if d}


def test_every_module_has_a_floor_and_imports_only_down(graph):
    assert upward(graph) == {}


def test_the_floor_check_sees_the_old_upward_arrows(graph):
    """The check is live: the arrows the layout had before it was held (checkpoint down among the parts,
    importing the step; the loader importing the step's shardings from above) are caught."""
    old = {**graph, "zerolm.config": {"zerolm.model"}, "zerolm.data.loader": {"zerolm.zero"},
           "zerolm.storage": {"zerolm.checkpoint"}}
    assert upward(old) == {"zerolm.config": ["zerolm.model"], "zerolm.data.loader": ["zerolm.zero"],
                           "zerolm.storage": ["zerolm.checkpoint"]}
