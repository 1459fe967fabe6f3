"""What speculation sources learned, kept beside the SSD tier: one learned file per source
and namespace (``storage.learned``), read back when a model is loaded and written at the
moments the cache persists.

A source registers with :meth:`LearnedFiles.keep` (a :class:`LearnedSource`: its
``revision`` changes whenever what it learned changes; ``learned_sequences()`` returns
arrays it never changes afterwards). The file is written

- at ``flush`` and ``close`` (the engine's flush and shutdown), on the calling thread,
  after a background write still under way;
- when the engine goes idle, at most every :data:`SAVE_EVERY_S` seconds, on a writer
  thread of its own: the engine thread only takes the list of arrays.

Each write replaces the file atomically, so a crash leaves the last complete one. A file
that cannot be used (damaged, hostile, another namespace's, another schema) is one warning
and an empty start; a damaged one is removed by the store, the others are left alone and
replaced at the next save.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from mlxkv.engine.cache.events import Events

if TYPE_CHECKING:
    from mlxkv.storage.store import BlockStore

SAVE_EVERY_S = 30.0  # while idle, a changed source is saved at most this often


class LearnedSource(Protocol):
    """What a speculation source that learns gives the cache to save."""

    schema: str  # the layout of what it saves (a file of another schema is not read)
    revision: int  # changes whenever what it learned changes

    def learned_sequences(self) -> list[np.ndarray]:
        """What it learned, oldest first (arrays it never changes afterwards)."""


@dataclass
class _Kept:
    ns: str  # the store's namespace folder
    name: str
    source: LearnedSource
    saved: int  # the source's revision on disk (or being written)
    at: float = field(default_factory=time.monotonic)


class LearnedFiles:
    """The learned files of one block store (engine thread, but for its own writer)."""

    def __init__(self, disk: BlockStore, events: Events) -> None:
        self.disk = disk
        self.events = events
        self._kept: dict[tuple[str, str], _Kept] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._writing: Future[int] | None = None
        self._lock = threading.Lock()  # one write at a time, whichever thread runs it
        self.saves = 0

    def load(self, store_ns: str, name: str, schema: str) -> list[np.ndarray]:
        """The sequences saved for ``name`` in ``store_ns`` ([] when there are none, or when
        the file cannot be used: one warning says why)."""
        from mlxkv.storage.learned import LearnedDamaged

        where = f"learned:{self.disk.root}:{store_ns}:{name}"  # warned once per file
        try:
            learned = self.disk.get_learned(store_ns, name)
        except LearnedDamaged as exc:
            self.events.warn(where, "prefix cache: the saved %s index %s is not used (%s): %s",
                             name, exc.path, "removed" if exc.removed else "left in place",
                             exc.reason)
            return []
        except Exception as exc:  # noqa: BLE001  (an unusable folder: start empty)
            self.events.warn(where, "prefix cache: the saved %s index cannot be read: %s", name, exc)
            return []
        if learned is None:
            return []
        if learned.schema != schema:
            self.events.warn(where, "prefix cache: the saved %s index is of another kind (%s, "
                             "not %s) and is not used", name, learned.schema, schema)
            return []
        return list(learned.sequences)

    def keep(self, store_ns: str, name: str, source: LearnedSource) -> None:
        """Save ``source`` (a :class:`LearnedSource`) as ``name`` in ``store_ns`` from now on."""
        self._kept[(store_ns, name)] = _Kept(store_ns, name, source, source.revision)

    def idle(self) -> None:
        """The engine has nothing to do: save a changed source now and then, in the
        background."""
        if self._writing is not None and not self._writing.done():
            return
        now = time.monotonic()
        due = [k for k in self._kept.values()
               if k.source.revision != k.saved and now - k.at >= SAVE_EVERY_S]
        if not due:
            return
        jobs = [self._snapshot(k) for k in due]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="mlxkv-learned")
        self._writing = self._pool.submit(self._write_all, jobs)

    def flush(self, timeout: float | None) -> int:
        """Save every changed source now (after a background write under way); the files
        written."""
        if self._writing is not None:
            try:
                self._writing.result(timeout)
            except Exception:  # noqa: BLE001  (already warned about by the writer)
                pass
        jobs = [self._snapshot(k) for k in self._kept.values() if k.source.revision != k.saved]
        return self._write_all(jobs)

    def close(self, timeout: float | None) -> int:
        written = self.flush(timeout)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        return written

    def _snapshot(self, k: _Kept) -> tuple[_Kept, int, Sequence[np.ndarray]]:
        """On the engine thread: the source's arrays now (the write reads only those)."""
        revision, seqs = k.source.revision, k.source.learned_sequences()
        k.saved, k.at = revision, time.monotonic()
        return k, revision, seqs

    def _write_all(self, jobs: list[tuple[_Kept, int, Sequence[np.ndarray]]]) -> int:
        from mlxkv.storage.format import Learned
        from mlxkv.storage.keys import StoreWriteError

        written = 0
        with self._lock:
            for k, revision, seqs in jobs:
                try:
                    if seqs:
                        self.disk.put_learned(k.ns, k.name, Learned(k.ns, k.source.schema, tuple(seqs),
                                                                    time.time()))
                    else:
                        self.disk.remove_learned(k.ns, k.name)
                    written += 1
                    self.saves += 1
                except Exception as exc:  # noqa: BLE001  (a full disk, a folder gone: kept in RAM)
                    if k.saved == revision:
                        k.saved = -1  # try again at the next save
                    if not isinstance(exc, StoreWriteError):  # that one the store warned about
                        self.events.warn(f"learned-write:{k.ns}:{k.name}", "prefix cache: the %s index "
                                         "could not be saved: %s", k.name, exc)
        return written

    def stats(self) -> dict[str, int]:
        return {"learned_files": len(self._kept), "learned_saves": self.saves}
