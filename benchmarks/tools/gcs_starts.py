"""How reliably the tests' GCS server (benchmarks/lib/gcs.py's GCSServer) starts under load: many starts, each timed to
its first answer.

    nice -n 10 python -m benchmarks.tools.gcs_starts [--starts 300] [--parallel 2] [--burners N] [--clients 4] [--poison]

`--parallel` servers start at once, each on its own thread and in its own root (the suite's two workers each
start one, and test_storage one more of its own), while `--burners` processes spin the CPU (one per core by
default) and a process with `--clients` threads opens and closes loopback connections without pause (clients
at their busiest, holding ephemeral ports, as a training run's storage clients do). `--poison` first does what
test_harness's --download test does in a worker: the process's first urlopen made with a dead proxy in the
environment (urllib keeps the proxies of its first urlopen for the whole process), the environment restored
after. Prints each failed start's message, how many failed, how many took over 5 s, and the median, 99th
percentile and maximum of the time to the first answer. Run it under `nice` on a shared machine: the burners
then compete with the starts, not with everyone else.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import statistics
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from benchmarks.lib.gcs import GCSServer


def burn() -> None:
    while True:
        pass


def churn(threads: int) -> None:
    """Loopback connections opened and closed without pause, by `threads` threads, to a listener of its own."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=1024)
    port = listener.getsockname()[1]

    def accept():
        while True:
            listener.accept()[0].close()

    def connect():
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
            except OSError:
                pass

    threading.Thread(target=accept, daemon=True).start()
    workers = [threading.Thread(target=connect, daemon=True) for _ in range(threads)]
    for w in workers:
        w.start()
    workers[0].join()


def poison() -> None:
    """The process's first urlopen with a dead proxy in the environment, then the environment as it was."""
    names = ("HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy")
    saved = {n: os.environ.get(n) for n in names}
    os.environ.update({n: "http://127.0.0.1:9" for n in names})
    try:
        urllib.request.urlopen("http://example.invalid/", timeout=5)
    except (OSError, urllib.error.URLError):
        pass
    for n, v in saved.items():
        if v is None:
            os.environ.pop(n)
        else:
            os.environ[n] = v


def starts(n: int, base: Path, out: list, lock: threading.Lock) -> None:
    for _ in range(n):
        server = GCSServer(Path(tempfile.mkdtemp(dir=base)) / "root")
        t0 = time.time()
        try:
            server.start()
            result = (time.time() - t0, None, None)
        except BaseException as e:
            alive = server.process is not None and server.process.poll() is None
            result = (time.time() - t0, f"{type(e).__name__}: {e}"[:300], alive)
        finally:
            server.stop()
        with lock:
            out.append(result)
            if result[1]:
                print(f"failed after {result[0]:.1f} s (its process {'left running' if result[2] else 'gone'}): "
                      f"{result[1]}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--starts", type=int, default=300)
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--burners", type=int, default=os.cpu_count())
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--poison", action="store_true")
    args = parser.parse_args()
    if args.poison:
        poison()
    load = [multiprocessing.Process(target=burn, daemon=True) for _ in range(args.burners)]
    if args.clients:
        load.append(multiprocessing.Process(target=churn, args=(args.clients,), daemon=True))
    for p in load:
        p.start()
    out: list = []
    lock = threading.Lock()
    t0 = time.time()
    with tempfile.TemporaryDirectory() as base:
        share = [args.starts // args.parallel + (i < args.starts % args.parallel) for i in range(args.parallel)]
        threads = [threading.Thread(target=starts, args=(k, Path(base), out, lock)) for k in share]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for p in load:
        p.kill()
    times = sorted(t for t, error, _ in out if error is None)
    failed = [r for r in out if r[1]]
    print(f"{len(out)} starts ({args.parallel} at a time, {args.burners} burners, {args.clients} client threads"
          f"{', poisoned' if args.poison else ''}) in {time.time() - t0:.0f} s: {len(failed)} failed "
          f"({sum(1 for r in failed if r[2])} left running), {sum(1 for t in times if t > 5)} took over 5 s; "
          + (f"median {statistics.median(times):.3f} s, p99 {times[int(0.99 * (len(times) - 1))]:.3f} s, "
             f"max {times[-1]:.3f} s" if times else "none started"))


if __name__ == "__main__":
    main()
