# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Storage hot path: block pack/unpack fused with XXH3-64, aligned buffers, file I/O.

Every loop over bytes and every syscall runs with the GIL released; the Python objects it
touches are pinned first (a held ``Py_buffer`` keeps its exporter alive and unresizable).
Pure-Python oracle, with the same signatures and errors: ``storage/reference.py``.
A *segment* is ``(buf, outer, t_capacity, row_bytes)``: a C-contiguous buffer of exactly
``outer * t_capacity * row_bytes`` bytes whose rows ``[t0, t1)`` of each outer slice are moved.
Buffers must be C-contiguous; a strided view is refused even when its exporter ignores the
request for contiguous memory (MLX hands out sliced and broadcast arrays that way).

Besides ``pack``/``unpack``/``xxh3_64``/``AlignedBuffer`` and the I/O calls:
``unpack_hash`` (scatter, then hash what landed, for verified restores; ``hasher=`` for a
block restored in pieces), ``preadv_hash`` (a block read from a file straight into its rows
and hashed there, piece by piece, in one call), ``pack(..., hash=False)``, ``Xxh3Hasher`` (streaming, shareable
by threads), ``set_direct`` (toggle O_DIRECT / F_NOCACHE on an open fd, e.g. for an
unaligned tail), ``hash_isa``/``hash_isas``/``set_hash_isa``/``hash_self_check`` (which
SIMD stripe loop runs; env ``MLXKV_XXH3_ISA``), and a ``path=`` keyword on the I/O calls
that names the file in their OSError.
The selected stripe loop passes a known-answer test at import; if it fails, the scalar loop
runs instead and one warning is logged (``mlxkv.storage``).
"""

import logging
import os

from cpython.buffer cimport (
    PyBUF_C_CONTIGUOUS,
    PyBUF_FORMAT,
    PyBUF_ND,
    PyBUF_STRIDES,
    PyBUF_WRITABLE,
    PyBuffer_IsContiguous,
    PyBuffer_Release,
    PyObject_GetBuffer,
)
from cpython.pythread cimport (
    NOWAIT_LOCK,
    WAIT_LOCK,
    PyThread_acquire_lock,
    PyThread_allocate_lock,
    PyThread_free_lock,
    PyThread_release_lock,
    PyThread_type_lock,
)
from cpython.pyport cimport PY_SSIZE_T_MAX
from libc.errno cimport errno
from libc.stdint cimport uint8_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free, qsort
from libc.string cimport memcmp, memcpy, memset
from posix.stdlib cimport posix_memalign

_log = logging.getLogger("mlxkv.storage")

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
    cdef int cur = mk_get_isa()
    for name, isa in _ISA_NAMES.items():
        if isa == cur:
            return name
    return "?"


# Known answers: XXH3-64 of _kat_byte(0..n-1) with seed 0 and seed _KAT_SEED, from the
# xxhash package (tests/test_blocks.py recomputes them). Lengths reach every short path, a
# partial and a full 1 KiB block (scramble) and several 16 KiB split-copy chunks.
_KAT_SEED = 0x9E3779B97F4A7C15
_KAT = (
    (0, 0x2d06800538d394c2, 0x602b0e2cd6662c8b),
    (7, 0xe6f7770846c47df5, 0xea8f3a28ed450ba5),
    (16, 0x81e9eb8634460bb9, 0x7f7f704e06138a8a),
    (200, 0xe07bfbc15015bf69, 0x835addcc5ee1d8d4),
    (241, 0x2d431e984c441f15, 0x67e2cf13c7452cbc),
    (1025, 0x83cba9b371e4e7f4, 0x18c39aa411c5deb2),
    (4159, 0x262f67471c89c1e9, 0x086b9aa87fe206bf),
    (70001, 0x401c3408c59b310c, 0x19855626e8c0ba55),
)
cdef size_t _KAT_MAX = 70001
# Streaming splits: uneven on purpose, so buffered and direct stripes both run.
cdef size_t[7] _KAT_SPLITS = [1, 63, 64, 65, 255, 257, 4097]


cdef inline uint8_t _kat_byte(size_t i) noexcept nogil:
    return <uint8_t>((<uint32_t>(i * <size_t>0x9E3779B1u)) >> 24)


cdef struct kat_fail_t:
    int kind  # 0 one-shot, 1 streaming, 2 fused copy, 3 fused non-temporal copy, 4 copy+verify
    size_t offset
    uint64_t got
    bint bytes_differ


cdef bint _kat_vector(int isa, size_t n, uint64_t seed, uint64_t expect, uint8_t *src,
                      uint8_t *dst, kat_fail_t *fail) noexcept nogil:
    """Every way the kernel hashes n known bytes with loop `isa`; False (and *fail) on the
    first mismatch."""
    cdef size_t i, off, pos, k, split
    cdef int mode
    cdef mk_xxh3_state st
    fail.bytes_differ = False
    for off in range(0, 64, 31):  # one-shot at offsets 0, 31, 62: unaligned starts too
        for i in range(n):
            src[off + i] = _kat_byte(i)
        fail.kind, fail.offset = 0, off
        fail.got = mk_xxh3_64_isa(isa, src + off, n, seed)
        if fail.got != expect:
            return False
    # src + 62 holds the bytes now; streaming and the copies read them from there.
    mk_xxh3_init_isa(&st, seed, isa)
    pos = split = 0
    while pos < n:
        k = min(n - pos, _KAT_SPLITS[split % 7])
        mk_xxh3_update(&st, src + 62 + pos, k)
        pos += k
        split += 1
    fail.kind, fail.offset, fail.got = 1, 62, mk_xxh3_digest(&st)
    if fail.got != expect:
        return False
    # The copying paths (fused copy + hash with cached and with non-temporal stores, and
    # copy then hash the destination: unpack_hash), to an aligned and an unaligned dst.
    for mode in range(3):
        for off in range(0, 16, 8):
            memset(dst, 0, n + 64)
            mk_xxh3_init_isa(&st, seed, isa)
            st.nt_stores = mode == 1
            k = n // 3
            if mode == 2:
                mk_xxh3_copy_verify(&st, dst + off, src + 62, k)
                mk_xxh3_copy_verify(&st, dst + off + k, src + 62 + k, n - k)
            else:
                mk_xxh3_update_copy(&st, dst + off, src + 62, k)
                mk_xxh3_update_copy(&st, dst + off + k, src + 62 + k, n - k)
            fail.kind, fail.offset, fail.got = 2 + mode, off, mk_xxh3_digest(&st)
            fail.bytes_differ = memcmp(dst + off, src + 62, n) != 0
            if fail.got != expect or fail.bytes_differ:
                return False
    return True


_KAT_KINDS = ("one-shot", "streaming", "fused copy+hash", "fused copy+hash, non-temporal",
              "copy, then hash the destination")


cdef str _self_check(int isa, uint64_t tamper):
    """Known-answer test of stripe loop `isa`; None if it passes, else what failed.

    ``tamper`` is XORed into every expected hash: nonzero only in tests, to fail on purpose.
    """
    cdef void *mem = NULL
    cdef uint8_t *src
    cdef size_t n
    cdef uint64_t seed, expect
    cdef bint ok
    cdef kat_fail_t fail
    if posix_memalign(&mem, 64, 2 * (_KAT_MAX + 128)) != 0 or mem == NULL:
        raise MemoryError()
    src = <uint8_t *>mem
    try:
        for n, h0, h1 in _KAT:
            for seed, expect in ((0, h0), (_KAT_SEED, h1)):
                expect ^= tamper
                with nogil:
                    ok = _kat_vector(isa, n, seed, expect, src, src + _KAT_MAX + 128, &fail)
                if not ok:
                    what = "bytes differ" if fail.bytes_differ else f"{fail.got:#x} != {expect:#x}"
                    return (f"{_KAT_KINDS[fail.kind]}, {n} bytes at offset {fail.offset}, "
                            f"seed {seed:#x}: {what}")
    finally:
        free(mem)
    return None


def hash_self_check(name: str | None = None) -> str | None:
    """Run the known-answer test on stripe loop ``name`` (default: the one in use).

    Returns None when every vector matches, else a description of the first mismatch.
    """
    name = hash_isa() if name is None else name
    if name not in hash_isas():
        raise ValueError(f"hash ISA {name!r} is not available here; usable: {hash_isas()}")
    return _self_check(_ISA_NAMES[name], 0)


_warned = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        _log.warning(message)


def set_hash_isa(name: str, *, tamper: int = 0) -> str:
    """Select a stripe loop by name ('best' picks the fastest); returns the loop now in use.

    The loop must pass the known-answer test first; if it does not, the scalar loop is
    selected and one warning is logged. Hashes already under way finish with the loop they
    started with. ``tamper`` is for tests only: XORed into the expected hashes of ``name``'s
    check (not the scalar fallback's), it makes that check fail on purpose.
    """
    cdef int isa = mk_best_isa() if name == "best" else _ISA_NAMES.get(name, -1)
    if isa < 0 or not mk_isa_supported(isa):
        raise ValueError(f"hash ISA {name!r} is not available here; usable: {hash_isas()}")
    failed = _self_check(isa, tamper)
    if failed is not None:
        chosen = [k for k, v in _ISA_NAMES.items() if v == isa][0]
        if isa == MK_ISA_SCALAR:
            _warn_once("scalar", f"XXH3 self-check failed on the scalar hash loop ({failed}); "
                                 "stored blocks may fail verification")
        else:
            _warn_once(chosen, f"XXH3 self-check failed on the {chosen} hash loop ({failed}); "
                               "using the scalar loop instead")
            if _self_check(MK_ISA_SCALAR, 0) is not None:
                _warn_once("scalar", "XXH3 self-check failed on the scalar hash loop too; "
                                     "stored blocks may fail verification")
            isa = MK_ISA_SCALAR
    mk_set_isa(isa)
    return hash_isa()


def _select_at_import() -> None:
    """The fastest verified loop, or the one MLXKV_XXH3_ISA names (never raises)."""
    env = os.environ.get("MLXKV_XXH3_ISA")
    if env and env != "best":
        try:
            set_hash_isa(env)
            return
        except ValueError:
            _warn_once("env", f"MLXKV_XXH3_ISA={env!r} is not usable here (usable: "
                              f"{', '.join(hash_isas())}); using the fastest loop")
    set_hash_isa("best")


_select_at_import()


# --------------------------------------------------------------------------- buffers

cdef int _get_buffer(object obj, Py_buffer *view, bint writable, str what) except -1:
    """Acquire a C-contiguous byte view of obj, turning buffer refusals into ValueError.

    The request asks for strides, so an exporter that honours it refuses a strided array
    itself; one that ignores it (MLX: sliced and broadcast arrays report len = nbytes over
    strided memory) is caught by checking the view we got against its shape and strides.
    """
    cdef int flags = PyBUF_C_CONTIGUOUS
    if writable:
        flags |= PyBUF_WRITABLE
    try:
        PyObject_GetBuffer(obj, view, flags)
    except (BufferError, ValueError) as exc:
        raise ValueError(f"{what}: cannot use this buffer ({exc})") from None
    except TypeError:
        raise TypeError(f"{what}: object does not export a buffer: {type(obj).__name__}") from None
    problem = _view_problem(view, writable)
    if problem is not None:
        PyBuffer_Release(view)
        raise ValueError(f"{what}: cannot use this buffer ({type(obj).__name__}: {problem})")
    return 0


cdef str _view_problem(Py_buffer *view, bint writable):
    """Why a view the exporter handed out cannot be read as view.len flat bytes, or None."""
    cdef Py_ssize_t i
    if writable and view.readonly:
        return "buffer is read-only"
    if view.len < 0 or view.itemsize < 0 or view.ndim < 0:
        return f"negative length ({view.len}), itemsize ({view.itemsize}) or ndim ({view.ndim})"
    if view.shape != NULL:
        n = view.itemsize  # a Python int: a lying shape must not overflow the check
        for i in range(view.ndim):
            if view.shape[i] < 0:
                return f"negative shape {[view.shape[j] for j in range(view.ndim)]}"
            n *= view.shape[i]
        if n != view.len:
            return (f"shape {[view.shape[j] for j in range(view.ndim)]} x itemsize "
                    f"{view.itemsize} = {n} bytes, but it reports {view.len}")
    if not PyBuffer_IsContiguous(view, b'C'):
        shape = [view.shape[i] for i in range(view.ndim)] if view.shape != NULL else None
        strides = [view.strides[i] for i in range(view.ndim)] if view.strides != NULL else None
        return f"not C-contiguous: shape {shape}, strides {strides}, itemsize {view.itemsize}"
    return None


cdef struct seg_t:
    char *ptr
    Py_ssize_t outer
    Py_ssize_t t_cap
    Py_ssize_t row_bytes


cdef struct span_t:
    char *ptr
    char *end
    Py_ssize_t index


cdef int _cmp_span(const void *a, const void *b) noexcept nogil:
    cdef char *x = (<const span_t *>a).ptr
    cdef char *y = (<const span_t *>b).ptr
    return -1 if x < y else (1 if x > y else 0)


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
            if max(outer, t_cap, row_bytes) > PY_SSIZE_T_MAX:
                raise ValueError(f"segment {i}: dimension too large ({outer}, {t_cap}, {row_bytes})")
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
        if writable:
            self.check_segments_disjoint()

    cdef int check_segments_disjoint(self) except -1:
        """Refuse destinations that share bytes: the later scatter would overwrite the
        earlier one after its bytes were verified."""
        cdef Py_ssize_t i, j, k
        cdef span_t *spans = <span_t *>calloc(self.n + 1, sizeof(span_t))
        if spans == NULL:
            raise MemoryError()
        try:
            k = 0
            for i in range(self.n):
                if self.views[i].len:
                    spans[k].ptr = self.segs[i].ptr
                    spans[k].end = self.segs[i].ptr + self.views[i].len
                    spans[k].index = i
                    k += 1
            qsort(spans, <size_t>k, sizeof(span_t), _cmp_span)
            for j in range(1, k):
                if spans[j].ptr < spans[j - 1].end:
                    raise ValueError(f"segment {spans[j].index} overlaps segment "
                                     f"{spans[j - 1].index} (destinations must be disjoint)")
        finally:
            free(spans)
        return 0

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


# ------------------------------------------------------------------ streaming hasher

cdef class Xxh3Hasher:
    """Streaming XXH3-64: ``update`` any number of buffers, ``digest`` any time.

    ``digest()`` equals ``xxh3_64`` of the concatenated input; the stripe loop is the one
    selected when the hasher was made. Safe to share between threads (as hashlib objects
    are): calls on one hasher run one at a time, large updates with the GIL released.
    """
    cdef mk_xxh3_state st
    cdef PyThread_type_lock lock

    def __cinit__(self, uint64_t seed=0):
        self.lock = PyThread_allocate_lock()
        if self.lock == NULL:
            raise MemoryError()
        mk_xxh3_init(&self.st, seed)

    def __dealloc__(self):
        if self.lock != NULL:
            PyThread_free_lock(self.lock)

    cdef int _lock(self) except -1:
        if not PyThread_acquire_lock(self.lock, NOWAIT_LOCK):
            with nogil:  # the holder may need the GIL to finish
                PyThread_acquire_lock(self.lock, WAIT_LOCK)
        return 0

    cdef void _unlock(self) noexcept:
        PyThread_release_lock(self.lock)

    def update(self, buf) -> None:
        cdef Py_buffer view
        _get_buffer(buf, &view, False, "Xxh3Hasher.update")
        try:
            self._lock()
            try:
                if view.len < _NOGIL_MIN:
                    mk_xxh3_update(&self.st, <const uint8_t *>view.buf, <size_t>view.len)
                else:
                    with nogil:
                        mk_xxh3_update(&self.st, <const uint8_t *>view.buf, <size_t>view.len)
            finally:
                self._unlock()
        finally:
            PyBuffer_Release(&view)

    def digest(self) -> int:
        cdef uint64_t h
        self._lock()
        h = mk_xxh3_digest(&self.st)
        self._unlock()
        return h

    @property
    def length(self) -> int:
        """Bytes fed so far."""
        cdef uint64_t n
        self._lock()
        n = self.st.total_len
        self._unlock()
        return n


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
    """Copy packed bytes from inp into rows [t0, t0+ntok); with st, hash what landed.

    The hash reads the destination, piece by piece right after copying it (still in L1),
    never the source: a faulty copy then fails verification instead of passing it.
    """
    cdef Py_ssize_t i, o, chunk, stride
    cdef char *dst
    for i in range(n):
        chunk = ntok * segs[i].row_bytes
        if chunk == 0:
            continue
        stride = segs[i].t_cap * segs[i].row_bytes
        dst = segs[i].ptr + t0 * segs[i].row_bytes
        for o in range(segs[i].outer):
            if st == NULL:
                memcpy(dst, inp, <size_t>chunk)
            else:
                mk_xxh3_copy_verify(st, <uint8_t *>dst, <const uint8_t *>inp, <size_t>chunk)
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
    if ntokens < 0:
        raise ValueError(f"ntokens must be >= 0, got {ntokens}")
    cdef _Segments segs = _Segments(segments, True)
    cdef Py_buffer inp
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

    Returns the number of bytes read. Segment buffers must be writable and disjoint.
    """
    return _unpack(src, src_offset, segments, dst_t0, ntokens, NULL)


def unpack_hash(src, Py_ssize_t src_offset, segments, Py_ssize_t dst_t0, Py_ssize_t ntokens,
                uint64_t seed=0, *, Xxh3Hasher hasher=None) -> tuple:
    """``unpack``, then xxh3_64(seed) of the bytes as they landed in the segments.

    For verify-on-restore: scatter into fresh buffers, then discard them if the hash differs.
    Returns ``(nbytes, hash)``; it equals the hash of the packed bytes read iff every byte
    was copied right. With ``hasher`` (a block restored in pieces), the destination bytes
    are fed to it instead (``seed`` is then unused) and the hash is ``hasher.digest()``.
    """
    cdef mk_xxh3_state st
    if hasher is None:
        mk_xxh3_init(&st, seed)
        n = _unpack(src, src_offset, segments, dst_t0, ntokens, &st)
        return (n, mk_xxh3_digest(&st))
    hasher._lock()
    try:
        n = _unpack(src, src_offset, segments, dst_t0, ntokens, &hasher.st)
        return (n, mk_xxh3_digest(&hasher.st))
    finally:
        hasher._unlock()


cdef long long _read_piece(int fd, long long off, iovec *iov, iovec *work, int cnt,
                           mk_xxh3_state *st, int *err) noexcept nogil:
    """preadv one piece into its rows, then hash what landed (still in cache); the bytes read
    (short only at end of file: then only those are hashed) or -1."""
    cdef int k
    cdef long long got, left
    cdef size_t m
    memcpy(work, iov, <size_t>cnt * sizeof(iovec))  # mk_preadv_full consumes its vectors
    got = mk_preadv_full(fd, work, cnt, off, err)
    if got < 0:
        return -1
    left = got
    for k in range(cnt):
        if left <= 0:
            break
        m = iov[k].iov_len if <long long>iov[k].iov_len <= left else <size_t>left
        mk_xxh3_update(st, <const uint8_t *>iov[k].iov_base, m)
        left -= <long long>m
    return got


cdef long long _preadv_rows(int fd, long long off, seg_t *segs, Py_ssize_t n, Py_ssize_t t0,
                            Py_ssize_t ntok, Py_ssize_t piece, iovec *iov, iovec *work,
                            int max_iov, mk_xxh3_state *st, int *err) noexcept nogil:
    """Read a packed block (payload order: segment by segment, outer slice by outer slice)
    straight into rows [t0, t0+ntok), piece by piece; the bytes read or -1."""
    cdef Py_ssize_t i, o, chunk, stride
    cdef char *dst
    cdef int cnt = 0
    cdef long long want = 0, done = 0, got
    for i in range(n):
        chunk = ntok * segs[i].row_bytes
        if chunk == 0:
            continue
        stride = segs[i].t_cap * segs[i].row_bytes
        dst = segs[i].ptr + t0 * segs[i].row_bytes
        for o in range(segs[i].outer):
            iov[cnt].iov_base = dst
            iov[cnt].iov_len = <size_t>chunk
            cnt += 1
            want += chunk
            dst += stride
            if cnt == max_iov or want >= piece:
                got = _read_piece(fd, off + done, iov, work, cnt, st, err)
                if got < 0:
                    return -1
                done += got
                if got < want:
                    return done
                cnt, want = 0, 0
    if cnt:
        got = _read_piece(fd, off + done, iov, work, cnt, st, err)
        if got < 0:
            return -1
        done += got
    return done


def preadv_hash(int fd, long long offset, segments, Py_ssize_t dst_t0, Py_ssize_t ntokens,
                uint64_t seed=0, Py_ssize_t piece=512 * 1024, *, path=None) -> tuple:
    """Read a packed block at ``offset`` of ``fd`` straight into rows [dst_t0, dst_t0+ntokens)
    of each segment with preadv (the kernel's copy out of the page cache is the only copy),
    in pieces of about ``piece`` bytes, each hashed from the destination right after it
    landed (still in cache), all with the GIL released.

    Returns ``(nbytes_read, xxh3_64(seed) of those bytes as they landed)``: ``unpack_hash``
    of the bytes at ``offset``; fewer bytes than the packed size only at end of file.
    Segment buffers must be writable and disjoint; ``path`` only names the file in an OSError.
    """
    if offset < 0:
        raise ValueError(f"offset must be >= 0, got {offset}")
    if ntokens < 0:
        raise ValueError(f"ntokens must be >= 0, got {ntokens}")
    if piece <= 0:
        raise ValueError(f"piece must be > 0, got {piece}")
    cdef _Segments segs = _Segments(segments, True)
    segs.check_range(dst_t0, dst_t0 + ntokens)
    cdef int max_iov = IOV_MAX if IOV_MAX < 512 else 512
    cdef iovec *iov = <iovec *>calloc(2 * <size_t>max_iov, sizeof(iovec))
    cdef mk_xxh3_state st
    cdef long long got
    cdef int err = 0
    if iov == NULL:
        raise MemoryError()
    try:
        with nogil:
            mk_xxh3_init(&st, seed)
            got = _preadv_rows(fd, offset, segs.segs, segs.n, dst_t0, ntokens, piece, iov,
                               iov + max_iov, max_iov, &st, &err)
    finally:
        free(iov)
    if got < 0:
        raise _oserror(err, path)
    return (got, mk_xxh3_digest(&st))


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
    so no memoryview, numpy array or in-flight kernel call can see freed memory. A resize
    copies with the GIL released; meanwhile the buffer is marked busy, and other threads'
    ``resize``/``free``/new views are refused (BufferError) instead of racing the copy.
    """

    def __cinit__(self, Py_ssize_t nbytes, Py_ssize_t alignment=4096, bint zero=False):
        if alignment < <Py_ssize_t>sizeof(void *) or (alignment & (alignment - 1)) != 0:
            raise ValueError(f"alignment must be a power of two >= {sizeof(void *)}, got {alignment}")
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        self._alignment = alignment
        self._zero = zero
        self._allocate(nbytes)

    cdef int _check_idle(self, str action) except -1:
        if self._busy:
            raise BufferError(f"cannot {action} an AlignedBuffer while another thread resizes it")
        return 0

    cdef int _allocate(self, Py_ssize_t nbytes) except -1:
        """Allocate nbytes (rounded up to the alignment), copying the old contents over.

        Called with the GIL held and no views alive; the old pointer is pinned in a local
        and the buffer marked busy before the GIL is dropped for the copy.
        """
        cdef void *p = NULL
        cdef char *old = self._ptr
        cdef size_t cap, keep
        cdef bint zero = self._zero
        self._check_idle("resize")
        if nbytes > PY_SSIZE_T_MAX - self._alignment:
            raise MemoryError(f"cannot allocate {nbytes} bytes aligned to {self._alignment}")
        cap = <size_t>((nbytes + self._alignment - 1) // self._alignment * self._alignment)
        keep = <size_t>(nbytes if nbytes < self._nbytes else self._nbytes) if old != NULL else 0
        if cap == 0:
            cap = <size_t>self._alignment
        if posix_memalign(&p, <size_t>self._alignment, cap) != 0 or p == NULL:
            raise MemoryError(f"cannot allocate {nbytes} bytes aligned to {self._alignment}")
        self._busy = True
        with nogil:
            if keep:
                memcpy(p, old, keep)
            if zero and cap > keep:
                memset(<char *>p + keep, 0, cap - keep)
        self._ptr = <char *>p
        self._nbytes = nbytes
        self._busy = False
        free(old)
        return 0

    def __dealloc__(self):
        free(self._ptr)
        self._ptr = NULL

    def __getbuffer__(self, Py_buffer *view, int flags):
        self._check_idle("export")
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
                f"exports={self._exports}{', freed' if self._ptr == NULL else ''}"
                f"{', resizing' if self._busy else ''})")

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
        self._check_idle("resize")
        if self._exports:
            raise BufferError(f"cannot resize an AlignedBuffer with {self._exports} live view(s)")
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        self._allocate(nbytes)

    def free(self) -> None:
        """Release the memory now; later views raise BufferError (resize reallocates)."""
        self._check_idle("free")
        if self._exports:
            raise BufferError(f"cannot free an AlignedBuffer with {self._exports} live view(s)")
        free(self._ptr)
        self._ptr = NULL
        self._nbytes = 0


# ------------------------------------------------------------------ file I/O

cdef object _oserror(int err, object path):
    if path is None:
        return OSError(err, os.strerror(err))
    return OSError(err, os.strerror(err), os.fspath(path))


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
    with nogil:
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
