"""User-facing warnings of the engine, once per condition per process.

The CLI installs one handler on the ``mlxkv`` logger tree that prints
``mlxkv: warning: <message>``; what a condition is, the caller names with ``key``.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

_warned: set[str] = set()  # "<logger>:<key>" of the warnings already given
_lock = threading.Lock()


def warn_once(logger: logging.Logger, key: str, message: str, *args: Any) -> None:
    """Log ``message % args`` at WARNING on ``logger`` unless ``key`` was warned about."""
    condition = f"{logger.name}:{key}"
    with _lock:
        if condition in _warned:
            return
        _warned.add(condition)
    logger.warning(message, *args)
