"""The engine's figures as of a moment ago, for callers that must not wait for the engine
thread: ``Engine.stats()``, ``Engine.cache_entries()``, the server's ``/stats`` and
``/health``, the TUI inspector.

The engine thread publishes an immutable :class:`Snapshot`, a new object swapped in by one
attribute assignment (other threads read ``latest`` without a lock), after every command
it serves and, while it serves one, at most every ``PERIOD_S`` at the points where it
looks up from its work: between the layers and chunks of a prefill, between tokens, and
between batch steps (:meth:`Publisher.tick`). While it is busy a caller gets the latest
snapshot at once, with its age (``as_of``, ``age_s``); while it is idle the engine thread
answers a quick call at once, so an idle engine's answer is as of now.

The cache listing (every entry, which may mean reading the SSD tier's manifests) is part
of a snapshot only while someone asked for it within ``LISTING_INTEREST_S``; it is made
again when the cache changed since (every cache event counts as a change), at most every
``LISTING_PERIOD_S`` while busy. An idle engine thread lists on demand, as it always did,
so nothing a cache event does not announce (a session closed) is ever missed there.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from mlxkv.engine.requests import CacheEvent, EngineError, EngineEvent

PERIOD_S = 0.5  # figures published at most this often while the engine thread is busy
LISTING_PERIOD_S = 1.0  # the listing made at most this often while busy
LISTING_INTEREST_S = 30.0  # the listing is kept up only this long after it was asked for

log = logging.getLogger("mlxkv.engine")


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """What the engine thread published at ``as_of`` (unix time)."""

    stats: dict[str, Any]
    as_of: float
    entries: tuple | None = None  # the cache listing, every namespace (None: not made)
    entries_changes: int = -1  # how many cache changes it had seen when it was made

    def answer(self) -> dict[str, Any]:
        """The figures for a caller: ``as_of`` and their age ``age_s`` added."""
        return {**self.stats, "as_of": self.as_of,
                "age_s": round(max(0.0, time.time() - self.as_of), 3)}


class Publisher:
    """Publishes snapshots (engine thread) and answers from them (any thread).
    ``collect()`` gives the figures and ``listing()`` the cache entries; both run on the
    engine thread."""

    def __init__(self, collect: Callable[[], dict[str, Any]], listing: Callable[[], list]):
        self._collect = collect
        self._listing = listing
        self.latest: Snapshot | None = None
        self.busy = False  # the engine thread serves a command (its own flag)
        self._published = 0.0  # time.monotonic() of the last snapshot
        self._listed = 0.0  # ... and of the last listing
        self._wanted = -LISTING_INTEREST_S  # when a listing was last asked for
        self._changes = 0
        self._lock = threading.Lock()

    # any thread
    def on_event(self, event: EngineEvent) -> None:
        """An engine-wide event (a subscriber): a cache event makes the listing stale."""
        if isinstance(event, CacheEvent):
            with self._lock:
                self._changes += 1

    @property
    def changes(self) -> int:
        return self._changes

    def stats(self, ask: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """The figures: the latest snapshot while the engine thread is busy, else
        ``ask()`` (a quick call of :meth:`publish_now`, answered at once by an idle
        engine thread)."""
        snap = self.latest
        if snap is not None and self.busy:
            return snap.answer()
        return ask()

    def entries(self, ask: Callable[[], list]) -> list:
        """The cache listing: the snapshot's while the engine thread is busy (made again
        at its next tick when the cache changed), else ``ask()`` (a quick call of
        :meth:`list_now`, answered at once by an idle engine thread). If that fails (the
        engine did not answer in time), the snapshot's listing, however old, rather than
        nothing."""
        self._wanted = time.monotonic()
        snap = self.latest
        listing = snap.entries if snap is not None else None
        if listing is not None and self.busy:
            return list(listing)
        try:
            return ask()
        except EngineError:
            if listing is not None:
                return list(listing)
            raise

    # the engine thread
    def tick(self, now: bool = False) -> None:
        """A point where the engine thread looks up from its work: publish when the last
        snapshot is older than ``PERIOD_S``, or ``now`` (a request started or joined)."""
        if now or time.monotonic() - self._published >= PERIOD_S:
            self.publish()

    def publish(self) -> Snapshot | None:
        """Collect the figures (and the listing, when wanted, stale and due) and publish
        them. A failure is logged, never raised into the engine thread's work: the last
        snapshot stays (None: there is none)."""
        try:
            return self._publish(False)
        except Exception:
            log.exception("the engine's figures could not be collected")
            self._published = time.monotonic()  # not again before the next period
            return self.latest

    def _publish(self, relist: bool) -> Snapshot:
        now = time.monotonic()
        old = self.latest
        entries, seen = (old.entries, old.entries_changes) if old is not None else (None, -1)
        changes = self._changes
        if relist or (now - self._wanted < LISTING_INTEREST_S and seen != changes
                      and (not self.busy or now - self._listed >= LISTING_PERIOD_S)):
            entries, seen = tuple(self._listing()), changes
            self._listed = now
        snap = Snapshot(self._collect(), time.time(), entries, seen)
        self.latest = snap
        self._published = now
        return snap

    def publish_now(self) -> dict[str, Any]:
        """Publish and answer (a quick call of :meth:`stats`); errors are raised here."""
        return self._publish(False).answer()

    def list_now(self) -> list:
        """List the cache, publish it and answer it (a quick call of :meth:`entries`);
        errors are raised here."""
        self._wanted = time.monotonic()
        return list(self._publish(True).entries or ())
