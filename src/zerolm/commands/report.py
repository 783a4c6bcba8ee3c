"""`zerolm report RUN_DIR`: a run's training log, as markdown and PNGs in RUN_DIR/report (zerolm.observe.run_report)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("run", metavar="RUN_DIR", help="the run's logging.dir (where its metrics.jsonl is)")
    parser.add_argument("--checkpoints", default=None, metavar="DIR",
                        help="the run's checkpoint.dir, local or gs:// (default: the one its launches.jsonl "
                             "records; a run of an older zerolm has none)")
    parser.add_argument("--wandb", action="store_true",
                        help="also log the report as an artifact of the run's wandb run (a run with "
                             "logging.wandb offline or online)")
    return parser


def run(args: argparse.Namespace) -> int:
    from zerolm.core.storage import check
    from zerolm.observe import run_files
    from zerolm.observe import run_report as report

    check(args.run, "RUN_DIR", local_only="a run's logs are local: logging.dir")
    files = run_files.read(Path(args.run), args.checkpoints)
    page = report.write(files)
    print(page)
    if args.wandb:
        print(report.log_to_wandb(files, page))
    return 0
