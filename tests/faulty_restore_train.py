"""`zerolm train`, with orbax's restore of the state's arrays failing as it does in the field (test fault injection).

    ZEROLM_TEST_RESTORE_FAULT=oom python tests/faulty_restore_train.py --config ... --set ...

The fault is raised where orbax reads the arrays of a checkpoint onto the devices (its jax.Array handler), so
everything above it (orbax's manager, zerolm's restore, where a run starts) runs as it does for real:
  oom         XLA's error when the device runs out of memory (what a restore onto fewer devices meets)
  storage     TensorStore's error for a storage endpoint that stopped answering past its retries
  permission  TensorStore's error for a file this user may not read
  bug         a TypeError, as a bug in the restore path raises
"""

import os
import sys

import jax
from orbax.checkpoint._src.serialization.jax_array_handlers import ArrayHandler

FAULTS = {
    "oom": lambda: jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 4.0GiB."),
    "storage": lambda: ValueError('UNAVAILABLE: Error reading "params.wte/0.0" in OCDBT database at '
                                  '"gs://bucket/ckpt/16/state/": HTTP response code: 503 with body: Service Unavailable'),
    "permission": lambda: ValueError('PERMISSION_DENIED: Error reading "params.wte/0.0" in OCDBT database at local '
                                     'file "ckpt/16/state/": Failed to open: "ckpt/16/state/d/0a1b": Permission denied '
                                     "[os_error_code='13']"),
    "bug": lambda: TypeError("unsupported operand type(s) for +: 'NoneType' and 'int' (injected by the test)"),
}
FAULT = FAULTS[os.environ["ZEROLM_TEST_RESTORE_FAULT"]]


async def _failing_deserialize(self, *args, **kwargs):
    raise FAULT()


ArrayHandler.deserialize = _failing_deserialize

from zerolm.commands import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
