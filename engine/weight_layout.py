"""How a model's float matrices lie in memory on the CPU backend.

mlx-lm's ``nn.Linear`` computes ``x @ weight.T`` with ``weight`` stored [out, in], and the
tied LM head ``embed_tokens.as_linear`` does the same with the [vocab, hidden] embedding.
On the CPU backend every matmul is one ``sgemm`` call, and a decode step's matmuls have a
few rows (one per stream decoding). A decode step reads every weight once, so how BLAS
walks them decides its speed.

OpenBLAS runs a product in one of two ways. A small one (rows x out x in at most
:data:`SMALL_PRODUCT`, 10^6, with the matrix not transposed) goes to its "small-matrix"
kernels, which read the matrix straight from memory; a larger one is first copied,
block by block, into a packed buffer (``sgemm_itcopy``), then multiplied. For a few rows
nothing amortises that copy: profiled on a batched decode step of the real model
(SmolLM2-135M, 8 rows), 47% of the step was the packing copy and 11% the multiplication,
and every product of 2 or more rows (and the 49,152 x 576 LM head even for one row) took
that path, in mlx-lm's layout and in a plain transposed one alike.

:func:`layout_for_cpu` therefore stores each float ``nn.Linear`` / ``nn.Embedding``
weight as column chunks, a contiguous [n, in, c] array: chunk ``i`` holds output columns
``i*c .. (i+1)*c`` laid out [in, c], with ``c`` the widest divisor of ``out`` for which
:data:`ROWS` rows x c x in stays within :data:`SMALL_PRODUCT`. A product is then one
batched matmul (``x @ chunks``, which MLX runs as ``n`` sgemm calls, each a small-matrix
kernel for up to ``ROWS`` rows) and a copy of the small [n, rows, c] result into [rows,
out]. Measured on the real model's matrices (cold in memory, OpenBLAS SkylakeX kernels, one
thread): the 30 layers' products for 1 / 2 / 4 / 8 rows 52 / 101 / 115 / 119 ms stored
[in, out] and 55 / 65 / 78 / 88 ms chunked; the LM head 26 -> 12 ms for one row and
28 -> 21 ms for 8. Every output is the same dot product over ``in`` as before; a chunked
product of several rows is bit for bit the product of each row alone (the same kernel
sums each dot product in the same order), so a batched row computes what it computes
alone. Against mlx-lm's own layout the products are equal up to the rounding of the order
BLAS sums in (greedy output is checked token-identical), and the prefix cache's namespace
does not change. A product of more than ``ROWS`` rows (a prefill chunk) runs ``n`` packed
sgemm calls instead of one, measured within a few percent of one call at 512 rows.

The modules keep their class's behaviour and their ``weight`` (a lazy [out, in] view built
from the chunks, for code that reads its shape); they change class in place
(:class:`ChunkedLinear`, :class:`ChunkedEmbedding`), so whatever holds a module (a draft
or MTP head sharing the embedding) sees the new layout and no copy of the old weight stays
alive. The embedding lookup gathers each token's row from the chunks.

The copy costs about as long as a few decode steps (0.6 s for the real model's 540 MB on a
quiet machine, several seconds on a loaded one), so it is not made at load, where a
one-shot ``mlxkv generate`` would wait for it before its first token, but at a model's
first decoding (``engine.decoding.decode_step``). Not on Metal or CUDA (their
matrix-vector kernels read [out, in] rows), not for quantized layers, and not for module
classes other than these two exactly (a subclass may read its weight another way).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

_DONE = "_mlxkv_cpu_layout"
SMALL_PRODUCT = 10**6  # OpenBLAS's small-matrix kernels take rows * cols * depth up to this
ROWS = 8  # rows a chunk's product keeps within SMALL_PRODUCT (the default max_batch)


def chunk_width(out: int, depth: int, rows: int = ROWS) -> int:
    """The widest divisor ``c`` of ``out`` with ``rows * c * depth <= SMALL_PRODUCT``."""
    c = max(1, min(out, SMALL_PRODUCT // max(1, rows * depth)))
    while out % c:
        c -= 1
    return c


def to_chunks(weight: mx.array, rows: int = ROWS) -> mx.array:
    """A [out, in] weight as its contiguous [n, in, c] column chunks (evaluated)."""
    out, depth = weight.shape
    c = chunk_width(out, depth, rows)
    chunks = mx.contiguous(weight.T.reshape(depth, out // c, c).transpose(1, 0, 2))
    mx.eval(chunks)
    return chunks


def chunked_product(x: mx.array, chunks: mx.array) -> mx.array:
    """``x @ weight.T`` for a weight stored as ``chunks`` ([..., in] -> [..., out])."""
    n, depth, c = chunks.shape
    lead = x.shape[:-1]
    rows = x.reshape(-1, depth)
    y = (rows @ chunks).transpose(1, 0, 2).reshape(rows.shape[0], n * c)
    return y.reshape(*lead, n * c)


def _weight_of(chunks: mx.array) -> mx.array:
    n, depth, c = chunks.shape
    return chunks.transpose(0, 2, 1).reshape(n * c, depth)  # lazy: only its shape is usually read


class ChunkedLinear(nn.Linear):
    """An ``nn.Linear`` whose weight is stored as column chunks (see the module doc)."""

    @property
    def weight(self) -> mx.array:
        return _weight_of(self["chunks"])

    def __call__(self, x: mx.array) -> mx.array:
        y = chunked_product(x, self["chunks"])
        return y + self["bias"] if "bias" in self else y


class ChunkedEmbedding(nn.Embedding):
    """An ``nn.Embedding`` whose [vocab, hidden] table is stored as column chunks of its
    transpose: the tied LM head (``as_linear``) is a chunked product, a lookup gathers
    each token's row from the chunks."""

    @property
    def weight(self) -> mx.array:
        return _weight_of(self["chunks"])

    def __call__(self, x: mx.array) -> mx.array:
        chunks = self["chunks"]
        _, hidden, c = chunks.shape
        tokens = x.reshape(-1)
        start = (tokens // c) * (hidden * c) + tokens % c  # element (token, 0) in the chunks
        at = start[:, None] + (mx.arange(hidden) * c)[None]
        return mx.take(chunks.reshape(-1), at).reshape(*x.shape, hidden)

    def as_linear(self, x: mx.array) -> mx.array:
        return chunked_product(x, self["chunks"])


_CHUNKED = {nn.Linear: ChunkedLinear, nn.Embedding: ChunkedEmbedding}


def layout_for_cpu(model: Any) -> int:
    """Store ``model``'s float Linear and Embedding weights as column chunks (see above)
    when the default device is the CPU; the number of weights changed (0 elsewhere, or
    when done before). One matrix at a time, so the layout needs one extra matrix of
    memory at most."""
    if mx.default_device() != mx.cpu or not isinstance(model, nn.Module) or getattr(model, _DONE, False):
        return 0  # (a model wrapped in a plain object keeps its layout: nothing to walk)
    changed = 0
    for _, module in model.named_modules():
        kind = _CHUNKED.get(type(module))
        if kind is None or "weight" not in module:
            continue
        weight = module["weight"]
        if weight.ndim != 2 or not mx.issubdtype(weight.dtype, mx.floating):
            continue
        chunks = to_chunks(weight)
        del module["weight"]
        module["chunks"] = chunks
        module.__class__ = kind  # in place: every holder of the module sees the new layout
        changed += 1
    object.__setattr__(model, _DONE, True)
    return changed
