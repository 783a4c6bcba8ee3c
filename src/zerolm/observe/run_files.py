"""A run's own files, read once for its report (zerolm.observe.run_report): metrics.jsonl (each step's loss, lr,
tokens seen, tokens/s, MFU, data wait; the saves', evaluations' and downstream tasks' rows), launches.jsonl (each
launch's config, parameter count, devices, mesh, the data's size, compile and restore seconds, the steps and
seconds a restart lost: zerolm.observe.launches), the run's newest checkpoint (its record, and the parameter count
its arrays hold), and its decay branches beside it (directories next to RUN_DIR, as runs/<name> are, whose
launches.jsonl records a start from this run).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from zerolm.checkpoint.meta import CheckpointMeta
from zerolm.core.errors import ZerolmError
from zerolm.observe import launches, plot
from zerolm.observe.launches import Launch


class ReportError(ZerolmError):
    """RUN_DIR is not a run's logging directory (exit 2)."""


@dataclasses.dataclass(frozen=True)
class RunFiles:
    """What a run's directory holds, read once."""

    run_dir: Path
    records: list[dict[str, Any]]  # metrics.jsonl
    launches: list[Launch]  # launches.jsonl ([] before zerolm recorded launches)
    checkpoint_dir: str | None  # the launches' record, or --checkpoints
    checkpoint: CheckpointMeta | None  # the newest checkpoint's record
    checkpoint_params: int | None  # the parameter count its arrays hold
    branches: list[Path] = dataclasses.field(default_factory=list)  # logging dirs of its decay branches beside it

    @property
    def steps(self) -> list[dict[str, Any]]:
        """The rows of training steps (saves, evaluations and tasks write rows of their own)."""
        return [r for r in self.records if "loss" in r]

    @property
    def config(self) -> dict[str, Any] | None:
        """The run's resolved config: the last launch's, else the newest checkpoint's."""
        if self.launches:
            return self.launches[-1].config
        return self.checkpoint.full_config if self.checkpoint else None

    @property
    def facts(self) -> dict[str, Any]:
        return self.launches[-1].facts if self.launches else {}

    @property
    def first_steps(self) -> set[int]:
        """Each launch's first step (its time includes warming up), or the run's first where launches are
        not recorded."""
        if self.launches:
            return {launch.start_step + 1 for launch in self.launches}
        return {min(r["step"] for r in self.steps)} if self.steps else set()


def read(run_dir: Path, checkpoints: str | None = None) -> RunFiles:
    """The run in `run_dir` (its logging.dir), its checkpoints found through launches.jsonl or `checkpoints`."""
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir}: no such directory (a run's logging.dir, e.g. runs/tiny)")
    try:
        records = plot.read_run(run_dir)
    except plot.PlotError as e:
        raise ReportError(f"{e}: not a run's logging directory") from None
    recorded = launches.read(run_dir)
    where = checkpoints or (recorded[-1].checkpoint_dir if recorded else None)
    meta, count = _newest_checkpoint(where) if where else (None, None)
    return RunFiles(run_dir, records, recorded, where, meta, count, find_branches(run_dir))


def find_branches(run_dir: Path) -> list[Path]:
    """The decay branches of the run in `run_dir` that sit beside it (runs/<name>, the default logging.dir): the
    directories next to it whose first launch records a start from this run's logs."""
    here = run_dir.resolve()
    found = []
    for other in sorted(here.parent.iterdir()):
        try:
            if other == here or not (other / launches.NAME).exists() or not (other / plot.METRICS).exists():
                continue
            points = plot.branch_points(other)
        except OSError:  # a neighbour this user may not read is no branch of this run's
            continue
        if points and points[0].get("log_dir") and Path(points[0]["log_dir"]).resolve() == here:
            found.append(other)
    return found


def _newest_checkpoint(where: str) -> tuple[CheckpointMeta | None, int | None]:
    """The newest checkpoint's record and parameter count; (None, None) where there is none (any more)."""
    from zerolm.checkpoint.errors import CheckpointError
    from zerolm.checkpoint.store import Checkpoints, quiet_orbax
    from zerolm.core import storage

    with storage.faults(where, "reading the checkpoints"), quiet_orbax():
        if not storage.path(where).exists():
            return None, None
        ckpts = Checkpoints(where, read_only=True)
        try:
            step = ckpts.latest_step()
            if step is None:
                return None, None
            try:
                return ckpts.readable_meta(step), ckpts.param_count(step)
            except CheckpointError as e:
                raise ReportError(f"{where}: {e}") from None
        finally:
            ckpts.close()
