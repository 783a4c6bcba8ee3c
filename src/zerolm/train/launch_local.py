"""`zerolm launch-local`: a multi-process run on this machine, as a slice or a cluster would run it.

    zerolm launch-local --processes 2 --devices-per-process 4 -- --config configs/tiny.yaml --set ...

Starts P `zerolm train` processes, each with D CPU devices (`--xla_force_host_platform_device_count`),
joined through `jax.distributed` on 127.0.0.1 at a free port. Process 0's output is shown live (less gloo's
"[Gloo] Rank N is connected" lines); every process also writes `<logging.dir>/process-<i>.log`, all of it.
The logs of the launches before are kept as logrotate and Python's RotatingFileHandler keep them:
`process-<i>.log.1` is the last launch's, `.2` the one before, up to `.5` (`KEPT_LAUNCHES`): a crashed
run's logs survive the relaunch that resumes it, the current launch's keep the name that scripts and
docs point to, and the directory does not grow without end under a supervisor that relaunches.

- Ctrl-C or SIGTERM is forwarded to every process: they agree on a step, save it and exit 75
  together, as a single process does. A second Ctrl-C is forwarded too, and abandons the save.
- When a process dies (any exit but 0 or 75 while others still run), the others get `--grace`
  seconds (default 3) to notice on their own (a failed collective: exit 76 with their own line),
  then are killed. The launcher prints one line naming the process that died and its exit status.
  It exits 76 ("restart me"; the run resumes from its last complete checkpoint) only when that
  process was killed from outside (SIGKILL, SIGTERM, SIGHUP, SIGINT: the OOM killer, a lost host) or
  itself lost a peer; a crash that a restart would repeat (a Python error, exit 1; an abort, SIGABRT)
  gives the crashed process's own code (128 + the signal's number for a signal), and processes that
  all failed alike give that code (2 for a bad config, say).
- Nothing outlives the launcher. The children run in their own process group (a Ctrl-C at the
  terminal reaches the launcher alone, which forwards it), write straight into their log files (so a
  launcher that is gone leaves no broken pipe behind), and get SIGTERM from the kernel the moment the
  launcher dies, however it dies (`kill -9` included: Linux's parent-death signal, `PR_SET_PDEATHSIG`):
  they save the step reached and exit, and a process then stuck in JAX's distributed shutdown is ended
  after a few seconds (`zerolm.parallel.mesh.bound_shutdown`). SIGHUP (a closed terminal) is forwarded
  like SIGTERM.
"""

from __future__ import annotations

import codecs
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import NamedTuple

from zerolm.core.exitcodes import EXIT_PEER_LOST, EXIT_PREEMPTED
from zerolm.core.interrupts import die_with_parent

# Signals that mean "killed from outside": the run can be restarted as it is.
_EXTERNAL = {signal.SIGKILL, signal.SIGTERM, signal.SIGHUP, signal.SIGINT}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _describe(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


class Processes(NamedTuple):
    """What launch-local starts: `processes` of `devices` CPU devices each, in `slices` groups (slices)."""

    processes: int
    devices: int
    slices: int = 1


def launch(layout: Processes, train_args: list[str], log_dir: Path, grace: float = 3.0, out=sys.stdout) -> int:
    """Run `zerolm train TRAIN_ARGS` as `layout.processes` processes of `layout.devices` CPU devices each; their logs
    go to `log_dir` (the run's logging.dir). With several slices, process i is told its slice, i // (processes /
    slices), as a TPU VM of that slice is (MEGASCALE_SLICE_ID, MEGASCALE_NUM_SLICES;
    zerolm.parallel.mesh.slice_groups checks it). Returns the launch's exit code (module docstring)."""
    processes, devices, slices = layout
    log_dir.mkdir(parents=True, exist_ok=True)
    earlier = " (the last launch's: process-*.log.1)" if _rotate_logs(log_dir) else ""
    port = _free_port()
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} "
                                      f"--xla_force_host_platform_device_count={devices}".strip(),
           "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    procs, logs = [], []
    for i in range(processes):
        cmd = [sys.executable, "-m", "zerolm.cli", "train", *train_args, "--coordinator", f"127.0.0.1:{port}",
               "--num-processes", str(processes), "--process-id", str(i)]
        log = (log_dir / f"process-{i}.log").open("w")
        told = {"MEGASCALE_SLICE_ID": str(i // (processes // slices)), "MEGASCALE_NUM_SLICES": str(slices)} \
            if slices > 1 else {}
        proc = subprocess.Popen(cmd, env={**env, **told}, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True,  # own process group: Ctrl-C reaches the launcher only
                                preexec_fn=die_with_parent)
        procs.append(proc)
        logs.append(log)
    done = threading.Event()
    pump = threading.Thread(target=_follow, args=(log_dir / "process-0.log", out, done), daemon=True)
    pump.start()
    grouped = f" in {slices} slices" if slices > 1 else ""
    print(f"launch-local: {processes} process(es){grouped} × {devices} CPU device(s), coordinator 127.0.0.1:{port}, "
          f"pids {' '.join(str(p.pid) for p in procs)}; logs in {log_dir}/process-*.log{earlier}", file=sys.stderr, flush=True)

    def forward(signum, frame):
        # A closed terminal (SIGHUP) stops the run as a preemption does: the processes save and exit 75.
        sent = signal.SIGTERM if signum == signal.SIGHUP else signum
        for p in procs:
            if p.poll() is None:
                p.send_signal(sent)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        code = _supervise(procs, grace)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for p in procs:  # nothing outlives the launcher
            if p.poll() is None:
                p.kill()
                p.wait()
        done.set()
        pump.join(timeout=5)
        for log in logs:
            log.close()
    return code


KEPT_LAUNCHES = 5  # process-<i>.log.1 .. .5: the logs of the launches before this one (module docstring)


def _rotate_logs(log_dir: Path) -> bool:
    """process-<i>.log -> .log.1 -> .log.2 ... -> .log.KEPT_LAUNCHES, then gone, every process of every earlier
    launch alike (so that .1 is one launch's, whatever its process count). Whether there was a log to keep."""
    kept = False
    for generation in range(KEPT_LAUNCHES, -1, -1):
        for log in log_dir.glob("process-*.log" + (f".{generation}" if generation else "")):
            if generation == KEPT_LAUNCHES:
                log.unlink()
                continue
            base = log.name.removesuffix(f".{generation}") if generation else log.name
            log.replace(log.with_name(f"{base}.{generation + 1}"))
            kept = True
    return kept


class _WithoutGloo:
    """Text for the terminal without gloo's connection lines. gloo (JAX's CPU collectives between processes)
    prints "[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1" to
    stdout from C++ for each connection, with no setting to stop it, and from several threads at once: the
    pieces of one line (each `<<` of its `std::cout`) interleave with another's. Each piece goes, with its
    number; a piece that may still be growing at the end of what has been read waits for the next read (and
    no longer: `final` when that read finds nothing more).
    gloo's "is NOT connected" line (a failed connection) stays."""

    _PIECES = ("[Gloo] Rank ", " is connected to ", " peer ranks. ", "Expected number of connected peer ranks is : ")
    _PIECE = re.compile(r"\[Gloo\] Rank (?!\d* is NOT)\d*| is connected to \d*| peer ranks\. "
                        r"|Expected number of connected peer ranks is : \d*\n?")
    _NUMBER = re.compile(r"\d*")
    _RANK = re.compile(r"\[Gloo\] Rank \d*")  # " is NOT" may yet follow it

    def __init__(self) -> None:
        self._held = ""

    def __call__(self, text: str, final: bool = False) -> str:
        text = self._held + text
        cut = len(text) if final else self._unfinished(text)
        self._held = text[cut:]
        return self._PIECE.sub("", text[:cut])

    def _unfinished(self, text: str) -> int:
        """Where a piece begins that the next read may complete (a prefix of one, or one and its number so far),
        or decide (a rank, and perhaps the start of " is NOT")."""
        for start in range(max(0, len(text) - 64), len(text)):
            tail = text[start:]
            if any(piece.startswith(tail) or (tail.startswith(piece) and self._NUMBER.fullmatch(tail[len(piece):]))
                   for piece in self._PIECES):
                return start
            rank = self._RANK.match(tail)
            if rank and " is NOT".startswith(tail[rank.end():]):
                return start
        return len(text)


def _follow(path: Path, out, done: threading.Event) -> None:
    """Show process 0's log as it grows (less gloo's lines), until the processes are done and it is read to the
    end. Decoded incrementally: a character split between two reads (a progress bar's) comes out whole."""
    decode, quiet = codecs.getincrementaldecoder("utf-8")(errors="replace").decode, _WithoutGloo()
    with path.open("rb") as f:
        while True:
            chunk = f.read()
            finished = not chunk and done.is_set()
            # What a read that found nothing new leaves held is not a piece of gloo's: those come microseconds apart.
            text = quiet(decode(chunk, final=finished), final=not chunk)
            if text:
                out.write(text)
                out.flush()
            if finished:
                return
            if not chunk:
                time.sleep(0.05)


def _exit_code(code: int) -> int:
    """A process's exit status as a shell reports it: 128 + N when killed by signal N."""
    return 128 - code if code < 0 else code


def _restartable(code: int) -> bool:
    """Would restarting the run help? Yes when the process was killed from outside or lost a peer;
    no when it crashed by itself (a restart would repeat the crash)."""
    return code == EXIT_PEER_LOST or (code < 0 and -code in _EXTERNAL)


def _supervise(procs: list[subprocess.Popen], grace: float) -> int:
    while True:
        polled = [p.poll() for p in procs]
        if all(c is not None for c in polled):
            codes = [int(c) for c in polled if c is not None]
            if len(set(codes)) == 1:
                return codes[0] if codes[0] >= 0 else _verdict(codes, 0, "")
            failed = min((i for i, c in enumerate(codes) if c not in (0, EXIT_PREEMPTED)),
                         key=lambda i: (codes[i] == EXIT_PEER_LOST, i))
            return _verdict(codes, failed, "")
        # A process that lost its peer (76) is a consequence; name the one that failed first.
        dead = sorted((i for i, c in enumerate(polled) if c is not None and c not in (0, EXIT_PREEMPTED)),
                      key=lambda i: (polled[i] == EXIT_PEER_LOST, i))
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
            codes = [int(p.returncode) for p in procs]
            if len(set(codes)) == 1 and codes[0] > 0:
                return codes[0]  # every process failed alike (a bad config: 2)
            killed = f"; killed the other {len(running)} process(es) after {grace:g} s" if running else ""
            return _verdict(codes, first, killed)
        time.sleep(0.1)


def _verdict(codes: list[int], failed: int, killed: str) -> int:
    """One line naming the process that failed; 76 when a restart can help, else its own code."""
    code = codes[failed]
    if _restartable(code):
        print(f"launch-local: process {failed} {_describe(code)}{killed}; exit codes {codes}", file=sys.stderr,
              flush=True)
        return EXIT_PEER_LOST
    print(f"launch-local: process {failed} {_describe(code)} (it crashed by itself: a restart would repeat it, "
          f"see {'its log' if failed else 'above'}){killed}; exit codes {codes}", file=sys.stderr, flush=True)
    return _exit_code(code)
