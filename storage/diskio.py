"""Disk and kernel helpers of the block store: the ``_blocks`` kernel (or its numpy
reference when the extension is not built), whole-buffer pread/pwrite, fsync, atomic
small-file writes, and the piece plan used by the pread restore path. No mlx.

Nothing here follows a symlink below the cache root or blocks on a FIFO: files are opened
with O_NOFOLLOW | O_NONBLOCK and must be regular (fstat), folders are created 0700 and
checked with lstat, files are created 0600 with O_EXCL, and a removal walks the folders
from the root with O_NOFOLLOW descriptors and unlinks only a regular file.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np
import xxhash

from mlxkv.storage import reference
from mlxkv.storage.format import PAGE
from mlxkv.storage.keys import BufferLike, Segment, view

if TYPE_CHECKING:  # the reference has a subset of the kernels: callers ask hasattr()
    from mlxkv.storage import _blocks as kernel

    KERNEL = "cython"
else:
    try:  # the Cython kernel; the numpy reference stands in only when it is not built
        from mlxkv.storage import _blocks as kernel

        KERNEL = "cython"
    except ImportError:  # pragma: no cover - exercised only on an unbuilt checkout
        from mlxkv.storage import reference as kernel

        KERNEL = "reference"


class PageBuffer(Protocol):
    """A page-aligned scratch buffer (``aligned``): the buffer protocol and its size."""

    @property
    def nbytes(self) -> int: ...

    def __buffer__(self, flags: int, /) -> memoryview: ...


def aligned(nbytes: int) -> PageBuffer:
    if hasattr(kernel, "AlignedBuffer"):
        return kernel.AlignedBuffer(max(nbytes, PAGE))
    raw = np.empty(nbytes + PAGE, dtype=np.uint8)  # reference fallback: align by offset
    off = (-raw.ctypes.data) % PAGE
    return raw[off : off + nbytes].data


def pwrite_full(fd: int, buf: BufferLike, offset: int) -> None:
    if hasattr(kernel, "pwrite_full"):
        kernel.pwrite_full(fd, buf, offset)
        return
    mv = view(buf).cast("B")
    while mv:
        n = os.pwrite(fd, mv, offset)
        mv, offset = mv[n:], offset + n


def pread_full(fd: int, buf: BufferLike, offset: int) -> int:
    if hasattr(kernel, "pread_full"):
        return kernel.pread_full(fd, buf, offset)
    mv = view(buf).cast("B")
    got = 0
    while got < len(mv):
        n = os.preadv(fd, [mv[got:]], offset + got)
        if n == 0:
            break
        got += n
    return got


def unpack_hash(src: BufferLike, off: int, segs: Sequence[Segment], t0: int, ntok: int,
                seed: int) -> tuple[int, int]:
    if hasattr(kernel, "unpack_hash"):
        return kernel.unpack_hash(src, off, segs, t0, ntok, seed)
    n = kernel.unpack(src, off, segs, t0, ntok)
    return n, kernel.xxh3_64(view(src).cast("B")[off : off + n], seed)


class _XxhashHasher:
    """The xxhash package's streaming state with the kernel hasher's interface."""

    def __init__(self, seed: int) -> None:
        self._state = xxhash.xxh3_64(seed=seed)

    def update(self, buf: BufferLike) -> None:
        self._state.update(view(buf))

    def digest(self) -> int:
        return self._state.intdigest()


if TYPE_CHECKING:  # the second only where the kernel is not built
    Hasher = kernel.Xxh3Hasher | _XxhashHasher


def hasher(seed: int) -> Hasher:
    """Streaming XXH3-64 with ``update(buf)`` and ``digest() -> int``."""
    if hasattr(kernel, "Xxh3Hasher"):
        return kernel.Xxh3Hasher(seed)
    return _XxhashHasher(seed)


def unpack_into(src: BufferLike, off: int, segs: Sequence[Segment], t0: int, ntok: int,
                into: Hasher) -> None:
    """``unpack``, feeding the bytes as they landed in the segments to ``into``."""
    if isinstance(into, _XxhashHasher):  # the kernel is the reference: it takes any hasher
        reference.unpack_hash(src, off, segs, t0, ntok, hasher=into)
    else:
        kernel.unpack_hash(src, off, segs, t0, ntok, hasher=into)


CHUNK = 512 * 1024  # bytes moved per step: stays in L2, so each byte crosses DRAM once


# (payload offset, nbytes, the segments or sub-segments whose rows it holds)
Piece = tuple[int, int, list[Segment]]


def plan(segs: Sequence[Segment], ntok: int, chunk: int = CHUNK) -> list[Piece]:
    """Split a block's payload into pieces of about ``chunk`` bytes: (payload offset,
    nbytes, sub-segments). A piece is whole segments or a range of one segment's outer
    slices, so pack/unpack of a piece touches exactly its bytes of the payload."""
    pieces: list[Piece] = []
    off = cur_off = cur_n = 0
    cur: list[Segment] = []
    for buf, outer, t_cap, row_bytes in segs:
        size = outer * ntok * row_bytes
        if cur and cur_n + size > chunk:
            pieces.append((cur_off, cur_n, cur))
            cur, cur_n = [], 0
        if size > chunk and outer > 1:
            flat = view(buf).cast("B") if view(buf).format != "B" or \
                view(buf).ndim != 1 else view(buf)
            step = max(1, chunk // (ntok * row_bytes))
            for o0 in range(0, outer, step):
                o1 = min(outer, o0 + step)
                sub = (flat[o0 * t_cap * row_bytes : o1 * t_cap * row_bytes], o1 - o0, t_cap, row_bytes)
                pieces.append((off + o0 * ntok * row_bytes, (o1 - o0) * ntok * row_bytes, [sub]))
            off += size
            cur_off = off
            continue
        if not cur:
            cur_off = off
        cur.append((buf, outer, t_cap, row_bytes))
        cur_n += size
        off += size
    if cur:
        pieces.append((cur_off, cur_n, cur))
    return pieces


def fsync(fd: int) -> None:
    (kernel.fsync if hasattr(kernel, "fsync") else os.fsync)(fd)


def fsync_dir(path: str) -> None:
    if hasattr(kernel, "fsync_dir"):
        kernel.fsync_dir(path)
        return
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def scandir(path: str, errors: dict[str, str] | None = None) -> list[os.DirEntry[str]]:
    """The entries of a folder; [] if it is gone, or unreadable (noted in ``errors``)."""
    try:
        with os.scandir(path) as it:
            return list(it)
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as exc:
        if errors is not None:
            errors[printable(path)] = f"cannot list: {exc.strerror or exc}"
        return []


def printable(path: str) -> str:
    """``path`` as text any terminal or JSON encoder accepts (undecodable bytes escaped)."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def quiet(fn: Callable[..., object], *args: object) -> int:
    """Call fn, ignoring OSError; 1 if it succeeded (for counting removals)."""
    try:
        fn(*args)
        return 1
    except OSError:
        return 0


_NOATIME = getattr(os, "O_NOATIME", 0)
NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
FILE_MODE = 0o600  # manifests hold the token ids of private conversations
DIR_MODE = 0o700
CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW | os.O_CLOEXEC


class NotAFile(OSError):
    """Something other than a regular file (a FIFO, socket, device or folder) where one of
    our files should be: never read, written or removed."""


def open_ro(path: str) -> int:
    """Open a regular file for reading: no symlink (O_NOFOLLOW), no wait on a FIFO
    (O_NONBLOCK, then fstat), and no atime update (a read would otherwise dirty the
    inode: a journal update per file on the first scan after a write)."""
    global _NOATIME
    flags = os.O_RDONLY | os.O_CLOEXEC | NOFOLLOW | _NONBLOCK
    try:
        fd = os.open(path, flags | _NOATIME)
    except PermissionError:
        if not _NOATIME:
            raise
        _NOATIME = 0  # only the owner (or root) may ask for O_NOATIME
        fd = os.open(path, flags)
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        os.close(fd)
        raise
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise NotAFile(errno.EINVAL, "not a regular file", path)
    return fd


def _parts(root: str, path: str) -> list[str]:
    rel = os.path.relpath(path, root)
    parts = [] if rel == "." else rel.split(os.sep)
    if parts[:1] == [os.pardir]:
        raise ValueError(f"{path} is not under {root}")
    return parts


def make_dirs(root: str, d: str, to_sync: set[str]) -> None:
    """Create the folders from ``root`` down to ``d`` (0700), each checked to be a real
    folder (not a symlink, not a file); notes in ``to_sync`` the parent of every folder
    created (its entry is only durable once that parent is fsynced too)."""
    p = root
    for part in _parts(root, d):
        parent, p = p, os.path.join(p, part)
        try:
            os.mkdir(p, DIR_MODE)
            to_sync.add(parent)
        except FileExistsError:
            pass
        if not stat.S_ISDIR(os.lstat(p).st_mode):
            raise OSError(errno.ENOTDIR, "not a folder of the cache (a file or a symlink is "
                          "in the way)", p)


def create(root: str, path: str, mode: int = FILE_MODE) -> int:
    """A new file ``path`` (O_EXCL: never an existing file, symlink or FIFO); a leftover
    regular file of that name (a temp name of a dead thread) is replaced once."""
    try:
        return os.open(path, CREATE, mode)
    except FileExistsError:
        unlink_under(root, path)
        return os.open(path, CREATE, mode)


def unlink_under(root: str, path: str) -> bool:
    """Remove the regular file ``path`` below ``root``, reaching it through O_NOFOLLOW
    folder descriptors (a symlinked folder on the way is never entered); False if it is
    gone, not a regular file, or cannot be removed."""
    try:
        parts = _parts(root, path)
    except ValueError:
        return False
    if not parts:
        return False
    try:
        fd = os.open(root, os.O_RDONLY | _DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        for part in parts[:-1]:
            nfd = os.open(part, os.O_RDONLY | _DIRECTORY | NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = nfd
        if not stat.S_ISREG(os.stat(parts[-1], dir_fd=fd, follow_symlinks=False).st_mode):
            return False
        os.unlink(parts[-1], dir_fd=fd)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def atomic_write(root: str, path: str, data: bytes, durable: bool) -> None:
    """Write a small file below ``root`` atomically: temp name, write, fsync, rename,
    fsync folder(s)."""
    d = os.path.dirname(path)
    dirs = {d}
    make_dirs(root, d, dirs)
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    fd = create(root, tmp)
    try:
        try:
            pwrite_full(fd, data, 0)
            if durable:
                fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)
    except BaseException:
        unlink_under(root, tmp)
        raise
    if durable:
        for p in sorted(dirs, key=len, reverse=True):
            fsync_dir(p)


__all__ = [
    "CHUNK",
    "CREATE",
    "DIR_MODE",
    "FILE_MODE",
    "KERNEL",
    "NOFOLLOW",
    "NotAFile",
    "PageBuffer",
    "Piece",
    "aligned",
    "atomic_write",
    "create",
    "fsync",
    "fsync_dir",
    "hasher",
    "kernel",
    "make_dirs",
    "open_ro",
    "plan",
    "pread_full",
    "printable",
    "pwrite_full",
    "quiet",
    "scandir",
    "unlink_under",
    "unpack_hash",
    "unpack_into",
]
