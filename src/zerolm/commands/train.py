"""`zerolm train` (and `python main_zero.py`): train a model from a YAML config.

Exit codes (zerolm.core.exitcodes): 0 done; 2 bad config, data, checkpoint or launch flags, a checkpoint
or logging directory held by another run, or a step that does not fit the device's memory; 3 a
non-finite loss or gradient norm (or, with train.skip_nonfinite, too many skipped updates in a row);
74 a checkpoint could not be saved (a full disk) or storage stopped answering; 75 stopped by SIGTERM
(preemption) or Ctrl-C: a checkpoint of the step reached was saved, run again to resume; 76 a peer
process of a multi-process run died: restart, the run resumes from the last complete checkpoint; 70 an
error of zerolm's own (a bug), with its traceback; 130 a second Ctrl-C abandoned that save, or Ctrl-C
before the first step.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from zerolm.core.exitcodes import EXIT_USAGE

# JAX, orbax and the library are imported in `run`, not here: `zerolm train --help` imports none of them.


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--config", default="configs/tiny.yaml", help="YAML config file (default: %(default)s)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a config key; repeatable")
    parser.add_argument("--resume", choices=["auto", "strict", "never"], default="auto",
                        help="auto: continue from the newest intact checkpoint of the run if there is one (a damaged "
                             "newer one is moved aside); strict: the same, but a damaged latest checkpoint stops the "
                             "run; never: start fresh (refused over existing checkpoints without --overwrite) "
                             "(default: %(default)s)")
    parser.add_argument("--overwrite", action="store_true",
                        help="with --resume never: move existing checkpoints aside and start over")
    parser.add_argument("--plot", action="store_true",
                        help="at the end, draw the run's curves into <logging.dir>/metrics.png (as `zerolm plot`)")
    parser.add_argument("--profile", metavar="FIRST-LAST", default=None,
                        help="capture a jax.profiler trace of these steps (the same as --set logging.profile=...)")
    dist = parser.add_argument_group("multi-process (omit on one host; on a TPU VM slice use --distributed)")
    dist.add_argument("--distributed", action="store_true", help="join a multi-process run (auto-detected cluster)")
    dist.add_argument("--coordinator", default=None, help="host:port of process 0, e.g. 127.0.0.1:12355")
    dist.add_argument("--num-processes", type=int, default=None)
    dist.add_argument("--process-id", type=int, default=None)
    dist.add_argument("--heartbeat-timeout", type=int, default=10, metavar="S",
                      help="a process silent this long is declared dead and the others stop with exit code 76 "
                           "(default: %(default)s)")
    dist.add_argument("--init-timeout", type=int, default=120, metavar="S",
                      help="how long to wait for the coordinator at start (default: %(default)s)")
    return parser


def config_of(args: argparse.Namespace, device_count: int | None, say=lambda line: None):
    """The run's config from these flags (ConfigError for a bad one); mesh.dp auto unresolved without
    `device_count`. `say` takes what it resolves differently from what it says (zerolm.config.load.load_config)."""
    from zerolm.config.load import load_config

    sets = args.set + ([f"logging.profile={args.profile}"] if args.profile else [])
    return load_config(args.config, sets, device_count=device_count, say=say)


def run(args: argparse.Namespace) -> int:
    from zerolm.parallel.mesh import bound_shutdown

    try:
        return _run(args)
    finally:
        bound_shutdown()


def _run(args: argparse.Namespace) -> int:
    """Errors: zerolm.commands.run_command prints a ZerolmError's line and returns its code; those raised
    after orbax or the storage clients may still have threads at work exit here, quietly (see below).
    Ctrl-C before the first step goes up to zerolm.core.interrupts.guarded: one line, and the process ends at
    once (an import it cut short can crash the interpreter's shutdown)."""
    import jax

    from zerolm.checkpoint.errors import CheckpointError
    from zerolm.core.storage import StorageFault
    from zerolm.observe import plot
    from zerolm.parallel.mesh import initialize_distributed
    from zerolm.train import trainer
    from zerolm.train.preemption import Preempted

    try:
        _libtpu_flags(args)
        if args.distributed or args.coordinator or args.num_processes is not None or args.process_id is not None:
            initialize_distributed(args.coordinator, args.num_processes, args.process_id,
                                   heartbeat_timeout_s=args.heartbeat_timeout, init_timeout_s=args.init_timeout)
        # (said by the first process, and once: the libtpu flags read the config before, quietly)
        cfg = config_of(args, jax.device_count(), say=_to_stderr if jax.process_index() == 0 else lambda line: None)
        trainer.train(cfg, resume=args.resume, overwrite=args.overwrite)
        if args.plot and jax.process_index() == 0:
            print(f"plot: {plot.write([cfg.log_dir], cfg.log_dir / 'metrics.png')}", flush=True)
    except (StorageFault, CheckpointError) as e:
        _exit_after_checkpoint_error(f"error: {e}", e.exit_code)
    except Preempted as e:
        print(f"zerolm: {e}; exiting with code {e.exit_code}", file=sys.stderr)
        return e.exit_code
    return 0


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _libtpu_flags(args: argparse.Namespace) -> None:
    """libtpu's asynchronous collective fusion where zero.tpu_async_collectives wants it (zerolm.core.tpu_flags),
    before JAX opens the devices: libtpu reads its flags once. The header says what was set, on a TPU."""
    from zerolm.core import tpu_flags

    if tpu_flags.may_load_libtpu():
        cfg = config_of(args, None)
        tpu_flags.apply(cfg.zero.tpu_async_collectives, [cfg.zero.stage])


def _exit_after_checkpoint_error(message: str, code: int) -> None:
    """Report a checkpoint or storage error as the last line and exit.

    After a failed restore, orbax has closed its event loop while TensorStore reads are still in
    flight, and their callbacks print 'Event loop is closed' tracebacks (not through sys.excepthook).
    The same after a failed save, from its background threads. They say nothing about the user's problem:
    from here on the process's stderr goes to /dev/null (however late a thread writes, and under load they
    are late), and the message is written to the real one, the last line, after a moment to drain (after
    a failed save on a line of its own: what a thread wrote before the redirect may end mid-line).
    """
    sys.stdout.flush()
    sys.stderr.flush()
    stderr = os.dup(2)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
    time.sleep(0.5)
    # A save that failed mid-run (not the user's input, exit 74) had threads writing: its line on a line of
    # its own, as a thread's traceback may have been cut off mid-line by the redirect.
    os.write(stderr, ("" if code == EXIT_USAGE else "\n").encode() + (message + "\n").encode())
    os._exit(code)
