"""What zerolm sets aside instead of deleting, beside the run's directory and named by the time: the checkpoints
(and logs) `--overwrite` replaces, into `<dir>.replaced-<time>/` (`move_aside`), and a damaged step that
`--resume auto` passes over, into `<dir>.damaged/<step>-<time>` (`move_damaged`).
"""

from __future__ import annotations

import time

from etils import epath

from zerolm.core import storage


def _stamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


def move_aside(directory: str | epath.Path, keep: tuple[str, ...] = ()) -> epath.Path:
    """Move a run's checkpoints into `<dir>.replaced-<time>/` (never delete someone's checkpoints).

    The directory itself stays, with the entries named in `keep` (the run lock)."""
    directory = storage.path(directory)
    aside = directory.parent / f"{directory.name}.replaced-{_stamp()}"
    aside.mkdir(parents=True)
    for p in directory.iterdir():
        if p.name not in keep:
            storage.move(p, aside / p.name)
    return aside


def move_damaged(directory: str | epath.Path, step: int) -> epath.Path:
    """Move one damaged step out of the run into `<dir>.damaged/<step>-<time>` (never deleted)."""
    directory = storage.path(directory)
    target = directory.parent / f"{directory.name}.damaged" / f"{step}-{_stamp()}"
    target.parent.mkdir(parents=True, exist_ok=True)
    storage.move(directory / str(step), target)
    return target
