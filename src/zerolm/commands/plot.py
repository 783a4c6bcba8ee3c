"""`zerolm plot RUN_DIR...`: loss, throughput, MFU and lr of runs, as a PNG (zerolm.observe.plot)."""

from __future__ import annotations

import argparse
from pathlib import Path

from zerolm.core.errors import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (logging.dir) to overlay")
    parser.add_argument("--out", default=None, metavar="FILE.png",
                        help="(default: RUN_DIR/metrics.png for one run, runs.png for several)")
    parser.add_argument("--skip-steps", type=int, default=1, metavar="N",
                        help="leave each run's first N steps out of the throughput and MFU panels (compiling) "
                             "(default: %(default)s)")
    return parser


def run(args: argparse.Namespace) -> int:
    from zerolm.core.storage import check
    from zerolm.observe.plot import write

    for where, what in [*((r, "RUN_DIR") for r in args.runs), (args.out or "", "--out")]:
        check(where, what, local_only="a run's logs are local: logging.dir")
    run_dirs = [Path(r) for r in args.runs]
    out = Path(args.out) if args.out else (run_dirs[0] / "metrics.png" if len(run_dirs) == 1 else Path("runs.png"))
    if out.suffix.lower() != ".png":
        raise UsageError(f"--out: {out}: expected a .png file")
    if args.skip_steps < 0:
        raise UsageError(f"--skip-steps: {args.skip_steps} is negative")
    print(write(run_dirs, out, args.skip_steps))
    return 0
