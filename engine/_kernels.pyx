# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""CPU kernels for the engine's attention (:mod:`engine.cpu_attention`), with the GIL
released: :func:`softmax_rows`, a row softmax in place (``engine/softmax.h``)."""

from cpython.buffer cimport (
    PyBUF_C_CONTIGUOUS,
    PyBUF_FORMAT,
    PyBUF_WRITABLE,
    PyBuffer_Release,
    PyObject_GetBuffer,
)
from libc.stdint cimport int64_t


cdef extern from "softmax.h" nogil:
    void mk_softmax_rows(float *s, int64_t rows, int64_t cols, int64_t group,
                         int64_t first_visible, int threads)
    int mk_best_isa()
    int mk_isa


_ISAS = ("baseline", "avx2", "avx512f")


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
        if view.itemsize != 4 or view.format == NULL or view.format[0] not in (b'f', b'='):
            raise TypeError("softmax_rows needs float32 scores")
        if (view.len // 4) % cols:
            raise ValueError(f"{view.len // 4} scores are not rows of {cols}")
        with nogil:
            mk_softmax_rows(<float *>view.buf, (view.len // 4) // cols, cols, group,
                            first_visible, threads)
    finally:
        PyBuffer_Release(&view)
