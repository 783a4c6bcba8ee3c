"""Training metrics: one JSON object per step in <logging.dir>/metrics.jsonl, mirrored to wandb.

A resumed run appends; for a step logged twice (computed again after a restart) the last line wins.
Only process 0 writes. wandb is imported only when a run asks for it (`offline` or `online`), and
the WANDB_MODE environment variable, when set, wins over the config, as wandb documents.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax


class MetricsWriter:
    def __init__(self, log_dir: Path, config: dict[str, Any], run_name: str, wandb_mode: str, project: str,
                 wandb_id: str):
        self.enabled = jax.process_index() == 0
        self._wandb = None
        if not self.enabled:
            return
        log_dir.mkdir(parents=True, exist_ok=True)
        self.path = log_dir / "metrics.jsonl"
        self._file = self.path.open("a")
        mode = os.environ.get("WANDB_MODE", wandb_mode)
        if mode != "disabled":
            import wandb

            # The id is stored in every checkpoint, so a resumed run continues the same wandb run.
            self._wandb = wandb.init(project=project, name=run_name, config=config, dir=str(log_dir), mode=mode,
                                     id=wandb_id, resume="allow")

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._wandb is not None:
            self._wandb.log(record, step=step)

    def close(self) -> None:
        if self.enabled:
            self._file.close()
            if self._wandb is not None:
                self._wandb.finish()
