"""`zerolm launch-local`: a multi-process run on this machine, as a slice or a cluster would run it.

    zerolm launch-local --processes 2 --devices-per-process 4 -- --config configs/tiny.yaml --set ...

Starts P `zerolm train` processes, each with D CPU devices (`--xla_force_host_platform_device_count`),
joined through `jax.distributed` on 127.0.0.1 at a free port. Process 0's output is shown live; every
process also writes `<logging.dir>/process-<i>.log`.

- Ctrl-C or SIGTERM is forwarded to every process: they agree on a step, save it and exit 75
  together, as a single process does. A second Ctrl-C is forwarded too, and abandons the save.
- When a process dies (any exit but 0 or 75 while others still run), the others get `--grace`
  seconds (default 3) to notice on their own (a failed collective: exit 76 with their own line),
  then are killed. The launcher prints one line naming the process that died and its exit status,
  and exits 76 ("restart me"; the run resumes from its last complete checkpoint), or with the
  processes' own code when they all failed alike (2 for a bad config, say).
- The children run in their own process group, so nothing outlives the launcher.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from zerolm.mesh import EXIT_PEER_LOST
from zerolm.train import EXIT_PREEMPTED


def add_arguments(p) -> None:
    p.add_argument("--processes", type=int, required=True, help="number of processes (P)")
    p.add_argument("--devices-per-process", type=int, required=True, help="CPU devices per process (D)")
    p.add_argument("--grace", type=float, default=3.0,
                   help="when a process dies, seconds the others get to exit on their own before they are killed "
                        "(default: %(default)s)")
    p.add_argument("train_args", nargs="*", metavar="-- TRAIN_ARGS", help="arguments of `zerolm train`")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _log_dir(train_args: list[str], devices: int) -> Path:
    """The run's logging.dir, from the config and overrides the processes get, validated for the
    launch's `devices` in all (so that a bad config fails here, once, before any process starts)."""
    from zerolm.config import load_config
    from zerolm.train import build_parser

    args, _ = build_parser().parse_known_args(train_args)
    return load_config(args.config, args.set, device_count=devices).log_dir


def _describe(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def launch(processes: int, devices: int, train_args: list[str], grace: float = 3.0, out=sys.stdout) -> int:
    if processes < 1:
        raise ValueError(f"--processes {processes}: must be at least 1")
    if devices < 1:
        raise ValueError(f"--devices-per-process {devices}: must be at least 1")
    for flag in ("--coordinator", "--num-processes", "--process-id", "--distributed"):
        if flag in train_args:
            raise ValueError(f"{flag}: set by launch-local itself; leave it out of the train arguments")
    log_dir = _log_dir(train_args, processes * devices)
    log_dir.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} "
                                      f"--xla_force_host_platform_device_count={devices}".strip(),
           "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    procs, logs, pumps = [], [], []
    for i in range(processes):
        cmd = [sys.executable, "-m", "zerolm.cli", "train", *train_args, "--coordinator", f"127.0.0.1:{port}",
               "--num-processes", str(processes), "--process-id", str(i)]
        log = (log_dir / f"process-{i}.log").open("w")
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)  # own process group: Ctrl-C reaches the launcher only
        procs.append(proc)
        logs.append(log)
        pump = threading.Thread(target=_pump, args=(proc.stdout, log, out if i == 0 else None), daemon=True)
        pump.start()
        pumps.append(pump)
    print(f"launch-local: {processes} process(es) × {devices} CPU device(s), coordinator 127.0.0.1:{port}, "
          f"pids {' '.join(str(p.pid) for p in procs)}; logs in {log_dir}/process-*.log", file=sys.stderr, flush=True)

    def forward(signum, frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = _supervise(procs, grace)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for p in procs:  # nothing outlives the launcher
            if p.poll() is None:
                p.kill()
                p.wait()
        for pump in pumps:
            pump.join(timeout=5)
        for log in logs:
            log.close()
    return code


def _pump(stream, log, out) -> None:
    for line in iter(stream.readline, b""):
        log.write(line.decode(errors="replace"))
        log.flush()
        if out is not None:
            out.write(line.decode(errors="replace"))
            out.flush()


def _supervise(procs: list[subprocess.Popen], grace: float) -> int:
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            if len(set(codes)) == 1:
                return codes[0] if codes[0] >= 0 else EXIT_PEER_LOST
            failed = min((i for i, c in enumerate(codes) if c not in (0, EXIT_PREEMPTED)),
                         key=lambda i: (codes[i] == EXIT_PEER_LOST, i))
            print(f"launch-local: process {failed} {_describe(codes[failed])}; exit codes {codes}",
                  file=sys.stderr, flush=True)
            return EXIT_PEER_LOST
        # A process that lost its peer (76) is a consequence; name the one that failed first.
        dead = sorted((i for i, c in enumerate(codes) if c is not None and c not in (0, EXIT_PREEMPTED)),
                      key=lambda i: (codes[i] == EXIT_PEER_LOST, i))
        if dead:
            first = dead[0]
            # The others cannot finish a step, a save or a preemption sync without the dead one: give them
            # `grace` seconds to notice on their own (a failed collective: exit 76 with their own line; a
            # bad config: exit 2 alike), then kill what is left.
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and any(p.poll() is None for p in procs):
                time.sleep(0.05)
            running = [p for p in procs if p.poll() is None]
            for p in running:
                p.kill()
                p.wait()
            codes = [p.returncode for p in procs]
            if len(set(codes)) == 1 and codes[0] > 0:
                return codes[0]  # every process failed alike (a bad config: 2)
            killed = f"; killed the other {len(running)} process(es) after {grace:g} s" if running else ""
            print(f"launch-local: process {first} {_describe(codes[first])}{killed}; exit codes {codes}",
                  file=sys.stderr, flush=True)
            return EXIT_PEER_LOST
        time.sleep(0.1)
