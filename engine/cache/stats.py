"""Counters of the prefix cache (read from any thread) and per-entry usage."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any, TypedDict

COUNTERS = ("lookups", "ram_hits", "ssd_hits", "misses", "prompt_tokens", "cached_tokens",
            "ram_tokens", "ssd_tokens", "restore_ms", "restore_bytes", "ssd_restore_failures",
            "ssd_restore_timeouts", "ssd_skipped_stuck", "layout_mismatches", "ssd_corrupt",
            "stores", "store_ms", "unsupported", "checkpoint_stores", "checkpoints_persisted",
            "released", "invalidated", "deleted", "evicted", "prefetches", "prefetched_tokens",
            "prefetches_background", "prefetches_cancelled")

_MAX_USAGE = 4096


class LastLookup(TypedDict, total=False):
    """The last lookup (empty before the first): which tier served how many tokens."""

    prompt_tokens: int
    cached_tokens: int
    tier: str | None  # "ram", "ssd", or None (a miss)
    ram_tokens: int
    ssd_tokens: int
    restore_ms: float
    lookup_ms: float


class Counters:
    """Thread-safe counters plus the last lookup's summary."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, float] = dict.fromkeys(COUNTERS, 0)
        for k in ("restore_ms", "store_ms"):
            self._values[k] = 0.0
        self.last: LastLookup = {}

    def add(self, **kw: float) -> None:
        with self._lock:
            for k, v in kw.items():
                self._values[k] += v

    def set_last(self, last: LastLookup) -> None:
        with self._lock:
            self.last = last

    def last_lookup(self) -> LastLookup:
        with self._lock:
            return LastLookup(**self.last)

    def snapshot(self) -> dict[str, Any]:
        """Every counter, and ``last`` (the last lookup): figures for ``stats()``."""
        with self._lock:
            s: dict[str, Any] = dict(self._values)
            s["last"] = dict(self.last)
        return s


class Usage:
    """Hits and last use per entry id (bounded; engine thread)."""

    def __init__(self) -> None:
        self._by_entry: OrderedDict[str, tuple[int, float]] = OrderedDict()

    def hit(self, entry_id: str) -> None:
        hits, _ = self._by_entry.pop(entry_id, (0, 0.0))
        self._by_entry[entry_id] = (hits + 1, time.time())
        while len(self._by_entry) > _MAX_USAGE:
            self._by_entry.popitem(last=False)

    def get(self, entry_id: str) -> tuple[int, float | None]:
        hits, when = self._by_entry.get(entry_id, (0, None))
        return hits, when

    def forget(self, entry_id: str) -> None:
        self._by_entry.pop(entry_id, None)
