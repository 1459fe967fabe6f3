"""Events and warnings of the prefix cache.

``Events.emit`` calls the receiver (``PrefixCache.on_event``) with
``{"type": "cache.<kind>", ...}`` from whichever thread the event happens on (engine
thread, storage writer); a receiver that raises is logged, never propagated. Warnings go
to the ``mlxkv.cache`` logger once per condition per process, and out as a
``cache.warning`` event with the message.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, TypeAlias

log = logging.getLogger("mlxkv.cache")

# An event as the receiver gets it: ``{"type": "cache.<kind>", ...}`` with JSON values.
Event: TypeAlias = dict[str, Any]
Receiver: TypeAlias = Callable[[Event], None]

_warned: set[str] = set()
_warned_lock = threading.Lock()


class Events:
    """The cache's event fan-out (see the module docstring). Warnings given before a
    receiver is connected (e.g. the SSD tier found unusable while the cache was built)
    are handed to the first receiver when it is."""

    def __init__(self, receiver: Receiver | None = None) -> None:
        self._receiver = receiver
        self._early: list[Event] = []  # warnings nobody received yet (a few)

    @property
    def receiver(self) -> Receiver | None:
        return self._receiver

    @receiver.setter
    def receiver(self, fn: Receiver | None) -> None:
        self._receiver = fn
        early, self._early = self._early, []
        for ev in early if fn is not None else ():
            self.emit(ev["type"].removeprefix("cache."), **{k: v for k, v in ev.items()
                                                             if k != "type"})

    def emit(self, kind: str, **data: object) -> None:
        fn = self._receiver
        if fn is None:
            if kind == "warning" and len(self._early) < 16:
                self._early.append({"type": f"cache.{kind}", **data})
            return
        try:
            fn({"type": f"cache.{kind}", **data})
        except Exception as exc:  # noqa: BLE001  (a receiver's bug must not break the cache)
            if kind != "warning":
                self.warn("event-receiver", "a cache event receiver failed: %s: %s",
                          type(exc).__name__, exc)

    def warn(self, condition: str, msg: str, *args: object, logged: bool = False) -> bool:
        """Log ``msg % args`` once per ``condition`` per process (``logged``: another layer
        already told the user; only the event goes out); True the first time."""
        text = msg % args if args else msg
        with _warned_lock:
            first = condition not in _warned
            _warned.add(condition)
        if first:
            if logged:
                log.debug("%s", text)
            else:
                log.warning("%s", text)
            self.emit("warning", message=text, condition=condition)
        return first
