"""Block store: verified, deduplicated KV blocks on disk, keyed by 128-bit chain keys.

API (all byte-level; ``storage`` never imports mlx)::

    store = BlockStore(root, block_tokens=256, max_bytes=None, durable=True, direct_io=True)
        # creates/marks/adopts the folder; CacheFolderError if it is not a usable cache
    store.scan()                                   # at startup: rebuild the index from headers

    # layout: one SegmentSpec per per-layer tensor (format.SegmentSpec / make_layout)
    # segments: one (buf, outer, t_capacity, row_bytes) per spec, same order; buf is any
    #   C-contiguous buffer of outer*t_capacity*row_bytes bytes (memoryview(mx_array) works).
    m = store.lookup(ns, tokens, max_tokens=None)  # -> Match; the index (+ one probe, below)
        # Match: n_tokens, block_keys, tail_key/tail_tokens, nbytes, layout (as stored:
        # what to allocate the destination from after a restart)
    n = store.longest_prefix(ns, tokens)           # == lookup(...).n_tokens
    r = store.put_blocks(ns, tokens, layout, segments, tail=True, manifest=None)
        # persists rows [0, len(tokens)) of the segments: every full block not yet on disk
        # (existing keys are never rewritten) plus an exact tail entry for the last
        # len(tokens) % block_tokens tokens; optional named manifest. -> PutResult
    g = store.get_blocks(ns, tokens, layout, segments, n_tokens=m)
        # restores rows [0, n) into the caller's (writable) segments, every block verified
        # against its content hash. -> Restore; Restore.n_tokens may be < n when a block
        # vanished or was corrupt (that block is removed and counted; rows past
        # Restore.n_tokens are undefined). Never returns an unverified byte.
    # states that cannot be cut per token (rotating windows, SSM): exact positions only;
    # segments are (buf, outer, 1, row_bytes), each buffer stored whole
    store.put_checkpoint(ns, tokens, layout, segments, manifest=None)   -> PutResult
    m = store.lookup_checkpoint(ns, tokens, max_tokens=None)           -> Match (.checkpoint_key)
    store.get_checkpoint(ns, m, layout, segments)                       -> Restore
    store.put_manifest / get_manifest / manifests / delete_manifest   # named conversations
    store.manifests(ns, errors={})  # + the unreadable ones: errors[path] = reason
    store.damaged_manifests(ns)     # -> {path: reason}: what ``cache verify`` reports
    store.evict(max_bytes) ; store.gc(ns, min_age_s) ; store.stats() ; store.close()
    store.retain(ns, keys, ttl_s)  # evict those files only after all others, for ttl_s
        # gc leaves a namespace whole while one of its manifests cannot be read
        # (its report lists them under "unreadable_manifests")
    store.clear(ns)                 # remove a namespace whole, damaged manifests included
    store.put_learned(ns, name, learned) / get_learned(ns, name) / learned_files(ns)
        # what a speculation source learned in ns, one verified file each (storage.learned)

Keys: block key = xxh3_128(parent key, namespace id, token ids of the block); a tail key
hashes its parent key and its (< block_tokens) token ids. A tail is usable for any query
that shares a prefix of its tokens (KV rows are per token), so a conversation that
continues re-prefills only its new tokens.

Files: ``<root>/<ns>/<2 hex>/<key>.blk|.tail|.ckpt``, ``<root>/<ns>/manifests/*.man`` and
``<root>/<ns>/learned/*.lrn``, each written atomically (temp name, write, fsync, rename,
fsync dir), 0600 in 0700 folders.
The folder is marked as a cache (``<root>/MLXKV-CACHE``); opening a folder that is not
one (user files, no marker), is read-only, or is a file raises
:class:`~storage.keys.CacheFolderError` (see ``storage.folder``). Nothing is removed but
files named as ours, in real folders, that failed verification (or orphaned temp files,
evicted and collected entries); a file that cannot be read is a miss, never removed. Several processes may
share a root: writers hold a shared flock on ``<root>/.lock``, scan/evict/gc an exclusive
one; readers take no lock and treat a vanished file as a miss. Each process indexes what
it scanned and what it wrote; a lookup that reaches a chain key its index lacks opens the
file that key maps to (one failed open on a miss), so another process's new blocks are
found without a rescan; another process's tails are found by their exact tokens, and
checkpoints only after ``scan()``.
Thread-safe: one writer thread and one reader thread (see ``storage.io``) may call
concurrently with lookups from another thread.

Modules: ``keys`` (chain keys, results), ``entries`` (index entries from file headers),
``index`` (lookups, scan), ``write`` (put_*), ``folder`` (marker, lock, names),
``restore`` (get_*), ``maintenance`` (locks, evict, gc, manifests), ``learned`` (learned
files); ``BlockStore`` joins them.
Speed: see ``storage.write`` and ``storage.restore`` (``read_threads`` defaults to
min(4, CPUs)).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from mlxkv.storage import diskio as dio
from mlxkv.storage.diskio import KERNEL
from mlxkv.storage.entries import Space
from mlxkv.storage.folder import open_folder
from mlxkv.storage.index import IndexMixin
from mlxkv.storage.keys import (
    ZERO_KEY,
    CacheFolderError,
    Match,
    PutResult,
    Restore,
    Segment,
    StoreWriteError,
    check_namespace,
    namespace_id,
)
from mlxkv.storage.learned import LearnedMixin
from mlxkv.storage.maintenance import MaintenanceMixin
from mlxkv.storage.restore import ReadMixin
from mlxkv.storage.write import WriteMixin

log = logging.getLogger("mlxkv.storage")

_COUNTERS = ("blocks_written", "tails_written", "checkpoints_written", "bytes_written",
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


class BlockStore(IndexMixin, WriteMixin, ReadMixin, MaintenanceMixin, LearnedMixin):
    """Content-addressed KV blocks under ``root`` (see the module docstring)."""

    def __init__(
        self, root: str | os.PathLike, block_tokens: int = 256, max_bytes: int | None = None,
        durable: bool = True, direct_io: bool = True, read_threads: int | None = None,
        direct_reads: bool = False,
    ) -> None:
        if block_tokens <= 0:
            raise ValueError(f"block_tokens must be > 0, got {block_tokens}")
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.root = os.path.abspath(os.fspath(root))
        open_folder(self.root)  # CacheFolderError if it is not a usable cache folder
        self.block_tokens = int(block_tokens)
        self.max_bytes = max_bytes
        self.durable = durable
        # Block writes bypass the page cache (O_DIRECT / F_NOCACHE) where the filesystem
        # allows: on the machines measured, copying into the page cache cost more than
        # the disk write itself, and persisted blocks should not evict hot pages.
        self.direct_io = direct_io
        self._lock = threading.RLock()  # guards the index, counters and pools
        self._spaces: dict[str, Space] = {}
        self._bytes = 0
        self._clock = 0.0
        self._local = threading.local()
        self._pool: ThreadPoolExecutor | None = None
        self._rpool: ThreadPoolExecutor | None = None
        # Cold block files read with O_DIRECT (storage.direct) where the filesystem allows:
        # off by default, since on the machines measured the page cache's readahead read
        # cold files faster than direct reads did (see storage.direct).
        self.direct_reads = direct_reads
        # threads that verify+scatter blocks of one restore in parallel (1 = the caller's)
        self.read_threads = max(1, read_threads if read_threads is not None
                                else min(4, os.cpu_count() or 1))
        self._c: dict[str, int] = dict.fromkeys(_COUNTERS, 0)
        self._skipped: dict[str, str] = {}  # path -> reason (unknown versions)
        self._left: dict[str, str] = {}  # path -> reason: files left alone (not ours, unreadable)
        self._removing: set[str] = set()  # see IndexMixin._retire
        self._removals = 0
        # (ns, key) -> until when (``retain_clock``) eviction keeps it over the others
        self._retained: dict[tuple[str, bytes], float] = {}
        self.retain_clock = time.monotonic

    def stats(self) -> dict[str, Any]:
        with self._lock:
            per_ns = {ns: {**sp.counts(), "bytes": sum(e.file_size for e in sp.entries())}
                      for ns, sp in self._spaces.items()}
            totals = {k: sum(v[k] for v in per_ns.values())
                      for k in ("blocks", "tails", "checkpoints")}
            return {"root": dio.printable(self.root), "kernel": KERNEL,
                    "block_tokens": self.block_tokens, "bytes": self._bytes, "max_bytes": self.max_bytes, **totals,
                    "namespaces": per_ns, "skipped_unknown_version": dict(self._skipped),
                    "skipped": dict(self._left), **self._c}

    def close(self) -> None:
        """Stop the helper threads (the store stays usable; they restart on demand)."""
        with self._lock:
            pools = (self._pool, self._rpool)
            self._pool = self._rpool = None
        for pool in pools:
            if pool is not None:
                pool.shutdown(wait=True)
        direct = self.__dict__.get("_direct")
        if direct is not None:
            direct.close()

    def _scratch(self, which: str, nbytes: int) -> Any:
        """A page-aligned buffer of this thread, grown on demand and reused."""
        bufs = self._local.__dict__.setdefault("bufs", {})
        buf = bufs.get(which)
        if buf is None or buf.nbytes < nbytes:
            buf = dio.aligned(max(nbytes, 1 << 20))
            bufs[which] = buf
        return buf

    def _warn_once(self, what: str, msg: str, *args: Any) -> None:
        """One warning per condition per process (a full disk fails every write)."""
        with _warned_lock:
            if what in _warned:
                return
            _warned.add(what)
        log.warning(msg, *args)

    def _unlink(self, path: str) -> bool:
        """Remove one of our files: a regular file reached from the root without
        following a symlink (dio.unlink_under); False if it was not removed."""
        return dio.unlink_under(self.root, path)

    def _leave(self, path: str, reason: str) -> None:
        """Note a file left alone (not ours, or unreadable) with its reason, for the first
        few (paths made printable: names need not be UTF-8)."""
        with self._lock:
            p = dio.printable(path)
            if p in self._left or len(self._left) < _MAX_NOTED:
                self._left[p] = reason


__all__ = [
    "KERNEL",
    "ZERO_KEY",
    "BlockStore",
    "CacheFolderError",
    "Match",
    "PutResult",
    "Restore",
    "Segment",
    "StoreWriteError",
    "check_namespace",
    "namespace_id",
]
