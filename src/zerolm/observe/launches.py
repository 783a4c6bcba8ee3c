"""Every launch of a run, one JSON line each in `<logging.dir>/launches.jsonl`: what the run's other files do
not keep (`zerolm report` reads it).

A run is often launched several times (a preemption, a crash, more steps): each launch appends its record
before its first step, on the host that writes metrics.jsonl. The record holds the run's facts as that launch
saw them (the resolved config, the parameter count, devices and mesh, the data's size), the seconds it spent
compiling the step and restoring (or initialising) the state, the last step metrics.jsonl held before it
started, and the seconds of the rows after the step it starts from: a resume from an earlier checkpoint (or a
restart from scratch, where no checkpoint was saved) drops those rows from metrics.jsonl, and they are the
steps, evaluations and saves the interruption lost, recorded nowhere else. A decay branch's launches record
where it branched from (train.branch_from). Runs of a zerolm before this file existed have none; launches
recorded before version 2 lack the lost seconds, and before version 3 the branch record (they were no branches).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

NAME = "launches.jsonl"
VERSION = 3


@dataclasses.dataclass(frozen=True)
class Launch:
    time: float  # when the launch's first step was about to run (seconds since the epoch)
    start_step: int  # the step it starts after: 0 fresh, else the checkpoint it restored
    last_logged_step: int  # the last step metrics.jsonl held before this launch (0: none)
    compile_s: float  # building and compiling the training step (compilation cache hits included)
    start_s: float  # restoring the checkpoint of start_step, or initialising a fresh state
    checkpoint_dir: str  # absolute where local
    wandb_id: str  # the wandb run the metrics go to (where logging.wandb is not disabled)
    config: dict[str, Any]  # the resolved config (zerolm.config.tree.Config.model_dump())
    facts: dict[str, Any]  # zerolm.train.preflight.run_facts, and the device's peak FLOP/s (None: unknown)
    data: list[dict[str, Any]]  # per training dataset: name, location, train samples and tokens, mixture weight
    # Per `*_s` field of metrics.jsonl (step_time_s, data_wait_s, save_s, eval_s, tasks_s), its sum over the
    # rows after start_step, which this launch dropped: time an earlier launch spent on work that is done
    # again. None: a launch recorded before version 2.
    lost_s: dict[str, float] | None = None
    # A decay branch's source: the checkpoint (and its step) it started from, the source's logging directory as
    # found then (None: not found), and the source's own record if it was a branch
    # (zerolm.checkpoint.branch.Source.record); None: not a branch.
    branched_from: dict[str, Any] | None = None
    version: int = VERSION

    @property
    def steps_lost(self) -> int:
        """Steps logged by an earlier launch after the checkpoint this one restored: trained again."""
        return max(self.last_logged_step - self.start_step, 0)

    @property
    def lost_seconds(self) -> float | None:
        """The wall-clock seconds of the work dropped (a step's data wait is part of its step time)."""
        if self.lost_s is None:
            return None
        return sum(seconds for key, seconds in self.lost_s.items() if key != "data_wait_s")

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Launch:
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in fields})


def logged_after(log_dir: Path, step: int) -> tuple[int, dict[str, float]]:
    """The last step metrics.jsonl holds (0: no file, or no complete line), and per `*_s` field (not a rate,
    `*_per_s`) its sum over the rows of steps after `step`: what a launch starting from `step` drops."""
    path = log_dir / "metrics.jsonl"
    last, lost = 0, dict[str, float]()
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
                last = max(last, int(row["step"]))
            except (ValueError, KeyError, TypeError):
                continue  # a line cut short by a kill
            if row["step"] > step:
                for key, value in row.items():
                    if key.endswith("_s") and not key.endswith("_per_s"):
                        lost[key] = lost.get(key, 0.0) + value
    return last, lost


def append(log_dir: Path, launch: Launch) -> None:
    log_dir.mkdir(parents=True, exist_ok=True)
    with (log_dir / NAME).open("a") as f:
        f.write(json.dumps(dataclasses.asdict(launch)) + "\n")


def read(log_dir: Path) -> list[Launch]:
    """The run's launches in order ([] for a run of a zerolm that did not record them); a line cut short by
    a kill is left out."""
    path = log_dir / NAME
    if not path.exists():
        return []
    launches = []
    for line in path.read_text().splitlines():
        try:
            launches.append(Launch.from_json(json.loads(line)))
        except (ValueError, TypeError):
            continue
    return launches
