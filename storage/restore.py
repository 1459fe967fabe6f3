"""Restores of the block store: every block verified against its content hash while it is
scattered into the caller's buffers; a vanished or unreadable file is a miss (left alone),
a corrupt one (read whole, and wrong) is removed.

A restore streams each file in L2-sized pieces: with preadv straight into the
destination rows where rows run long enough (the kernel's copy out of the page cache is
the only copy; each piece is hashed right after it landed; one kernel call per block,
``_blocks.preadv_hash``, does every read and hash with the GIL released), else with pread into an
L2-sized staging buffer (read, scatter, hash),
``read_threads`` blocks at a time (blocks land in disjoint rows), asking the OS for the
next files' pages ahead (posix_fadvise WILLNEED, ~96 MiB ahead of the blocks being
verified). With ``BlockStore(direct_reads=True)`` a file that is not in the page cache is
read with O_DIRECT instead, double-buffered, into aligned staging buffers
(``storage.direct``, which says why that is not the default). Files are never mapped: a file
truncated or failing under a mapping raises SIGBUS, which would kill the process; under
pread it is a short read or an error, so a miss.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from mlxkv.storage import diskio
from mlxkv.storage import format as fmt
from mlxkv.storage.context import StoreContext
from mlxkv.storage.direct import FALLBACK, DirectReader, is_cold
from mlxkv.storage.diskio import CHUNK, Piece, kernel
from mlxkv.storage.entries import Entry
from mlxkv.storage.format import KIND_CHECKPOINT, FormatError, Layout, LayoutLike, make_layout
from mlxkv.storage.index import Index
from mlxkv.storage.keys import Match, Restore, Segment, check_segments, view

if TYPE_CHECKING:
    from mlxkv.storage.diskio import Hasher

log = logging.getLogger("mlxkv.storage")

# a block to restore: its entry, the first destination row, the rows it fills
ReadJob = tuple[Entry, int, int]


@dataclass
class ReadPlans:
    """What one restore computed once per row count and reuses for every block: the
    pieces of a block (``diskio.plan``) and whether the kernel scatters straight into the
    destinations (``_scatterable``)."""

    pieces: dict[int, list[Piece]] = field(default_factory=dict)
    scatter: dict[int, bool] = field(default_factory=dict)


_READ_AHEAD = 8  # blocks whose pages are requested ahead of the one being verified
_AHEAD_BYTES = 96 << 20  # payload asked of the OS ahead of the blocks being verified


class Reader:
    """The read path of a block store: ``get_blocks`` and ``get_checkpoint`` of what
    ``index`` holds, ``read_threads`` blocks at a time; ``direct_reads``: cold files are
    read with O_DIRECT (``storage.direct``)."""

    def __init__(self, context: StoreContext, index: Index, read_threads: int,
                 direct_reads: bool) -> None:
        self.context = context
        self.index = index
        self.read_threads = read_threads
        self.direct_reads = direct_reads
        self._pool: ThreadPoolExecutor | None = None  # verifies+scatters blocks in parallel
        self.direct: DirectReader | None = None  # made on the first direct read

    def close(self) -> None:
        """Stop the helper threads (they restart on demand)."""
        with self.context.lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        if self.direct is not None:
            self.direct.close()

    def get_blocks(
        self, ns: str, tokens: npt.ArrayLike, layout: LayoutLike, segments: Sequence[Segment],
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
            m = self.index.lookup(ns, tokens, n_tokens)
        segs = check_segments(layout, segments, m.n_tokens, writable=True)
        block_len = self.context.block_tokens
        done = nread = n_blocks = corrupt = missing = 0
        jobs: list[ReadJob] = []
        row, dropped = 0, False
        ents = self.index.entries_of(ns, m)
        for i, e in enumerate(ents):
            if e is None:  # dropped from the index since the lookup
                dropped = True
                break
            # the last entry of a match with a tail part: a tail, or a block used in part
            last = m.tail_key is not None and m.tail_tokens and i == len(ents) - 1
            ntok = m.tail_tokens if last else block_len
            jobs.append((e, row, ntok))
            row += ntok
        plans = ReadPlans()
        if self.read_threads > 1 and len(jobs) > 1:
            # Blocks scatter into disjoint rows, so several are verified at once: a restore
            # is what the engine waits on, and one core cannot reach the memory bandwidth.
            # The disk is kept busy ahead of them: starting job i asks the OS for the pages
            # of job i + ahead (the first ones are asked for here), ~_AHEAD_BYTES in flight.
            ahead = max(self.read_threads, min(len(jobs), _AHEAD_BYTES // max(
                1, max(e.payload_len for e, _, _ in jobs))))
            for e, _, _ in jobs[:ahead]:
                self._advise(e)
            results = list(self._read_pool().map(
                lambda ij: self._read_job(ij[1], layout, segs, plans,
                                          jobs[ij[0] + ahead][0] if ij[0] + ahead < len(jobs)
                                          else None), enumerate(jobs)))
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
            n_blocks += 1
            nread += e.payload_len
        if dropped and done == row:
            missing += 1
        self._count_read(done > 0, n_blocks, nread)
        if done:
            with self.context.lock:
                self.index.touch(ns, m.block_keys[: done // block_len],
                            m.tail_key if done == m.n_tokens else None)
        return Restore(done, m.n_tokens, n_blocks, nread, corrupt, missing)

    def get_checkpoint(self, ns: str, match: Match, layout: LayoutLike,
                       segments: Sequence[Segment]) -> Restore:
        """Restore the checkpoint ``match`` (from lookup_checkpoint) into ``segments``
        ((buf, outer, 1, row_bytes) each), verified; n_tokens is 0 if it is gone/corrupt."""
        if match.checkpoint_key is None:
            raise ValueError("not a checkpoint match (use lookup_checkpoint)")
        layout = make_layout(layout)
        segs = check_segments(layout, segments, 1, writable=True)
        with self.context.lock:
            space = self.index.spaces.get(ns)
            e = space.find_child(match.checkpoint_key) if space is not None else None
        res = None if e is None else self._read_job((e, 0, 1), layout, segs, ReadPlans())
        ok = res is True
        nread = e.payload_len if ok and e is not None else 0
        self._count_read(ok, int(ok), nread)
        if ok and e is not None:
            with self.context.lock:
                self.index.touch(ns, (), e.key)
        return Restore(match.n_tokens if ok else 0, match.n_tokens, int(ok), nread,
                       int(res is False), int(res is None))

    def _count_read(self, hit: bool, blocks: int, nbytes: int) -> None:
        with self.context.lock:
            self.context.counters["blocks_read"] += blocks
            self.context.counters["bytes_read"] += nbytes
            self.context.counters["hits" if hit else "misses"] += 1

    # ------------------------------------------------------------------ one block
    def _read_job(self, job: ReadJob, layout: Layout, segs: list[Segment],
                  plans: ReadPlans, advise: Entry | None = None) -> bool | None:
        """True (verified and scattered), False (corrupt: removed) or None (vanished).
        ``advise``: a later block whose pages the OS is asked for now."""
        e, t0, ntok = job
        if advise is not None:
            self._advise(advise)
        fd = self._open(e, prefetch=advise is None)
        if fd == -1:
            return None
        try:
            return self._read_verified(e, fd, layout, segs, t0, ntok, plans)
        except OSError as exc:
            self._unreadable(e, exc)
            return None
        finally:
            os.close(fd)

    def _read_sequential(self, jobs: list[ReadJob], layout: Layout, segs: list[Segment],
                         plans: ReadPlans) -> list[bool | None]:
        """One block after another, asking the OS for the next ones' pages meanwhile."""
        out: list[bool | None] = []
        fds: list[int | None] = [None] * len(jobs)  # -1: the file had vanished
        try:
            for i, (e, t0, ntok) in enumerate(jobs):
                for j in range(i, min(len(jobs), i + 1 + _READ_AHEAD)):
                    if fds[j] is None:
                        fds[j] = self._open(jobs[j][0], prefetch=True)
                fd = fds[i]
                assert fd is not None  # opened by the loop above
                if fd == -1:
                    out.append(None)
                    break
                ok: bool | None
                try:
                    ok = self._read_verified(e, fd, layout, segs, t0, ntok, plans)
                except OSError as exc:
                    self._unreadable(e, exc)
                    ok = None
                os.close(fd)
                fds[i] = None
                out.append(ok)
                if not ok:
                    break
        finally:
            for fd in fds:
                if fd is not None and fd >= 0:
                    diskio.quiet(os.close, fd)
        return out

    def _read_pool(self) -> ThreadPoolExecutor:
        with self.context.lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.read_threads,
                                                 thread_name_prefix="mlxkv-read-io")
            return self._pool

    def _open(self, e: Entry, prefetch: bool = False) -> int:
        try:
            fd = diskio.open_ro(e.path)
        except FileNotFoundError:  # evicted by another process: a miss
            with self.context.lock:
                self.index.drop(e)
                self.context.counters["vanished"] += 1
            return -1
        except OSError as exc:  # unreadable, or no longer a regular file: a miss
            self._unreadable(e, exc)
            return -1
        if prefetch and hasattr(os, "posix_fadvise") and not self._goes_direct(fd, e):
            # start reading the next block from disk while this one is verified/unpacked
            diskio.quiet(os.posix_fadvise, fd, 0, 0, os.POSIX_FADV_WILLNEED)
        return fd

    def _advise(self, e: Entry) -> None:
        """Ask the OS to start reading ``e``'s pages (unless it will be read direct)."""
        if not hasattr(os, "posix_fadvise"):
            return
        try:
            fd = diskio.open_ro(e.path)
        except OSError:
            return  # the read itself reports it
        try:
            if not self._goes_direct(fd, e):
                diskio.quiet(os.posix_fadvise, fd, 0, 0, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)

    def _direct_reader(self) -> DirectReader:
        with self.context.lock:
            if self.direct is None:
                self.direct = DirectReader(self.context.scratch)
            return self.direct

    def _goes_direct(self, fd: int, e: Entry) -> bool:
        """Whether ``e`` will be read with O_DIRECT: direct reads on, and the file cold."""
        return self.direct_reads and self._direct_reader().usable and \
            is_cold(fd, e)

    def _unreadable(self, e: Entry, exc: OSError) -> None:
        """A file that cannot be read is a miss: dropped from the index until the next
        scan, never removed (a read error is not proof of damage)."""
        self.context.leave(e.path, f"{exc.strerror or exc}")
        self.context.warn_once(f"read:{exc.errno}", "mlxkv cache: cannot read %s: %s (a miss; "
                        "the file is left alone)", diskio.printable(e.path), exc.strerror or exc)
        with self.context.lock:
            self.index.drop(e)
            self.context.counters["read_errors"] += 1

    def _read_verified(self, e: Entry, fd: int, layout: Layout, segs: list[Segment], t0: int,
                       ntok: int, plans: ReadPlans) -> bool:
        """Read, verify and scatter one block/tail into rows [t0, t0+ntok) of segs
        (OSError if the file cannot be read).

        Full entries stream in L2-sized pieces (read, hash, scatter); the hash is checked
        at the end, so on a mismatch the rows written are garbage and not reported.
        """
        size = os.fstat(fd).st_size
        if size < e.file_size:
            reason: str | None = f"truncated file ({size} of {e.file_size} bytes)"
        elif ntok != (1 if e.kind == KIND_CHECKPOINT else e.t1 - e.t0):
            reason = self._read_tail_prefix(e, fd, layout, segs, t0, ntok)
        else:
            reason = self._read_pieces(e, fd, layout, segs, t0, ntok, plans)
        if reason is not None:
            self._remove_corrupt(e, reason)
            return False
        return True

    def _read_pieces(self, e: Entry, fd: int, layout: Layout, segs: list[Segment], t0: int,
                     ntok: int, plans: ReadPlans) -> str | None:
        """Stream L2-sized pieces with pread (read, scatter, hash the scattered bytes while
        they are in cache); a short read is a reason."""
        direct = self._goes_direct(fd, e)  # (asked before the header read caches pages)
        header_buf = self.context.scratch("h", e.payload_offset)
        with memoryview(header_buf) as head_view:
            got = diskio.pread_full(fd, head_view[: e.payload_offset], 0)
            reason = self._check_header(e, head_view[:got], layout)
        if reason is None:
            plan = plans.pieces.get(ntok)
            if plan is None:
                plan = plans.pieces[ntok] = diskio.plan(segs, ntok)
            if direct:
                hasher = diskio.hasher(fmt.content_seed(e.key))
                reason = self._direct_reader().read(e, plan, t0, ntok, hasher)
                if reason != FALLBACK:
                    if reason is None and hasher.digest() != e.content_hash:
                        reason = "content hash mismatch"
                    return reason
                reason = None
            scatter = plans.scatter.get(ntok)  # the segments are the restore's own
            if scatter is None:
                scatter = plans.scatter[ntok] = _scatterable(segs, ntok)
            if scatter and hasattr(kernel, "preadv_hash"):
                # one call reads and hashes every piece of the block with the GIL released
                got, digest = kernel.preadv_hash(fd, e.payload_offset, segs, t0, ntok,
                                            fmt.content_seed(e.key), CHUNK, path=e.path)
                if got < e.payload_len:
                    return f"truncated payload ({e.payload_offset + got} bytes)"
                return None if digest == e.content_hash else "content hash mismatch"
            hasher = diskio.hasher(fmt.content_seed(e.key))
            if scatter:
                reason = _read_scattered(fd, e, plan, t0, ntok, hasher)
                if reason is None and hasher.digest() != e.content_hash:
                    reason = "content hash mismatch"
                return reason
            stage = self.context.scratch("r", 2 * CHUNK)
            mv = memoryview(stage)
            for off, n, sub in plan:
                if n > len(mv):
                    mv = memoryview(self.context.scratch("r", n))
                got = diskio.pread_full(fd, mv[:n], e.payload_offset + off)
                if got < n:
                    reason = f"truncated payload ({e.payload_offset + off + got} bytes)"
                    break
                # Hash what landed in the destination, not the staging copy: a faulty
                # scatter then fails the block instead of restoring wrong KV.
                diskio.unpack_into(mv, 0, sub, t0, ntok, hasher)
            mv.release()
            if reason is None and hasher.digest() != e.content_hash:
                reason = "content hash mismatch"
        return reason

    def _read_tail_prefix(self, e: Entry, fd: int, layout: Layout, segs: list[Segment], t0: int,
                          ntok: int) -> str | None:
        """Verify a whole tail (or a block a prompt ends inside), then scatter only its
        first ntok rows: the content hash covers the whole payload."""
        buf = self.context.scratch("t", e.file_size)
        with memoryview(buf) as mv:
            got = diskio.pread_full(fd, mv[: e.file_size], 0)
            reason = self._check_header(e, mv[: min(got, e.payload_offset)], layout)
            if reason is None and got < e.payload_offset + e.payload_len:
                reason = f"truncated ({got} of {e.file_size} bytes)"
            pay = mv[e.payload_offset : e.payload_offset + e.payload_len]
            if reason is None and kernel.xxh3_64(pay, fmt.content_seed(e.key)) != e.content_hash:
                reason = "content hash mismatch"
            if reason is None:
                src, off, full = [], 0, e.t1 - e.t0
                for spec in layout:
                    n = spec.outer * full * spec.row_bytes
                    src.append((pay[off : off + n], spec.outer, full, spec.row_bytes))
                    off += n
                tmp = self.context.scratch("p", kernel.packed_size(src, ntok))
                kernel.pack(tmp, 0, src, 0, ntok)
                kernel.unpack(tmp, 0, segs, t0, ntok)
            pay.release()
        return reason

    def _check_header(self, e: Entry, head: memoryview, layout: Layout) -> str | None:
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

    def _remove_corrupt(self, e: Entry, reason: str) -> None:
        """A verified mismatch (read whole, and wrong): the file is removed."""
        if self.context.unlink(e.path):
            log.warning("mlxkv cache: removed corrupt %s %s: %s", fmt.KIND_NAMES[e.kind],
                        diskio.printable(e.path), reason)
        with self.context.lock:
            self.index.drop(e)
            self.context.counters["corrupt_removed"] += 1


_IOV = 512  # destination ranges per preadv call (IOV_MAX is 1024 on Linux and macOS)
_MIN_RUN = 16 << 10  # rows of one outer slice per block at least this long: kernel scatter


def _scatterable(segs: list[Segment], ntok: int) -> bool:
    """Whether the kernel should scatter a warm block straight into ``segs`` (preadv into
    the destination rows): every run of rows long enough that a system call per few of
    them costs less than the copy it saves, and no two destinations overlapping."""
    if not hasattr(os, "preadv") or any(ntok * row_bytes < _MIN_RUN for _, _, _, row_bytes in segs):
        return False
    spans = []
    for buf, outer, t_cap, row_bytes in segs:
        with view(buf) as mv:
            flat = mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
            spans.append((int(np.frombuffer(flat, dtype=np.uint8).ctypes.data) if flat.nbytes
                          else 0, outer * t_cap * row_bytes))
    spans.sort()
    return all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:]))


def _read_scattered(fd: int, e: Entry, plan: list[Piece], t0: int, ntok: int,
                    hasher: Hasher) -> str | None:
    """Read a warm block with preadv straight into its destination rows (the kernel's copy
    out of the page cache is the only one), hashing each piece's rows right after they
    landed (still in cache), in payload order: ``_blocks.preadv_hash`` in Python, for the
    numpy reference kernel, which lacks it."""
    for off, _, sub in plan:
        runs: list[memoryview] = []
        for buf, outer, t_cap, row_bytes in sub:
            mv = view(buf)
            flat = mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
            for o in range(outer):
                start = (o * t_cap + t0) * row_bytes
                runs.append(flat[start : start + ntok * row_bytes])
        pos = e.payload_offset + off
        for i in range(0, len(runs), _IOV):
            group = runs[i : i + _IOV]
            want = sum(r.nbytes for r in group)
            got = _preadv_full(fd, group, pos)
            if got < want:
                return f"truncated payload ({pos + got} bytes)"
            pos += want
            for r in group:
                hasher.update(r)
    return None


def _preadv_full(fd: int, runs: list[memoryview], offset: int) -> int:
    """preadv until every run is full or the file ends; the bytes read."""
    done = 0
    while runs:
        n = os.preadv(fd, runs, offset + done)
        if n <= 0:
            break
        done += n
        while runs and n >= runs[0].nbytes:
            n -= runs[0].nbytes
            runs = runs[1:]
        if runs and n:
            runs = [runs[0][n:], *runs[1:]]
    return done
