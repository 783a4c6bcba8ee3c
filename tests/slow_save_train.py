"""`zerolm train`, with orbax's final rename of one checkpoint held back (test fault injection).

    ZEROLM_TEST_SLOW_FINALIZE_STEP=8 python tests/slow_save_train.py --config ... --set ...

The checkpoint of that step is fully written into orbax's temporary directory and then waits before
the atomic rename that makes it a checkpoint, so a test can kill the process in the middle of a save.
"""

import asyncio
import os
import sys

from orbax.checkpoint._src.path import atomicity

SLOW_STEP = os.environ["ZEROLM_TEST_SLOW_FINALIZE_STEP"]
_finalize = atomicity.AtomicRenameTemporaryPath.finalize


async def _slow_finalize(self):
    if self.get_final().name == SLOW_STEP:
        print(f"slow finalize of step {SLOW_STEP}", flush=True)
        await asyncio.sleep(120)
    return await _finalize(self)


atomicity.AtomicRenameTemporaryPath.finalize = _slow_finalize

from zerolm.commands import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
