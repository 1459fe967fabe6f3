"""Cold restores: a block file that is not in the page cache is read with ``O_DIRECT``.

Through the page cache a cold read costs the kernel a page allocation, an LRU insertion
and a copy to user space per 4 KiB, on the CPU that also has to verify and scatter the
block. Read direct, the device writes straight into a page-aligned staging buffer and
that work disappears. The payload is read in windows of ``WINDOW`` bytes, two at a time
(double-buffered on a small pool of disk threads, which wait with the GIL released),
so the disk reads window k+1 while window k is scattered into the destination and
hashed there (``kernel.unpack_hash``), exactly as the buffered path does piece by piece.

Whether a file is cold is asked of the kernel without reading it: ``mincore`` over a
read-only mapping of its payload's last pages (never touched, so neither a fault nor a
readahead; a probing read would itself pull the page in). Warm files (just restored, or
read by someone else) keep the buffered path, which copies from memory.
Where the filesystem refuses ``O_DIRECT`` (tmpfs, some network filesystems) or an
aligned read fails with EINVAL, the store falls back to buffered reads for good.

Opt-in (``BlockStore(direct_reads=True)``): where the page cache's readahead reads
sequential files at least as fast as O_DIRECT, the buffered path (readahead asked ahead
of the blocks being verified, ``preadv`` straight into the destination rows) is the
better default. The destinations themselves (MLX buffers) are not page-aligned, so
O_DIRECT can never land in them without staging.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import sys
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from mlxkv.storage import diskio
from mlxkv.storage.diskio import PageBuffer, Piece, kernel
from mlxkv.storage.entries import Entry
from mlxkv.storage.format import PAGE

if TYPE_CHECKING:
    from mlxkv.storage.diskio import Hasher

WINDOW = 4 << 20  # bytes per direct read
MIN_DIRECT = 1 << 20  # smaller payloads: the buffered path is as fast
FALLBACK = "fallback"  # _read_direct's answer when direct reads cannot be used here

_PROBE_PAGES = 4  # the payload's last pages asked about
_libc: ctypes.CDLL | bool | None = None  # False: mincore cannot be asked here


def _mincore_fns() -> ctypes.CDLL | None:
    global _libc
    if _libc is None:
        _libc = False
        if sys.platform.startswith("linux"):
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                libc.mmap.restype = ctypes.c_void_p
                libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                      ctypes.c_int, ctypes.c_int, ctypes.c_long]
                libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
                libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
                _libc = libc
            except (OSError, AttributeError):
                pass
    return _libc if isinstance(_libc, ctypes.CDLL) else None


def is_cold(fd: int, e: Entry) -> bool:
    """Whether none of the last pages of ``e``'s payload is in the page cache (asked
    with mincore, without reading); False where that cannot be told."""
    libc = _mincore_fns()
    if not libc or e.payload_len < MIN_DIRECT or not hasattr(kernel, "set_direct"):
        return False
    end = e.payload_offset + e.payload_len
    start = max(e.payload_offset, (end - 1) // PAGE * PAGE - (_PROBE_PAGES - 1) * PAGE)
    length = end - start
    addr = libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, start)
    if addr is None or addr == ctypes.c_void_p(-1).value:
        return False
    try:
        vec = ctypes.create_string_buffer((length + PAGE - 1) // PAGE)
        if libc.mincore(addr, length, vec) != 0:
            return False
        return not any(b & 1 for b in vec.raw)
    finally:
        libc.munmap(addr, length)


# (page-aligned payload offset, aligned length, the pieces inside)
Window = tuple[int, int, list[Piece]]


def windows(plan: list[Piece], limit: int = WINDOW) -> list[Window]:
    """Group a block's pieces (``diskio.plan``) into page-aligned payload windows of at
    most about ``limit`` bytes: (aligned start, aligned length, pieces inside)."""
    out: list[Window] = []
    cur: list[Piece] = []
    start = 0
    for piece in plan:
        off, n, _ = piece
        if cur and _align_up(off + n) - start > limit:
            last_off, last_n, _ = cur[-1]
            out.append((start, _align_up(last_off + last_n) - start, cur))
            cur = []
        if not cur:
            start = off // PAGE * PAGE
        cur.append(piece)
    if cur:
        last_off, last_n, _ = cur[-1]
        out.append((start, _align_up(last_off + last_n) - start, cur))
    return out


def _align_up(n: int) -> int:
    return (n + PAGE - 1) // PAGE * PAGE


class DirectReader:
    """The direct read path of a store (see the module docstring)."""

    def __init__(self, scratch: Callable[[str, int], PageBuffer], threads: int = 2) -> None:
        self._scratch = scratch  # (name, nbytes) -> a page-aligned buffer of this thread
        self._threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self.usable = True  # False once the filesystem refused direct reads
        self.reads = 0  # blocks read direct

    def pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="mlxkv-read-disk")
        return self._pool

    def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def read(self, e: Entry, plan: list[Piece], t0: int, ntok: int, hasher: Hasher) -> str | None:
        """Read ``e``'s payload direct, scatter and hash it piece by piece into ``hasher``:
        None (read whole), a reason (a short read: truncated), or FALLBACK (use the
        buffered path; nothing was scattered)."""
        try:
            fd = diskio.open_ro(e.path)
        except OSError:
            return FALLBACK  # the buffered path reports it
        try:
            try:
                if not kernel.set_direct(fd, True, path=e.path):
                    self.usable = False
                    return FALLBACK
            except OSError:
                self.usable = False
                return FALLBACK
            return self._stream(fd, e, windows(plan), t0, ntok, hasher)
        finally:
            os.close(fd)

    def _stream(self, fd: int, e: Entry, wins: list[Window], t0: int, ntok: int,
                hasher: Hasher) -> str | None:
        size = max(n for _, n, _ in wins)
        bufs = [self._scratch("d0", size), self._scratch("d1", size)]
        pool = self.pool()

        def submit(i: int) -> Future[int]:
            start, n, _ = wins[i]
            window = memoryview(bufs[i % 2])[:n]
            return pool.submit(diskio.pread_full, fd, window, e.payload_offset + start)

        fut: Future[int] | None = submit(0)
        scattered = False
        try:
            for i, (start, _, pieces) in enumerate(wins):
                try:
                    got = fut.result() if fut is not None else 0
                except OSError as exc:
                    if exc.errno == errno.EINVAL and not scattered:
                        self.usable = False  # alignment refused: buffered from now on
                        return FALLBACK
                    raise
                fut = submit(i + 1) if i + 1 < len(wins) else None
                last_off, last_n, _ = pieces[-1]
                if got < last_off + last_n - start:
                    return f"truncated payload ({e.payload_offset + start + got} bytes)"
                with memoryview(bufs[i % 2]) as mv:
                    for off, _, sub in pieces:
                        diskio.unpack_into(mv, off - start, sub, t0, ntok, hasher)
                scattered = True
        finally:
            if fut is not None:
                try:
                    fut.result()  # never leave a read writing into a buffer we reuse
                except OSError:
                    pass
        self.reads += 1
        return None
