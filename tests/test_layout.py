"""The package's layout: one package per concern, ordered, each importing only from those before it.

Read from the source with `ast` (imports inside functions included), so a lazy import cannot hide an
arrow. The order is docs/layout.md's table of packages, and every module must be on that page: the page
and the rule cannot drift apart. The checks are shown to fail on arrows the tree had before this layout:
a config section importing the data package for a mixture's check, the planner taking mesh labels from the
HLO reader, a circle through the commands."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"
LAYOUT = REPO / "docs" / "layout.md"
FACE = "zerolm"  # the package face: its version; it imports nothing
ENTRY = ("zerolm.cli", "zerolm.lm_eval_cli")  # the entry points, above every package
COMMANDS = "zerolm.commands"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(source: str, name: str, modules: set[str]) -> set[str]:
    """The zerolm modules that module `name` imports, anywhere in it (`from zerolm.p import x` names p.x where
    that is a module)."""
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


def package_order() -> list[str]:
    """docs/layout.md's packages, lowest first (the rows of its table whose first cell is a package name)."""
    return re.findall(r"^\| `(\w+)` \| [^|]+ \| [^|]+ \|$", LAYOUT.read_text(), re.M)


def package_of(module: str) -> str:
    """A module's package (`zerolm.parallel.zero` -> parallel); the face and the entry points are their own."""
    if module == FACE or module in ENTRY:
        return module
    return module.split(".")[1]


def rank(module: str, order: list[str]) -> int:
    if module in ENTRY:
        return len(order)
    return order.index(package_of(module))


def upward(graph: dict[str, set[str]], order: list[str]) -> list[str]:
    """Every import that goes up the order (or into the face from it), as "module -> import"."""
    wrong = []
    for module, deps in sorted(graph.items()):
        for dep in sorted(deps):
            if module == FACE or (dep != FACE and package_of(dep) != package_of(module)
                                  and rank(dep, order) >= rank(module, order)):
                wrong.append(f"{module} -> {dep}")
    return wrong


def test_every_package_is_in_the_order(graph):
    order = package_order()
    assert order[0] == "core" and order[-1] == "commands" and len(set(order)) == len(order)
    packages = {package_of(m) for m in graph} - {FACE, *ENTRY}
    assert packages == set(order), f"packages docs/layout.md does not order: {sorted(packages - set(order))}"


def test_imports_run_one_way(graph):
    """No module imports from a package after its own (nor does the face import anything): no two packages
    import each other, directly or through a longer circle."""
    assert upward(graph, package_order()) == []


def test_at_most_a_dozen_modules_at_the_top(graph):
    top = [m for m in graph if m.count(".") == 1 and not (SRC / m.replace(".", "/")).is_dir()]
    assert len(top) <= 12 and set(top) == set(ENTRY), top


def test_each_packages_docstring_says_what_it_may_import():
    order = package_order()
    for i, package in enumerate(order):
        doc = ast.get_docstring(ast.parse((SRC / "zerolm" / package / "__init__.py").read_text())) or ""
        said = re.search(r"May import: ([^.]*)\.", doc)
        assert said, f"zerolm.{package}'s docstring has no 'May import:' line"
        named = [] if said.group(1).startswith("nothing") else [p.strip() for p in said.group(1).split(",")]
        assert named == order[:i], f"zerolm.{package}: 'May import: {said.group(1)}', the order says {order[:i]}"


def listed_modules() -> set[str]:
    """The modules docs/layout.md's module table names (`pkg/a.py`, `b.py` in one cell: both in pkg)."""
    listed = set()
    for cell in re.findall(r"^\| ((?:`[^`]+`(?:, )?)+) \|", LAYOUT.read_text(), re.M):
        folder = ""
        for path in re.findall(r"`([^`]+)`", cell):
            path = path.removeprefix("zerolm/")
            if "/" in path:
                folder = path.rsplit("/", 1)[0] + "/" if not path.endswith("/") else path
            listed.add((path if "/" in path else folder + path).removesuffix(".py"))
    return listed


def test_every_module_is_on_the_layout_page(graph):
    listed = listed_modules()
    missing = []
    for module in graph:
        rel = module.removeprefix("zerolm").lstrip(".").replace(".", "/")
        is_package = (SRC / "zerolm" / rel).is_dir() if rel else True
        if module == FACE:
            continue
        if not (rel in listed or (is_package and rel + "/" in listed) or rel.rsplit("/", 1)[0] + "/*" in listed
                or any(rel.startswith(p) for p in listed if p.endswith("/"))
                or (is_package and package_of(module) == rel)):
            missing.append(module)
    assert missing == [], f"modules docs/layout.md does not list: {missing}"


def test_no_library_module_imports_a_command(graph):
    wrong = {m: sorted(d for d in deps if d.startswith(COMMANDS)) for m, deps in graph.items()
             if not m.startswith(COMMANDS) and m not in ENTRY}
    assert not {m: d for m, d in wrong.items() if d}


def test_no_library_module_parses_flags():
    wrong = [p.name for p in SRC.rglob("*.py") if not module_name(p).startswith(COMMANDS)
             and any(isinstance(n, (ast.Import, ast.ImportFrom)) and "argparse" in ast.dump(n)
                     for n in ast.walk(ast.parse(p.read_text())))]
    assert not wrong, f"argparse belongs in zerolm.commands: {wrong}"


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """A circle of module imports, by depth-first search for a back edge (a package and its own submodules
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


def test_modules_import_each_other_in_no_circle(graph):
    circle = find_circle(graph)
    assert circle is None, " -> ".join(circle)


def test_the_checks_see_the_arrows_the_tree_had_before(graph):
    """The checks are live: the config's lazy import of the data package for a mixture's weights, the
    planner's of the HLO reader for mesh labels, the face importing a package, and the commands' old circle
    (train imported cli's parser and the collectives report, which imported train) are each caught."""
    order = package_order()
    config_source = "def _one_source(self):\n    from zerolm.data.mixture import BLOCK, apportion\n"
    assert imports_of(config_source, "zerolm.config.tree", set(graph)) == {"zerolm.data.mixture"}
    old = {**graph, "zerolm.config.tree": {"zerolm.data.mixture"}, "zerolm.plan.traffic": {"zerolm.compile.hlo"},
           FACE: {"zerolm.core.storage"}}
    assert upward(old, order) == [f"{FACE} -> zerolm.core.storage", "zerolm.config.tree -> zerolm.data.mixture",
                                  "zerolm.plan.traffic -> zerolm.compile.hlo"]
    commands_circle = {"zerolm.cli": {"zerolm.train.trainer"}, "zerolm.train.trainer": {"zerolm.compile.collectives"},
                       "zerolm.compile.collectives": {"zerolm.train.trainer"}}
    assert find_circle(commands_circle) == ["zerolm.train.trainer", "zerolm.compile.collectives", "zerolm.train.trainer"]


def long_or_wide_functions(source: str) -> list[tuple[str, int, int]]:
    """(name, lines, parameters) of each function of `source` over 60 lines or 7 parameters (self and cls not
    counted)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
            params = len(names) - (names[:1] in (["self"], ["cls"])) + (a.vararg is not None) + (a.kwarg is not None)
            lines = node.end_lineno - node.lineno + 1  # type: ignore[operator]
            if lines > 60 or params > 7:
                found.append((node.name, lines, params))
    return found


def test_every_function_reads_in_one_sitting():
    """No function of the package runs past 60 lines or takes more than 7 parameters (a record instead: the
    ruff limits, without per-file exceptions, hold the rest)."""
    wrong = {module_name(p): f for p in SRC.rglob("*.py") if (f := long_or_wide_functions(p.read_text()))}
    assert wrong == {}
    # The check is live: a function of 8 parameters and one of 61 lines are each caught.
    assert long_or_wide_functions("def f(a, b, c, d, e, f, g, h):\n    pass\n") == [("f", 2, 8)]
    assert long_or_wide_functions("def g(self):\n" + "    x = 1\n" * 60) == [("g", 61, 0)]
