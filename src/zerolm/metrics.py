"""Training metrics: one JSON object per step in <logging.dir>/metrics.jsonl, mirrored to wandb.

`step` is the number of optimizer steps taken, as in messages and checkpoint names: the line of
step s holds the loss of the s-th update, and the checkpoint of step s the state after it. A run
that resumes from the checkpoint of step s first drops the lines of later steps (rewriting the file
atomically), so each step is logged once even after a `kill -9`. One host writes: the one holding
the mesh's first device (process 0 by default).

wandb is imported only when a run asks for it (`offline` or `online`); the WANDB_MODE environment
variable, when set, wins over the config, as wandb documents. Everything wandb writes (the run, its
cache, config and staging areas) goes under `<logging.dir>/wandb/`, not into the home directory or
the working directory, unless the user's own WANDB_*_DIR variables say otherwise. An offline run is
uploaded later with `wandb sync <logging.dir>/wandb/offline-run-*`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax


class MetricsWriter:
    def __init__(self, log_dir: Path, config: dict[str, Any], run_name: str, wandb_mode: str, project: str,
                 wandb_id: str, resume_step: int = 0, enabled: bool | None = None):
        """`config` goes to wandb's run config (the resolved config plus facts of the run)."""
        self.enabled = jax.process_index() == 0 if enabled is None else enabled
        self._wandb = None
        if not self.enabled:
            return
        log_dir.mkdir(parents=True, exist_ok=True)
        self.path = log_dir / "metrics.jsonl"
        _drop_after(self.path, resume_step)
        self._file = self.path.open("a")
        mode = os.environ.get("WANDB_MODE", wandb_mode)
        if mode != "disabled":
            home = (log_dir / "wandb").absolute()
            self._env_before = {v: os.environ.get(v) for v in _WANDB_DIRS}
            for variable, sub in _WANDB_DIRS.items():
                if self._env_before[variable] is None:
                    os.environ[variable] = str(home / sub) if sub else str(log_dir.absolute())
            import wandb

            # The id is stored in every checkpoint, so a resumed run continues the same wandb run.
            self._wandb = wandb.init(project=project, name=run_name, config=config, dir=str(log_dir.absolute()),
                                     mode=mode, id=wandb_id, resume="allow")

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._wandb is not None:
            self._wandb.log(record, step=step)

    def write_text(self, step: int, key: str, text: str) -> None:
        """Text (a generated sample) to wandb, as preformatted HTML; metrics.jsonl holds numbers only."""
        if self.enabled and self._wandb is not None:
            import html

            import wandb
            self._wandb.log({key: wandb.Html(f"<pre>{html.escape(text)}</pre>")}, step=step)

    def close(self) -> None:
        if self.enabled:
            self._file.close()
            if self._wandb is not None:
                self._wandb.finish()
                for variable, value in self._env_before.items():
                    if value is None:
                        os.environ.pop(variable, None)


# wandb's environment variables for where it writes -> the place under <logging.dir>/wandb ("": the
# run directory itself, under which wandb makes its own `wandb/`).
_WANDB_DIRS = {"WANDB_DIR": "", "WANDB_CACHE_DIR": "cache", "WANDB_CONFIG_DIR": "config", "WANDB_DATA_DIR": "data",
               "WANDB_ARTIFACT_DIR": "artifacts"}


def _drop_after(path: Path, step: int) -> None:
    """Keep the lines of steps <= `step` (and drop a line cut short by a kill); atomic rewrite."""
    if not path.exists():
        return
    kept, changed = [], False
    for line in path.read_text().splitlines():
        try:
            keep = json.loads(line)["step"] <= step
        except (ValueError, KeyError, TypeError):
            keep = False
        kept.append(line) if keep else None
        changed |= not keep
    if changed:
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, path)
