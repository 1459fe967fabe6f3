"""Earlier ``/v1/responses`` answers, for ``previous_response_id``: each stored response keeps
the whole conversation it ended (the input items it was given, those of the responses it
continued, and its own output items), so a lookup needs no chain of earlier entries that
may have been evicted since. In memory only and bounded by bytes (``responses_store_bytes``):
the least recently used responses are forgotten first, and a restart forgets them all."""

from __future__ import annotations

import collections
import json
import threading
from typing import Any


class ResponseStore:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._items: collections.OrderedDict[str, tuple[list[dict[str, Any]], int]] = \
            collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.evicted = 0

    @property
    def bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response_id: str, items: list[dict[str, Any]]) -> bool:
        """Keep ``items`` under ``response_id``; False when they alone exceed the bound."""
        size = len(json.dumps(items, ensure_ascii=False, separators=(",", ":")).encode())
        with self._lock:
            if size > self.max_bytes:
                return False
            old = self._items.pop(response_id, None)
            if old is not None:
                self._bytes -= old[1]
            self._items[response_id] = (items, size)
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, (_, freed) = self._items.popitem(last=False)
                self._bytes -= freed
                self.evicted += 1
        return True

    def get(self, response_id: str) -> list[dict[str, Any]] | None:
        """The conversation ``response_id`` ended (a copy of the list), or None."""
        with self._lock:
            entry = self._items.get(response_id)
            if entry is None:
                return None
            self._items.move_to_end(response_id)
            return list(entry[0])
