"""Disk and kernel helpers of the block store: the ``_blocks`` kernel (or its numpy
reference when the extension is not built), whole-buffer pread/pwrite, fsync, atomic
small-file writes, and the piece plan used by the pread restore path. No mlx."""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np
import xxhash

from storage.format import PAGE

try:  # the Cython kernel; the numpy reference stands in only when it is not built
    from storage import _blocks as K

    KERNEL = "cython"
except ImportError:  # pragma: no cover - exercised only on an unbuilt checkout
    from storage import reference as K

    KERNEL = "reference"


def aligned(nbytes: int) -> Any:
    if hasattr(K, "AlignedBuffer"):
        return K.AlignedBuffer(max(nbytes, PAGE))
    raw = np.empty(nbytes + PAGE, dtype=np.uint8)  # reference fallback: align by offset
    off = (-raw.ctypes.data) % PAGE
    return raw[off : off + nbytes]


def pwrite_full(fd: int, buf: Any, offset: int) -> None:
    if hasattr(K, "pwrite_full"):
        K.pwrite_full(fd, buf, offset)
        return
    mv = memoryview(buf).cast("B")
    while mv:
        n = os.pwrite(fd, mv, offset)
        mv, offset = mv[n:], offset + n


def pread_full(fd: int, buf: Any, offset: int) -> int:
    if hasattr(K, "pread_full"):
        return K.pread_full(fd, buf, offset)
    mv = memoryview(buf).cast("B")
    got = 0
    while got < len(mv):
        n = os.preadv(fd, [mv[got:]], offset + got)
        if n == 0:
            break
        got += n
    return got


def unpack_hash(src: Any, off: int, segs: list, t0: int, ntok: int, seed: int) -> tuple[int, int]:
    if hasattr(K, "unpack_hash"):
        return K.unpack_hash(src, off, segs, t0, ntok, seed)
    n = K.unpack(src, off, segs, t0, ntok)
    return n, K.xxh3_64(memoryview(src).cast("B")[off : off + n], seed)


def hasher(seed: int) -> Any:
    """Streaming XXH3-64 with ``update(buf)`` and ``digest() -> int``."""
    if hasattr(K, "Xxh3Hasher"):
        return K.Xxh3Hasher(seed)
    h = xxhash.xxh3_64(seed=seed)
    h.digest = h.intdigest  # type: ignore[method-assign]
    return h


CHUNK = 512 * 1024  # bytes moved per step: stays in L2, so each byte crosses DRAM once


def plan(segs: list, ntok: int, chunk: int = CHUNK) -> list[tuple[int, int, list]]:
    """Split a block's payload into pieces of about ``chunk`` bytes: (payload offset,
    nbytes, sub-segments). A piece is whole segments or a range of one segment's outer
    slices, so pack/unpack of a piece touches exactly its bytes of the payload."""
    pieces: list[tuple[int, int, list]] = []
    off = cur_off = cur_n = 0
    cur: list = []
    for buf, outer, t_cap, rb in segs:
        size = outer * ntok * rb
        if cur and cur_n + size > chunk:
            pieces.append((cur_off, cur_n, cur))
            cur, cur_n = [], 0
        if size > chunk and outer > 1:
            flat = memoryview(buf).cast("B") if memoryview(buf).format != "B" or \
                memoryview(buf).ndim != 1 else memoryview(buf)
            step = max(1, chunk // (ntok * rb))
            for o0 in range(0, outer, step):
                o1 = min(outer, o0 + step)
                sub = (flat[o0 * t_cap * rb : o1 * t_cap * rb], o1 - o0, t_cap, rb)
                pieces.append((off + o0 * ntok * rb, (o1 - o0) * ntok * rb, [sub]))
            off += size
            cur_off = off
            continue
        if not cur:
            cur_off = off
        cur.append((buf, outer, t_cap, rb))
        cur_n += size
        off += size
    if cur:
        pieces.append((cur_off, cur_n, cur))
    return pieces


def fsync(fd: int) -> None:
    (K.fsync if hasattr(K, "fsync") else os.fsync)(fd)


def fsync_dir(path: str) -> None:
    if hasattr(K, "fsync_dir"):
        K.fsync_dir(path)
        return
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def scandir(path: str) -> list[os.DirEntry]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except (FileNotFoundError, NotADirectoryError):
        return []


def quiet(fn: Any, *args: Any) -> int:
    """Call fn, ignoring OSError; 1 if it succeeded (for counting removals)."""
    try:
        fn(*args)
        return 1
    except OSError:
        return 0


_NOATIME = getattr(os, "O_NOATIME", 0)


def open_ro(path: str) -> int:
    """Open for reading without updating atime (a read would otherwise dirty the inode:
    10,000 journal updates on the first scan after a write)."""
    global _NOATIME
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC | _NOATIME)
    except PermissionError:
        if not _NOATIME:
            raise
        _NOATIME = 0  # only the owner (or root) may ask for O_NOATIME
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)


def make_dirs(d: str, to_sync: set[str]) -> None:
    """os.makedirs, noting the parents of every folder it creates in ``to_sync``: a new
    folder's entry is only durable once its parent is fsynced too."""
    missing = []
    p = d
    while not os.path.isdir(p):
        missing.append(p)
        p = os.path.dirname(p)
    if missing:
        os.makedirs(d, exist_ok=True)
        to_sync.update(os.path.dirname(m) for m in missing)


def atomic_write(path: str, data: bytes, durable: bool) -> None:
    """Write a small file atomically: temp name, write, fsync, rename, fsync folder(s)."""
    d = os.path.dirname(path)
    dirs = {d}
    make_dirs(d, dirs)
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        try:
            pwrite_full(fd, data, 0)
            if durable:
                fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)
    except BaseException:
        quiet(os.unlink, tmp)
        raise
    if durable:
        for p in sorted(dirs, key=len, reverse=True):
            fsync_dir(p)
