"""The libraries' own reports during a run, in a file: `<logging.dir>/library-<process>.log`.

orbax's background threads, gcsfs's and google-cloud-storage's retries log through Python's logging
(with tracebacks) when storage misbehaves. zerolm says in one line what went wrong and stops; the
details stay in this file, not on the terminal. The file (and its directory) appear only once a
library has something to say.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

NAME = "library-{process}.log"
LIBRARIES = ("absl", "gcsfs", "fsspec", "google", "urllib3")  # the loggers taken over


class _LazyFileHandler(logging.FileHandler):
    def __init__(self, path: Path):
        super().__init__(path, delay=True)

    def _open(self):
        Path(self.baseFilename).parent.mkdir(parents=True, exist_ok=True)
        return super()._open()


@contextlib.contextmanager
def capture(path: Path):
    """While the block runs, the LIBRARIES' log records go to `path` only."""
    handler = _LazyFileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    loggers = [logging.getLogger(name) for name in LIBRARIES]
    saved = [(logger.handlers, logger.propagate) for logger in loggers]
    for logger in loggers:
        logger.handlers, logger.propagate = [handler], False
    try:
        yield
    finally:
        for logger, (handlers, propagate) in zip(loggers, saved, strict=True):
            logger.handlers, logger.propagate = handlers, propagate
        handler.close()
