"""The recorded results (benchmarks/results/*.json) as the figures, the comparison table and the step-time study
read them: each file whole, and zerolm's current H100 rows (those no newer session superseded)."""

from __future__ import annotations

import json

from benchmarks.lib import REPO

RESULTS = REPO / "benchmarks" / "results"


def load(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text())


def current(train: dict) -> dict[tuple[str, int], dict]:
    """zerolm's current H100 rows of train_h100.json by (config, micro-batch), each with its session's date."""
    return {(r["config"], r["micro_batch"]): {**r, "date": s["date"]} for s in train["sessions"] for r in s["rows"]
            if r["status"].startswith("current")}
