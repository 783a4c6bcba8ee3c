"""benchmarks/tools/suite_cpu.py's hook, imported by every Python process started with this directory on PYTHONPATH:
at exit, one JSON line with the process's CPU seconds and the test that started it, appended to
$ZEROLM_SUITE_CPU_LOG (nothing where that is unset)."""

import atexit
import json
import os
import sys
import time

_START = time.time()


def _record() -> None:
    path = os.environ.get("ZEROLM_SUITE_CPU_LOG")
    if not path:
        return
    t = os.times()
    line = json.dumps({"pid": os.getpid(), "argv": sys.argv[:8], "test": os.environ.get("PYTEST_CURRENT_TEST"),
                       "worker": os.environ.get("PYTEST_XDIST_WORKER"), "wall": time.time() - _START,
                       "user": t.user, "sys": t.system})
    try:
        with open(path, "a") as f:  # one short write per process: lines from several processes do not interleave
            f.write(line + "\n")
    except OSError:
        pass


atexit.register(_record)
