"""Engine-wide events (:class:`CacheEvent`, :class:`LoadEvent`) for whoever subscribed:
published from the engine thread or the cache's threads, delivered on that thread."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from mlxkv.engine.requests import CacheEvent, EngineEvent

log = logging.getLogger("mlxkv.engine")


class Listeners:
    """Subscribers of engine-wide events; thread-safe."""

    def __init__(self) -> None:
        self._listeners: list[tuple[object, Callable[[EngineEvent], None]]] = []
        self._lock = threading.Lock()

    def subscribe(self, callback: Callable[[EngineEvent], None]) -> Callable[[], None]:
        """Add ``callback``; returns the function that removes it."""
        token = object()
        with self._lock:
            self._listeners.append((token, callback))

        def unsubscribe() -> None:
            with self._lock:
                self._listeners[:] = [(t, c) for t, c in self._listeners if t is not token]
        return unsubscribe

    def publish(self, event: EngineEvent) -> None:
        with self._lock:
            listeners = [c for _, c in self._listeners]
        for callback in listeners:
            try:
                callback(event)
            except Exception:  # a front end's bug must not break the engine or the cache
                log.exception("engine event listener failed")

    def cache_event(self, data: dict) -> None:
        """Publish one of the prefix cache's events (a dict with a ``type``)."""
        kind = str(data.get("type", "cache.event")).removeprefix("cache.")
        self.publish(CacheEvent(kind, {k: v for k, v in data.items() if k != "type"}))
