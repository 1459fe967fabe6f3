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

Parts: ``context`` (settings, lock, counters shared by the parts), ``index`` (lookups,
scan), ``write`` (put_*), ``restore`` (get_*), ``maintenance`` (evict, gc, manifests),
``learned`` (learned files); ``keys`` (chain keys, results), ``entries`` (index entries
from file headers) and ``folder`` (marker, lock, names) serve them. ``BlockStore`` builds
the parts and hands each call to the one that does it.
Speed: see ``storage.write`` and ``storage.restore`` (``read_threads`` defaults to
min(4, CPUs)).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy.typing as npt

from mlxkv.storage import diskio
from mlxkv.storage.context import StoreContext, reset_warnings
from mlxkv.storage.diskio import KERNEL
from mlxkv.storage.folder import open_folder
from mlxkv.storage.format import LayoutLike, Learned, Manifest
from mlxkv.storage.index import Index
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
from mlxkv.storage.learned import LearnedFile, LearnedFiles
from mlxkv.storage.maintenance import Maintenance
from mlxkv.storage.restore import Reader
from mlxkv.storage.write import Writer


class BlockStore:
    """Content-addressed KV blocks under ``root`` (see the module docstring).

    The work is done by its parts: ``index`` (lookups, scan), ``writer`` (put_*),
    ``reader`` (get_*), ``upkeep`` (evict, gc, manifests) and ``learned`` (learned
    files), which share ``context``."""

    def __init__(
        self, root: str | os.PathLike[str], block_tokens: int = 256,
        max_bytes: int | None = None, durable: bool = True, direct_io: bool = True,
        read_threads: int | None = None, direct_reads: bool = False,
    ) -> None:
        if block_tokens <= 0:
            raise ValueError(f"block_tokens must be > 0, got {block_tokens}")
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        root = os.path.abspath(os.fspath(root))
        open_folder(root)  # CacheFolderError if it is not a usable cache folder
        self.context = StoreContext(root, int(block_tokens), durable)
        self.index = Index(self.context)
        self.learned = LearnedFiles(root, durable)
        self.upkeep = Maintenance(self.context, self.index, self.learned, max_bytes)
        self.writer = Writer(self.context, self.index, self.upkeep, direct_io)
        # Cold block files are read with O_DIRECT (storage.direct) only when asked:
        # the page cache's readahead is usually as fast (see storage.direct).
        # read_threads: threads that verify+scatter the blocks of one restore in
        # parallel (1 = the caller's)
        self.reader = Reader(self.context, self.index,
                             max(1, read_threads if read_threads is not None
                                 else min(4, os.cpu_count() or 1)),
                             direct_reads)

    # ------------------------------------------------------------------ settings
    @property
    def root(self) -> str:
        return self.context.root

    @property
    def block_tokens(self) -> int:
        return self.context.block_tokens

    @property
    def durable(self) -> bool:
        return self.context.durable

    @property
    def max_bytes(self) -> int | None:
        return self.upkeep.max_bytes

    @max_bytes.setter
    def max_bytes(self, value: int | None) -> None:
        self.upkeep.max_bytes = value

    @property
    def direct_io(self) -> bool:
        return self.writer.direct_io

    @property
    def direct_reads(self) -> bool:
        return self.reader.direct_reads

    @property
    def read_threads(self) -> int:
        return self.reader.read_threads

    @property
    def retain_clock(self) -> Callable[[], float]:
        """The clock retention hints count from (``time.monotonic``)."""
        return self.upkeep.retain_clock

    @retain_clock.setter
    def retain_clock(self, clock: Callable[[], float]) -> None:
        self.upkeep.retain_clock = clock

    # ------------------------------------------------------------------ lookups
    def chain_keys(self, ns: str, tokens: npt.ArrayLike) -> list[bytes]:
        return self.index.chain_keys(ns, tokens)

    def lookup(self, ns: str, tokens: npt.ArrayLike, max_tokens: int | None = None,
               keys: Sequence[bytes] | None = None) -> Match:
        return self.index.lookup(ns, tokens, max_tokens, keys)

    def longest_prefix(self, ns: str, tokens: npt.ArrayLike, max_tokens: int | None = None) -> int:
        return self.index.lookup(ns, tokens, max_tokens).n_tokens

    def lookup_checkpoint(self, ns: str, tokens: npt.ArrayLike, max_tokens: int | None = None,
                          keys: Sequence[bytes] | None = None) -> Match:
        return self.index.lookup_checkpoint(ns, tokens, max_tokens, keys)

    def latest_tokens(self, ns: str) -> int:
        return self.index.latest_tokens(ns)

    def scan(self) -> dict[str, float]:
        return self.index.scan()

    # ------------------------------------------------------------------ writes, reads
    def put_blocks(
        self, ns: str, tokens: npt.ArrayLike, layout: LayoutLike, segments: Sequence[Segment], *,
        tail: bool = True, manifest: str | None = None, durable: bool | None = None,
        pace: Callable[[], None] | None = None,
    ) -> PutResult:
        return self.writer.put_blocks(ns, tokens, layout, segments, tail=tail,
                                      manifest=manifest, durable=durable, pace=pace)

    def put_checkpoint(
        self, ns: str, tokens: npt.ArrayLike, layout: LayoutLike, segments: Sequence[Segment], *,
        manifest: str | None = None, durable: bool | None = None,
    ) -> PutResult:
        return self.writer.put_checkpoint(ns, tokens, layout, segments, manifest=manifest,
                                          durable=durable)

    def get_blocks(self, ns: str, tokens: npt.ArrayLike, layout: LayoutLike, segments: Sequence[Segment],
                   n_tokens: int | Match | None = None) -> Restore:
        return self.reader.get_blocks(ns, tokens, layout, segments, n_tokens)

    def get_checkpoint(self, ns: str, match: Match, layout: LayoutLike,
                       segments: Sequence[Segment]) -> Restore:
        return self.reader.get_checkpoint(ns, match, layout, segments)

    # ------------------------------------------------------------------ upkeep
    def retain(self, ns: str, keys: Iterable[bytes], ttl_s: float) -> None:
        self.upkeep.retain(ns, keys, ttl_s)

    def evict(self, max_bytes: int | None = None) -> dict[str, int]:
        return self.upkeep.evict(max_bytes)

    def gc(self, ns: str | None = None, min_age_s: float = 60.0) -> dict[str, int | dict[str, str]]:
        return self.upkeep.gc(ns, min_age_s)

    def clear(self, ns: str) -> dict[str, int | bool]:
        return self.upkeep.clear(ns)

    def remove(self, ns: str, keys: Iterable[bytes]) -> dict[str, int]:
        return self.upkeep.remove(ns, keys)

    def put_manifest(self, ns: str, name: str, tokens: npt.ArrayLike,
                     extra_keys: Sequence[bytes] = ()) -> Manifest:
        return self.upkeep.put_manifest(ns, name, tokens, extra_keys)

    def get_manifest(self, ns: str, name: str) -> Manifest | None:
        return self.upkeep.get_manifest(ns, name)

    def manifests(self, ns: str, errors: dict[str, str] | None = None) -> list[Manifest]:
        return self.upkeep.manifests(ns, errors)

    def damaged_manifests(self, ns: str) -> dict[str, str]:
        return self.upkeep.damaged_manifests(ns)

    def delete_manifest(self, ns: str, name: str) -> bool:
        return self.upkeep.delete_manifest(ns, name)

    # ------------------------------------------------------------------ learned files
    def put_learned(self, ns: str, name: str, learned: Learned) -> int:
        return self.learned.put(ns, name, learned)

    def get_learned(self, ns: str, name: str, remove: bool = True) -> Learned | None:
        return self.learned.get(ns, name, remove)

    def remove_learned(self, ns: str, name: str) -> bool:
        return self.learned.remove(ns, name)

    def learned_files(self, ns: str | None = None) -> list[LearnedFile]:
        return self.learned.files(ns)

    # ------------------------------------------------------------------ the store
    def stats(self) -> dict[str, Any]:
        context, index = self.context, self.index
        with context.lock:
            per_ns = {ns: {**space.counts(), "bytes": sum(e.file_size for e in space.entries())}
                      for ns, space in index.spaces.items()}
            totals = {k: sum(v[k] for v in per_ns.values())
                      for k in ("blocks", "tails", "checkpoints")}
            return {"root": diskio.printable(context.root), "kernel": KERNEL,
                    "block_tokens": context.block_tokens, "bytes": index.nbytes,
                    "max_bytes": self.upkeep.max_bytes, **totals,
                    "namespaces": per_ns, "skipped_unknown_version": dict(context.skipped),
                    "skipped": dict(context.left), **context.counters}

    def close(self) -> None:
        """Stop the helper threads (the store stays usable; they restart on demand)."""
        self.writer.close()
        self.reader.close()


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
    "reset_warnings",
]
