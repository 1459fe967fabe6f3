"""What the parts of a block store share: its folder and settings, the lock over its
in-memory state, its counters, the files it left alone, per-thread scratch buffers and
the warnings it gives once per process."""

from __future__ import annotations

import errno
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from mlxkv.storage import diskio
from mlxkv.storage.diskio import PageBuffer
from mlxkv.storage.folder import folder_lock
from mlxkv.storage.keys import CacheFolderError, StoreWriteError

log = logging.getLogger("mlxkv.storage")

COUNTERS = ("blocks_written", "tails_written", "checkpoints_written", "bytes_written",
            "dedup_blocks", "write_failures", "blocks_read", "bytes_read", "hits", "misses",
            "corrupt_removed", "vanished", "bad_removed", "tmp_removed", "evicted",
            "evicted_bytes", "gc_removed", "gc_bytes", "tails_superseded", "probed",
            "read_errors")
_MAX_NOTED = 100  # skipped files remembered with their reason (the counters count all)
_warned: set[str] = set()  # conditions already warned about, once per process
_warned_lock = threading.Lock()


def reset_warnings() -> None:
    """Forget which conditions were warned about (tests check each warns once)."""
    with _warned_lock:
        _warned.clear()


class StoreContext:
    """The folder, settings and shared state of one block store.

    ``lock`` guards the index, the counters, the notes and the parts' thread pools;
    ``counters`` are the figures ``BlockStore.stats()`` reports."""

    def __init__(self, root: str, block_tokens: int, durable: bool) -> None:
        self.root = root
        self.block_tokens = block_tokens
        self.durable = durable
        self.lock = threading.RLock()
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.skipped: dict[str, str] = {}  # path -> reason (unknown versions)
        self.left: dict[str, str] = {}  # path -> reason: files left alone (not ours, unreadable)
        self._thread = threading.local()

    @contextmanager
    def folder_lock(self, shared: bool) -> Iterator[None]:
        """The folder lock (shared: writers; exclusive: scan/evict/gc), across processes;
        CacheFolderError if the folder stopped being usable (see storage.folder)."""
        with folder_lock(self.root, shared):
            yield

    def scratch(self, which: str, nbytes: int) -> PageBuffer:
        """A page-aligned buffer of this thread, grown on demand and reused."""
        bufs: dict[str, PageBuffer] = self._thread.__dict__.setdefault("bufs", {})
        buf = bufs.get(which)
        if buf is None or buf.nbytes < nbytes:
            buf = diskio.aligned(max(nbytes, 1 << 20))
            bufs[which] = buf
        return buf

    def warn_once(self, what: str, msg: str, *args: object) -> None:
        """One warning per condition per process (a full disk fails every write)."""
        with _warned_lock:
            if what in _warned:
                return
            _warned.add(what)
        log.warning(msg, *args)

    def unlink(self, path: str) -> bool:
        """Remove one of our files: a regular file reached from the root without
        following a symlink (diskio.unlink_under); False if it was not removed."""
        return diskio.unlink_under(self.root, path)

    def leave(self, path: str, reason: str) -> None:
        """Note a file left alone (not ours, or unreadable) with its reason, for the first
        few (paths made printable: names need not be UTF-8)."""
        with self.lock:
            p = diskio.printable(path)
            if p in self.left or len(self.left) < _MAX_NOTED:
                self.left[p] = reason

    def write_failed(self, exc: OSError, what: str) -> StoreWriteError:
        """Warn once per errno and process; the error to raise for a failed ``what`` write."""
        self.warn_once(f"write:{exc.errno}", "mlxkv cache: cannot write under %s: %s "
                       "(the cache keeps serving reads; new state is not persisted)",
                       diskio.printable(self.root), exc.strerror or exc)
        return StoreWriteError(exc.errno, f"{what} write failed: {exc.strerror or exc}",
                               getattr(exc, "filename", None))

    def folder_failed(self, exc: CacheFolderError, what: str) -> StoreWriteError:
        """A write refused because the folder stopped being usable (warned once)."""
        self.warn_once(f"folder:{exc}", "mlxkv cache: %s", exc)
        with self.lock:
            self.counters["write_failures"] += 1
        return StoreWriteError(errno.EIO, f"{what} write refused: {exc}")
