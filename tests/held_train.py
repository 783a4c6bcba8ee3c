"""`zerolm train`, held before one step until the test lets it go (test fault injection).

    ZEROLM_TEST_HOLD=/path/held ZEROLM_TEST_HOLD_BEFORE_STEP=9 python tests/held_train.py --config ... --set ...

Before it computes step N, the run writes its pid to the hold file and waits until the test removes the
file (at most 120 s). A test then acts (a signal, kill -9, a second run) while the run is certainly alive,
at a known step, however fast or slow the machine is: nothing races the clock. With ZEROLM_TEST_HOLD_IN=tasks
it holds instead as the evaluation of eval.tasks after step N begins (before its row is written).
"""

import os
import sys
import time
from pathlib import Path

from zerolm.eval.downstream import DuringTraining
from zerolm.parallel.zero import Zero

HOLD = Path(os.environ["ZEROLM_TEST_HOLD"])
BEFORE_STEP = int(os.environ["ZEROLM_TEST_HOLD_BEFORE_STEP"])
_step, _tasks = Zero.step, DuringTraining.__call__


def _hold():
    HOLD.write_text(str(os.getpid()))
    deadline = time.monotonic() + 120
    while HOLD.exists() and time.monotonic() < deadline:
        time.sleep(0.01)


def _held_step(self, state, batch):
    if int(state.step) + 1 == BEFORE_STEP:
        _hold()
    return _step(self, state, batch)


def _held_tasks(self, params, step):
    if step == BEFORE_STEP:
        _hold()
    return _tasks(self, params, step)


if os.environ.get("ZEROLM_TEST_HOLD_IN") == "tasks":
    DuringTraining.__call__ = _held_tasks
else:
    Zero.__call__ = _held_step

from zerolm.commands import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
