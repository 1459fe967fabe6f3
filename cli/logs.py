"""The one logging handler of the command line: everything the ``mlxkv`` logger hierarchy
reports at WARNING or above reaches the user as one line ``mlxkv: warning: <message>``,
each distinct condition (message, or the template of a message with
arguments) once per process (a disk that fills up is one warning, not one per
failed write). Tracebacks are shown only with ``MLXKV_DEBUG=1``."""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import TextIO

PREFIX = "mlxkv: warning: "


class OncePerMessage(logging.Handler):
    def __init__(self, stream: TextIO | None = None, debug: bool = False) -> None:
        super().__init__(logging.DEBUG if debug else logging.WARNING)
        self.stream = stream
        self.debug = debug
        self._seen: set[tuple[str, str]] = set()
        self._seen_lock = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage().strip()
            for prefix in ("mlxkv: ", "mlxkv "):  # "mlxkv: warning: mlxkv cache: ..." says it twice
                if message.startswith(prefix):
                    message = message[len(prefix):]
                    break
            # One line per condition: a message logged with arguments is keyed by its
            # template ("write of %d tokens failed"), so counts and sizes do not repeat it.
            key = record.msg if record.args and isinstance(record.msg, str) else message
            with self._seen_lock:
                if (record.name, key) in self._seen:
                    return
                self._seen.add((record.name, key))
            text = PREFIX + message.replace("\n", "\n  ")
            if self.debug:  # every level, named, with where it came from
                text = f"mlxkv: {record.levelname.lower()}: {message} [{record.name}]"
                if record.exc_info:
                    text += "\n" + logging.Formatter().formatException(record.exc_info)
            stream = self.stream or sys.stderr
            stream.write(text + "\n")
            stream.flush()
        except Exception:  # a broken stderr must not take a generation down with it
            pass


def install(stream: TextIO | None = None) -> OncePerMessage:
    """Route the ``mlxkv`` loggers to one :class:`OncePerMessage` handler (idempotent)."""
    debug = os.environ.get("MLXKV_DEBUG", "") not in ("", "0")
    logger = logging.getLogger("mlxkv")
    for h in list(logger.handlers):
        if isinstance(h, OncePerMessage):
            logger.removeHandler(h)
    handler = OncePerMessage(stream, debug)
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG if debug else logging.WARNING)
    logger.propagate = False  # no second copy through the root logger's handlers
    return handler
