# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Storage hot path: block pack/unpack fused with XXH3-64, aligned buffers, file I/O.

Every loop over bytes and every syscall runs with the GIL released; the Python objects it
touches are pinned first (a held ``Py_buffer`` keeps its exporter alive and unresizable).
Contract: ``.cache/STORAGE_API.md``; pure-Python oracle: ``storage/reference.py``.
A *segment* is ``(buf, outer, t_capacity, row_bytes)``: a C-contiguous buffer of exactly
``outer * t_capacity * row_bytes`` bytes whose rows ``[t0, t1)`` of each outer slice are moved.

Beyond the contract: ``unpack_hash`` (scatter + hash in one pass, for verified restores),
``pack(..., hash=False)``, ``Xxh3Hasher`` (streaming), ``set_direct`` (toggle O_DIRECT /
F_NOCACHE on an open fd, e.g. for an unaligned tail), ``hash_isa``/``hash_isas``/
``set_hash_isa`` (which SIMD stripe loop runs; env ``MLXKV_XXH3_ISA``), and a ``path=``
keyword on the I/O calls that names the file in their OSError.
"""

import os

from cpython.buffer cimport (
    PyBUF_C_CONTIGUOUS,
    PyBUF_FORMAT,
    PyBUF_ND,
    PyBUF_STRIDES,
    PyBUF_WRITABLE,
    PyBuffer_Release,
    PyObject_GetBuffer,
)
from libc.errno cimport errno
from libc.stdint cimport uint8_t, uint64_t
from libc.stdlib cimport calloc, free
from libc.string cimport memcpy, memset, strerror
from posix.stdlib cimport posix_memalign

# Hash on the calling thread without dropping the GIL below this size: a GIL round trip
# costs more than hashing a small header.
cdef enum:
    _NOGIL_MIN = 16384
# Fused copies of at least this many bytes use non-temporal stores: such a block is bound
# for the disk (or for arrays bigger than the cache), so caching it only costs bandwidth.
cdef Py_ssize_t _STREAM_MIN = 8 << 20
STREAM_MIN_BYTES = _STREAM_MIN

_ISA_NAMES = {"scalar": MK_ISA_SCALAR, "sse2": MK_ISA_SSE2, "avx2": MK_ISA_AVX2,
              "avx512": MK_ISA_AVX512, "neon": MK_ISA_NEON}


# --------------------------------------------------------------------------- ISA choice

def hash_isas() -> list:
    """Stripe-loop implementations usable on this CPU (all give identical hashes)."""
    return [name for name, isa in _ISA_NAMES.items() if mk_isa_supported(isa)]


def hash_isa() -> str:
    """Name of the stripe loop in use."""
    for name, isa in _ISA_NAMES.items():
        if isa == mk_isa:
            return name
    return "?"


def set_hash_isa(str name) -> None:
    """Select a stripe loop by name (tests and benchmarks); 'best' picks the fastest."""
    cdef int isa = mk_best_isa() if name == "best" else _ISA_NAMES.get(name, -1)
    if isa < 0 or not mk_set_isa(isa):
        raise ValueError(f"hash ISA {name!r} is not available here; usable: {hash_isas()}")


_env_isa = os.environ.get("MLXKV_XXH3_ISA")
set_hash_isa(_env_isa if _env_isa else "best")


# --------------------------------------------------------------------------- buffers

cdef int _get_buffer(object obj, Py_buffer *view, bint writable, str what) except -1:
    """Acquire a C-contiguous byte view of obj, turning buffer refusals into ValueError."""
    cdef int flags = PyBUF_C_CONTIGUOUS
    if writable:
        flags |= PyBUF_WRITABLE
    try:
        PyObject_GetBuffer(obj, view, flags)
    except (BufferError, ValueError) as exc:
        raise ValueError(f"{what}: cannot use this buffer ({exc})") from None
    except TypeError:
        raise TypeError(f"{what}: object does not export a buffer: {type(obj).__name__}") from None
    return 0


cdef struct seg_t:
    char *ptr
    Py_ssize_t outer
    Py_ssize_t t_cap
    Py_ssize_t row_bytes


cdef class _Segments:
    """Pinned views of a segment list; releases whatever it acquired, even on error."""
    cdef Py_buffer *views
    cdef seg_t *segs
    cdef Py_ssize_t n
    cdef Py_ssize_t acquired

    def __cinit__(self, object segments, bint writable):
        cdef Py_ssize_t i
        cdef object outer, t_cap, row_bytes, buf
        segments = list(segments)
        self.n = len(segments)
        self.views = <Py_buffer *>calloc(self.n + 1, sizeof(Py_buffer))
        self.segs = <seg_t *>calloc(self.n + 1, sizeof(seg_t))
        if self.views == NULL or self.segs == NULL:
            raise MemoryError()
        for i in range(self.n):
            seg = segments[i]
            try:
                buf, outer, t_cap, row_bytes = seg
            except (TypeError, ValueError):
                raise ValueError(
                    f"segment {i}: expected (buf, outer, t_capacity, row_bytes), got {seg!r:.80}"
                ) from None
            outer, t_cap, row_bytes = int(outer), int(t_cap), int(row_bytes)
            if outer < 0 or t_cap < 0 or row_bytes < 0:
                raise ValueError(f"segment {i}: negative dimension ({outer}, {t_cap}, {row_bytes})")
            _get_buffer(buf, &self.views[i], writable, f"segment {i}")
            self.acquired = i + 1
            if outer * t_cap * row_bytes != self.views[i].len:
                raise ValueError(
                    f"segment {i}: buffer has {self.views[i].len} bytes, expected "
                    f"outer*t_capacity*row_bytes = {outer}*{t_cap}*{row_bytes} = "
                    f"{outer * t_cap * row_bytes}"
                )
            self.segs[i].ptr = <char *>self.views[i].buf
            self.segs[i].outer = outer
            self.segs[i].t_cap = t_cap
            self.segs[i].row_bytes = row_bytes

    def __dealloc__(self):
        cdef Py_ssize_t i
        for i in range(self.acquired):
            PyBuffer_Release(&self.views[i])
        free(self.views)
        free(self.segs)

    cdef Py_ssize_t check_range(self, Py_ssize_t t0, Py_ssize_t t1) except -1:
        """Validate rows [t0, t1) against every segment; return the packed byte count."""
        cdef Py_ssize_t i, total = 0
        if t0 < 0 or t1 < t0:
            raise ValueError(f"bad token range [{t0}, {t1})")
        for i in range(self.n):
            if t1 > self.segs[i].t_cap:
                raise ValueError(
                    f"segment {i}: token range [{t0}, {t1}) exceeds t_capacity {self.segs[i].t_cap}"
                )
            # Fits: outer*(t1-t0)*row_bytes <= outer*t_cap*row_bytes == the buffer's length.
            total += self.segs[i].outer * (t1 - t0) * self.segs[i].row_bytes
        return total

    cdef int check_disjoint(self, const char *p, Py_ssize_t n, str what) except -1:
        """Refuse a packed region that overlaps a segment (memcpy of overlaps is undefined)."""
        cdef Py_ssize_t i
        cdef const char *q
        if n == 0:
            return 0
        for i in range(self.n):
            q = self.segs[i].ptr
            if self.views[i].len and p < q + self.views[i].len and q < p + n:
                raise ValueError(f"{what} overlaps segment {i}")
        return 0


cdef class _Views:
    """Pinned C-contiguous views of a list of buffers, released on dealloc."""
    cdef Py_buffer *views
    cdef Py_ssize_t n
    cdef Py_ssize_t acquired

    def __cinit__(self, object bufs, bint writable, str what):
        cdef Py_ssize_t i
        bufs = list(bufs)
        self.n = len(bufs)
        self.views = <Py_buffer *>calloc(self.n + 1, sizeof(Py_buffer))
        if self.views == NULL:
            raise MemoryError()
        for i in range(self.n):
            _get_buffer(bufs[i], &self.views[i], writable, f"{what}[{i}]")
            self.acquired = i + 1

    def __dealloc__(self):
        cdef Py_ssize_t i
        for i in range(self.acquired):
            PyBuffer_Release(&self.views[i])
        free(self.views)


cdef inline int _check_flat(Py_ssize_t size, Py_ssize_t offset, Py_ssize_t need,
                            str what) except -1:
    if offset < 0 or offset > size or need > size - offset:
        raise ValueError(
            f"{what}: {need} bytes at offset {offset} do not fit in a buffer of {size} bytes"
        )
    return 0


# ------------------------------------------------------------------ the byte movers

cdef void _gather(seg_t *segs, Py_ssize_t n, Py_ssize_t t0, Py_ssize_t ntok, char *out,
                  mk_xxh3_state *st) noexcept nogil:
    """Copy rows [t0, t0+ntok) of every outer slice to out, hashing in the same pass."""
    cdef Py_ssize_t i, o, chunk, stride
    cdef char *src
    for i in range(n):
        chunk = ntok * segs[i].row_bytes
        if chunk == 0:
            continue
        stride = segs[i].t_cap * segs[i].row_bytes
        src = segs[i].ptr + t0 * segs[i].row_bytes
        for o in range(segs[i].outer):
            if st != NULL:
                mk_xxh3_update_copy(st, <uint8_t *>out, <const uint8_t *>src, <size_t>chunk)
            else:
                memcpy(out, src, <size_t>chunk)
            out += chunk
            src += stride


cdef void _scatter(seg_t *segs, Py_ssize_t n, Py_ssize_t t0, Py_ssize_t ntok, const char *inp,
                   mk_xxh3_state *st) noexcept nogil:
    """Copy packed bytes from inp into rows [t0, t0+ntok), hashing them in the same pass."""
    cdef Py_ssize_t i, o, chunk, stride
    cdef char *dst
    for i in range(n):
        chunk = ntok * segs[i].row_bytes
        if chunk == 0:
            continue
        stride = segs[i].t_cap * segs[i].row_bytes
        dst = segs[i].ptr + t0 * segs[i].row_bytes
        for o in range(segs[i].outer):
            if st != NULL:
                mk_xxh3_update_copy(st, <uint8_t *>dst, <const uint8_t *>inp, <size_t>chunk)
            else:
                memcpy(dst, inp, <size_t>chunk)
            inp += chunk
            dst += stride


def packed_size(segments, Py_ssize_t ntokens) -> int:
    """Bytes a block of ``ntokens`` tokens of these segments occupies when packed."""
    cdef Py_ssize_t total = 0
    if ntokens < 0:
        raise ValueError(f"ntokens must be >= 0, got {ntokens}")
    for i, seg in enumerate(segments):
        if len(seg) != 4:
            raise ValueError(f"segment {i}: expected (buf, outer, t_capacity, row_bytes)")
        total += int(seg[1]) * ntokens * int(seg[3])
    return total


def pack(dst, Py_ssize_t dst_offset, segments, Py_ssize_t t0, Py_ssize_t t1,
         uint64_t seed=0, *, bint hash=True) -> tuple:
    """Gather rows [t0, t1) of every segment into ``dst`` at ``dst_offset``, no padding.

    Returns ``(nbytes_written, xxh3_64(seed) of those bytes)``, the hash computed while
    copying. ``hash=False`` skips hashing and returns ``(nbytes, None)`` (benchmarks).
    Raises ValueError on any size or bounds mismatch before writing anything.
    """
    cdef _Segments segs = _Segments(segments, False)
    cdef Py_ssize_t total = segs.check_range(t0, t1)
    cdef Py_buffer out
    cdef mk_xxh3_state st
    cdef mk_xxh3_state *stp = &st if hash else NULL
    cdef uint64_t h = 0
    _get_buffer(dst, &out, True, "dst")
    try:
        _check_flat(out.len, dst_offset, total, "dst")
        segs.check_disjoint(<char *>out.buf + dst_offset, total, "dst")
        with nogil:
            mk_xxh3_init(&st, seed)
            st.nt_stores = total >= _STREAM_MIN
            _gather(segs.segs, segs.n, t0, t1 - t0, <char *>out.buf + dst_offset, stp)
            if hash:
                h = mk_xxh3_digest(&st)
    finally:
        PyBuffer_Release(&out)
    return (total, h if hash else None)


cdef Py_ssize_t _unpack(src, Py_ssize_t src_offset, segments, Py_ssize_t dst_t0,
                        Py_ssize_t ntokens, mk_xxh3_state *st) except -1:
    cdef _Segments segs = _Segments(segments, True)
    cdef Py_buffer inp
    if ntokens < 0:
        raise ValueError(f"ntokens must be >= 0, got {ntokens}")
    cdef Py_ssize_t total = segs.check_range(dst_t0, dst_t0 + ntokens)
    _get_buffer(src, &inp, False, "src")
    try:
        _check_flat(inp.len, src_offset, total, "src")
        segs.check_disjoint(<const char *>inp.buf + src_offset, total, "src")
        with nogil:
            _scatter(segs.segs, segs.n, dst_t0, ntokens, <const char *>inp.buf + src_offset, st)
    finally:
        PyBuffer_Release(&inp)
    return total


def unpack(src, Py_ssize_t src_offset, segments, Py_ssize_t dst_t0, Py_ssize_t ntokens) -> int:
    """Scatter a packed block from ``src`` into rows [dst_t0, dst_t0+ntokens) of each segment.

    Returns the number of bytes read. Segment buffers must be writable.
    """
    return _unpack(src, src_offset, segments, dst_t0, ntokens, NULL)


def unpack_hash(src, Py_ssize_t src_offset, segments, Py_ssize_t dst_t0, Py_ssize_t ntokens,
                uint64_t seed=0) -> tuple:
    """``unpack`` that also returns xxh3_64(seed) of the bytes it read, in one pass.

    For verify-on-restore: scatter into fresh buffers, then discard them if the hash differs.
    """
    cdef mk_xxh3_state st
    mk_xxh3_init(&st, seed)
    st.nt_stores = packed_size(segments, ntokens) >= _STREAM_MIN
    n = _unpack(src, src_offset, segments, dst_t0, ntokens, &st)
    return (n, mk_xxh3_digest(&st))


def xxh3_64(buf, uint64_t seed=0) -> int:
    """XXH3-64 of a C-contiguous buffer; equals ``xxhash.xxh3_64_intdigest(buf, seed)``."""
    cdef Py_buffer view
    cdef uint64_t h
    _get_buffer(buf, &view, False, "xxh3_64")
    try:
        if view.len < _NOGIL_MIN:
            h = mk_xxh3_64(view.buf, <size_t>view.len, seed)
        else:
            with nogil:
                h = mk_xxh3_64(view.buf, <size_t>view.len, seed)
    finally:
        PyBuffer_Release(&view)
    return h


# ------------------------------------------------------------------ aligned buffer

cdef char *_FORMAT_B = b"B"


cdef class AlignedBuffer:
    """Page-aligned bytes with the buffer protocol (1-D, format 'B', writable).

    Counts the views it has handed out and refuses ``resize``/``free`` while any is alive,
    so no memoryview, numpy array or in-flight kernel call can see freed memory.
    """

    def __cinit__(self, Py_ssize_t nbytes, Py_ssize_t alignment=4096, bint zero=False):
        if alignment < <Py_ssize_t>sizeof(void *) or (alignment & (alignment - 1)) != 0:
            raise ValueError(f"alignment must be a power of two >= {sizeof(void *)}, got {alignment}")
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        self._alignment = alignment
        self._zero = zero
        self._allocate(nbytes)

    cdef int _allocate(self, Py_ssize_t nbytes) except -1:
        """Allocate nbytes (rounded up to the alignment), copying the old contents over."""
        cdef void *p = NULL
        cdef size_t cap = <size_t>((nbytes + self._alignment - 1) // self._alignment * self._alignment)
        cdef size_t keep = <size_t>(nbytes if nbytes < self._nbytes else self._nbytes)
        if cap == 0:
            cap = <size_t>self._alignment
        if posix_memalign(&p, <size_t>self._alignment, cap) != 0 or p == NULL:
            raise MemoryError(f"cannot allocate {nbytes} bytes aligned to {self._alignment}")
        with nogil:
            if self._ptr != NULL and keep:
                memcpy(p, self._ptr, keep)
            if self._zero and cap > keep:
                memset(<char *>p + keep, 0, cap - keep)
        free(self._ptr)
        self._ptr = <char *>p
        self._nbytes = nbytes
        return 0

    def __dealloc__(self):
        free(self._ptr)
        self._ptr = NULL

    def __getbuffer__(self, Py_buffer *view, int flags):
        if self._ptr == NULL:
            raise BufferError("AlignedBuffer was freed")
        self._shape[0] = self._nbytes
        self._strides[0] = 1
        view.buf = self._ptr
        view.obj = self
        view.len = self._nbytes
        view.readonly = 0
        view.itemsize = 1
        view.format = _FORMAT_B if (flags & PyBUF_FORMAT) == PyBUF_FORMAT else NULL
        view.ndim = 1
        view.shape = self._shape if (flags & PyBUF_ND) == PyBUF_ND else NULL
        view.strides = self._strides if (flags & PyBUF_STRIDES) == PyBUF_STRIDES else NULL
        view.suboffsets = NULL
        view.internal = NULL
        self._exports += 1

    def __releasebuffer__(self, Py_buffer *view):
        self._exports -= 1

    def __len__(self) -> int:
        return self._nbytes

    def __repr__(self) -> str:
        return (f"AlignedBuffer(nbytes={self._nbytes}, alignment={self._alignment}, "
                f"exports={self._exports}{', freed' if self._ptr == NULL else ''})")

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def alignment(self) -> int:
        return self._alignment

    @property
    def address(self) -> int:
        return <size_t>self._ptr

    @property
    def exports(self) -> int:
        """Number of live buffer views (memoryviews, numpy arrays, kernel calls)."""
        return self._exports

    @property
    def freed(self) -> bool:
        return self._ptr == NULL

    def resize(self, Py_ssize_t nbytes) -> None:
        """Reallocate to nbytes, keeping the common prefix (new bytes zeroed if zero=True)."""
        if self._exports:
            raise BufferError(f"cannot resize an AlignedBuffer with {self._exports} live view(s)")
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        self._allocate(nbytes)

    def free(self) -> None:
        """Release the memory now; later views raise BufferError (resize reallocates)."""
        if self._exports:
            raise BufferError(f"cannot free an AlignedBuffer with {self._exports} live view(s)")
        free(self._ptr)
        self._ptr = NULL
        self._nbytes = 0


# ------------------------------------------------------------------ file I/O

cdef object _oserror(int err, object path):
    if path is None:
        return OSError(err, strerror(err).decode("utf-8", "replace"))
    return OSError(err, strerror(err).decode("utf-8", "replace"), os.fspath(path))


def pwrite_full(int fd, buf, long long offset, *, path=None) -> int:
    """Write all of ``buf`` at ``offset`` (retrying short writes and EINTR); returns its size.

    ``path`` only names the file in an OSError.
    """
    cdef Py_buffer view
    cdef int err = 0
    cdef long long n
    if offset < 0:
        raise ValueError(f"offset must be >= 0, got {offset}")
    _get_buffer(buf, &view, False, "pwrite_full")
    try:
        with nogil:
            n = mk_pwrite_full(fd, <const char *>view.buf, <size_t>view.len, offset, &err)
    finally:
        PyBuffer_Release(&view)
    if n < 0:
        raise _oserror(err, path)
    return n


def pread_full(int fd, buf, long long offset, *, path=None) -> int:
    """Fill ``buf`` from ``offset``; returns bytes read (fewer only at end of file)."""
    cdef Py_buffer view
    cdef int err = 0
    cdef long long n
    if offset < 0:
        raise ValueError(f"offset must be >= 0, got {offset}")
    _get_buffer(buf, &view, True, "pread_full")
    try:
        with nogil:
            n = mk_pread_full(fd, <char *>view.buf, <size_t>view.len, offset, &err)
    finally:
        PyBuffer_Release(&view)
    if n < 0:
        raise _oserror(err, path)
    return n


def pwritev_full(int fd, bufs, long long offset, *, path=None) -> int:
    """Write the buffers back to back at ``offset`` with vectored writes; returns the total."""
    cdef _Views pinned
    cdef iovec *iov = NULL
    cdef Py_ssize_t i
    cdef int err = 0
    cdef long long n
    if offset < 0:
        raise ValueError(f"offset must be >= 0, got {offset}")
    pinned = _Views(bufs, False, "pwritev_full")
    if pinned.n > 0x7FFFFFFF:
        raise ValueError("too many buffers")
    iov = <iovec *>calloc(pinned.n + 1, sizeof(iovec))
    if iov == NULL:
        raise MemoryError()
    try:
        for i in range(pinned.n):
            iov[i].iov_base = pinned.views[i].buf
            iov[i].iov_len = <size_t>pinned.views[i].len
        with nogil:
            n = mk_pwritev_full(fd, iov, <int>pinned.n, offset, &err)
    finally:
        free(iov)
    if n < 0:
        raise _oserror(err, path)
    return n


def fsync(int fd, *, path=None) -> None:
    """fsync(2), GIL released."""
    cdef int r, err = 0
    with nogil:
        r = mk_fsync(fd)
        if r < 0:
            err = errno
    if r < 0:
        raise _oserror(err, path)


def fdatasync(int fd, *, path=None) -> None:
    """fdatasync(2) (fsync where the OS lacks it), GIL released."""
    cdef int r, err = 0
    with nogil:
        r = mk_fdatasync(fd)
        if r < 0:
            err = errno
    if r < 0:
        raise _oserror(err, path)


def fsync_dir(path) -> None:
    """fsync a directory so renames and unlinks inside it are durable."""
    cdef bytes bpath = os.fsencode(path)
    cdef const char *cpath = bpath
    cdef int r, err = 0
    with nogil:
        r = mk_fsync_dir(cpath, &err)
    if r < 0:
        raise _oserror(err, path)


def open_direct(path, int flags, int mode=0o644, *, bint direct=True) -> tuple:
    """open(2) and bypass the page cache where possible (O_DIRECT / F_NOCACHE).

    Returns ``(fd, is_direct)``; ``is_direct`` is False when the filesystem refused (or
    ``direct=False``), in which case the fd is plain buffered. Direct fds need aligned
    buffers, offsets and lengths (use AlignedBuffer; see ``set_direct`` for a tail).
    """
    cdef bytes bpath = os.fsencode(path)
    cdef const char *cpath = bpath
    cdef int fd, is_direct = 0, err = 0
    with nogil:
        fd = mk_open_direct(cpath, flags, mode, direct, &is_direct, &err)
    if fd < 0:
        raise _oserror(err, path)
    return (fd, bool(is_direct))


def set_direct(int fd, bint on, *, path=None) -> bool:
    """Turn page-cache bypass on/off for an open fd; False if the filesystem cannot."""
    cdef int r, err = 0
    r = mk_set_direct(fd, on, &err)
    if r < 0:
        raise _oserror(err, path)
    return bool(r)


def drop_cache(int fd, *, path=None) -> bool:
    """Ask the OS to drop fd's cached clean pages (fsync first); False where unsupported."""
    cdef int r, err = 0
    with nogil:
        r = mk_drop_cache(fd, &err)
    if r < 0:
        raise _oserror(err, path)
    return bool(r)



# ------------------------------------------------------------------ streaming hasher

cdef class Xxh3Hasher:
    """Streaming XXH3-64: ``update`` any number of buffers, ``digest`` any time.

    ``digest()`` equals ``xxh3_64`` of the concatenated input (the packer uses the same
    state to hash rows while it copies them).
    """
    cdef mk_xxh3_state st

    def __cinit__(self, uint64_t seed=0):
        mk_xxh3_init(&self.st, seed)

    def update(self, buf) -> None:
        cdef Py_buffer view
        _get_buffer(buf, &view, False, "Xxh3Hasher.update")
        try:
            if view.len < _NOGIL_MIN:
                mk_xxh3_update(&self.st, <const uint8_t *>view.buf, <size_t>view.len)
            else:
                # Another thread could call update on this object meanwhile; the state is not
                # locked, so (as with hashlib objects) share one hasher per thread only.
                with nogil:
                    mk_xxh3_update(&self.st, <const uint8_t *>view.buf, <size_t>view.len)
        finally:
            PyBuffer_Release(&view)

    def digest(self) -> int:
        return mk_xxh3_digest(&self.st)

    @property
    def length(self) -> int:
        """Bytes fed so far."""
        return self.st.total_len
