"""Writes of the block store: the missing blocks of a chain, its exact tail, and whole
checkpoints, each file written atomically (temp name, write, fsync, rename, fsync dir).

A block file is built in one page-aligned buffer (pack fused with XXH3, then the header)
and written with one O_DIRECT pwrite where the filesystem allows, double-buffered so
packing overlaps the disk write; fsyncs and renames are batched, in chain order. When a
write fails (a full disk), the blocks written before it are still fsynced and renamed
into place, so the prefix of the chain that fit is usable; the rest is removed.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait

import numpy.typing as npt

from mlxkv.storage import diskio
from mlxkv.storage import format as fmt
from mlxkv.storage.context import StoreContext
from mlxkv.storage.diskio import kernel
from mlxkv.storage.entries import Entry, Space
from mlxkv.storage.format import (
    KIND_BLOCK,
    KIND_CHECKPOINT,
    KIND_TAIL,
    Layout,
    LayoutLike,
    TokenIds,
    make_layout,
)
from mlxkv.storage.index import Index
from mlxkv.storage.keys import (
    ZERO_KEY,
    CacheFolderError,
    PutResult,
    Segment,
    check_namespace,
    check_segments,
    ckpt_key,
    common,
    namespace_id,
    tail_key,
    token_ids,
)
from mlxkv.storage.maintenance import Maintenance

_BATCH = 64  # temp files open at once before they are fsynced and renamed

Job = tuple[int, bytes, bytes, int, int]  # kind, key, parent, t0, t1
# a file being written: fd (-1 once closed), temp name (None once renamed), final name,
# its index entry
Pending = tuple[int, str | None, str, Entry]


class Writer:
    """The write path of a block store: ``put_blocks`` and ``put_checkpoint``, indexed
    into ``index``; ``upkeep`` names what was written (manifests) and evicts past the
    byte cap."""

    def __init__(self, context: StoreContext, index: Index, upkeep: Maintenance,
                 direct_io: bool) -> None:
        self.context = context
        self.index = index
        self.upkeep = upkeep
        # Block writes bypass the page cache (O_DIRECT / F_NOCACHE) where the filesystem
        # allows: copying into the page cache can cost more than the disk write itself,
        # and persisted blocks should not evict hot pages.
        self.direct_io = direct_io
        self._io_pool: ThreadPoolExecutor | None = None  # the thread that runs the pwrites

    def close(self) -> None:
        """Stop the write helper thread (it restarts on demand)."""
        with self.context.lock:
            pool, self._io_pool = self._io_pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def put_blocks(
        self, ns: str, tokens: npt.ArrayLike, layout: LayoutLike, segments: Sequence[Segment], *,
        tail: bool = True, manifest: str | None = None, durable: bool | None = None,
        pace: Callable[[], None] | None = None,
    ) -> PutResult:
        """Persist rows [0, len(tokens)) of ``segments``: missing full blocks + exact tail.

        Raises StoreWriteError (after removing every temp file of this call) when the disk
        is full or the folder unwritable; blocks completed before the failure stay valid.
        """
        toks = token_ids(tokens)
        layout = make_layout(layout)
        segs = check_segments(layout, segments, toks.size)
        nsid = namespace_id(check_namespace(ns))
        block_len, n = self.context.block_tokens, toks.size
        keys = self.index.chain_keys(ns, toks)
        jobs: list[Job] = []
        with self.context.lock:
            space = self.index.spaces.setdefault(ns, Space())
            parent = ZERO_KEY
            for b, k in enumerate(keys):
                if k not in space.blocks:
                    jobs.append((KIND_BLOCK, k, parent, b * block_len, (b + 1) * block_len))
                parent = k
            present = len(keys) - len(jobs)
            tail_child_key = None
            if tail and n % block_len:
                tail_child_key = tail_key(parent, nsid, toks[len(keys) * block_len :])
                if tail_child_key not in space.tails.get(parent, {}):
                    jobs.append((KIND_TAIL, tail_child_key, parent, len(keys) * block_len, n))
        try:
            written = self._persist(ns, nsid, layout, segs, toks, jobs, durable, pace)
        finally:
            with self.context.lock:
                self.context.counters["dedup_blocks"] += present
        self._after_put(ns, keys, tail_child_key, manifest, toks, ())
        n_blocks = sum(1 for e in written if e.kind == KIND_BLOCK)
        return PutResult(n, n_blocks, present, any(e.kind == KIND_TAIL for e in written),
                         sum(e.file_size for e in written), tuple(keys))

    def put_checkpoint(
        self, ns: str, tokens: npt.ArrayLike, layout: LayoutLike, segments: Sequence[Segment], *,
        manifest: str | None = None, durable: bool | None = None,
    ) -> PutResult:
        """Persist a whole state that is only valid after exactly ``tokens`` (rotating KV
        windows, SSM/linear-attention state): each segment is ``(buf, outer, 1, row_bytes)``,
        stored whole. Restored only at that exact position (``lookup_checkpoint``)."""
        toks = token_ids(tokens)
        if toks.size == 0:
            raise ValueError("a checkpoint needs at least one token")
        layout = make_layout(layout)
        segs = check_segments(layout, segments, 1)
        if any(t != 1 for _, _, t, _ in segs):
            raise ValueError("checkpoint segments are whole states: (buf, outer, 1, row_bytes)")
        nsid = namespace_id(check_namespace(ns))
        keys = self.index.chain_keys(ns, toks)
        parent, t0 = (keys[-1] if keys else ZERO_KEY), len(keys) * self.context.block_tokens
        key = ckpt_key(parent, nsid, toks[t0:])
        with self.context.lock:
            present = key in self.index.spaces.setdefault(ns, Space()).ckpts.get(parent, {})
        jobs = [] if present else [(KIND_CHECKPOINT, key, parent, t0, toks.size)]
        written = self._persist(ns, nsid, layout, segs, toks, jobs, durable)
        self._after_put(ns, (), key, manifest, toks, (key,))
        return PutResult(toks.size, len(written), int(present), False,
                         sum(e.file_size for e in written), (key,))

    def _persist(self, ns: str, nsid: bytes, layout: Layout, segs: list[Segment], toks: TokenIds,
                 jobs: list[Job], durable: bool | None,
                 pace: Callable[[], None] | None = None) -> list[Entry]:
        """Write ``jobs`` under the shared folder lock; index whatever completed."""
        written: list[Entry] = []
        try:
            if jobs:
                with self.context.folder_lock(shared=True):
                    self._write_files(ns, nsid, layout, segs, toks, jobs,
                                      self.context.durable if durable is None else durable, written,
                                      pace)
        except CacheFolderError as exc:
            raise self.context.folder_failed(exc, "block") from exc
        finally:
            self._index_written(ns, written)
        return written

    def _after_put(self, ns: str, keys: Sequence[bytes], child_key: bytes | None,
                   manifest: str | None, toks: TokenIds, extra_keys: Sequence[bytes]) -> None:
        with self.context.lock:
            self.index.touch(ns, keys, child_key)
        if manifest is not None:
            self.upkeep.put_manifest(ns, manifest, toks, extra_keys=extra_keys)
        if self.upkeep.max_bytes is not None and self.index.nbytes > self.upkeep.max_bytes:
            try:
                self.upkeep.evict()
            except CacheFolderError as exc:  # the write itself succeeded
                self.context.warn_once(f"folder:{exc}", "mlxkv cache: %s", exc)

    def _write_files(self, ns: str, nsid: bytes, layout: Layout, segs: list[Segment], toks: TokenIds,
                     jobs: list[Job], durable: bool, written: list[Entry],
                     pace: Callable[[], None] | None = None) -> None:
        """Write ``jobs`` (``pace``, when given, runs before each file after the first:
        the caller's chance to let the machine breathe between slices of a big write)."""
        pending: list[Pending] = []
        writes: list[Future[None]] = []  # the pwrite of each pending file, in order
        dirs: set[str] = set()
        checked: set[str] = set()
        inflight: Future[None] | None = None
        publishing = False
        n_blocks = 0
        try:
            for i, (kind, key, parent, t0, t1) in enumerate(jobs):
                if pace is not None and i:
                    pace()
                # blocks and tails pack token rows [t0, t1); a checkpoint its one state row
                r0, r1 = (0, 1) if kind == KIND_CHECKPOINT else (t0, t1)
                hdr_size = fmt.block_header_size(layout, ns, t1 - t0)
                payload_len = kernel.packed_size(segs, r1 - r0)
                size = hdr_size + fmt.align(payload_len)
                final = self.index.path(ns, key, kind)
                folder = os.path.dirname(final)
                if folder not in checked:  # real folders only (never a symlink), made 0700
                    diskio.make_dirs(self.context.root, folder, dirs)
                    checked.add(folder)
                tmp = os.path.join(folder, f".{key.hex()}.{os.getpid()}.{threading.get_ident()}.tmp")
                # The whole file image is built in one page-aligned buffer (pack fused with
                # the hash, then the header) and written with one (direct where possible)
                # pwrite. Two buffers alternate: block i is written by the I/O helper
                # thread while block i+1 is packed here, so the disk never waits on the CPU.
                mv = memoryview(self.context.scratch(f"w{n_blocks % 2}", size))[:size]
                n_blocks += 1
                _, content_hash = kernel.pack(mv, hdr_size, segs, r0, r1, fmt.content_seed(key))
                mv[:hdr_size] = fmt.encode_block_header(
                    kind, key, parent, nsid, ns, layout, t0, t1, toks[t0:t1], content_hash, payload_len)
                mv[hdr_size + payload_len : size] = bytes(size - hdr_size - payload_len)
                if inflight is not None:
                    inflight.result()  # the other buffer is free again (or the write failed)
                fd = self._open_write(tmp)
                entry = Entry(kind, key, parent, ns, final, size, hdr_size, payload_len, content_hash,
                              t0, t1, layout, toks[t0:t1].copy(),
                              0.0)
                pending.append((fd, tmp, final, entry))
                dirs.add(folder)
                inflight = self._io_thread().submit(diskio.pwrite_full, fd, mv, 0)
                writes.append(inflight)
                if len(pending) >= _BATCH:
                    inflight.result()
                    inflight = None
                    publishing = True
                    self._publish(pending, written, durable)
                    publishing = False
                    pending.clear()
                    writes.clear()
            if inflight is not None:
                inflight.result()
                inflight = None
            publishing = True
            self._publish(pending, written, durable)
            if durable:
                for folder in sorted(dirs, key=len, reverse=True):  # a new folder before its parent
                    diskio.fsync_dir(folder)
        except BaseException as exc:
            if inflight is not None:  # never close or unlink under a running write
                wait([inflight])
            if not publishing and isinstance(exc, OSError):
                self._publish_landed(pending, writes, written, dirs, durable)
            for fd, tmp_name, _, _ in pending:
                if fd >= 0:
                    diskio.quiet(os.close, fd)
                if tmp_name is not None:
                    self.context.unlink(tmp_name)
            if not isinstance(exc, OSError):
                raise
            with self.context.lock:
                self.context.counters["write_failures"] += 1
            raise self.context.write_failed(exc, "block") from exc

    def _publish_landed(self, pending: list[Pending], writes: list[Future[None]], written: list[Entry],
                        dirs: set[str], durable: bool) -> None:
        """After a failed write: publish the files before it whose writes completed (a
        prefix of the chain, so it is usable); ``pending`` keeps what is left to clean."""
        n = 0
        while n < len(writes) and writes[n].done() and writes[n].exception() is None:
            n += 1
        if not n:
            return
        head = pending[:n]
        try:
            self._publish(head, written, durable)
            if durable:
                for folder in sorted(dirs, key=len, reverse=True):
                    diskio.fsync_dir(folder)
        except OSError:
            pass  # the cleanup below removes whatever was not renamed
        pending[:n] = head

    def _io_thread(self) -> ThreadPoolExecutor:
        with self.context.lock:
            if self._io_pool is None:
                self._io_pool = ThreadPoolExecutor(1, thread_name_prefix="mlxkv-write-io")
            return self._io_pool

    def _open_write(self, path: str) -> int:
        """A new temp file (O_EXCL, O_NOFOLLOW, 0600), page-cache bypass where possible."""
        fd = diskio.create(self.context.root, path)
        if self.direct_io and hasattr(kernel, "set_direct"):
            try:
                kernel.set_direct(fd, True, path=path)  # False (buffered) where unsupported
            except OSError:
                pass
        return fd

    @staticmethod
    def _publish(pending: list[Pending], written: list[Entry], durable: bool) -> None:
        """fsync, close and rename a batch of temp files (fsyncs batched so the disk
        writes them back together). Entries are updated in place so a failure midway
        leaves ``pending`` describing exactly what still needs cleaning up."""
        if durable:
            for fd, *_ in pending:
                diskio.fsync(fd)
        for i, (fd, tmp, final, entry) in enumerate(pending):
            os.close(fd)
            pending[i] = (-1, tmp, final, entry)
        for i, (_, tmp, final, entry) in enumerate(pending):
            assert tmp is not None  # every file of a batch is renamed here, once
            os.rename(tmp, final)
            entry.mtime = time.time()
            written.append(entry)
            pending[i] = (-1, None, final, entry)

    def _index_written(self, ns: str, written: list[Entry]) -> None:
        if not written:
            return
        stale: list[Entry] = []
        with self.context.lock:
            space = self.index.spaces.setdefault(ns, Space())
            for e in written:
                self.index.add(space, e)
                if e.kind == KIND_BLOCK:
                    self.context.counters["blocks_written"] += 1
                elif e.kind == KIND_CHECKPOINT:
                    self.context.counters["checkpoints_written"] += 1
                else:
                    self.context.counters["tails_written"] += 1
                    # a shorter tail on the same parent that this one extends is superseded
                    for t in list(space.tails.get(e.parent, {}).values()):
                        if t is not e and t.tokens.size < e.tokens.size and \
                                common(t.tokens, e.tokens) == t.tokens.size:
                            self.index.retire(t)
                            stale.append(t)
                            self.context.counters["tails_superseded"] += 1
                self.context.counters["bytes_written"] += e.file_size
        self.index.remove_retired(stale)
