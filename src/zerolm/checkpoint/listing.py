"""`zerolm checkpoints DIR`: the table of a run's checkpoints (or of one step's), each step's time, size, tokens
seen, loss and dp, damaged ones marked, and the step `--resume auto` would take (`describe`).
"""

from __future__ import annotations

import time

from etils import epath

from zerolm.checkpoint.errors import CheckpointError, DamagedCheckpoint
from zerolm.checkpoint.store import Checkpoints, quiet_orbax
from zerolm.core import storage


def directory_size(path: epath.Path) -> int:
    return sum(storage.sizes(path).values())


SIZES_ONLY = ("(a step marked ok has every file with the size it had when saved, and its metadata reads; the "
              "arrays' contents are checked only by a restore: a same-size corruption shows then, and --resume auto "
              "moves that step aside and takes the one before)")


def describe(directory: str | epath.Path) -> str:
    """The table `zerolm checkpoints DIR` prints: every step, damaged ones marked, and the step
    `--resume auto` would really take (the newest intact one). DIR may also be one step's directory
    (`checkpoints/tiny/200`): then that step alone is described."""
    directory = storage.path(directory)
    only = None
    if directory.name.isdigit() and directory.is_dir() and not any(p.name.isdigit() for p in directory.iterdir()):
        only, directory = int(directory.name), directory.parent
    with quiet_orbax():
        ckpts = Checkpoints(directory, read_only=True)
        steps = ckpts.steps()
        if only is not None:
            if only not in steps:
                raise CheckpointError(f"{directory / str(only)}: not a complete checkpoint of {directory} "
                                      f"(its steps: {', '.join(map(str, steps)) or 'none'})")
            steps = [only]
        if not steps:
            return f"{directory}: no complete checkpoint; `--resume auto` would start from scratch"
        rows = ["step  saved (UTC)           size      tokens seen      loss    dp  status"]
        intact = []
        for step in steps:
            size = directory_size(ckpts.directory / str(step))
            try:
                ckpts.verify(step)
                meta = ckpts.meta(step)
            except DamagedCheckpoint as e:
                rows.append(f"{step:<5} {'-':<19}  {size / 2**20:7.1f} MiB  {'-':>13}  {'-':>8}  {'-':>4}  "
                            f"DAMAGED: {e.reason}")
                continue
            intact.append(step)
            saved = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(meta.time))
            loss = f"{meta.loss:.4f}" if meta.loss is not None else "-"
            rows.append(f"{step:<5} {saved}  {size / 2**20:7.1f} MiB  {meta.tokens_seen:>13,}  {loss:>8}  "
                        f"{meta.dp:>4}  ok")
    if only is not None:
        return "\n".join(rows + ([SIZES_ONLY] if intact else []))
    if intact:
        rows.append(f"`--resume auto` would take step {intact[-1]}"
                    + (" (the newer damaged ones are moved aside)" if intact[-1] != steps[-1] else ""))
        rows.append(SIZES_ONLY)
    else:
        rows.append("`--resume auto` would start from scratch: no intact checkpoint")
    return "\n".join(rows)
