"""The engine's CPU kernels (engine/_kernels.pyx, engine/kernels.h) against numpy: the row
softmax (causal groups, masked scores exactly 0, rows with nothing visible, one thread or
several alike) and silu(gate) * up, on every instruction set this CPU runs, and clear errors
for buffers they cannot take."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxkv.engine import _kernels as K

ISAS = [name for name in ("baseline", "avx2", "avx512f")
        if ("baseline", "avx2", "avx512f").index(name) <= ("baseline", "avx2", "avx512f").index(K.isa())]


@pytest.fixture
def isa(request):
    before = K.isa()
    K.set_isa(request.param)
    yield request.param
    K.set_isa(before)


def _reference(x: np.ndarray, group: int, first_visible: int) -> np.ndarray:
    out = np.zeros_like(x, dtype=np.float64)
    for r in range(x.shape[0]):
        v = max(0, min(x.shape[1], first_visible + (r % group if group else 0)))
        row = x[r, :v].astype(np.float64)
        if v and np.isfinite(row.max()):
            e = np.exp(row - row.max())
            out[r, :v] = e / e.sum()
    return out


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("rows,cols,group,first", [(1, 1, 0, 1), (7, 37, 3, 30), (12, 300, 4, 290),
                                                    (5, 16, 0, 16), (9, 64, 9, 56), (3, 17, 0, 5)])
def test_it_is_the_softmax_over_the_visible_scores(isa, rows, cols, group, first):
    rng = np.random.default_rng(rows * cols)
    x = (rng.standard_normal((rows, cols)) * 6).astype(np.float32)
    want = _reference(x, group, first)
    got = x.copy()
    K.softmax_rows(got, cols, group, first)
    assert np.allclose(got, want, rtol=3e-6, atol=1e-7), np.abs(got - want).max()
    hidden = np.array([[c >= min(cols, first + (r % group if group else 0)) for c in range(cols)]
                       for r in range(rows)])
    assert (got[hidden] == 0.0).all()  # what a query may not see weighs exactly nothing


@pytest.mark.parametrize("isa", ISAS, indirect=True)
def test_masked_and_far_below_scores_are_exactly_zero(isa):
    x = np.array([[0.0, -np.inf, -200.0, -1.0, 3.0] + [-np.inf] * 20], dtype=np.float32)
    K.softmax_rows(x, x.shape[1], 0, x.shape[1])
    assert x[0, 1] == 0.0 and x[0, 2] == 0.0 and (x[0, 5:] == 0.0).all()
    assert abs(x.sum() - 1.0) < 1e-6


@pytest.mark.parametrize("isa", ISAS, indirect=True)
def test_a_row_that_sees_nothing_is_all_zero(isa):
    x = np.full((3, 40), -np.inf, dtype=np.float32)
    x[1, :] = 1.0
    K.softmax_rows(x, 40, 0, 40)
    assert (x[0] == 0).all() and (x[2] == 0).all()
    assert np.allclose(x[1], 1 / 40)
    y = np.ones((2, 8), dtype=np.float32)
    K.softmax_rows(y, 8, 0, 0)  # nothing visible
    assert (y == 0).all()


def test_threads_change_nothing():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((600, 1000)) * 4).astype(np.float32)
    one, many = x.copy(), x.copy()
    K.softmax_rows(one, 1000, 7, 900, 1)
    K.softmax_rows(many, 1000, 7, 900, 4)
    assert np.array_equal(one, many)


def test_it_writes_into_an_evaluated_mlx_array():
    a = mx.random.normal((2, 3, 8)) * 3
    mx.eval(a)
    want = mx.softmax(a, axis=-1)
    mx.eval(want)  # before the write: the kernel changes the buffer under every lazy reader
    K.softmax_rows(a, 8, 0, 8)
    assert mx.allclose(a, want, rtol=1e-5, atol=1e-6).item()


def test_buffers_it_cannot_take_are_refused():
    with pytest.raises(TypeError, match="float32"):
        K.softmax_rows(np.zeros((2, 4)), 4, 0, 4)
    with pytest.raises(ValueError, match="not rows of 3"):
        K.softmax_rows(np.zeros((2, 4), dtype=np.float32), 3, 0, 3)
    with pytest.raises(ValueError, match="cols"):
        K.softmax_rows(np.zeros((2, 4), dtype=np.float32), 0, 0, 3)
    ro = np.zeros((2, 4), dtype=np.float32)
    ro.flags.writeable = False
    with pytest.raises((BufferError, ValueError)):
        K.softmax_rows(ro, 4, 0, 4)
    with pytest.raises((BufferError, ValueError)):
        K.softmax_rows(np.zeros((4, 4), dtype=np.float32)[:, :2], 2, 0, 2)  # not contiguous
    with pytest.raises(ValueError, match="unknown kernel"):
        K.set_isa("sse9")


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("n", [1, 15, 16, 17, 1000, 300_001])
def test_swiglu_is_silu_of_the_gate_times_up(isa, n):
    rng = np.random.default_rng(n)
    gate = (rng.standard_normal(n) * 8).astype(np.float32)
    gate[: min(n, 4)] = np.array([0.0, -200.0, 200.0, -0.5], dtype=np.float32)[: min(n, 4)]
    up = rng.standard_normal(n).astype(np.float32)
    g64 = gate.astype(np.float64)
    want = g64 / (1 + np.exp(-g64)) * up
    got = gate.copy()
    K.swiglu(got, up, 2)
    assert np.allclose(got, want, rtol=3e-6, atol=1e-30), np.abs(got - want).max()
    assert np.isfinite(got).all()


def test_swiglu_refuses_what_it_cannot_take():
    with pytest.raises(ValueError, match="gate has 3 values, up 4"):
        K.swiglu(np.zeros(3, np.float32), np.zeros(4, np.float32))
    with pytest.raises(TypeError, match="float32"):
        K.swiglu(np.zeros(3, np.float32), np.zeros(3))


def test_an_int32_buffer_is_not_taken_for_float32():
    with pytest.raises(TypeError, match="float32"):
        K.softmax_rows(np.zeros((2, 4), dtype=np.int32), 4, 0, 4)
