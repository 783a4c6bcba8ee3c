"""What can be wrong with a checkpoint, and why one could not be read: damage, which `--resume auto` moves aside,
or anything else, which leaves the checkpoint where it is.

Only positive evidence of damage counts as damage: a file of the checkpoint that is missing, truncated, fails
to decompress or to parse (TensorStore's DATA_LOSS, OUT_OF_RANGE, FAILED_PRECONDITION and NOT_FOUND, a
FileNotFoundError, a JSON file that does not parse). What says nothing about the checkpoint is named and
kept apart, each with the exit code of what the user does next:
  - the device ran out of memory restoring it (a restore onto fewer or smaller devices): exit 2;
  - no permission to read it (a file's mode, a bucket's IAM): exit 2;
  - the storage failed (an endpoint that stopped answering past its client's retries, an I/O error): exit 74.
Anything else (a bug of zerolm's, an error of orbax's this module cannot name) goes on as it is, with a note that
the checkpoint was left as it is: a traceback and exit 70, never a good checkpoint moved aside.

The libraries wrap their causes (orbax raises `Exception("Encountered error while reading array index ...")`
from TensorStore's `ValueError("DATA_LOSS: ...")`), so the whole chain of causes is read, the deepest first.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator

from etils import epath

from zerolm.core.errors import ZerolmError, first_line, is_out_of_memory
from zerolm.core.storage import StorageFault

DAMAGE = "damage"
OUT_OF_MEMORY = "out of memory"
PERMISSION = "permission"
STORAGE = "storage"

# absl status codes, as TensorStore (orbax's I/O) prefixes its errors with them.
_STATUS = re.compile(r"^([A-Z_]{5,}):")
_BY_STATUS = {"DATA_LOSS": DAMAGE, "OUT_OF_RANGE": DAMAGE, "FAILED_PRECONDITION": DAMAGE, "NOT_FOUND": DAMAGE,
              "PERMISSION_DENIED": PERMISSION, "UNAUTHENTICATED": PERMISSION,
              "UNAVAILABLE": STORAGE, "DEADLINE_EXCEEDED": STORAGE, "ABORTED": STORAGE, "CANCELLED": STORAGE}


class CheckpointError(ZerolmError):
    """A checkpoint that cannot be used; one line naming the directory and what is wrong."""


class DamagedCheckpoint(CheckpointError):
    """A checkpoint whose files are missing, truncated or unreadable (as opposed to one that does not fit)."""

    def __init__(self, step: int, where: epath.Path, reason: str):
        super().__init__(f"{where}: damaged checkpoint: {reason}")
        self.step, self.reason = step, reason


class RestoreDoesNotFit(CheckpointError):
    """The device ran out of memory restoring a checkpoint: it is kept; restore where its state fits."""


def chain(error: BaseException) -> list[BaseException]:
    """`error` and its causes (explicit or implicit), the deepest last."""
    out: list[BaseException] = []
    while error is not None and error not in out:
        out.append(error)
        error = error.__cause__ or error.__context__  # type: ignore[assignment]
    return out


def kind(error: BaseException) -> str | None:
    """DAMAGE, OUT_OF_MEMORY, PERMISSION or STORAGE, by the deepest cause that says which; None: unknown."""
    for e in reversed(chain(error)):
        if (found := _kind_of_one(e)) is not None:
            return found
    return None


def _kind_of_one(e: BaseException) -> str | None:
    if isinstance(e, DamagedCheckpoint | FileNotFoundError | json.JSONDecodeError):
        return DAMAGE
    if is_out_of_memory(e) or isinstance(e, MemoryError):
        return OUT_OF_MEMORY
    if isinstance(e, PermissionError):
        return PERMISSION
    if isinstance(e, ValueError) and (status := _STATUS.match(str(e))):
        return _BY_STATUS.get(status.group(1))
    code = getattr(e, "code", None)  # gcsfs's HttpError and google-api-core's errors carry the HTTP status
    if isinstance(code, int) and 400 <= code < 600 and type(e).__module__.split(".")[0] in ("gcsfs", "google"):
        return {401: PERMISSION, 403: PERMISSION, 404: DAMAGE}.get(code, STORAGE if code >= 429 else None)
    if isinstance(e, ConnectionError | TimeoutError | OSError):  # an I/O error, a connection lost past its retries
        return STORAGE
    return None


@contextlib.contextmanager
def classified(step: int, where: epath.Path, doing: str) -> Iterator[None]:
    """Reading checkpoint `step` (at `where`; `doing`: "restore it", "read its metadata", ...): a failure becomes
    DamagedCheckpoint only on evidence of damage; see the module's docstring for the rest."""
    try:
        yield
    except (CheckpointError, StorageFault):  # already said what it is
        raise
    except Exception as e:
        found = kind(e)
        cause = next((c for c in reversed(chain(e)) if kind(c) == found), e) if found else e
        said = f"{type(cause).__name__}: {_without_tensorstore_spec(first_line(cause))}"
        kept = "the checkpoint is kept as it is"
        if found == DAMAGE:
            raise DamagedCheckpoint(step, where, f"cannot {doing} ({said})") from None
        if found == OUT_OF_MEMORY:
            raise RestoreDoesNotFit(
                f"{where}: the device ran out of memory to {doing} ({said}); {kept}; restore it where its state "
                "fits: more devices, zero.stage 3 (the parameters sharded too) or mesh.tp (`zerolm plan` says what "
                "fits)") from None
        if found == PERMISSION:
            raise CheckpointError(f"{where}: no permission to {doing} ({said}); {kept}; give this user (or these "
                                  "credentials) read access and run again") from None
        if found == STORAGE:
            raise StorageFault(f"{where}: the storage failed as zerolm tried to {doing} ({said}); {kept}; run again "
                               "to resume from it once the storage answers") from None
        e.add_note(f"zerolm: {where}: raised while trying to {doing}; {kept} (not taken for damaged)")
        raise


def _without_tensorstore_spec(text: str) -> str:
    """TensorStore's errors end in a printed spec of the whole array store: a line says enough without it."""
    return text.split(" See full TensorStore details")[0].rstrip(".")
