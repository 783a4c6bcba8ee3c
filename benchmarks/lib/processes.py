"""A command's peak memory: the resident bytes of its whole process tree (the parent and its workers, summed),
sampled every 0.1 s while it runs."""

from __future__ import annotations

import subprocess
import threading
import time

import psutil


def peak_rss(cmd: list[str]) -> tuple[int, float, str]:
    """Run `cmd`; (peak resident bytes of its process tree, seconds, stdout)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    peak = 0
    stop = threading.Event()

    def sample():
        nonlocal peak
        root = psutil.Process(proc.pid)
        while not stop.is_set():
            try:
                rss = sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
                peak = max(peak, rss)
            except psutil.Error:
                pass
            time.sleep(0.1)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    out, _ = proc.communicate()
    stop.set()
    t.join()
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}")
    return peak, time.perf_counter() - start, out
