"""Where the test suite's CPU time goes: the pytest workers' own, and each Python process the tests start.

    python -m benchmarks.tools.suite_cpu [--log FILE] [--top 30] [-- PYTEST_ARGS...]

Runs the suite as `make test` does (two xdist workers, a file to each at a time; PYTEST_ARGS replace `tests`,
e.g. `-- tests/test_launch.py`) with benchmarks/tools/suite_cpu_hook/ first on PYTHONPATH: its sitecustomize.py appends,
as each Python process exits, its CPU seconds (user + system, os.times) and the test that started it
(PYTEST_CURRENT_TEST, which the tests' processes inherit) to a JSON-lines log. Then prints the wall time and the
CPU of the whole run (os.times of pytest's process tree), the workers' own CPU, the Python subprocesses' by
test file, by test and by command, and what no Python process reported (processes killed with SIGKILL, which
run no exit handler; Chromium; the GCS server; shells). `--log FILE` only summarizes a log written before.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.lib import REPO

HOOK = Path(__file__).resolve().parent / "suite_cpu_hook"


def run(pytest_args: list[str], log: Path) -> tuple[float, float]:
    """The suite with the per-process hook on: (wall seconds, CPU seconds of the whole process tree)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HOOK), os.environ.get("PYTHONPATH", "")]).strip(os.pathsep),
           "ZEROLM_SUITE_CPU_LOG": str(log), "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
           "WANDB_MODE": "disabled", "JAX_PLATFORMS": "cpu"}
    before, t0 = os.times(), time.time()
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadfile", "--no-loadscope-reorder",
                    "-p", "no:cacheprovider", *pytest_args], cwd=REPO, env=env, check=False)
    after = os.times()
    return time.time() - t0, (after.children_user - before.children_user) + (after.children_system - before.children_system)


def _command(argv: list[str]) -> str:
    """A process's script (`python -m M` records M's file), with the subcommand of `zerolm.cli`."""
    name = Path(argv[0]).name if argv else "?"
    return f"{name} {argv[1]}" if name == "cli.py" and len(argv) > 1 else name


def summarize(log: Path, top: int, wall: float | None = None, total: float | None = None) -> None:
    records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    cpu = lambda r: r["user"] + r["sys"]
    workers = [r for r in records if r["worker"] and not r["test"]]
    started = [r for r in records if r["test"]]
    by_file, by_test, by_command = collections.Counter(), collections.Counter(), collections.Counter()
    count = collections.Counter()
    for r in started:
        test = r["test"].split(" ")[0]
        by_file[test.split("::")[0]] += cpu(r)
        by_test[test] += cpu(r)
        count[test] += 1
        by_command[_command(r["argv"])] += cpu(r)
    worker_cpu, started_cpu = sum(map(cpu, workers)), sum(map(cpu, started))
    if wall is not None and total is not None:
        print(f"wall {wall:.0f} s; CPU {total:.0f} s ({total / wall:.2f} cores busy on average)")
        print(f"  the pytest workers' own: {worker_cpu:.0f} s; the Python processes the tests started: {started_cpu:.0f} s "
              f"({len(started)} processes, median {statistics.median(map(cpu, started)) if started else 0:.2f} s); "
              f"the rest (pytest's main process, processes killed by SIGKILL, Chromium, the GCS server, shells): "
              f"{total - worker_cpu - started_cpu:.0f} s")
    else:
        print(f"the pytest workers' own CPU: {worker_cpu:.0f} s; the Python processes the tests started: {started_cpu:.0f} s "
              f"({len(started)} processes)")
    for title, counter in (("by test file", by_file), ("by test", by_test), ("by command", by_command)):
        print(f"\nCPU seconds of the processes the tests started, {title}:")
        for name, seconds in counter.most_common(top):
            print(f"  {seconds:7.1f}  {name}" + (f"  (processes: {count[name]})" if counter is by_test else ""))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--log", type=Path, help="summarize this log instead of running the suite")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("pytest_args", nargs="*", default=["tests"])
    args = p.parse_args()
    if args.log is not None:
        summarize(args.log, args.top)
        return
    log = Path(tempfile.mkdtemp(prefix="suite-cpu-")) / "processes.jsonl"
    wall, total = run(args.pytest_args, log)
    print(f"\nlog: {log}")
    summarize(log, args.top, wall, total)


if __name__ == "__main__":
    main()
