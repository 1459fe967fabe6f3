"""The engine's MLX primitives for the CPU (``engine/native/row_product.cpp``, built by
``make ext``): few-row products over every core (``row_product``, used by
``engine.weight_layout``), a decode step's attention over a cache's filled slots
(``slot_attention``, used by the compiled step's caches, ``engine.compiled_step``), the
attention of a prompt chunk or a verify's queries (``chunk_attention``) and a SwiGLU MLP's
``silu(gate) * up`` (``swiglu``), both used by ``engine.cpu_attention``, a norm and a rotary
embedding as one operation each (``rms_norm``, ``rope``), and a llama-shaped layer's decode
step as one operation (``decode_layer``), the last three used by ``engine.native_layers``.

Optional: where the module is not built, is switched off (``MLXKV_ROW_PRODUCT=0``), or does
not work with this mlx (a nanobind ABI apart from mlx's makes it refuse mx.array), the
callers keep their MLX paths. It is checked once, on a small product and a small attention
against MLX's own, on the first caller's thread (the engine's, which owns the model).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import mlx.core as mx
import mlx.nn as nn

log = logging.getLogger("mlxkv.engine")

MAX_ROWS = 40  # rows up to which a row product beats sgemm at the real model's shapes (48: by 7%)
MAX_QUERY_ROWS = 64  # queries per KV head a slot attention takes (the module's own limit)
MAX_GROUP = 64  # query heads per KV head a chunk attention takes (the module's own limit)

_module: Any = None
_checked = False


def _works(module: Any) -> str | None:
    """Why ``module``'s primitives do not compute what MLX does on small inputs, or None."""
    x = mx.arange(6, dtype=mx.float32).reshape(2, 3)
    w = mx.arange(12, dtype=mx.float32).reshape(4, 3)
    if not mx.array_equal(module.row_product(x, w, stream=mx.cpu), x @ w.T).item():
        return "its row product differs from x @ w.T"
    q, k = mx.ones((1, 2, 1, 4)), mx.arange(24, dtype=mx.float32).reshape(1, 1, 6, 4) / 24
    got = module.slot_attention(q, k, k, mx.array(3, dtype=mx.int32), 0.5, stream=mx.cpu)
    scores = mx.softmax((q * 0.5) @ k[:, :, :4].swapaxes(-1, -2), axis=-1)
    if not mx.allclose(got, scores @ k[:, :, :4], rtol=1e-5, atol=1e-6).item():
        return "its slot attention differs from MLX's"
    q, k = mx.ones((1, 3, 2, 4)) / 2, mx.arange(24, dtype=mx.float32).reshape(1, 1, 6, 4) / 24
    got = module.chunk_attention(q, k, k, 0.5, 5, stream=mx.cpu)
    want = mx.fast.scaled_dot_product_attention(q, k, k, scale=0.5, mask="causal", stream=mx.cpu)
    if not mx.allclose(got, want, rtol=1e-5, atol=1e-6).item():
        return "its chunk attention differs from MLX's"
    x, g = mx.arange(8, dtype=mx.float32).reshape(2, 4) / 8, mx.arange(4, dtype=mx.float32) + 1
    if not mx.allclose(module.rms_norm(x, g, 1e-5, stream=mx.cpu), mx.fast.rms_norm(x, g, 1e-5),
                       rtol=1e-5, atol=1e-6).item():
        return "its rms_norm differs from MLX's"
    q = mx.arange(48, dtype=mx.float32).reshape(1, 2, 3, 8) / 48
    got = module.rope(q, mx.array(5, dtype=mx.int32), 6, False, 10000.0, 1.0, stream=mx.cpu)
    if not mx.allclose(got, mx.fast.rope(q, 6, traditional=False, base=10000.0, scale=1.0, offset=5),
                       rtol=1e-5, atol=1e-6).item():
        return "its rope differs from MLX's"
    g = mx.arange(-8, 8, dtype=mx.float32).reshape(2, 8) * 1.5
    if not mx.allclose(module.swiglu(g, g + 1, stream=mx.cpu), nn.silu(g) * (g + 1),
                       rtol=1e-5, atol=1e-6).item():
        return "its swiglu differs from MLX's"
    return None


def native() -> Any:
    """The built module, or None (see the module doc)."""
    global _module, _checked
    if _checked:
        return _module
    _checked = True
    if os.environ.get("MLXKV_ROW_PRODUCT", "1") == "0":
        return None
    try:
        from mlxkv.engine import _row_product as module
    except ImportError as e:
        log.debug("the CPU primitives are not built (%s): MLX's paths", e)
        return None
    try:
        why = _works(module)
    except (TypeError, RuntimeError, ValueError, AttributeError) as e:  # (an older build lacks one)
        why = str(e)
    if why is not None:
        log.warning("the CPU primitives do not work with this mlx (%s): MLX's paths", why)
        return None
    _module = module
    return module


def row_product(x: mx.array, weight: mx.array) -> mx.array | None:
    """``x @ weight.T`` by the row product when it takes it (built, float32, at most
    :data:`MAX_ROWS` rows, the CPU), else None."""
    module = native()
    rows = x.size // x.shape[-1] if module is not None and x.ndim and x.shape[-1] else 0
    if (0 < rows <= MAX_ROWS and x.dtype == mx.float32 and weight.dtype == mx.float32
            and weight.ndim == 2 and mx.default_device() == mx.cpu):
        return module.row_product(x, weight, stream=mx.cpu)
    return None


def slot_attention(queries: mx.array, keys: mx.array, values: mx.array, offset: mx.array,
                   scale: float, start: mx.array | None = None) -> mx.array | None:
    """Attention of ``queries`` [B, H, L, D] over the buffers ``keys`` / ``values`` [B, Hk,
    S, D], query ``l`` seeing slots ``[0, offset + l]`` (with ``start``, int32 [B]: batch
    row ``b`` from slot ``start[b]`` on, its left padding unseen), when the primitive takes
    it (built, float32, at most :data:`MAX_QUERY_ROWS` queries per KV head, the CPU), else
    None."""
    module = native()
    if (module is None or mx.default_device() != mx.cpu or queries.ndim != 4 or keys.ndim != 4
            or queries.dtype != mx.float32 or keys.dtype != mx.float32 or values.dtype != mx.float32
            or queries.shape[1] % keys.shape[1]
            or (queries.shape[1] // keys.shape[1]) * queries.shape[2] > MAX_QUERY_ROWS):
        return None
    return module.slot_attention(queries, keys, values, offset, float(scale), start=start, stream=mx.cpu)


def chunk_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
                    causal: bool, mask: mx.array | None = None) -> mx.array | None:
    """Attention of ``queries`` [B, H, L, D] (a prompt chunk, a verify) over ``keys`` /
    ``values`` [B, Hk, S, D], every query seeing every key, or with ``causal`` query ``l``
    seeing keys ``[0, S - L + l]``, or the keys a boolean ``mask`` [L, S] or [B or 1, 1, L,
    S] marks (mlx-lm's masks of a padded batch or a sliding window; read when the
    operation runs, so the graph stays lazy), when the primitive takes it (built, float32,
    at most 64 query heads per KV head, the CPU), else None."""
    module = native()
    if (module is None or mx.default_device() != mx.cpu or queries.ndim != 4 or keys.ndim != 4
            or queries.dtype != mx.float32 or keys.dtype != mx.float32 or values.dtype != mx.float32
            or queries.shape[1] % keys.shape[1] or queries.shape[1] // keys.shape[1] > MAX_GROUP
            or keys.shape != values.shape):
        return None
    length, slots = queries.shape[2], keys.shape[2]
    if mask is not None:
        shape = tuple(mask.shape)
        if mask.dtype != mx.bool_ or shape not in ((length, slots), (1, 1, length, slots),
                                                    (queries.shape[0], 1, length, slots)):
            return None
        return module.chunk_attention(queries, keys, values, float(scale), slots, mask=mask, stream=mx.cpu)
    first = slots - length + 1 if causal else slots
    return module.chunk_attention(queries, keys, values, float(scale), first, stream=mx.cpu)


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array | None:
    """``mx.fast.rms_norm(x, weight, eps)`` as one operation when the primitive takes it
    (built, float32, the CPU), else None."""
    module = native()
    if (module is None or mx.default_device() != mx.cpu or x.dtype != mx.float32
            or weight.dtype != mx.float32 or weight.ndim != 1 or x.ndim < 1 or x.shape[-1] != weight.shape[0]):
        return None
    return module.rms_norm(x, weight, float(eps), stream=mx.cpu)


def rope(x: mx.array, offset: int | mx.array, dims: int, traditional: bool, base: float | None,
         scale: float, freqs: mx.array | None = None) -> mx.array | None:
    """``mx.fast.rope`` of ``x`` ([B, ..., T, D]) at ``offset`` (an int, or an array: one, or
    one per batch row) as one operation when the primitive takes it (built, float32, 3 or 4
    dimensions, the CPU), else None."""
    module = native()
    if (module is None or mx.default_device() != mx.cpu or x.dtype != mx.float32 or x.ndim not in (3, 4)
            or (freqs is not None and freqs.dtype != mx.float32)):
        return None
    if not isinstance(offset, mx.array):
        offset = mx.array(offset, dtype=mx.int32)
    elif offset.dtype != mx.int32:
        offset = offset.astype(mx.int32)
    if offset.ndim > 1 or offset.size not in (1, x.shape[0]):
        return None
    return module.rope(x, offset, dims, traditional, None if base is None else float(base), float(scale), freqs,
                       stream=mx.cpu)


def swiglu(gate: mx.array, up: mx.array) -> mx.array | None:
    """``silu(gate) * up`` as one operation when the primitive takes it (built, float32, one
    shape, the CPU), else None."""
    module = native()
    if (module is None or mx.default_device() != mx.cpu or gate.dtype != mx.float32
            or up.dtype != mx.float32 or gate.shape != up.shape or gate.ndim < 1):
        return None
    return module.swiglu(gate, up, stream=mx.cpu)


def decode_layer(x: mx.array, weights: tuple[mx.array, ...], keys: mx.array, values: mx.array,
                 offset: mx.array, extras: dict[str, mx.array], positions: mx.array | None = None,
                 start: mx.array | None = None, **shape: Any) -> tuple[mx.array, mx.array, mx.array] | None:
    """One token of each row of ``x`` ([B, 1, hidden]) through a llama-shaped layer
    (``weights``: the two norms' and the grouped products', in ``_row_product.decode_layer``'s
    order; ``extras``: its q/k/v biases, ``bqkv``, and its heads' norms, ``q_norm`` and
    ``k_norm``, where it has them): the layer's output and the key and value buffers
    ([B, kv_heads, slots, head_dim]) with every row's slot ``offset`` written, or None where
    the primitive does not take it (not built, not float32, not the CPU). One row is rotated
    at position ``offset``; the rows of a batch at their ``positions`` ([B]), row ``b``
    seeing slots ``[start[b], offset]``."""
    module = native()
    if (module is None or mx.default_device() != mx.cpu or x.dtype != mx.float32 or x.ndim != 3
            or x.shape[1] != 1 or x.shape[0] > module.MAX_ROWS or (x.shape[0] > 1 and positions is None)
            or keys.dtype != mx.float32 or any(w.dtype != mx.float32 for w in (*weights, *extras.values()))):
        return None
    rows = {name: a if a.dtype == mx.int32 else a.astype(mx.int32)
            for name, a in (("positions", positions), ("start", start)) if a is not None}
    out, k, v = module.decode_layer(x, *weights, keys, values, offset, **extras, **rows, **shape, stream=mx.cpu)
    return out, k, v
