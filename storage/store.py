"""Block store: verified, deduplicated KV blocks on disk, keyed by 128-bit chain keys.

API (all byte-level; ``storage`` never imports mlx)::

    store = BlockStore(root, block_tokens=256, max_bytes=None, durable=True, direct_io=True)
    store.scan()                                   # at startup: rebuild the index from headers

    # layout: one SegmentSpec per per-layer tensor (format.SegmentSpec / make_layout)
    # segments: one (buf, outer, t_capacity, row_bytes) per spec, same order; buf is any
    #   C-contiguous buffer of outer*t_capacity*row_bytes bytes (memoryview(mx_array) works).
    m = store.lookup(ns, tokens, max_tokens=None)  # -> Match; index only, no I/O
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
    store.evict(max_bytes) ; store.gc(ns, min_age_s) ; store.stats() ; store.close()

Keys: block key = xxh3_128(parent key, namespace id, token ids of the block); a tail key
hashes its parent key and its (< block_tokens) token ids. A tail is usable for any query
that shares a prefix of its tokens (KV rows are per token), so a conversation that
continues re-prefills only its new tokens.

Files: ``<root>/<ns>/<2 hex>/<key>.blk|.tail|.ckpt`` and ``<root>/<ns>/manifests/*.man``, each
written atomically (temp name, write, fsync, rename, fsync dir). Several processes may
share a root: writers hold a shared flock on ``<root>/.lock``, scan/evict/gc an exclusive
one; readers take no lock and treat a vanished file as a miss. Each process indexes what
it scanned and what it wrote; call ``scan()`` again to see other processes' new blocks.
Thread-safe: one writer thread and one reader thread (see ``storage.io``) may call
concurrently with lookups from another thread.

Speed: a block file is built in one page-aligned buffer (pack fused with XXH3) and written
with one O_DIRECT pwrite where the filesystem allows, double-buffered so packing overlaps
the disk write; a restore maps each file (MAP_POPULATE) and scatters it with the hash
fused into the copy, ``read_threads`` blocks at a time (default min(4, CPUs); blocks land
in disjoint rows), asking the OS for the next files' pages ahead (posix_fadvise WILLNEED).
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import re
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from storage import diskio as dio
from storage import format as fmt
from storage.diskio import CHUNK, KERNEL, K
from storage.format import (
    KIND_BLOCK,
    KIND_CHECKPOINT,
    KIND_TAIL,
    PAGE,
    FormatError,
    Layout,
    Manifest,
    UnknownVersion,
    make_layout,
)

log = logging.getLogger("mlxkv.storage")

ZERO_KEY = bytes(16)
_NS_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_EXT = {KIND_BLOCK: ".blk", KIND_TAIL: ".tail", KIND_CHECKPOINT: ".ckpt"}
_SCAN_THREADS = 4
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_HEAD_READ = 2 * PAGE  # one read covers the header of every usual layout
_BLOCK_DOMAIN = b"mlxkv/block/1"
_TAIL_DOMAIN = b"mlxkv/tail/1"
_CKPT_DOMAIN = b"mlxkv/ckpt/1"
_MANIFEST_DIR = "manifests"
_READ_AHEAD = 8  # blocks whose pages are requested ahead of the one being verified
_BATCH = 64  # temp files open at once before they are fsynced and renamed

Segment = tuple[Any, int, int, int]


class StoreWriteError(OSError):
    """A write that could not complete; nothing partial of it is left on disk."""


# ----------------------------------------------------------------------------- results
@dataclass(frozen=True)
class Match:
    """The longest cached prefix of a token sequence (from the index alone)."""

    ns: str
    n_tokens: int
    block_keys: tuple[bytes, ...]
    tail_key: bytes | None = None
    tail_tokens: int = 0  # tokens used from the tail (a prefix of it)
    nbytes: int = 0  # payload bytes a restore reads
    layout: Layout | None = None  # the stored layout (to allocate destinations after a restart)
    checkpoint_key: bytes | None = None  # set by lookup_checkpoint


@dataclass(frozen=True)
class PutResult:
    n_tokens: int
    blocks_written: int
    blocks_present: int  # deduplicated: already on disk, not rewritten
    tail_written: bool
    bytes_written: int
    keys: tuple[bytes, ...]


@dataclass(frozen=True)
class Restore:
    n_tokens: int  # rows [0, n_tokens) of the destination are verified state
    requested: int
    blocks_read: int
    bytes_read: int
    corrupt: int  # blocks that failed verification (removed)
    missing: int  # blocks whose file had vanished


@dataclass
class _Entry:
    kind: int
    key: bytes
    parent: bytes
    ns: str
    path: str
    file_size: int
    payload_offset: int
    payload_len: int
    content_hash: int
    t0: int
    t1: int
    layout: Layout
    tokens: np.ndarray | None  # kept for tails only
    mtime: float
    last_used: float = 0.0


@dataclass
class _Space:
    blocks: dict[bytes, _Entry] = field(default_factory=dict)
    tails: dict[bytes, dict[bytes, _Entry]] = field(default_factory=dict)  # parent -> tails
    ckpts: dict[bytes, dict[bytes, _Entry]] = field(default_factory=dict)  # parent -> ckpts

    def side(self, kind: int) -> dict[bytes, dict[bytes, _Entry]]:
        return self.tails if kind == KIND_TAIL else self.ckpts


def _tokens(tokens: Any) -> np.ndarray:
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"tokens must be integers, got {arr.dtype}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= 1 << 32):
        raise ValueError("token ids must be in [0, 2**32)")
    return np.ascontiguousarray(arr, dtype="<u4")


def _common(a: np.ndarray, b: np.ndarray) -> int:
    m = min(a.size, b.size)
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if diff.size else m


def namespace_id(ns: str) -> bytes:
    return xxhash.xxh3_128_digest(ns.encode())


def check_namespace(ns: str) -> str:
    if not isinstance(ns, str) or not _NS_RE.match(ns):
        raise ValueError(
            f"namespace {ns!r} must be 1-128 characters of letters, digits, '.', '_' or '-'"
        )
    return ns


class BlockStore:
    """Content-addressed KV blocks under ``root`` (see the module docstring)."""

    def __init__(
        self, root: str | os.PathLike, block_tokens: int = 256, max_bytes: int | None = None,
        durable: bool = True, direct_io: bool = True, read_threads: int | None = None,
    ) -> None:
        if block_tokens <= 0:
            raise ValueError(f"block_tokens must be > 0, got {block_tokens}")
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.root = os.path.abspath(os.fspath(root))
        self.block_tokens = int(block_tokens)
        self.max_bytes = max_bytes
        self.durable = durable
        # Block writes bypass the page cache (O_DIRECT / F_NOCACHE) where the filesystem
        # allows: on the machines measured, copying into the page cache cost more than
        # the disk write itself, and persisted blocks should not evict hot pages.
        self.direct_io = direct_io
        self._lock = threading.RLock()
        self._spaces: dict[str, _Space] = {}
        self._bytes = 0
        self._clock = 0.0
        self._local = threading.local()
        self._pool: ThreadPoolExecutor | None = None
        self._rpool: ThreadPoolExecutor | None = None
        # threads that verify+scatter blocks of one restore in parallel (1 = the caller's)
        self.read_threads = max(1, read_threads if read_threads is not None
                                else min(4, os.cpu_count() or 1))
        self._warned: set[str] = set()
        self._c: dict[str, int] = dict.fromkeys(
            ("blocks_written", "tails_written", "checkpoints_written", "bytes_written",
             "dedup_blocks", "write_failures",
             "blocks_read", "bytes_read", "hits", "misses", "corrupt_removed", "vanished",
             "bad_removed", "tmp_removed", "evicted", "evicted_bytes", "gc_removed",
             "gc_bytes", "tails_superseded"), 0)
        self._skipped: dict[str, str] = {}  # path -> reason (unknown versions)

    # ------------------------------------------------------------------ keys / lookup
    def chain_keys(self, ns: str, tokens: Any) -> list[bytes]:
        """Keys of every full block of ``tokens`` in ``ns``."""
        toks = _tokens(tokens)
        nsid = namespace_id(check_namespace(ns))
        bt, parent, keys = self.block_tokens, ZERO_KEY, []
        for b in range(toks.size // bt):
            parent = _block_key(parent, nsid, toks[b * bt : (b + 1) * bt])
            keys.append(parent)
        return keys

    def lookup(self, ns: str, tokens: Any, max_tokens: int | None = None) -> Match:
        """Longest cached prefix of ``tokens`` (at most ``max_tokens``), index only."""
        toks = _tokens(tokens)
        nsid = namespace_id(check_namespace(ns))
        limit = toks.size if max_tokens is None else max(0, min(toks.size, int(max_tokens)))
        bt = self.block_tokens
        keys: list[bytes] = []
        parent, nbytes, layout = ZERO_KEY, 0, None
        with self._lock:
            space = self._spaces.get(ns)
            if space is None:
                return Match(ns, 0, ())
            for b in range(limit // bt):
                k = _block_key(parent, nsid, toks[b * bt : (b + 1) * bt])
                e = space.blocks.get(k)
                if e is None:
                    break
                keys.append(k)
                nbytes += e.payload_len
                parent = k
                layout = layout or e.layout
            n = len(keys) * bt
            best, best_m = None, 0
            rest = toks[n:limit]
            for e in space.tails.get(parent, {}).values():
                m = _common(e.tokens, rest)
                if m > best_m:
                    best, best_m = e, m
            if best is not None:
                nbytes += best.payload_len * best_m // (best.t1 - best.t0)
                return Match(ns, n + best_m, tuple(keys), best.key, best_m, nbytes,
                             layout or best.layout)
            return Match(ns, n, tuple(keys), None, 0, nbytes, layout)

    def longest_prefix(self, ns: str, tokens: Any, max_tokens: int | None = None) -> int:
        return self.lookup(ns, tokens, max_tokens).n_tokens

    # ------------------------------------------------------------------ write
    def put_blocks(
        self, ns: str, tokens: Any, layout: Any, segments: Sequence[Segment], *,
        tail: bool = True, manifest: str | None = None, durable: bool | None = None,
    ) -> PutResult:
        """Persist rows [0, len(tokens)) of ``segments``: missing full blocks + exact tail.

        Raises StoreWriteError (after removing every temp file of this call) when the disk
        is full or the folder unwritable; blocks completed before the failure stay valid.
        """
        toks = _tokens(tokens)
        layout = make_layout(layout)
        segs = _check_segments(layout, segments, toks.size)
        nsid = namespace_id(check_namespace(ns))
        durable = self.durable if durable is None else durable
        bt, n = self.block_tokens, toks.size
        keys = self.chain_keys(ns, toks)
        jobs = []  # (kind, key, parent, t0, t1)
        with self._lock:
            space = self._spaces.setdefault(ns, _Space())
            parent = ZERO_KEY
            for b, k in enumerate(keys):
                if k not in space.blocks:
                    jobs.append((KIND_BLOCK, k, parent, b * bt, (b + 1) * bt))
                parent = k
            present = len(keys) - len(jobs)
            tkey = None
            if tail and n % bt:
                tkey = _tail_key(parent, nsid, toks[len(keys) * bt :])
                if tkey not in space.tails.get(parent, {}):
                    jobs.append((KIND_TAIL, tkey, parent, len(keys) * bt, n))
        written: list[_Entry] = []
        try:
            if jobs:
                with self._flock(shared=True):
                    self._write_files(ns, nsid, layout, segs, toks, jobs, durable, written)
        finally:
            self._index_written(ns, written)
            with self._lock:
                self._c["dedup_blocks"] += present
        with self._lock:
            self._touch(ns, keys, tkey)
        if manifest is not None:
            self.put_manifest(ns, manifest, toks)
        if self.max_bytes is not None and self._bytes > self.max_bytes:
            self.evict()
        nblk = sum(1 for e in written if e.kind == KIND_BLOCK)
        return PutResult(n, nblk, present, any(e.kind == KIND_TAIL for e in written),
                         sum(e.file_size for e in written), tuple(keys))

    def _write_files(self, ns, nsid, layout, segs, toks, jobs, durable, written) -> None:
        pending: list[tuple[int, str, str, _Entry]] = []  # fd, tmp, final, entry
        dirs: set[str] = set()
        inflight: Future | None = None
        nblk = 0
        try:
            for kind, key, parent, t0, t1 in jobs:
                # blocks and tails pack token rows [t0, t1); a checkpoint its one state row
                r0, r1 = (0, 1) if kind == KIND_CHECKPOINT else (t0, t1)
                hdr_size = fmt.block_header_size(layout, ns, t1 - t0)
                plen = K.packed_size(segs, r1 - r0)
                size = hdr_size + fmt.align(plen)
                final = self._path(ns, key, kind)
                d = os.path.dirname(final)
                dio.make_dirs(d, dirs)
                tmp = os.path.join(d, f".{key.hex()}.{os.getpid()}.{threading.get_ident()}.tmp")
                # The whole file image is built in one page-aligned buffer (pack fused with
                # the hash, then the header) and written with one (direct where possible)
                # pwrite. Two buffers alternate: block i is written by the I/O helper
                # thread while block i+1 is packed here, so the disk never waits on the CPU.
                mv = memoryview(self._scratch(f"w{nblk % 2}", size))[:size]
                nblk += 1
                _, chash = K.pack(mv, hdr_size, segs, r0, r1, fmt.content_seed(key))
                mv[:hdr_size] = fmt.encode_block_header(
                    kind, key, parent, nsid, ns, layout, t0, t1, toks[t0:t1], chash, plen)
                mv[hdr_size + plen : size] = bytes(size - hdr_size - plen)
                fd = self._open_write(tmp)
                entry = _Entry(kind, key, parent, ns, final, size, hdr_size, plen, chash,
                               t0, t1, layout, toks[t0:t1].copy() if kind != KIND_BLOCK else None,
                               0.0)
                pending.append((fd, tmp, final, entry))
                dirs.add(d)
                if inflight is not None:
                    inflight.result()  # the other buffer is free again (or the write failed)
                inflight = self._io_pool().submit(dio.pwrite_full, fd, mv, 0)
                if len(pending) >= _BATCH:
                    inflight.result()
                    inflight = None
                    self._publish(pending, written, durable)
                    pending.clear()
            if inflight is not None:
                inflight.result()
                inflight = None
            self._publish(pending, written, durable)
            if durable:
                for d in sorted(dirs, key=len, reverse=True):  # a new folder before its parent
                    dio.fsync_dir(d)
        except BaseException as exc:
            if inflight is not None:  # never close or unlink under a running write
                wait([inflight])
            for fd, tmp, _, _ in pending:
                if fd >= 0:
                    dio.quiet(os.close, fd)
                if tmp is not None:
                    dio.quiet(os.unlink, tmp)
            if not isinstance(exc, OSError):
                raise
            with self._lock:
                self._c["write_failures"] += 1
            self._warn_once(f"write:{exc.errno}", "mlxkv cache: cannot write under %s: %s "
                            "(the cache keeps serving reads; new state is not persisted)",
                            self.root, exc)
            raise StoreWriteError(exc.errno, f"block write failed: {exc.strerror or exc}",
                                  getattr(exc, "filename", None)) from exc

    def _io_pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="mlxkv-write-io")
            return self._pool

    def close(self) -> None:
        """Stop the helper threads (the store stays usable; they restart on demand)."""
        with self._lock:
            pools = (self._pool, self._rpool)
            self._pool = self._rpool = None
        for pool in pools:
            if pool is not None:
                pool.shutdown(wait=True)

    def _open_write(self, path: str) -> int:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
        if self.direct_io and hasattr(K, "open_direct"):
            return K.open_direct(path, flags, 0o644)[0]  # falls back to buffered itself
        return os.open(path, flags, 0o644)

    @staticmethod
    def _publish(pending: list, written: list[_Entry], durable: bool) -> None:
        """fsync, close and rename a batch of temp files (fsyncs batched so the disk
        writes them back together). Entries are updated in place so a failure midway
        leaves ``pending`` describing exactly what still needs cleaning up."""
        if durable:
            for fd, *_ in pending:
                dio.fsync(fd)
        for i, (fd, tmp, final, entry) in enumerate(pending):
            os.close(fd)
            pending[i] = (-1, tmp, final, entry)
        for i, (_, tmp, final, entry) in enumerate(pending):
            os.rename(tmp, final)
            entry.mtime = time.time()
            written.append(entry)
            pending[i] = (-1, None, final, entry)

    def _index_written(self, ns: str, written: list[_Entry]) -> None:
        if not written:
            return
        stale: list[_Entry] = []
        with self._lock:
            space = self._spaces.setdefault(ns, _Space())
            for e in written:
                self._add(space, e)
                if e.kind == KIND_BLOCK:
                    self._c["blocks_written"] += 1
                elif e.kind == KIND_CHECKPOINT:
                    self._c["checkpoints_written"] += 1
                else:
                    self._c["tails_written"] += 1
                    # a shorter tail on the same parent that this one extends is superseded
                    for t in list(space.tails.get(e.parent, {}).values()):
                        if t is not e and t.tokens.size < e.tokens.size and \
                                _common(t.tokens, e.tokens) == t.tokens.size:
                            self._drop(t)
                            stale.append(t)
                            self._c["tails_superseded"] += 1
                self._c["bytes_written"] += e.file_size
        for t in stale:
            dio.quiet(os.unlink, t.path)

    # ------------------------------------------------------------------ read
    def get_blocks(
        self, ns: str, tokens: Any, layout: Any, segments: Sequence[Segment],
        n_tokens: int | Match | None = None,
    ) -> Restore:
        """Restore rows [0, n) into ``segments`` (n = a Match, a token count or the longest
        cached prefix), verifying each block; stops at the first missing/corrupt block."""
        layout = make_layout(layout)
        if isinstance(n_tokens, Match):
            m = n_tokens
            if m.ns != ns:
                raise ValueError(f"match is for namespace {m.ns!r}, not {ns!r}")
        else:
            m = self.lookup(ns, tokens, n_tokens)
        segs = _check_segments(layout, segments, m.n_tokens, writable=True)
        bt = self.block_tokens
        done = nread = nblk = corrupt = missing = 0
        jobs: list[tuple[_Entry, int, int]] = []  # entry, first destination row, rows
        row, dropped = 0, False
        for e in self._entries(ns, m):
            if e is None:  # dropped from the index since the lookup
                dropped = True
                break
            ntok = m.tail_tokens if e.kind == KIND_TAIL else bt
            jobs.append((e, row, ntok))
            row += ntok
        plans: dict[int, list] = {}
        if self.read_threads > 1 and len(jobs) > 1:
            # Blocks scatter into disjoint rows, so several are verified at once: a restore
            # is what the engine waits on, and one core cannot reach the memory bandwidth.
            results = list(self._read_pool().map(
                lambda j: self._read_job(j, layout, segs, plans), jobs))
        else:
            results = self._read_sequential(jobs, layout, segs, plans)
        for (e, _, ntok), res in zip(jobs, results):
            if res is not True:
                if res is None:
                    missing += 1
                else:
                    corrupt += 1
                break
            done += ntok
            nblk += 1
            nread += e.payload_len
        if dropped and done == row:
            missing += 1
        with self._lock:
            self._c["blocks_read"] += nblk
            self._c["bytes_read"] += nread
            self._c["hits" if done else "misses"] += 1
            if done:
                self._touch(ns, m.block_keys[: done // bt], m.tail_key if done == m.n_tokens else None)
        return Restore(done, m.n_tokens, nblk, nread, corrupt, missing)

    def _read_job(self, job: tuple[_Entry, int, int], layout: Layout, segs: list,
                  plans: dict[int, list]) -> bool | None:
        """True (verified and scattered), False (corrupt: removed) or None (vanished)."""
        e, t0, ntok = job
        fd = self._open(e, prefetch=True)
        if fd == -1:
            return None
        try:
            return self._read_verified(e, fd, layout, segs, t0, ntok, plans)
        finally:
            os.close(fd)

    def _read_sequential(self, jobs: list, layout: Layout, segs: list,
                         plans: dict[int, list]) -> list[bool | None]:
        """One block after another, asking the OS for the next ones' pages meanwhile."""
        out: list[bool | None] = []
        fds: list[int | None] = [None] * len(jobs)  # -1: the file had vanished
        try:
            for i, (e, t0, ntok) in enumerate(jobs):
                for j in range(i, min(len(jobs), i + 1 + _READ_AHEAD)):
                    if fds[j] is None:
                        fds[j] = self._open(jobs[j][0], prefetch=True)
                if fds[i] == -1:
                    out.append(None)
                    break
                ok = self._read_verified(e, fds[i], layout, segs, t0, ntok, plans)
                os.close(fds[i])
                fds[i] = None
                out.append(ok)
                if not ok:
                    break
        finally:
            for fd in fds:
                if fd is not None and fd >= 0:
                    dio.quiet(os.close, fd)
        return out

    def _read_pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._rpool is None:
                self._rpool = ThreadPoolExecutor(self.read_threads,
                                                 thread_name_prefix="mlxkv-read-io")
            return self._rpool

    def _entries(self, ns: str, m: Match) -> list[_Entry | None]:
        with self._lock:
            space = self._spaces.get(ns, _Space())
            out: list[_Entry | None] = [space.blocks.get(k) for k in m.block_keys]
            if m.tail_key is not None and m.tail_tokens:
                parent = m.block_keys[-1] if m.block_keys else ZERO_KEY
                out.append(space.tails.get(parent, {}).get(m.tail_key))
        return out

    def _open(self, e: _Entry, prefetch: bool = False) -> int:
        try:
            fd = dio.open_ro(e.path)
        except FileNotFoundError:  # evicted by another process: a miss
            with self._lock:
                self._drop(e)
                self._c["vanished"] += 1
            return -1
        if prefetch and hasattr(os, "posix_fadvise"):
            # start reading the next block from disk while this one is verified/unpacked
            dio.quiet(os.posix_fadvise, fd, 0, 0, os.POSIX_FADV_WILLNEED)
        return fd

    def _read_verified(self, e: _Entry, fd: int, layout: Layout, segs: list, t0: int,
                       ntok: int, plans: dict[int, list]) -> bool:
        """Read, verify and scatter one block/tail into rows [t0, t0+ntok) of segs.

        Full entries stream in L2-sized pieces (read, hash, scatter); the hash is checked
        at the end, so on a mismatch the rows written are garbage and not reported.
        """
        if ntok != (1 if e.kind == KIND_CHECKPOINT else e.t1 - e.t0):
            return self._read_tail_prefix(e, fd, layout, segs, t0, ntok)
        mapped = self._read_mapped(e, fd, layout, segs, t0, ntok)
        if mapped is not False:
            reason = mapped
        else:
            reason = self._read_pieces(e, fd, layout, segs, t0, ntok, plans)
        if reason is not None:
            self._remove_corrupt(e, reason)
            return False
        return True

    def _read_mapped(self, e: _Entry, fd: int, layout: Layout, segs: list, t0: int,
                     ntok: int) -> str | None | bool:
        """Verify and scatter straight from a read-only mapping of the file: one pass over
        the bytes (hash fused with the scatter), no copy into a staging buffer. Files are
        immutable once renamed into place (never truncated, only unlinked), so the mapping
        stays valid. -> None (ok), a reason (bad), or False (cannot map: use pread)."""
        if os.fstat(fd).st_size < e.file_size:
            return f"truncated file ({os.fstat(fd).st_size} of {e.file_size} bytes)"
        try:
            # MAP_POPULATE maps every page in one call (cheaper than faulting 4 KiB at a
            # time during the scatter) and, for cold files, reads them in large chunks
            m = mmap.mmap(fd, e.file_size, flags=mmap.MAP_SHARED | _POPULATE,
                          prot=mmap.PROT_READ)
        except (OSError, ValueError):
            return False
        try:
            with memoryview(m) as mv:
                reason = self._check_header(e, mv[: e.payload_offset], layout)
                if reason is None:
                    _, h = dio.unpack_hash(mv, e.payload_offset, segs, t0, ntok,
                                        fmt.content_seed(e.key))
                    if h != e.content_hash:
                        reason = "content hash mismatch"
            return reason
        finally:
            try:
                m.close()
            except BufferError:  # a view survived in a traceback; unmapped when collected
                pass

    def _read_pieces(self, e: _Entry, fd: int, layout: Layout, segs: list, t0: int,
                     ntok: int, plans: dict[int, list]) -> str | None:
        """pread fallback: stream L2-sized pieces (read, hash, scatter)."""
        hbuf = self._scratch("h", e.payload_offset)
        with memoryview(hbuf) as hv:
            got = dio.pread_full(fd, hv[: e.payload_offset], 0)
            reason = self._check_header(e, hv[:got], layout)
        if reason is None:
            plan = plans.get(ntok)
            if plan is None:
                plan = plans[ntok] = dio.plan(segs, ntok)
            h = dio.hasher(fmt.content_seed(e.key))
            stage = self._scratch("r", 2 * CHUNK)
            mv = memoryview(stage)
            for off, n, sub in plan:
                if n > len(mv):
                    mv = memoryview(self._scratch("r", n))
                got = dio.pread_full(fd, mv[:n], e.payload_offset + off)
                if got < n:
                    reason = f"truncated payload ({e.payload_offset + off + got} bytes)"
                    break
                h.update(mv[:n])
                K.unpack(mv, 0, sub, t0, ntok)
            mv.release()
            if reason is None and h.digest() != e.content_hash:
                reason = "content hash mismatch"
        return reason

    def _check_header(self, e: _Entry, head: memoryview, layout: Layout) -> str | None:
        """None if the file's header is intact and matches the index entry, else why not."""
        if len(head) < e.payload_offset:
            return f"truncated header ({len(head)} bytes)"
        try:
            hdr = fmt.decode_block_header(head)
        except FormatError as exc:
            return f"header: {exc}"
        if hdr.key != e.key or hdr.payload_offset != e.payload_offset \
                or hdr.payload_len != e.payload_len or hdr.content_hash != e.content_hash:
            return "header does not match the index"
        if hdr.layout != layout:
            raise ValueError(f"block {e.key.hex()} has another layout than requested")
        return None

    def _read_tail_prefix(self, e: _Entry, fd: int, layout: Layout, segs: list, t0: int,
                          ntok: int) -> bool:
        """Verify a whole (small) tail, then scatter only its first ntok rows."""
        buf = self._scratch("t", e.file_size)
        with memoryview(buf) as mv:
            got = dio.pread_full(fd, mv[: e.file_size], 0)
            reason = self._check_header(e, mv[: min(got, e.payload_offset)], layout)
            if reason is None and got < e.payload_offset + e.payload_len:
                reason = f"truncated ({got} of {e.file_size} bytes)"
            pay = mv[e.payload_offset : e.payload_offset + e.payload_len]
            if reason is None and K.xxh3_64(pay, fmt.content_seed(e.key)) != e.content_hash:
                reason = "content hash mismatch"
            if reason is None:
                src, off, full = [], 0, e.t1 - e.t0
                for spec in layout:
                    n = spec.outer * full * spec.row_bytes
                    src.append((pay[off : off + n], spec.outer, full, spec.row_bytes))
                    off += n
                tmp = self._scratch("p", K.packed_size(src, ntok))
                K.pack(tmp, 0, src, 0, ntok)
                K.unpack(tmp, 0, segs, t0, ntok)
            pay.release()
        if reason is not None:
            self._remove_corrupt(e, reason)
            return False
        return True

    def _remove_corrupt(self, e: _Entry, reason: str) -> None:
        log.warning("mlxkv cache: removing corrupt %s %s: %s", fmt.KIND_NAMES[e.kind], e.path, reason)
        dio.quiet(os.unlink, e.path)
        with self._lock:
            self._drop(e)
            self._c["corrupt_removed"] += 1

    # ------------------------------------------------------------------ manifests
    # ------------------------------------------------------------------ checkpoints
    def put_checkpoint(
        self, ns: str, tokens: Any, layout: Any, segments: Sequence[Segment], *,
        manifest: str | None = None, durable: bool | None = None,
    ) -> PutResult:
        """Persist a whole state that is only valid after exactly ``tokens`` (rotating KV
        windows, SSM/linear-attention state): each segment is ``(buf, outer, 1, row_bytes)``,
        stored whole. Restored only at that exact position (``lookup_checkpoint``)."""
        toks = _tokens(tokens)
        if toks.size == 0:
            raise ValueError("a checkpoint needs at least one token")
        layout = make_layout(layout)
        segs = _check_segments(layout, segments, 1)
        if any(t != 1 for _, _, t, _ in segs):
            raise ValueError("checkpoint segments are whole states: (buf, outer, 1, row_bytes)")
        nsid = namespace_id(check_namespace(ns))
        keys = self.chain_keys(ns, toks)
        parent, t0 = (keys[-1] if keys else ZERO_KEY), len(keys) * self.block_tokens
        key = _ckpt_key(parent, nsid, toks[t0:])
        with self._lock:
            space = self._spaces.setdefault(ns, _Space())
            present = key in space.ckpts.get(parent, {})
        written: list[_Entry] = []
        try:
            if not present:
                with self._flock(shared=True):
                    self._write_files(ns, nsid, layout, segs, toks,
                                      [(KIND_CHECKPOINT, key, parent, t0, toks.size)],
                                      self.durable if durable is None else durable, written)
        finally:
            self._index_written(ns, written)
        with self._lock:
            self._touch(ns, (), key)
        if manifest is not None:
            self.put_manifest(ns, manifest, toks, extra_keys=(key,))
        if self.max_bytes is not None and self._bytes > self.max_bytes:
            self.evict()
        return PutResult(toks.size, len(written), int(present), False,
                         sum(e.file_size for e in written), (key,))

    def lookup_checkpoint(self, ns: str, tokens: Any, max_tokens: int | None = None) -> Match:
        """The longest checkpoint at an exact prefix of ``tokens`` (at most ``max_tokens``);
        Match.n_tokens == 0 when there is none. Index only."""
        toks = _tokens(tokens)
        nsid = namespace_id(check_namespace(ns))
        limit = toks.size if max_tokens is None else max(0, min(toks.size, int(max_tokens)))
        bt, parent = self.block_tokens, ZERO_KEY
        best: _Entry | None = None
        with self._lock:
            space = self._spaces.get(ns)
            if space is None or not space.ckpts:
                return Match(ns, 0, ())
            for b in range(limit // bt + 1):
                for e in space.ckpts.get(parent, {}).values():
                    n = e.tokens.size
                    if b * bt + n <= limit and (best is None or e.t1 > best.t1) and \
                            _common(e.tokens, toks[b * bt : b * bt + n]) == n:
                        best = e
                if (b + 1) * bt > limit:
                    break
                parent = _block_key(parent, nsid, toks[b * bt : (b + 1) * bt])
        if best is None:
            return Match(ns, 0, ())
        return Match(ns, best.t1, (), None, 0, best.payload_len, best.layout, best.key)

    def get_checkpoint(self, ns: str, match: Match, layout: Any,
                       segments: Sequence[Segment]) -> Restore:
        """Restore the checkpoint ``match`` (from lookup_checkpoint) into ``segments``
        ((buf, outer, 1, row_bytes) each), verified; n_tokens is 0 if it is gone/corrupt."""
        if match.checkpoint_key is None:
            raise ValueError("not a checkpoint match (use lookup_checkpoint)")
        layout = make_layout(layout)
        segs = _check_segments(layout, segments, 1, writable=True)
        with self._lock:
            sp = self._spaces.get(ns, _Space())
            e = next((ts[match.checkpoint_key] for ts in sp.ckpts.values()
                      if match.checkpoint_key in ts), None)
        res = None if e is None else self._read_job((e, 0, 1), layout, segs, {})
        ok = res is True
        with self._lock:
            self._c["hits" if ok else "misses"] += 1
            if ok:
                self._c["blocks_read"] += 1
                self._c["bytes_read"] += e.payload_len
                self._touch(ns, (), e.key)
        return Restore(match.n_tokens if ok else 0, match.n_tokens, int(ok),
                       e.payload_len if ok else 0, int(res is False), int(res is None))

    def _manifest_path(self, ns: str, name: str) -> str:
        h = xxhash.xxh3_64_hexdigest(name.encode())
        return os.path.join(self.root, check_namespace(ns), _MANIFEST_DIR, f"{h}.man")

    def put_manifest(self, ns: str, name: str, tokens: Any,
                     extra_keys: Sequence[bytes] = ()) -> Manifest:
        """Name the state of ``tokens`` (its block keys and tail key) so GC keeps it."""
        if not isinstance(name, str) or not name:
            raise ValueError("manifest name must be a non-empty string")
        toks = _tokens(tokens)
        keys = self.chain_keys(ns, toks)
        bt = self.block_tokens
        tkey = None
        if toks.size % bt:
            tkey = _tail_key(keys[-1] if keys else ZERO_KEY, namespace_id(ns), toks[len(keys) * bt :])
        man = Manifest(name, ns, toks, tuple(keys), tkey, time.time(), tuple(extra_keys))
        path = self._manifest_path(ns, name)
        try:
            with self._flock(shared=True):
                dio.atomic_write(path, fmt.encode_manifest(man), self.durable)
        except OSError as exc:
            self._warn_once(f"write:{exc.errno}", "mlxkv cache: cannot write under %s: %s",
                            self.root, exc)
            raise StoreWriteError(exc.errno, f"manifest write failed: {exc}") from exc
        return man

    def get_manifest(self, ns: str, name: str) -> Manifest | None:
        try:
            with open(self._manifest_path(ns, name), "rb") as f:
                m = fmt.decode_manifest(f.read())
        except (FileNotFoundError, FormatError):
            return None
        return m if m.name == name and m.ns == ns else None

    def manifests(self, ns: str) -> list[Manifest]:
        d = os.path.join(self.root, check_namespace(ns), _MANIFEST_DIR)
        out = []
        for de in dio.scandir(d):
            if de.name.endswith(".man"):
                try:
                    with open(de.path, "rb") as f:
                        out.append(fmt.decode_manifest(f.read()))
                except (OSError, FormatError):
                    continue
        return out

    def delete_manifest(self, ns: str, name: str) -> bool:
        try:
            os.unlink(self._manifest_path(ns, name))
            return True
        except FileNotFoundError:
            return False

    # ------------------------------------------------------------------ scan / evict / gc
    def scan(self) -> dict[str, Any]:
        """Rebuild the index from the files' headers; remove temp orphans and bad files."""
        with self._flock(shared=False):
            return self._scan_locked()

    def _scan_locked(self) -> dict[str, Any]:
        t_start = time.perf_counter()
        rep = {"blocks": 0, "tails": 0, "checkpoints": 0, "added": 0, "dropped": 0, "tmp_removed": 0,
               "bad_removed": 0, "skipped": 0}
        found: list[_Entry] = []
        todo: list[tuple[str, str, bytes, int]] = []
        seen: set[str] = set()
        nss = [de for de in dio.scandir(self.root) if de.is_dir() and _NS_RE.match(de.name)]
        with self._lock:
            known = {e.path: e for sp in self._spaces.values() for e in _all(sp)}
        for nsd in nss:
            ns, nsid = nsd.name, namespace_id(nsd.name)
            for sub in dio.scandir(nsd.path):
                if sub.name == _MANIFEST_DIR:
                    for de in dio.scandir(sub.path):
                        if de.name.endswith(".tmp"):
                            rep["tmp_removed"] += dio.quiet(os.unlink, de.path)
                    continue
                if len(sub.name) != 2 or not sub.is_dir():
                    continue
                for de in dio.scandir(sub.path):
                    name = de.name
                    if name.endswith(".tmp"):
                        rep["tmp_removed"] += dio.quiet(os.unlink, de.path)
                        continue
                    kind = KIND_BLOCK if name.endswith(".blk") else \
                        KIND_TAIL if name.endswith(".tail") else \
                        KIND_CHECKPOINT if name.endswith(".ckpt") else None
                    if kind is None:
                        continue
                    seen.add(de.path)
                    if de.path not in known:
                        todo.append((de.path, ns, nsid, kind))
        for path, res in _read_entries(todo):
            if isinstance(res, _Entry):
                found.append(res)
            elif isinstance(res, UnknownVersion):
                self._skipped[path] = str(res)
                rep["skipped"] += 1
            elif not isinstance(res, FileNotFoundError):
                log.warning("mlxkv cache: removing %s: %s", path, res)
                rep["bad_removed"] += dio.quiet(os.unlink, path)
        with self._lock:
            for e in known.values():
                if e.path not in seen:
                    self._drop(e)
                    rep["dropped"] += 1
            # older files are less recently used; a parent is never older than its child
            found.sort(key=lambda e: e.mtime)
            for e in found:
                self._add(self._spaces.setdefault(e.ns, _Space()), e)
                e.last_used = e.mtime
            for e in sorted(found, key=lambda e: -e.t0):
                p = self._spaces[e.ns].blocks.get(e.parent)
                if p is not None and p.last_used < e.last_used:
                    p.last_used = e.last_used
            self._clock = max([self._clock] + [e.last_used for e in found])
            rep["added"] = len(found)
            for sp in self._spaces.values():
                rep["blocks"] += len(sp.blocks)
                rep["tails"] += sum(len(t) for t in sp.tails.values())
                rep["checkpoints"] += sum(len(t) for t in sp.ckpts.values())
            self._c["tmp_removed"] += rep["tmp_removed"]
            self._c["bad_removed"] += rep["bad_removed"]
        rep["seconds"] = time.perf_counter() - t_start
        return rep

    def evict(self, max_bytes: int | None = None) -> dict[str, int]:
        """Remove least-recently-used entries until the store holds <= max_bytes."""
        cap = self.max_bytes if max_bytes is None else max_bytes
        if cap is None or self._bytes <= cap:
            return {"evicted": 0, "bytes": 0}
        removed = freed = 0
        with self._flock(shared=False):
            with self._lock:
                # deepest first among equals: evicting a parent would orphan its children
                order = sorted((e for sp in self._spaces.values() for e in _all(sp)),
                               key=lambda e: (e.last_used, -e.t0))
                victims = []
                for e in order:
                    if self._bytes <= cap:
                        break
                    self._drop(e)
                    victims.append(e)
                    removed += 1
                    freed += e.file_size
                self._c["evicted"] += removed
                self._c["evicted_bytes"] += freed
            for e in victims:
                dio.quiet(os.unlink, e.path)
        return {"evicted": removed, "bytes": freed}

    def gc(self, ns: str | None = None, min_age_s: float = 60.0) -> dict[str, int]:
        """Remove blocks and tails no manifest references (older than ``min_age_s``, so a
        block another process wrote moments before its manifest survives). A manifest
        whose first block and tail are both gone (evicted) restores nothing: removed too."""
        removed = freed = live_n = stale = 0
        with self._flock(shared=False):
            self._scan_locked()
            with self._lock:
                names = [ns] if ns is not None else list(self._spaces)
            now = time.time()
            for name in names:
                live: set[bytes] = set()
                with self._lock:
                    sp = self._spaces.get(name, _Space())
                    present = {e.key for e in _all(sp)}
                for m in self.manifests(name):
                    # it restores something while its first block, its tail or one of
                    # its checkpoints is still there
                    heads = {*m.block_keys[:1], *m.extra_keys, *([m.tail_key] if m.tail_key else [])}
                    if heads and not heads & present and m.created <= now - min_age_s:
                        stale += self.delete_manifest(name, m.name)
                        continue
                    live.update(m.block_keys)
                    live.update(m.extra_keys)
                    if m.tail_key:
                        live.add(m.tail_key)
                live_n += len(live)
                with self._lock:
                    sp = self._spaces.get(name, _Space())
                    dead = [e for e in _all(sp) if e.key not in live and e.mtime <= now - min_age_s]
                    for e in dead:
                        self._drop(e)
                for e in dead:
                    dio.quiet(os.unlink, e.path)
                    removed += 1
                    freed += e.file_size
            with self._lock:
                self._c["gc_removed"] += removed
                self._c["gc_bytes"] += freed
        return {"removed": removed, "bytes": freed, "live_keys": live_n,
                "manifests_removed": stale}

    def stats(self) -> dict[str, Any]:
        with self._lock:
            per_ns = {ns: {"blocks": len(sp.blocks),
                           "tails": sum(len(t) for t in sp.tails.values()),
                           "checkpoints": sum(len(t) for t in sp.ckpts.values()),
                           "bytes": sum(e.file_size for e in _all(sp))}
                      for ns, sp in self._spaces.items()}
            return {"root": self.root, "kernel": KERNEL, "block_tokens": self.block_tokens,
                    "bytes": self._bytes, "max_bytes": self.max_bytes,
                    "blocks": sum(v["blocks"] for v in per_ns.values()),
                    "tails": sum(v["tails"] for v in per_ns.values()),
                    "checkpoints": sum(v["checkpoints"] for v in per_ns.values()),
                    "namespaces": per_ns, "skipped_unknown_version": dict(self._skipped),
                    **self._c}

    # ------------------------------------------------------------------ internals
    def _path(self, ns: str, key: bytes, kind: int) -> str:
        h = key.hex()
        return os.path.join(self.root, ns, h[:2], h + _EXT[kind])

    def _add(self, sp: _Space, e: _Entry) -> None:
        if e.kind == KIND_BLOCK:
            old = sp.blocks.get(e.key)
            sp.blocks[e.key] = e
        else:
            side = sp.side(e.kind)
            old = side.setdefault(e.parent, {}).get(e.key)
            side[e.parent][e.key] = e
        self._bytes += e.file_size - (old.file_size if old else 0)

    def _drop(self, e: _Entry) -> None:
        sp = self._spaces.get(e.ns)
        if sp is None:
            return
        if e.kind == KIND_BLOCK:
            if sp.blocks.get(e.key) is e:
                del sp.blocks[e.key]
                self._bytes -= e.file_size
        else:
            side = sp.side(e.kind)
            ts = side.get(e.parent, {})
            if ts.get(e.key) is e:
                del ts[e.key]
                self._bytes -= e.file_size
                if not ts:
                    side.pop(e.parent, None)

    def _touch(self, ns: str, keys: Sequence[bytes], tail_key: bytes | None) -> None:
        """Mark a chain used; deeper entries get older stamps so they are evicted first."""
        sp = self._spaces.get(ns)
        if sp is None:
            return
        now = max(time.time(), self._clock)
        step = 1e-5  # well above float resolution at epoch scale (~4e-7 s)
        if tail_key is not None:  # a tail's or a checkpoint's key
            for ts in (*sp.tails.values(), *sp.ckpts.values()):
                if tail_key in ts:
                    ts[tail_key].last_used = now
                    break
        for i, k in enumerate(reversed(keys)):
            e = sp.blocks.get(k)
            if e is not None:
                e.last_used = now + (i + 1) * step
        self._clock = now + (len(keys) + 1) * step

    def _scratch(self, which: str, nbytes: int) -> Any:
        bufs = self._local.__dict__.setdefault("bufs", {})
        buf = bufs.get(which)
        if buf is None or buf.nbytes < nbytes:
            buf = dio.aligned(max(nbytes, 1 << 20))
            bufs[which] = buf
        return buf

    @contextmanager
    def _flock(self, shared: bool) -> Iterator[None]:
        os.makedirs(self.root, exist_ok=True)
        fd = os.open(os.path.join(self.root, ".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing the descriptor releases the lock

    def _warn_once(self, what: str, msg: str, *args: Any) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning(msg, *args)


# ----------------------------------------------------------------------------- helpers
def _block_key(parent: bytes, nsid: bytes, toks: np.ndarray | bytes) -> bytes:
    """Chain key: hash of (parent key, namespace id, little-endian uint32 token ids)."""
    raw = toks if isinstance(toks, bytes) else toks.tobytes()
    return xxhash.xxh3_128_digest(b"".join((_BLOCK_DOMAIN, parent, nsid, raw)))


def _tail_key(parent: bytes, nsid: bytes, toks: np.ndarray | bytes) -> bytes:
    raw = toks if isinstance(toks, bytes) else toks.tobytes()
    return xxhash.xxh3_128_digest(b"".join((_TAIL_DOMAIN, parent, nsid, raw)))


def _ckpt_key(parent: bytes, nsid: bytes, toks: np.ndarray | bytes) -> bytes:
    raw = toks if isinstance(toks, bytes) else toks.tobytes()
    return xxhash.xxh3_128_digest(b"".join((_CKPT_DOMAIN, parent, nsid, raw)))


_KEY_FN = {KIND_BLOCK: _block_key, KIND_TAIL: _tail_key, KIND_CHECKPOINT: _ckpt_key}


def _all(sp: _Space) -> Iterator[_Entry]:
    yield from sp.blocks.values()
    for side in (sp.tails, sp.ckpts):
        for ts in side.values():
            yield from ts.values()


def _check_segments(layout: Layout, segments: Sequence[Segment], ntokens: int,
                    writable: bool = False) -> list:
    if len(segments) != len(layout):
        raise ValueError(f"{len(segments)} segments for a layout of {len(layout)}")
    out = []
    for spec, seg in zip(layout, segments):
        try:
            buf, outer, t_cap, rb = seg
        except (TypeError, ValueError) as exc:
            raise ValueError(f"segment {spec.name}: expected (buf, outer, t_capacity, row_bytes)") from exc
        if int(outer) != spec.outer or int(rb) != spec.row_bytes:
            raise ValueError(f"segment {spec.name}: outer/row_bytes ({outer}, {rb}) do not match "
                             f"the layout ({spec.outer}, {spec.row_bytes})")
        if int(t_cap) < ntokens:
            raise ValueError(f"segment {spec.name}: t_capacity {t_cap} < {ntokens} tokens")
        if writable and memoryview(buf).readonly:
            raise ValueError(f"segment {spec.name}: destination buffer is read-only")
        out.append((buf, int(outer), int(t_cap), int(rb)))
    return out


def _read_entries(todo: list) -> Iterator[tuple[str, Any]]:
    """(path, _Entry or the exception) per file; headers are read by a few threads so a
    cold scan keeps several disk reads in flight (pread releases the GIL)."""

    def some(items: list) -> list[tuple[str, Any]]:
        out = []
        for item in items:
            try:
                out.append((item[0], _read_entry(*item)))
            except (FormatError, OSError) as exc:
                out.append((item[0], exc))
        return out

    if len(todo) < 512 or _SCAN_THREADS <= 1:
        yield from some(todo)
        return
    step = -(-len(todo) // (4 * _SCAN_THREADS))  # a few chunks per thread: one future each
    with ThreadPoolExecutor(max_workers=_SCAN_THREADS, thread_name_prefix="mlxkv-scan") as ex:
        for chunk in ex.map(some, [todo[i : i + step] for i in range(0, len(todo), step)]):
            yield from chunk


def _read_entry(path: str, ns: str, nsid: bytes, kind: int) -> _Entry:
    fd = dio.open_ro(path)
    try:
        st = os.fstat(fd)
        size, mtime = st.st_size, st.st_mtime
        head = os.pread(fd, _HEAD_READ, 0)
        span = fmt.header_span(head)
        if span > len(head):
            head = os.pread(fd, span, 0)
    finally:
        os.close(fd)
    hdr = fmt.decode_block_header(head)
    if hdr.kind != kind:
        raise FormatError(f"a {fmt.KIND_NAMES[hdr.kind]} stored under a {fmt.KIND_NAMES[kind]} name")
    if hdr.ns != ns or hdr.ns_id != nsid:
        raise FormatError(f"namespace {hdr.ns!r} stored under {ns!r}")
    want = _KEY_FN[kind](hdr.parent, nsid, hdr.token_bytes)
    if hdr.key != want or not path.endswith(hdr.key.hex() + _EXT[kind]):
        raise FormatError("key does not match the header's parent and tokens")
    if size < hdr.file_size:
        raise FormatError(f"truncated: {size} of {hdr.file_size} bytes")
    return _Entry(kind, hdr.key, hdr.parent, ns, path, hdr.file_size, hdr.payload_offset,
                  hdr.payload_len, hdr.content_hash, hdr.t0, hdr.t1, hdr.layout,
                  hdr.tokens.copy() if kind != KIND_BLOCK else None, mtime)



__all__ = [
    "KERNEL",
    "ZERO_KEY",
    "BlockStore",
    "Match",
    "PutResult",
    "Restore",
    "StoreWriteError",
    "check_namespace",
    "namespace_id",
]
