"""The engine's CPU primitives (``engine/native/row_product.cpp``) against MLX's own
operations: few-row products bit for bit per row, a decode step's attention over a
cache's filled slots, a prompt chunk's attention and a SwiGLU activation, across head groupings, query counts,
offsets and head sizes; and every kernel family (AVX-512, AVX2, the baseline) through
these same tests."""

from __future__ import annotations

import io
import os
import platform
import re
import subprocess
import sys

import mlx.core as mx
import pytest

from mlxkv.engine import native_ops

pytestmark = pytest.mark.skipif(native_ops.native() is None, reason="the CPU primitives are not built (make ext)")


def test_a_row_product_of_rows_is_each_row_alone_bit_for_bit():
    from mlxkv.engine._row_product import row_product

    for out, depth in ((1536, 576), (49152, 576), (7, 13), (577, 1536)):  # odd shapes: the tails
        weight = mx.random.normal((out, depth), key=mx.random.key(3))
        x = mx.random.normal((40, depth), key=mx.random.key(4))
        alone = [row_product(x[i: i + 1], weight) for i in range(40)]
        for rows in (2, 4, 5, 7, 9, 16, 24, 40):  # each way the kernels tile the rows of x
            together = row_product(x[:rows], weight)
            assert mx.allclose(together, x[:rows] @ weight.T, rtol=1e-4, atol=1e-4).item()
            for i in range(rows):
                assert mx.array_equal(together[i: i + 1], alone[i]).item(), (out, rows, i)
    together = row_product(x[:16], weight)
    compiled = mx.compile(lambda a, b: row_product(a, b) * 2)  # a primitive inside a compiled step
    assert mx.array_equal(compiled(x[:16], weight), together * 2).item()


@pytest.mark.parametrize("isa", ["avx2", "base"])
def test_each_kernel_family_passes_this_file(isa: str) -> None:
    """The module picks the CPU's best kernels at load, so this machine's run of the file
    tests one family; ``MLXKV_NATIVE_ISA`` caps the pick, and the file runs again under
    each lower one (bit for bit per row, attention against MLX, and the rest)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("one kernel family is built off x86")
    env = {**os.environ, "MLXKV_NATIVE_ISA": isa}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
                          "-k", "not each_kernel_family"], env=env, capture_output=True, text=True, timeout=600)
    summary = (run.stdout.strip().splitlines() or [""])[-1]
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    # (a family whose kernels fail the module's own check at load skips every test)
    assert " passed" in summary and "skipped" not in summary, run.stdout[-4000:]


def test_the_kernel_family_is_the_one_asked_for() -> None:
    from mlxkv.engine import _row_product

    asked = os.environ.get("MLXKV_NATIVE_ISA")
    assert _row_product.ISA in ("avx512", "avx2", "base")
    if asked == "base":
        assert _row_product.ISA == "base"
    elif asked == "avx2":
        assert _row_product.ISA in ("avx2", "base")  # base where the CPU has no AVX2


def test_the_row_product_refuses_what_it_does_not_take():
    from mlxkv.engine._row_product import MAX_ROWS, row_product

    weight = mx.zeros((8, 4))
    for x, why in ((mx.zeros((2, 5)), "x [..., in]"), (mx.zeros((2, 4), dtype=mx.float16), "float32"),
                   (mx.zeros((MAX_ROWS + 1, 4)), "1 to 64 rows")):
        with pytest.raises(ValueError, match=re.escape(why)):
            row_product(x, weight)


def reference_attention(q: mx.array, k: mx.array, v: mx.array, offset: int, scale: float) -> mx.array:
    """Query ``l`` over slots ``[0, offset + l]``, by MLX's softmax on repeated heads."""
    groups, length = q.shape[1] // k.shape[1], q.shape[2]
    filled = offset + length
    k, v = (mx.repeat(a[:, :, :filled], groups, axis=1) for a in (k, v))
    scores = (q * scale) @ k.swapaxes(-1, -2)
    visible = mx.arange(filled)[None] <= (offset + mx.arange(length))[:, None]
    scores = mx.where(visible, scores, -mx.inf)
    return mx.softmax(scores, axis=-1, precise=True) @ v


@pytest.mark.parametrize("heads, kv_heads, length, depth, offset, slots", [
    (9, 3, 1, 64, 255, 512),     # the real model's decode step: 3 queries per KV head
    (9, 3, 1, 64, 0, 256),       # the first slot only
    (4, 4, 5, 32, 100, 256),     # a verify pass: 5 queries each, one KV head each
    (8, 1, 8, 64, 4000, 4352),   # 64 queries on one KV head, a long context split over threads
    (6, 2, 3, 40, 17, 256),      # a head size not a multiple of the vector width
])
def test_slot_attention_is_attention_over_the_filled_slots(heads, kv_heads, length, depth, offset, slots):
    kq, kk, kv = mx.random.split(mx.random.key(7), 3)
    q = mx.random.normal((2, heads, length, depth), key=kq)
    k = mx.random.normal((2, kv_heads, slots, depth), key=kk)
    v = mx.random.normal((2, kv_heads, slots, depth), key=kv)
    # slots past the filled ones hold garbage a mask would have hidden: they must not count
    k[:, :, offset + length:] = 1e4
    v[:, :, offset + length:] = float("nan")
    scale = depth ** -0.5
    got = native_ops.slot_attention(q, k, v, mx.array(offset, dtype=mx.int32), scale)
    assert got is not None and got.shape == q.shape
    want = reference_attention(q, k, v, offset, scale)
    assert mx.allclose(got, want, rtol=1e-4, atol=1e-5).item(), mx.abs(got - want).max().item()
    compiled = mx.compile(lambda a, b, c, o: native_ops.slot_attention(a, b, c, o, scale))
    assert mx.array_equal(compiled(q, k, v, mx.array(offset, dtype=mx.int32)), got).item()


@pytest.mark.parametrize("padding, length, offset, slots", [
    ([0, 37, 255, 256], 1, 255, 512),  # a batch decode step: rows of different lengths
    ([3, 0, 120, 900], 2, 1000, 1280),  # two queries, a long row split into key spans
])
def test_slot_attention_skips_each_rows_left_padding(padding, length, offset, slots):
    """A batch's rows are left-padded to one write index: row b sees slots [start[b],
    offset + l] only, what the compiled batch step's mask let through. Padding slots hold
    garbage (NaN values) that must not count."""
    batch, heads, kv_heads, depth = len(padding), 9, 3, 64
    kq, kk, kv = mx.random.split(mx.random.key(8), 3)
    q = mx.random.normal((batch, heads, length, depth), key=kq)
    k = mx.random.normal((batch, kv_heads, slots, depth), key=kk)
    v = mx.random.normal((batch, kv_heads, slots, depth), key=kv)
    for b, pad in enumerate(padding):
        k[b, :, :pad] = 1e4
        v[b, :, :pad] = float("nan")
    start, at = mx.array(padding, dtype=mx.int32), mx.array(offset, dtype=mx.int32)
    got = native_ops.slot_attention(q, k, v, at, 0.125, start=start)
    assert got is not None
    for b, pad in enumerate(padding):
        if pad > offset:  # a row that is all padding (a removed row's slot) sees nothing: 0
            assert mx.array_equal(got[b], mx.zeros_like(got[b])).item()
            continue
        row = got[b:b + 1]  # against the row alone, its slots from its first one
        want = reference_attention(q[b:b + 1], k[b:b + 1, :, pad:], v[b:b + 1, :, pad:], offset - pad, 0.125)
        assert mx.allclose(row, want, rtol=1e-4, atol=1e-5).item(), (b, mx.abs(row - want).max().item())
    compiled = mx.compile(lambda a, b, c, o, st: native_ops.slot_attention(a, b, c, o, 0.125, start=st))
    assert mx.array_equal(compiled(q, k, v, at, start), got).item()


def test_slot_attention_leaves_to_mlx_what_it_does_not_take():
    q, k = mx.zeros((1, 4, 1, 8)), mx.zeros((1, 4, 256, 8))
    at = mx.array(3, dtype=mx.int32)
    assert native_ops.slot_attention(q.astype(mx.float16), k, k, at, 1.0) is None
    assert native_ops.slot_attention(mx.zeros((1, 6, 1, 8)), k, k, at, 1.0) is None  # 6 heads over 4
    assert native_ops.slot_attention(mx.zeros((1, 4, 65, 8)), k, k, at, 1.0) is None  # 65 queries a head
    from mlxkv.engine._row_product import slot_attention

    with pytest.raises(ValueError, match="one int32 offset"):
        slot_attention(q, k, k, mx.array([3, 4], dtype=mx.int32), 1.0)
    with pytest.raises(ValueError, match="int32 start per batch row"):
        slot_attention(q, k, k, at, 1.0, start=mx.array([0, 1], dtype=mx.int32))


@pytest.mark.parametrize("batch, heads, kv_heads, length, keys, depth, causal", [
    (1, 9, 3, 16, 4000, 64, True),    # the real model: a short chunk over a long context (key spans)
    (1, 9, 3, 200, 700, 64, True),    # several query tiles, the diagonal inside key blocks
    (2, 4, 2, 7, 300, 64, True),      # two rows of a batch
    (1, 8, 8, 3, 50, 80, False),      # no mask, one query per KV head, a head size of 80
    (1, 2, 1, 70, 70, 60, True),      # a whole prompt, a head size not a multiple of the vector
    (1, 32, 1, 5, 129, 128, True),    # 32 query heads per KV head: tiles of two positions
])
def test_chunk_attention_is_mlxs_attention(batch, heads, kv_heads, length, keys, depth, causal):
    kq, kk, kv = mx.random.split(mx.random.key(11), 3)
    q = mx.random.normal((batch, heads, length, depth), key=kq)
    k = mx.random.normal((batch, kv_heads, keys, depth), key=kk)
    v = mx.random.normal((batch, kv_heads, keys, depth), key=kv)
    scale = depth ** -0.5
    got = native_ops.chunk_attention(q, k, v, scale, causal=causal)
    assert got is not None and got.shape == q.shape
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal" if causal else None)
    assert mx.allclose(got, want, rtol=1e-4, atol=1e-5).item(), mx.abs(got - want).max().item()
    compiled = mx.compile(lambda a, b, c: native_ops.chunk_attention(a, b, c, scale, causal=causal))
    assert mx.array_equal(compiled(q, k, v), got).item()  # a primitive inside a compiled step


def test_chunk_attention_reads_a_caches_view_in_place_and_copies_any_other_layout():
    """Keys and values as a KV cache hands them over (the filled slots of a larger buffer:
    rows contiguous, heads a capacity apart), as a transpose (rows not contiguous: copied
    first) and broadcast over the batch give what contiguous copies give, bit for bit."""
    kq, kk, kv = mx.random.split(mx.random.key(5), 3)
    q = mx.random.normal((2, 6, 24, 64), key=kq)
    buf_k = mx.random.normal((2, 2, 512, 64), key=kk)
    buf_v = mx.random.normal((2, 2, 512, 64), key=kv)
    k, v = buf_k[:, :, :300], buf_v[:, :, :300]  # what KVCache.update_and_fetch returns
    want = native_ops.chunk_attention(q, mx.contiguous(k), mx.contiguous(v), 0.125, causal=True)
    assert mx.array_equal(native_ops.chunk_attention(q, k, v, 0.125, causal=True), want).item()
    kt = mx.contiguous(k.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)  # [B, S, Hk, D] storage
    vt = mx.contiguous(v.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    assert mx.array_equal(native_ops.chunk_attention(q, kt, vt, 0.125, causal=True), want).item()
    one_k, one_v = mx.broadcast_to(k[:1], k.shape), mx.broadcast_to(v[:1], v.shape)
    got = native_ops.chunk_attention(q, one_k, one_v, 0.125, causal=True)
    want = native_ops.chunk_attention(q, mx.contiguous(one_k), mx.contiguous(one_v), 0.125, causal=True)
    assert mx.array_equal(got, want).item()


def test_chunk_attention_gives_no_weight_to_a_key_a_query_may_not_see():
    """Keys past a causal query's reach weigh exactly nothing: huge keys and values there
    leave its output the same in every bit."""
    q, k, v = (mx.random.normal(s, key=mx.random.key(i)) for i, s in
               enumerate([(1, 6, 40, 64), (1, 2, 600, 64), (1, 2, 600, 64)]))
    before = native_ops.chunk_attention(q, k, v, 0.125, causal=True)
    k2, v2 = mx.array(k), mx.array(v)
    k2[:, :, 590:] = 1e4  # the last 10 keys: query l sees keys [0, 561 + l)
    v2[:, :, 590:] = -7e3
    after = native_ops.chunk_attention(q, k2, v2, 0.125, causal=True)
    assert mx.array_equal(before[:, :, :30], after[:, :, :30]).item()
    assert not mx.allclose(before[:, :, 30:], after[:, :, 30:]).item()


@pytest.mark.parametrize("padding, window, offset, length", [
    ((0, 5, 37), None, 0, 40),     # a padded batch's first chunk: padded queries see nothing
    ((0, 5, 37), None, 300, 40),   # its next chunk, over a long context (key spans)
    ((3,), 16, 0, 64),             # a sliding window: each query's keys start anew
    ((0, 130), 100, 200, 50),      # both, past a key block
    ((0, 0), None, 12, 9),         # no padding at all: the causal primitive's answer
])
def test_chunk_attention_takes_mlx_lms_masks_as_each_rows_run_of_keys(padding, window, offset, length):
    """The boolean masks mlx-lm builds for a batch of left-padded prompts and for sliding
    windows (``create_causal_mask``): MLX's attention on every query that sees a key, 0 on
    one that sees none."""
    from mlx_lm.models.base import create_causal_mask

    batch = len(padding)
    kq, kk, kv = mx.random.split(mx.random.key(8), 3)
    q = mx.random.normal((batch, 6, length, 64), key=kq)
    k = mx.random.normal((batch, 2, offset + length, 64), key=kk)
    v = mx.random.normal((batch, 2, offset + length, 64), key=kv)
    mask = create_causal_mask(length, offset, window_size=window, left_padding=mx.array(padding))
    got = native_ops.chunk_attention(q, k, v, 0.125, causal=False, mask=mask)
    assert got is not None and got.shape == q.shape
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
    sees = mask.any(axis=-1, keepdims=True)  # [B, 1, L, 1]
    assert mx.allclose(mx.where(sees, got, 0), mx.where(sees, want, 0), rtol=1e-4, atol=1e-5).item()
    assert mx.array_equal(mx.where(sees, 0, got), mx.zeros_like(got)).item()
    if not any(padding) and window is None:
        assert mx.allclose(got, native_ops.chunk_attention(q, k, v, 0.125, causal=True), atol=1e-6).item()


def test_chunk_attention_computes_a_mask_that_is_not_one_run_per_row():
    """A mask whose rows are not one run of keys (none of mlx-lm's) is still computed
    right, one score at a time; a shared [L, S] mask and a [1, 1, L, S] one alike."""
    kq, kk, kv, km = mx.random.split(mx.random.key(9), 4)
    q = mx.random.normal((2, 4, 9, 32), key=kq)
    k = mx.random.normal((2, 2, 50, 32), key=kk)
    v = mx.random.normal((2, 2, 50, 32), key=kv)
    mask = mx.random.uniform(shape=(9, 50), key=km) > 0.5
    mask[:, 0] = True
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.2, mask=mask)
    for m in (mask, mask[None, None]):
        got = native_ops.chunk_attention(q, k, v, 0.2, causal=False, mask=m)
        assert mx.allclose(got, want, rtol=1e-4, atol=1e-5).item()
    # what it does not take: masks per head, additive masks, other shapes (the caller's way)
    assert native_ops.chunk_attention(q, k, v, 0.2, causal=False, mask=mx.broadcast_to(mask, (2, 4, 9, 50))) is None
    assert native_ops.chunk_attention(q, k, v, 0.2, causal=False, mask=mask.astype(mx.float32)) is None
    assert native_ops.chunk_attention(q, k, v, 0.2, causal=False, mask=mask[:8]) is None
    from mlxkv.engine._row_product import chunk_attention

    with pytest.raises(ValueError, match="bool mask"):
        chunk_attention(q, k, v, 0.2, 50, mask=mask.astype(mx.float32))


def test_chunk_attention_leaves_to_mlx_what_it_does_not_take():
    q, k = mx.zeros((1, 4, 3, 8)), mx.zeros((1, 4, 30, 8))
    assert native_ops.chunk_attention(q.astype(mx.float16), k, k, 1.0, causal=True) is None
    assert native_ops.chunk_attention(mx.zeros((1, 6, 3, 8)), k, k, 1.0, causal=True) is None  # 6 over 4
    assert native_ops.chunk_attention(mx.zeros((1, 65, 3, 8)), mx.zeros((1, 1, 30, 8)),
                                      mx.zeros((1, 1, 30, 8)), 1.0, causal=True) is None  # 65 a head
    from mlxkv.engine._row_product import chunk_attention

    with pytest.raises(ValueError, match="64 query heads per KV head"):
        chunk_attention(mx.zeros((1, 65, 3, 8)), mx.zeros((1, 1, 30, 8)), mx.zeros((1, 1, 30, 8)), 1.0, 28)


def test_a_row_product_reads_strided_inputs_as_their_values():
    """x and w are read where they lie when row-contiguous and copied first otherwise (a
    transpose, a column view, a broadcast): the same values as contiguous copies, bit for bit."""
    from mlxkv.engine._row_product import row_product

    w = mx.random.normal((96, 40), key=mx.random.key(1))
    x = mx.random.normal((3, 5, 40), key=mx.random.key(2))
    want = row_product(mx.contiguous(x.transpose(1, 0, 2)), w)
    assert mx.array_equal(row_product(x.transpose(1, 0, 2), w), want).item()
    wide = mx.random.normal((96, 80), key=mx.random.key(3))
    assert mx.array_equal(row_product(x[0], wide[:, ::2]), row_product(x[0], mx.contiguous(wide[:, ::2]))).item()
    one = mx.broadcast_to(x[:1, :1], (4, 1, 40))
    assert mx.array_equal(row_product(one, w), row_product(mx.contiguous(one), w)).item()
    assert row_product(x, w).shape == (3, 5, 96)


def test_rms_norm_is_mlxs_over_any_layout():
    w = mx.random.normal((576,), key=mx.random.key(4))
    for x in (mx.random.normal((1, 1, 576), key=mx.random.key(5)),
              mx.random.normal((2, 300, 576), key=mx.random.key(6)),
              mx.random.normal((7, 3, 576), key=mx.random.key(7)).transpose(1, 0, 2),  # strided rows
              mx.random.normal((576, 4), key=mx.random.key(8)).T,  # a strided last dimension
              mx.random.normal((5, 13), key=mx.random.key(9))):  # a size not a multiple of 8
        weight = w[: x.shape[-1]]
        got = native_ops.rms_norm(x, weight, 1e-5)
        want = mx.fast.rms_norm(x, weight, 1e-5)
        assert got is not None and got.shape == want.shape
        assert mx.allclose(got, want, rtol=1e-5, atol=1e-5).item(), mx.abs(got - want).max().item()
    compiled = mx.compile(lambda a, b: native_ops.rms_norm(a, b, 1e-5))
    assert mx.array_equal(compiled(x, weight), native_ops.rms_norm(x, weight, 1e-5)).item()
    assert native_ops.rms_norm(x.astype(mx.float16), weight, 1e-5) is None


def test_swiglu_is_mlxs_over_any_layout_and_leaves_its_inputs_as_they_were():
    """``silu(gate) * up`` against mlx-lm's, on one-block inputs, a grouped product's columns
    (rows a whole gate-and-up width apart), a strided last dimension, sizes off the vector
    width, and values far out in both tails (where exp under- or overflows)."""
    from mlx_lm.models.activations import swiglu

    both = mx.random.normal((2, 300, 2 * 1536), key=mx.random.key(3)) * 4
    tails = mx.array([[-200.0, -90.0, -30.0, -1e-3, 0.0, 1e-3, 30.0, 90.0, 200.0] * 3])
    for gate, up in ((both[..., :1536], mx.contiguous(both[..., 1536:])),  # one block
                     (both[..., :1536], both[..., 1536:]),  # views of the grouped product's columns
                     (both[0, :, :40].T, both[1, :, :40].T),  # a strided last dimension
                     (mx.random.normal((5, 13), key=mx.random.key(4)), mx.ones((5, 13))),
                     (tails, mx.ones(tails.shape))):
        before = mx.array(gate)
        got = native_ops.swiglu(gate, up)
        want = swiglu(gate, up)
        assert got is not None and got.shape == want.shape
        assert mx.allclose(got, want, rtol=1e-5, atol=1e-6).item(), mx.abs(got - want).max().item()
        assert mx.array_equal(gate, before).item()  # a gate someone still holds is not written
    own = mx.random.normal((64, 96), key=mx.random.key(5))  # one nobody else holds: its buffer reused
    want = swiglu(own, own + 1)
    got = native_ops.swiglu(own * 1, own + 1)
    assert mx.allclose(got, want, rtol=1e-5, atol=1e-6).item()
    compiled = mx.compile(lambda a, b: native_ops.swiglu(a, b))  # a primitive inside a compiled step
    assert mx.array_equal(compiled(gate, up), native_ops.swiglu(gate, up)).item()
    assert native_ops.swiglu(gate.astype(mx.float16), up.astype(mx.float16)) is None
    assert native_ops.swiglu(gate, up[..., :-1]) is None


@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("dims", [64, 48])
def test_rope_is_mlxs_at_every_offset_kind(traditional, dims):
    """One offset (an int, an array), one per batch row (a batch's rows, a fused pass's
    tokens), a query laid out as the attention hands it over (a transpose), 3 dimensions,
    frequencies given, part of the features rotated. Long positions differ by float32
    evaluation (libm's sine and cosine against MLX's approximations: at 8,000 both are within
    5e-4 of a float64 evaluation of the same angles, ours the closer)."""
    q = mx.random.normal((2, 5, 9, 64), key=mx.random.key(10)).transpose(0, 2, 1, 3)  # [B, H, T, D] view
    cases = [(q, 7), (q, mx.array(300, dtype=mx.int32)), (q, mx.array([3, 8000], dtype=mx.int32)),
             (q, mx.array([0, 17])), (q[:, :, :1], mx.array([4, 9], dtype=mx.int32)),
             (q, mx.array([5, 0, 900, 0], dtype=mx.int32)[::2]),  # a strided offset array
             (mx.random.normal((3, 4, 64), key=mx.random.key(11)), 5)]
    for x, offset in cases:
        got = native_ops.rope(x, offset, dims, traditional, 10000.0, 1.0)
        want = mx.fast.rope(x, dims, traditional=traditional, base=10000.0, scale=1.0, offset=offset)
        assert got is not None and got.shape == want.shape
        assert mx.allclose(got, want, rtol=1e-4, atol=1e-3).item(), (offset, mx.abs(got - want).max().item())
        if dims < 64:
            assert mx.array_equal(got[..., dims:], x[..., dims:]).item()  # the rest copied
    freqs = mx.random.uniform(1.0, 500.0, (dims // 2,), key=mx.random.key(12))
    got = native_ops.rope(q, 40, dims, traditional, None, 0.25, freqs)
    want = mx.fast.rope(q, dims, traditional=traditional, base=None, scale=0.25, offset=40, freqs=freqs)
    assert got is not None and mx.allclose(got, want, rtol=1e-5, atol=1e-5).item()
    compiled = mx.compile(lambda a, o: native_ops.rope(a, o, dims, traditional, 10000.0, 1.0))
    at = mx.array(11, dtype=mx.int32)
    assert mx.array_equal(compiled(q, at), native_ops.rope(q, at, dims, traditional, 10000.0, 1.0)).item()


def test_rope_leaves_to_mlx_what_it_does_not_take():
    q = mx.zeros((2, 4, 3, 8))
    assert native_ops.rope(q.astype(mx.float16), 0, 8, False, 10000.0, 1.0) is None
    assert native_ops.rope(mx.zeros((4, 8)), 0, 8, False, 10000.0, 1.0) is None  # 2 dimensions
    assert native_ops.rope(q, mx.array([1, 2, 3]), 8, False, 10000.0, 1.0) is None  # 3 offsets, 2 rows
    from mlxkv.engine._row_product import rope

    with pytest.raises(ValueError, match="even dims"):
        rope(q, mx.array(0, dtype=mx.int32), 7, False, 10000.0, 1.0)
    with pytest.raises(ValueError, match="one of base and freqs"):
        rope(q, mx.array(0, dtype=mx.int32), 8, False, None, 1.0)


def test_a_models_norms_and_rotations_take_the_native_operation():
    """A llama's ``nn.RMSNorm`` and ``nn.RoPE`` modules become one operation each, and its
    forward pass over a prompt and a step after it gives MLX's logits up to rounding."""
    from mlx_lm.models import llama
    from mlx_lm.models.cache import make_prompt_cache

    from mlxkv.engine.native_layers import NativeRMSNorm, NativeRoPE, use_native_layers

    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=96,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=100)
    mx.random.seed(3)
    model = llama.Model(args)
    prompt, step = mx.array([[5, 9, 13, 2, 77, 31]]), mx.array([[8]])

    def logits() -> list[mx.array]:
        cache = make_prompt_cache(model)
        return [model(prompt, cache=cache), model(step, cache=cache)]

    want = logits()
    assert use_native_layers(model) == 2 * 2 + 1 + 2  # two norms a layer, the final one, a rope a layer
    assert isinstance(model.model.norm, NativeRMSNorm) and isinstance(model.model.layers[0].self_attn.rope, NativeRoPE)
    got = logits()
    for g, w in zip(got, want):
        assert mx.allclose(g, w, rtol=1e-4, atol=1e-4).item(), mx.abs(g - w).max().item()


def _tiny_llama(seed: int, arch: str = "llama", **kw):
    """A random 2-layer model of mlx-lm's ``arch`` (llama, qwen2: q/k/v biases, qwen3: each
    head's q and k normalized), its biases and norms random too so that they count."""
    import importlib

    from mlx.utils import tree_flatten, tree_unflatten

    module = importlib.import_module(f"mlx_lm.models.{arch}")
    args = dict(model_type=arch, hidden_size=64, num_hidden_layers=2, intermediate_size=96,
                num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=100,
                max_position_embeddings=4096, head_dim=16, tie_word_embeddings=True, rope_theta=10000.0)
    if arch == "qwen2":
        del args["head_dim"]
    args.update(kw)
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs(**args))
    model.update(tree_unflatten([(k, mx.random.uniform(0.5, 1.5, v.shape) if "norm" in k
                                  else mx.random.normal(v.shape) * 0.2 if "bias" in k else v)
                                 for k, v in tree_flatten(model.parameters())]))
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize("arch, kw, offset", [
    ("llama", {}, 0),                                                         # the first slot
    ("llama", {}, 300),                                                       # a longer context: key spans
    ("llama", {"num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 24}, 37),  # 8 per KV head
    ("llama", {"rope_traditional": True, "rope_theta": 500000.0}, 5),         # pairs (2i, 2i + 1)
    ("qwen2", {}, 41),                                                        # q, k and v biases
    ("qwen3", {}, 41),                                                        # each head's q and k normalized
])
def test_a_layers_decode_step_is_the_layers_own_code(arch, kw, offset):
    """One token through a laid-out llama layer over the compiled step's cache: the native
    step gives the layer's own output within rounding, and writes the token's key and value
    into the buffers' slot at the offset (the other slots as they were)."""
    from mlxkv.engine.compiled_step import FixedKV
    from mlxkv.engine.native_layers import use_native_blocks
    from mlxkv.engine.weight_layout import layout_for_cpu

    model = _tiny_llama(5, arch, **kw)
    layout_for_cpu(model)
    block = model.model.layers[1]
    assert type(block).__name__ == "NativeTransformerBlock" and use_native_blocks(model) == 0  # done once
    own = type(block).__mro__[1]
    attn = block.self_attn
    shape = (1, attn.n_kv_heads, 512, attn.k_proj["weight"].shape[0] // attn.n_kv_heads)
    keys, values = (mx.random.normal(shape, key=mx.random.key(i)) for i in (1, 2))
    x = mx.random.normal((1, 1, model.args.hidden_size), key=mx.random.key(3))
    at = mx.array(offset, dtype=mx.int32)
    theirs = FixedKV(mx.array(keys), mx.array(values), at)
    want = own.__call__(block, x, theirs.make_mask(1), theirs)
    ours = FixedKV(mx.array(keys), mx.array(values), at)
    got = block(x, None, ours)
    assert mx.allclose(got, want, rtol=1e-4, atol=1e-4).item(), mx.abs(got - want).max().item()
    for mine, their, before in ((ours.keys, theirs.keys, keys), (ours.values, theirs.values, values)):
        assert mx.allclose(mine[:, :, offset], their[:, :, offset], rtol=1e-5, atol=1e-5).item()
        assert not mx.allclose(mine[:, :, offset], before[:, :, offset]).item()
        assert mx.array_equal(mine[:, :, :offset], before[:, :, :offset]).item()
        assert mx.array_equal(mine[:, :, offset + 1:], before[:, :, offset + 1:]).item()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_a_batchs_decode_step_is_the_layers_own_code_and_each_row_alone(arch):
    """One token of each of three rows over the compiled batch step's cache (a shared write
    slot, each row at its own position, its left padding unseen): the native step gives
    the layer's own output, writes every row's key and value at the slot and nothing else,
    and each row's output is what the row computes alone over its own slots."""
    from mlxkv.engine.batch_step import FixedBatchKV
    from mlxkv.engine.compiled_step import FixedKV
    from mlxkv.engine.weight_layout import layout_for_cpu

    model = _tiny_llama(9, arch)
    layout_for_cpu(model)
    block = model.model.layers[0]
    own = type(block).__mro__[1]
    attn = block.self_attn
    at, padding = 300, [0, 40, 299]  # the last row has one earlier slot
    shape = (3, attn.n_kv_heads, 512, attn.k_proj["weight"].shape[0] // attn.n_kv_heads)
    keys, values = (mx.random.normal(shape, key=mx.random.key(i)) for i in (1, 2))
    x = mx.random.normal((3, 1, model.args.hidden_size), key=mx.random.key(3))

    def batch_kv() -> FixedBatchKV:
        return FixedBatchKV(mx.array(keys), mx.array(values), mx.array([at], dtype=mx.int32),
                            mx.array([at - p for p in padding], dtype=mx.int32), mx.array(padding, dtype=mx.int32))

    theirs, ours = batch_kv(), batch_kv()
    want = own.__call__(block, x, theirs.make_mask(1), theirs)
    got = block(x, None, ours)
    graph = io.StringIO()
    mx.export_to_dot(graph, got)
    assert "LayerRest" in graph.getvalue()  # the native step, not the layer's own code
    assert mx.allclose(got, want, rtol=1e-4, atol=1e-4).item(), mx.abs(got - want).max().item()
    for mine, their, before in ((ours.keys, theirs.keys, keys), (ours.values, theirs.values, values)):
        assert mx.allclose(mine[:, :, at], their[:, :, at], rtol=1e-5, atol=1e-5).item()
        assert mx.array_equal(mine[:, :, :at], before[:, :, :at]).item()
        assert mx.array_equal(mine[:, :, at + 1:], before[:, :, at + 1:]).item()
    for b, pad in enumerate(padding):  # the row alone: its slots from its first on
        alone = FixedKV(mx.array(keys[b:b + 1, :, pad:]), mx.array(values[b:b + 1, :, pad:]),
                        mx.array(at - pad, dtype=mx.int32))
        row = block(x[b:b + 1], None, alone)
        assert mx.allclose(row[0], got[b], rtol=1e-5, atol=1e-5).item(), mx.abs(row[0] - got[b]).max().item()
        assert mx.array_equal(alone.keys[0, :, at - pad], ours.keys[b, :, at]).item()


def test_a_layers_native_step_leaves_everything_else_to_its_own_code():
    """A prompt chunk, a plain KVCache, a layer with biases: the layer's own code."""
    from mlx_lm.models.cache import make_prompt_cache

    from mlxkv.engine.native_layers import use_native_blocks
    from mlxkv.engine.weight_layout import layout_for_cpu

    model = _tiny_llama(6)
    prompt = mx.array([[3, 1, 4, 1, 5, 9]])
    want = model(prompt, cache=make_prompt_cache(model))
    layout_for_cpu(model)
    got = model(prompt, cache=make_prompt_cache(model))  # a chunk over KVCache layers
    assert mx.allclose(got, want, rtol=1e-4, atol=1e-4).item()
    biased = _tiny_llama(7, attention_bias=True)
    layout_for_cpu(biased)
    assert all(type(layer).__name__ == "TransformerBlock" for layer in biased.model.layers)
    assert use_native_blocks(biased) == 0


def test_the_compiled_steps_layers_write_the_cache_in_place():
    """Greedy steps of the compiled step (as plain decoding runs them, each built while the
    last is in flight): every layer writes its slot into the buffers it was handed, never a
    copy of them (a copy per step would read and write the whole cache every token), and
    the tokens are the model's own forward pass's."""
    from mlx_lm.models.cache import make_prompt_cache

    from mlxkv.engine import _row_product
    from mlxkv.engine.compiled_step import CompiledStep
    from mlxkv.engine.weight_layout import layout_for_cpu

    model = _tiny_llama(8)
    prompt = mx.array([[2, 7, 1, 8, 2, 8]])

    def greedy(step, cache, n: int) -> list[int]:
        logits = model(prompt, cache=cache)[0, -1:]
        y = mx.argmax(logits, axis=-1)
        out = []
        for _ in range(n):
            nxt = mx.argmax(step(y[None], cache), axis=-1)
            mx.async_eval(nxt)
            out.append(y.item())
            y = nxt
        return out

    want = greedy(lambda t, c: model(t, cache=c)[0, -1:], make_prompt_cache(model), 12)
    layout_for_cpu(model)
    step = CompiledStep(model)
    assert greedy(step, make_prompt_cache(model), 12) == want  # the check, the first traces
    assert step.enabled
    before = _row_product.buffer_copies()
    assert greedy(step, make_prompt_cache(model), 12) == want
    # at most the first step's (the prompt's buffers, still held by the cache that filled them)
    assert _row_product.buffer_copies() - before <= 2 * len(model.model.layers)
