"""The docs say nothing the code does not have: every `zerolm.x.y` they name imports, every source path,
benchmark module and relative link they give exists, the exit-code table is exitcodes.py's, and the README stays a front page."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from zerolm.core import exitcodes

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", REPO / "BENCHMARKS.md", REPO / "benchmarks" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
NAMED = re.compile(r"(?<![\w/.])zerolm(?:\.[A-Za-z_]\w*)+")
PATHS = re.compile(r"(?<![\w/.])((?:src|tests|benchmarks|configs|tpu_scripts|slurm)/[\w./-]*\w)")
LINKS = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
MODULES = re.compile(r"-m\s+(benchmarks(?:\.\w+)+)")  # a benchmark as the docs run it: python -m benchmarks.GROUP.NAME


def resolves(name: str) -> bool:
    """`zerolm.a.b.c` is a module, or an attribute path of the longest module it starts with."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_module_and_name_the_docs_give_exists(doc):
    names = {m.group(0).rstrip(".") for m in NAMED.finditer(doc.read_text())}
    assert [n for n in sorted(names) if not resolves(n)] == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_path_and_link_the_docs_give_exists(doc):
    text = doc.read_text()
    paths = {m.group(1) for m in PATHS.finditer(text)}
    missing = [p for p in sorted(paths) if "*" not in p and not (REPO / p).exists()]
    links = {m.group(1) for m in LINKS.finditer(text) if not m.group(1).startswith(("http:", "https:"))}
    missing += [link for link in sorted(links) if not (doc.parent / link).exists()]
    modules = {m.group(1) for m in MODULES.finditer(text)}
    missing += [m for m in sorted(modules) if not (REPO / (m.replace(".", "/") + ".py")).exists()]
    assert missing == []


def test_the_checks_catch_what_does_not_exist():
    assert resolves("zerolm.parallel.scatter.two_stage_reduce_scatter") and resolves("zerolm.parallel.sharding.Table")
    assert not resolves("zerolm.parallel.zero.two_stage_reduce_scatter") and not resolves("zerolm.nothing_here")


def test_the_exit_code_table_is_exitcodes_py():
    rows = re.findall(r"^\|\s*(\d+)\s*\|\s*`(EXIT_\w+)`\s*\|", (REPO / "docs" / "exit-codes.md").read_text(), re.M)
    documented = {name: int(code) for code, name in rows}
    defined = {name: value for name, value in vars(exitcodes).items()
               if name.startswith("EXIT_") and isinstance(value, int)}
    assert documented == defined


def test_the_readme_is_a_front_page():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 200
    first = [line for line in lines[:8] if line.startswith("make ")]
    assert [line.split()[:2] for line in first] == [["make", "train"], ["make", "test"]]  # the two commands, first
