"""Evaluated MLX arrays for a restore to fill, allocated without a zero fill.

A restore overwrites every byte it reports, so zero-filling its destinations first is
wasted work. MLX has no public "empty", but its ``.npy`` loader hands the array's own
buffer to the stream's ``readinto``: :func:`unfilled_arrays` gives it a stream that leaves
the data part as allocated, and on Linux pre-faults the pages (``MADV_POPULATE_WRITE``).
Callers rely only on the bytes they write. If MLX ever keeps a stream past
``RELEASE_TIMEOUT_S`` (a risk at interpreter exit), :func:`give_up_unfilled` switches to
:func:`zeroed_arrays` for the rest of the process.
"""

from __future__ import annotations

import ctypes
import io
import logging
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, BinaryIO, cast

import mlx.core as mx
import numpy as np

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

log = logging.getLogger("mlxkv.cache")

RELEASE_TIMEOUT_S = 10.0
_given_up: str | None = None  # why unfilled allocation is off for good (None: it is on)
_ORDER = "<" if sys.byteorder == "little" else ">"
_UINT = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}
_MADV_POPULATE_WRITE = 23  # Linux 5.14+
_MADV_HUGEPAGE = 14
_HUGE = 4 << 20  # buffers that hold at least one aligned 2 MiB page
_PAGE = 4096
_PREFAULT_MIN = 1 << 20  # smaller buffers: the syscall costs more than their faults
Madvise = Callable[[int, int, int], int]
_madvise: Madvise | bool | None = None  # libc madvise, False once unavailable


def memory_of(a: mx.array) -> memoryview:
    """A memoryview over an evaluated array's own buffer (no copy)."""
    return memoryview(a)  # type: ignore[arg-type]  # mlx's stubs omit the buffer protocol


def _libc_madvise() -> Madvise | None:
    global _madvise
    if _madvise is None:
        _madvise = False
        if sys.platform.startswith("linux"):
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                f = libc.madvise
                f.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                f.restype = ctypes.c_int
                _madvise = cast(Madvise, f)
            except (OSError, AttributeError):
                pass
    return _madvise if callable(_madvise) else None


def prefault(arrays: Sequence[mx.array], huge: bool = False) -> int:
    """Map the pages of these (evaluated, writable) arrays' buffers now, without writing
    them (``MADV_POPULATE_WRITE``); returns the bytes covered. A no-op where the kernel
    or the platform has no such call: the first write then faults them in as usual.
    ``huge``: ask for transparent huge pages first (``MADV_HUGEPAGE``) for buffers kept
    and rewritten for long (the KV arena): a restore into them then takes far fewer TLB
    misses."""
    global _madvise
    madvise = _libc_madvise()
    done = 0
    for a in arrays:
        if not madvise or a.nbytes < _PREFAULT_MIN:
            continue
        with memory_of(a) as mv:
            address = int(np.frombuffer(mv.cast("B"), dtype=np.uint8).ctypes.data)
        start = (address + _PAGE - 1) & ~(_PAGE - 1)
        end = (address + a.nbytes) & ~(_PAGE - 1)
        if end <= start:
            continue
        if huge and end - start >= _HUGE:
            madvise(start, end - start, _MADV_HUGEPAGE)  # a hint: refused or ignored is fine
        if madvise(start, end - start, _MADV_POPULATE_WRITE) == 0:
            done += end - start
            continue
        err = ctypes.get_errno()
        if err in (22, 38):  # EINVAL / ENOSYS: a kernel without it; stop asking
            _madvise, madvise = False, None
        # ENOMEM/EFAULT/EHWPOISON: the restore's writes fault (or fail) as they would anyway
    return done


class _Unfilled(io.RawIOBase):
    """An ``.npy`` stream: the header is real, reads of the data leave the buffer alone."""

    def __init__(self, header: bytes) -> None:
        super().__init__()
        self._header = header
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b: WriteableBuffer) -> int:  # b: a writable buffer over the array
        with memoryview(b) as mv:
            n = mv.nbytes
            if self._pos < len(self._header):
                k = min(n, len(self._header) - self._pos)
                mv.cast("B")[:k] = self._header[self._pos : self._pos + k]
                self._pos += k
                return k
        self._pos += n
        return n  # the array's data: deliberately not written

    def seek(self, pos: int, whence: int = 0) -> int:
        if whence != 0:
            raise io.UnsupportedOperation("only absolute seeks")
        self._pos = int(pos)
        return self._pos

    def tell(self) -> int:
        return self._pos


def npy_header(itemsize: int, shape: Sequence[int]) -> bytes:
    """A version 1.0 ``.npy`` header for an unsigned integer array of ``itemsize`` bytes."""
    code = "|u1" if itemsize == 1 else f"{_ORDER}u{itemsize}"
    dims = ", ".join(str(int(s)) for s in shape) + ("," if len(shape) == 1 else "")
    d = f"{{'descr': '{code}', 'fortran_order': False, 'shape': ({dims}), }}"
    pad = -(10 + len(d) + 1) % 64
    d = d + " " * pad + "\n"
    return b"\x93NUMPY\x01\x00" + len(d).to_bytes(2, "little") + d.encode("latin1")


def unfilled_arrays(shapes: Sequence[tuple[int, ...]], dtypes: Sequence[mx.Dtype],
                    populate: bool = True, huge: bool = False) -> list[mx.array]:
    """Evaluated arrays of these shapes/dtypes whose contents were never written
    (pre-faulted with :func:`prefault` when ``populate``).

    Each is loaded as the unsigned integer type of its item size and viewed as its dtype
    (a view shares the buffer). Raises ValueError for an item size it cannot load
    (callers fall back to :func:`zeroed_arrays`). Must run on the thread that owns MLX.
    """
    if len(shapes) != len(dtypes):
        raise ValueError(f"{len(shapes)} shapes but {len(dtypes)} dtypes")
    if not shapes:
        return []
    kinds = [_UINT.get(d.size) for d in dtypes]
    if any(k is None for k in kinds):
        raise ValueError("no unsigned integer type of that item size")
    files = [_Unfilled(npy_header(d.size, s)) for s, d in zip(shapes, dtypes)]
    released = threading.Event()
    left = [len(files)]
    lock = threading.Lock()

    def gone() -> None:  # runs on whichever thread drops a stream last (MLX's I/O pool)
        with lock:
            left[0] -= 1
            if left[0] == 0:
                released.set()

    for f in files:
        weakref.finalize(f, gone)
    try:
        raw = [_load_npy(f) for f in files]
    finally:
        del files, f  # after eval, MLX holds the only references
    try:
        mx.eval(raw)
        out = [a if a.dtype == d else a.view(d, stream=mx.cpu) for a, d in zip(raw, dtypes)]
        mx.eval(out)
    finally:
        del raw
        # wait with the GIL released: MLX's I/O threads need it to drop the streams
        if not released.wait(RELEASE_TIMEOUT_S):
            give_up_unfilled(f"MLX kept {left[0]} restore stream(s) for more than "
                             f"{RELEASE_TIMEOUT_S:.0f} s")
    if populate:
        prefault(out, huge)
    return out


def _load_npy(f: _Unfilled) -> mx.array:
    # a raw binary stream serves as a file; an .npy file holds one array
    return cast(mx.array, mx.load(cast(BinaryIO, f), format="npy", stream=mx.cpu))


def give_up_unfilled(reason: str) -> None:
    """Use zero-filled restore buffers from now on (once per process, one warning)."""
    global _given_up
    if _given_up is None:
        _given_up = reason
        log.warning("prefix cache: %s; restore buffers are zero-filled from now on", reason)


def unfilled_usable() -> bool:
    """Whether :func:`unfilled_arrays` may still be used (see :func:`give_up_unfilled`)."""
    return _given_up is None


def zeroed_arrays(shapes: Sequence[tuple[int, ...]], dtypes: Sequence[mx.Dtype]
                  ) -> list[mx.array]:
    """Evaluated zero-filled arrays (the fallback). Zeros are written as the unsigned
    type of the same size and viewed: filling bfloat16 directly is slower."""
    out = []
    for s, d in zip(shapes, dtypes):
        k = _UINT.get(d.size)
        out.append(mx.zeros(s, d) if k is None or d == mx.bool_
                   else mx.zeros(s, k).view(d))
    mx.eval(out)
    return out
