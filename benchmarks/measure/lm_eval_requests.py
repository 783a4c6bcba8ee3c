"""Seconds per 1,000 lm-evaluation-harness requests through zerolm's backend (zerolm.eval.harness) on this machine:
a checkpoint, a shipped task (zerolm_choice: 4 loglikelihood requests a document; zerolm_text: rolling windows),
timed after a first pass that compiles. Writes its table into docs/evaluation.md between its markers.

    python -m benchmarks.measure.lm_eval_requests --checkpoint checkpoints/tiny [--docs 100] [--batch-size 8]
"""

from __future__ import annotations

import argparse
import os
import time

import jax

from benchmarks.lib import REPO
from benchmarks.lib.markdown import write_block

DOC = REPO / "docs" / "evaluation.md"
BEGIN, END = "<!-- lm_eval_requests: begin -->", "<!-- lm_eval_requests: end -->"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--docs", type=int, default=100, help="documents per task")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    args = parser.parse_args()
    os.environ.setdefault("DISABLE_MULTIPROC", "1")
    from zerolm.eval import downstream
    from zerolm.eval.harness import ZerolmLM

    downstream.go_offline()
    lm = ZerolmLM(checkpoint=args.checkpoint, batch_size=args.batch_size)
    cfg = lm.loaded.model.cfg
    rows = ["| task | requests | batches | seconds | s per 1,000 requests |", "|---|---:|---:|---:|---:|"]
    for task in ("zerolm_choice", "zerolm_cloze", "zerolm_text"):
        manager = downstream.task_manager([task])
        downstream.evaluate(lm, [task], manager, limit=args.docs, bootstrap_iters=0)  # compiles
        before, calls = lm.scorer.batches, _count(lm)
        t0 = time.perf_counter()
        downstream.evaluate(lm, [task], manager, limit=args.docs, bootstrap_iters=0)
        seconds = time.perf_counter() - t0
        requests = _count(lm) - calls
        rows.append(f"| {task} | {requests} | {lm.scorer.batches - before} | {seconds:.2f} | "
                    f"{1000 * seconds / requests:.2f} |")
    device = jax.devices()[0]
    lines = [f"{device.device_kind} x {jax.device_count()} ({jax.default_backend()}); model: {cfg.n_layer} layers, "
             f"d_model {cfg.d_model}, seq_len {cfg.seq_len}; {args.docs} documents a task, batch {lm.scorer.batch_rows} "
             f"rows (`python -m benchmarks.measure.lm_eval_requests --checkpoint ...`)", "", *rows]
    print("\n".join(lines))
    if not args.no_write:
        write_block(DOC, BEGIN, END, lines)


def _count(lm) -> int:
    """Requests the scorer has been given (windows for rolling requests)."""
    return lm.scorer.requests


if __name__ == "__main__":
    main()
