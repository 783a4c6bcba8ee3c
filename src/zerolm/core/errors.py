"""One base for every error a user can cause or fix, and the exit code it carries.

A `ZerolmError` is a mistake in the input (a flag, a config key, a dataset, a checkpoint), a place that
cannot be used, or a run stopped for a reason a user acts on; its message is the one line the command
prints (`error: ...`), and `exit_code` says what happened (zerolm.core.exitcodes). The commands catch it and
nothing else: any other exception that escapes is a bug of zerolm's, printed with its traceback and
exit code `EXIT_BUG` (zerolm.commands), never taken for the user's mistake.
"""

from __future__ import annotations

from zerolm.core.exitcodes import EXIT_USAGE


class ZerolmError(Exception):
    """An error the user can fix: one line (the message) and its exit code."""

    exit_code: int = EXIT_USAGE


class UsageError(ZerolmError):
    """A command-line flag with a value the command cannot use; the message names the flag."""


def first_line(error: object, limit: int = 300) -> str:
    """The useful head of a library's error, for a one-line message (several libraries append pages of
    detail, orbax a "See full ..." pointer): its first line, at most `limit` characters, or the error's
    type where it says nothing."""
    text = str(error).strip().splitlines()
    return (text[0] if text else type(error).__name__).split(" See full")[0][:limit]


def is_out_of_memory(error: BaseException) -> bool:
    """Whether `error` is XLA's refusal or failure for lack of device memory, compiling, running or restoring (a
    TPU's "Ran out of memory in memory space hbm", a GPU's "Out of memory while trying to allocate", the CPU's
    "Out of memory allocating"). Not any RESOURCE_EXHAUSTED: a full disk under a checkpoint save is one too
    (TensorStore's status), and that is a storage error (exit 74)."""
    import jax  # here, not at the top: every command's --help reads this module, and answers without jax

    text = str(error)
    return (isinstance(error, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in text
            and "out of memory" in text.lower())
