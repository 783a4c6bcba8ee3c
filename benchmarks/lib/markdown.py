"""A benchmark's table in a markdown file (BENCHMARKS.md), between its own markers: written again in place,
or appended the first time."""

from __future__ import annotations

import re
from pathlib import Path


def write_block(path: Path, begin: str, end: str, lines: list[str]) -> None:
    text = path.read_text()
    block = f"{begin}\n" + "\n".join(lines) + f"\n{end}"
    text = re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _: block, text, flags=re.S) \
        if begin in text else text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)
