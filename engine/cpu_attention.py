"""Attention of several queries at once (prefill chunks, speculative verifies) on the CPU
backend, with a vectorised exponential; and the MLP's ``silu(gate) * up`` of several
positions (:func:`swiglu`), for the same reason.

MLX's CPU softmax takes ``exp`` one element at a time, which dominates attention over a
long context. :func:`attention` computes the same products, mask and normalisation but
takes ``exp(x)`` as ``2**n * 2**f`` (a polynomial for the fraction, exponent bits for the
whole part) fused by ``mx.compile`` into one vectorised pass; it equals MLX's output up to
rounding, and masked scores give exactly 0. Where the engine's primitives are built, no
mask, the causal one and boolean masks (a padded batch's, a sliding window's) take
``native_ops.chunk_attention`` instead: the same products and
exp, in blocks of keys whose scores never leave the cache (flash attention), over every
core. :func:`use_on_this_thread` switches it on for
the calling thread only (the engine thread, reached through
``engine.mlx_lm_compat.install_attention``); one query, a quantized KV cache, attention
sinks, another dtype than float32 and every other device keep MLX's kernel.
"""

from __future__ import annotations

import os
import threading
from types import ModuleType
from typing import Any

import mlx.core as mx

from mlxkv.engine import native_ops
from mlxkv.engine.traced import Traced

_LOG2E = 1.4426950408889634
# 2**f on [0, 1): the Taylor series of exp(f * ln 2), to degree 7 (relative error < 1e-6)
_C = (1.0, 0.6931471805599453, 0.2402265069591007, 0.05550410866482158, 0.009618129107628477,
      0.0013333558146428443, 0.00015403530393381609, 1.525273380405984e-05)

_local = threading.local()


def use_on_this_thread(on: bool = True) -> None:
    """Compute attention of several queries with :func:`attention` on this thread (when
    :func:`applies`); ``on=False`` gives it back to MLX's kernel."""
    _local.on = bool(on)


def enabled() -> bool:
    return getattr(_local, "on", False)


def _exp_shifted(x: mx.array, row_max: mx.array) -> mx.array:
    """``exp(x - row_max)`` for ``x <= row_max`` (-inf gives 0)."""
    y = mx.maximum((x - row_max) * _LOG2E, -127.0)  # below 2**-126: 0 (n = -127 has no bits)
    n = mx.floor(y)
    f = y - n
    p = _C[7]
    for c in reversed(_C[:7]):
        p = p * f + c
    return p * ((n.astype(mx.int32) + 127) << 23).view(mx.float32)


_exp_compiled = Traced(_exp_shifted, "attention exp")


def applies(queries: mx.array, keys: mx.array, mask: Any, sinks: Any = None) -> bool:
    """Whether :func:`attention` computes this call (else MLX's kernel does)."""
    return (enabled() and queries.shape[2] > 1 and sinks is None and queries.dtype == mx.float32
            and keys.dtype == mx.float32 and mx.default_device() == mx.cpu
            and (mask is None or (isinstance(mask, str) and mask == "causal")
                 or (isinstance(mask, mx.array) and mask.ndim in (2, 4))))


# Scores of at most this many bytes at a time: the softmax's passes stay in the CPU's cache.
BLOCK_BYTES = 512 << 10
# With the row-softmax kernel the scores are read once per pass inside a row; a larger block
# means fewer, larger products.
KERNEL_BLOCK_BYTES = 32 << 20

_kernels: ModuleType | None  # the built extension (its interface: engine/_kernels.pyi), or None
try:
    from mlxkv.engine import _kernels
except ImportError:  # not built (a source tree without `make ext`): the MLX graph computes it
    _kernels = None


def _threads() -> int:
    """The kernels' threads: every core up to 8, or fewer where ``MLXKV_ROW_THREADS`` names
    a positive number (the one setting for all of the engine's own threads)."""
    cap = os.environ.get("MLXKV_ROW_THREADS", "")
    cores = os.cpu_count() or 1
    return max(1, min(8, int(cap) if cap.isdigit() and int(cap) > 0 else cores))


_THREADS = _threads()


def _tracing(error: ValueError) -> bool:
    """Whether ``error`` is MLX refusing an eval inside ``mx.compile`` or ``vmap``: the
    kernels need evaluated buffers, so a traced call takes the MLX graph (nothing was
    written yet)."""
    return "function transformations" in str(error)


def attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any) -> mx.array:
    """``softmax(scale * q @ k.T + mask) @ v`` for ``queries`` [B, H, L, D] and ``keys`` /
    ``values`` [B, Hk, S, D] (``H`` a multiple of ``Hk``: grouped queries share their KV
    head); ``mask`` None, ``"causal"`` (query ``i`` sees keys up to ``S - L + i``), or a
    boolean (True: attend) or additive array, [L, S] or [B, H or 1, L, S]. No mask, the
    causal one and a boolean one shared by the heads go to the engine's flash-style
    primitive where it is built (``native_ops.chunk_attention``: no score matrix in memory,
    every core, nothing evaluated while the graph is built); otherwise
    queries go in blocks whose scores take at most :data:`KERNEL_BLOCK_BYTES` (the
    row-softmax kernel) or :data:`BLOCK_BYTES` (the MLX graph, when the extension is not
    built)."""
    if mask is None or isinstance(mask, str) or mask.dtype == mx.bool_:  # the flash-style primitive
        out = native_ops.chunk_attention(queries, keys, values, scale, causal=isinstance(mask, str),
                                         mask=mask if isinstance(mask, mx.array) else None)
        if out is not None:
            return out
    b, h, length, d = queries.shape
    hk, s = keys.shape[1], keys.shape[2]
    rep = h // hk
    q = (queries * mx.array(scale, dtype=queries.dtype)).reshape(b, hk, rep, length, d)
    kt = keys.swapaxes(-1, -2)  # [B, Hk, D, S]
    m = mask
    if isinstance(m, mx.array) and m.ndim == 4:  # [B, H or 1, L, S] -> [B, Hk or 1, rep or 1, L, S]
        m = m.reshape(m.shape[0], hk, rep, length, s) if m.shape[1] == h else m[:, :, None]
    if _kernels is not None:
        try:
            return _kernel_attention(q, kt, values, m).reshape(b, h, length, d)
        except ValueError as e:  # traced (mx.compile of a multi-token step): the graph below
            if not _tracing(e):
                raise
    step = max(1, BLOCK_BYTES // (4 * b * h * s))
    outs = []
    for i in range(0, length, step):
        j = min(length, i + step)
        n = j - i
        rows = q[:, :, :, i:j].reshape(b, hk, rep * n, d)  # a group's queries share its keys
        scores = (rows @ kt).reshape(b, hk, rep, n, s)
        if isinstance(m, str):
            visible = mx.arange(s)[None] <= (mx.arange(i, j) + (s - length))[:, None]
            scores = mx.where(visible, scores, -mx.inf)
        elif m is not None:
            part = m[..., i:j, :] if m.shape[-2] == length else m
            scores = mx.where(part, scores, -mx.inf) if part.dtype == mx.bool_ else scores + part.astype(scores.dtype)
        exps = _exp_compiled(scores.shape, scores, scores.max(axis=-1, keepdims=True))
        p = exps / exps.sum(axis=-1, keepdims=True)
        outs.append((p.reshape(b, hk, rep * n, s) @ values).reshape(b, hk, rep, n, d))
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=3)
    return out.reshape(b, h, length, d)


def _kernel_attention(q: mx.array, kt: mx.array, values: mx.array, mask: Any) -> mx.array:
    """:func:`attention` with the softmax by the row kernel (``engine/kernels.h``), in place
    on each block's evaluated scores: [B, Hk, rep, L, D]. ``mask``: None, ``"causal"`` (the
    kernel's own limit per row), or an array as :func:`attention` reshaped it, applied to
    the scores first (a masked score becomes -inf, which the kernel weighs exactly 0; a row
    with nothing visible gets all 0 where MLX's softmax gives NaN)."""
    b, hk, rep, length, d = q.shape
    s = kt.shape[-1]
    causal = isinstance(mask, str)
    array = mask if isinstance(mask, mx.array) else None
    step = max(1, KERNEL_BLOCK_BYTES // (4 * b * hk * rep * s))
    outs = []
    for i in range(0, length, step):
        j = min(length, i + step)
        n = j - i
        rows = q[:, :, :, i:j].reshape(b, hk, rep * n, d)  # a group's queries share its keys
        scores = rows @ kt  # [B, Hk, rep * n, S]: row r is query i + r % n
        if array is not None:
            part = (array[..., i:j, :] if array.shape[-2] == length else array)
            grid = scores.reshape(b, hk, rep, n, s)
            grid = mx.where(part, grid, -mx.inf) if part.dtype == mx.bool_ else grid + part.astype(grid.dtype)
            scores = mx.contiguous(grid.reshape(b, hk, rep * n, s))
        mx.eval(scores)
        # A fresh result: C-contiguous, and nothing else holds its buffer.
        assert _kernels is not None  # the caller checked it is built
        _kernels.softmax_rows(scores, s, n, s - length + i + 1 if causal else s, _THREADS)
        outs.append((scores @ values).reshape(b, hk, rep, n, d))
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=3)


def swiglu_applies(gate: mx.array, up: mx.array) -> bool:
    """Whether :func:`swiglu` computes ``silu(gate) * up`` (else mlx-lm's compiled one):
    on a thread that opted in, float32 on the CPU, several positions (a prefill chunk or a
    verify), with the engine's primitive or the kernel built (the kernel alone finds a traced
    step of several positions when its eval is refused)."""
    return ((_kernels is not None or native_ops.native() is not None) and enabled()
            and gate.ndim >= 2 and gate.shape[-2] > 1
            and gate.shape == up.shape and gate.dtype == mx.float32 and up.dtype == mx.float32
            and mx.default_device() == mx.cpu)


def swiglu(gate: mx.array, up: mx.array) -> mx.array | None:
    """``silu(gate) * up`` in one vectorised pass where MLX's CPU backend takes ``exp`` an
    element at a time; equal up to rounding. The engine's primitive where it is built
    (``native_ops.swiglu``: an operation of the graph, computed when it is evaluated, so a
    prefill chunk evaluated layer by layer still stops between two), else the kernel
    (``engine/kernels.h``) on buffers evaluated here and now. None when the kernel cannot
    read a buffer as one block, or cannot run inside a traced function (the caller
    computes it the usual way)."""
    out = native_ops.swiglu(gate, up)
    if out is not None:
        return out
    out = gate * mx.array(1.0, dtype=gate.dtype)  # a buffer of our own to write into
    # ``up`` may be a view: a grouped product's columns (engine.weight_layout), rows a
    # whole gate-and-up width apart. MLX exports a view's buffer as it lies, whatever
    # contiguity the reader asks for, so the kernel would read the wrong columns.
    up = mx.contiguous(up)
    try:
        mx.eval(out, up)
    except ValueError as e:  # traced (mx.compile of a multi-token step): mlx-lm's own
        if not _tracing(e):
            raise
        return None
    if not all(memoryview(a).c_contiguous for a in (out, up)):  # type: ignore[arg-type]  # (mlx's stubs omit the buffer protocol)
        return None
    assert _kernels is not None  # swiglu_applies checked it is built
    try:
        _kernels.swiglu(out, up, _THREADS)
    except BufferError:
        return None
    return out
