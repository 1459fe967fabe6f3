# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""CPU kernels of the engine's prefill, with the GIL released (``engine/kernels.h``):
:func:`softmax_rows`, the attention's row softmax in place (:mod:`engine.cpu_attention`),
and :func:`swiglu`, ``silu(gate) * up`` in place (:func:`engine.mlx_lm_compat.install_swiglu`)."""

from cpython.buffer cimport (
    PyBUF_C_CONTIGUOUS,
    PyBUF_FORMAT,
    PyBUF_WRITABLE,
    PyBuffer_Release,
    PyObject_GetBuffer,
)
from libc.stdint cimport int64_t


cdef extern from "kernels.h" nogil:
    void mk_softmax_rows(float *s, int64_t rows, int64_t cols, int64_t group,
                         int64_t first_visible, int threads)
    void mk_swiglu(float *g, const float *u, int64_t n, int threads)
    int mk_best_isa()
    int mk_isa


_ISAS = ("baseline", "avx2", "avx512f")


cdef bint _is_float32(Py_buffer *view):
    if view.itemsize != 4 or view.format == NULL:
        return False
    cdef const char *f = view.format
    if f[0] in (b'=', b'<', b'@'):  # native or little-endian order: the type follows
        f += 1
    return f[0] == b'f' and f[1] == 0


def isa() -> str:
    """The row kernel this CPU runs: ``baseline``, ``avx2`` or ``avx512f``."""
    global mk_isa
    if mk_isa < 0:
        mk_isa = mk_best_isa()
    return _ISAS[mk_isa]


def set_isa(name: str) -> None:
    """Run the ``name`` row kernel from now on (tests compare them); one this CPU lacks is
    refused."""
    if name not in _ISAS:
        raise ValueError(f"unknown kernel {name!r}: one of {', '.join(_ISAS)}")
    want = _ISAS.index(name)
    if want > mk_best_isa():
        raise ValueError(f"this CPU cannot run the {name} kernel")
    global mk_isa
    mk_isa = want


def softmax_rows(object scores, Py_ssize_t cols, Py_ssize_t group, Py_ssize_t first_visible,
                 int threads=1) -> None:
    """``scores``: a writable, C-contiguous float32 buffer of rows of ``cols`` scores; each
    row becomes its softmax over its first ``first_visible + r % group`` entries (``r``: the
    row's index; ``group`` 0: ``first_visible`` for every row), 0 after them. A row with
    nothing visible becomes all 0."""
    cdef Py_buffer view
    if cols <= 0:
        raise ValueError("cols must be positive")
    if group < 0:
        raise ValueError("group must not be negative")
    PyObject_GetBuffer(scores, &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT)
    try:
        if not _is_float32(&view):
            raise TypeError("softmax_rows needs float32 scores")
        if (view.len // 4) % cols:
            raise ValueError(f"{view.len // 4} scores are not rows of {cols}")
        with nogil:
            mk_softmax_rows(<float *>view.buf, (view.len // 4) // cols, cols, group,
                            first_visible, threads)
    finally:
        PyBuffer_Release(&view)


def swiglu(object gate, object up, int threads=1) -> None:
    """``gate = silu(gate) * up`` in place: two C-contiguous float32 buffers of the same
    size, ``gate`` writable."""
    cdef Py_buffer g, u
    PyObject_GetBuffer(gate, &g, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT)
    try:
        PyObject_GetBuffer(up, &u, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT)
        try:
            if not (_is_float32(&g) and _is_float32(&u)):
                raise TypeError("swiglu needs float32 buffers")
            if g.len != u.len:
                raise ValueError(f"gate has {g.len // 4} values, up {u.len // 4}")
            with nogil:
                mk_swiglu(<float *>g.buf, <const float *>u.buf, g.len // 4, threads)
        finally:
            PyBuffer_Release(&u)
    finally:
        PyBuffer_Release(&g)
