"""Ctrl-C before a command's own handlers are in place (while JAX and the rest are imported, say).

Python's default handler raises KeyboardInterrupt wherever the main thread is; raised inside a
library function that swallows exceptions (JAX's garbage-collection callback and its plugin discovery do), it
is lost and the run
goes on as if nothing happened. `guarded(main)` installs a handler first that also *records* the
interrupt, so a lost one is still seen: the training loop asks `interrupted_early()` before its first
step. A Ctrl-C that lands inside such a function is not raised there (Python would print an
"Exception ignored" traceback and drop it) but delivered again a moment later, outside it. A Ctrl-C that
reaches `guarded` is one line and exit code 130, never a traceback (and the process ends there, at once).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable

from zerolm.core.exitcodes import EXIT_INTERRUPTED

_interrupted = False


def die_with_parent() -> None:
    """In a child process: SIGTERM when the process that started it dies, however it dies (`kill -9`
    included: Linux's prctl PR_SET_PDEATHSIG); elsewhere, nothing. The launcher's processes and prepare's
    workers call it, so that none outlives its parent."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the parent's own handlers are all there is
        pass


def _on_sigint(signum, frame):
    global _interrupted
    _interrupted = True
    if _in_swallowing_frame(frame):  # raised here it would be printed and lost: deliver it again, outside
        threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT)).start()
        return
    raise KeyboardInterrupt


# Library functions that catch every exception, KeyboardInterrupt included, and print it with its traceback:
# JAX's garbage-collection callback (Python prints "Exception ignored" and drops it), and JAX's discovery of its
# PJRT plugins (a bare `except:` around each plugin's initialize(), logged as an ERROR with a traceback; the
# CUDA plugin takes a while to load its libraries, so a Ctrl-C while JAX starts can land there).
_SWALLOWING = ("discover_pjrt_plugins",)


def _in_swallowing_frame(frame) -> bool:
    """Is the main thread inside a function that would swallow a KeyboardInterrupt raised here?"""
    while frame is not None:
        name = frame.f_code.co_name
        if name.endswith("gc_callback") or name in _SWALLOWING:
            return True
        frame = frame.f_back
    return False


def interrupted_early() -> bool:
    return _interrupted


def guarded(main: Callable[[], int | None], what: str = "interrupted before the first step; nothing was saved") -> int:
    signal.signal(signal.SIGINT, _on_sigint)
    try:
        return main() or 0
    except KeyboardInterrupt:
        print(f"\nzerolm: {what}; exiting with code {EXIT_INTERRUPTED}", file=sys.stderr, flush=True)
        # Now, without the interpreter's shutdown: threads of the libraries may still be at work (XLA's
        # compiler, a loader's prefetch), and finalizing modules under them ended in SIGSEGV (seen in the
        # suite under load: the line above, then -11 instead of 130). Nothing of the run needs a flush.
        sys.stdout.flush()
        os._exit(EXIT_INTERRUPTED)
