"""Stopping at a step every process agrees on: SIGTERM (a preemption) and Ctrl-C alike.

The step reached is saved and the run exits 75 (`exitcodes.EXIT_PREEMPTED`). In a multi-process run
JAX's preemption notifier owns SIGTERM and picks the step; on one process a flag does.
"""

from __future__ import annotations

import os
import signal
import sys

import jax
from jax.experimental import multihost_utils

from zerolm.core.errors import ZerolmError
from zerolm.core.exitcodes import EXIT_INTERRUPTED, EXIT_PREEMPTED
from zerolm.core.interrupts import interrupted_early


class Preempted(ZerolmError):
    """The run stopped at a step every process agreed on, and saved it (exit 75: run again to resume)."""

    exit_code = EXIT_PREEMPTED

    def __init__(self, step: int, why: str = "preempted"):
        super().__init__(f"{why}: checkpoint saved at step {step}")
        self.step = step


class PreemptionWatch:
    """Has a SIGTERM or a Ctrl-C arrived? All processes agree on the step at which they stop.

    Ctrl-C is taken as SIGTERM: the step reached is saved and the run exits 75. A second Ctrl-C
    abandons that save and exits at once (130); the unfinished save is removed by the next run."""

    def __init__(self):
        if interrupted_early():  # a Ctrl-C during start-up that something swallowed
            raise KeyboardInterrupt
        self.flag = False
        self.interrupted = False
        self.stop_at: int | None = None  # the step a stop requested now would save (one process; see reached)
        self.multi = jax.process_count() > 1
        if not self.multi:  # jax.distributed's preemption notifier handles SIGTERM across processes
            self._previous_term = signal.signal(signal.SIGTERM, self._on_sigterm)
        self._previous_int = signal.signal(signal.SIGINT, self._on_sigint)

    def _on_sigterm(self, signum, frame):
        self.flag = True

    def _on_sigint(self, signum, frame):
        if self.interrupted:
            print("\nzerolm: interrupted again: abandoned the save; the latest complete checkpoint stays the "
                  f"latest; exiting with code {EXIT_INTERRUPTED}", file=sys.stderr, flush=True)
            os._exit(EXIT_INTERRUPTED)
        self.interrupted = True
        # The progress bar shows the last step whose metrics arrived: steps already dispatched are still
        # computing, so say which step the run stops at, not "the step reached".
        at = ("at the step every process agrees on" if self.multi or self.stop_at is None else
              f"after step {self.stop_at} (the step in flight; the bar lags behind the device)")
        print(f"\nzerolm: interrupted: stopping {at} and saving it, then exiting (Ctrl-C again to abandon the "
              "save)", file=sys.stderr, flush=True)
        if self.multi:  # hand it to JAX's preemption notifier, which makes every process stop at one step
            os.kill(os.getpid(), signal.SIGTERM)
        else:
            self.flag = True

    def reached(self, step: int) -> bool:
        """Whether the run stops after `step`, which the loop has just dispatched."""
        if self.multi:
            return multihost_utils.reached_preemption_sync_point(step)
        if not self.flag:
            self.stop_at = step + 1
        return self.flag

    def dispatching(self, step: int) -> None:
        """The loop is about to dispatch `step`: a stop requested from now on saves it."""
        self.stop_at = step

    def finishing(self, step: int) -> None:
        """`step` is the run's last, and the work after it (evaluations, its save) runs now: a stop requested
        from now on saves it, and the run stops there (`stopped`) instead of going on to its closing work."""
        self.stop_at = step

    def stopped(self) -> bool:
        """Whether a stop was requested in one process since `finishing` (in a multi-process run JAX's notifier
        stops at a step, and the last step has none after it: the run ends as it would have)."""
        return not self.multi and self.flag

    @property
    def why(self) -> str:
        return "interrupted" if self.interrupted else "preempted"

    def close(self):
        if not self.multi:
            signal.signal(signal.SIGTERM, self._previous_term)
        signal.signal(signal.SIGINT, self._previous_int)
