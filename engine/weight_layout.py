"""How a model's float matrices are multiplied on the CPU backend.

mlx-lm's ``nn.Linear`` computes ``x @ weight.T`` with ``weight`` stored [out, in], and the
tied LM head ``embed_tokens.as_linear`` does the same with the [vocab, hidden] embedding.
On the CPU backend every matmul is one ``sgemm`` call. A decode step's products have a few
rows (one per stream decoding) and read every weight once, so they are bound by how fast
the weights stream from memory; sgemm runs each on MLX's stream thread alone, and for two
or more rows (and for the LM head even for one) first packs the matrix into a buffer,
which nothing amortises at a few rows.

:func:`layout_for_cpu` changes each float ``nn.Linear`` / ``nn.Embedding`` so that its
products of up to ``native_ops.MAX_ROWS`` rows take one of two faster paths:

- **row products** (``engine/native/row_product.cpp``, an MLX primitive built by ``make
  ext``): the weight stays as it is; a product reads each [out, in] row once, straight from
  memory, whatever the number of rows, with the output columns split over every core by a
  pool of threads that stay awake between the products of a step. A product of more rows
  (a prefill chunk) is mlx-lm's own ``x @ weight.T``. Nothing is copied, so the layout is
  instant and the weights' memory is what mlx-lm loaded.
- **column chunks**, where the primitive is not built (no CMake or nanobind, or a mlx
  whose nanobind ABI differs): each weight is copied once into a contiguous [n, in, c]
  array, chunk ``i`` holding output columns ``i*c .. (i+1)*c`` laid out [in, c], with ``c``
  the widest divisor of ``out`` for which :data:`ROWS` rows x c x in stays within
  OpenBLAS's small-matrix limit (:data:`SMALL_PRODUCT`): a product is then one batched
  matmul of small-matrix kernels, which read the matrix unpacked, and a copy of the small
  [n, rows, c] result into [rows, out].

Either way every output is one dot product over ``in``, summed the same way for every row,
so a batched row computes bit for bit what it computes alone; against mlx-lm's layout the
products are equal up to the rounding of the order of summation (greedy output is checked
token-identical), and the prefix cache's namespace does not change. The modules keep their
class's behaviour and a ``weight`` of the same shape and numbers; they change class in place
(``RowLinear`` / ``RowEmbedding`` or ``ChunkedLinear`` / ``ChunkedEmbedding``), so whatever
holds a module (a draft model or MTP head sharing the embedding) sees the new path. Not on Metal
or CUDA (their matrix-vector kernels read [out, in] rows), not for quantized layers, and not
for module classes other than these two exactly (a subclass may read its weight another
way). ``MLXKV_ROW_PRODUCT=0`` keeps the chunked path (engine.native_ops).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxkv.engine.native_ops import native, row_product
from mlxkv.engine.side_table import SideTable

_DONE: SideTable[bool] = SideTable()  # the models laid out already
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
    def weight(self) -> mx.array:  # type: ignore[override]  # mlx declares a plain attribute; here derived
        return _weight_of(self["chunks"])

    def __call__(self, x: mx.array) -> mx.array:
        y = chunked_product(x, self["chunks"])
        return y + self["bias"] if "bias" in self else y


class ChunkedEmbedding(nn.Embedding):
    """An ``nn.Embedding`` whose [vocab, hidden] table is stored as column chunks of its
    transpose: the tied LM head (``as_linear``) is a chunked product, a lookup gathers
    each token's row from the chunks."""

    @property
    def weight(self) -> mx.array:  # type: ignore[override]  # mlx declares a plain attribute; here derived
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


def row_product_available() -> bool:
    """Whether few-row products on the CPU take the row-product primitive."""
    return native() is not None


class RowLinear(nn.Linear):
    """An ``nn.Linear`` whose few-row products are row products (see the module doc)."""

    def __call__(self, x: mx.array) -> mx.array:
        y = row_product(x, self["weight"])
        if y is None:
            return super().__call__(x)
        return y + self["bias"] if "bias" in self else y


class RowEmbedding(nn.Embedding):
    """An ``nn.Embedding`` whose tied LM head (``as_linear``) takes the row product for a
    few rows; the lookup is the embedding's own."""

    def as_linear(self, x: mx.array) -> mx.array:
        y = row_product(x, self["weight"])
        return super().as_linear(x) if y is None else y


_CHUNKED: dict[type[nn.Module], type[nn.Module]] = {nn.Linear: ChunkedLinear, nn.Embedding: ChunkedEmbedding}
_ROWS: dict[type[nn.Module], type[nn.Module]] = {nn.Linear: RowLinear, nn.Embedding: RowEmbedding}


def layout_for_cpu(model: Any, path: str = "auto") -> int:
    """Give ``model``'s float Linear and Embedding modules the CPU's few-row product (see
    above) when the default device is the CPU; the number of modules changed (0 elsewhere,
    or when done before). ``path``: "rows", "chunks" or "auto" (rows where built). Chunks
    are made one matrix at a time, so that layout needs one extra matrix of memory at most."""
    if mx.default_device() != mx.cpu or not isinstance(model, nn.Module) or _DONE.get(model):
        return 0  # (a model wrapped in a plain object keeps its layout: nothing to walk)
    built = row_product_available()
    if path == "rows" and not built:
        raise RuntimeError("the row product is not built here (make ext)")
    rows = path == "rows" or (path == "auto" and built)
    kinds = _ROWS if rows else _CHUNKED
    changed = 0
    for _, module in model.named_modules():
        kind = kinds.get(type(module))
        if kind is None or "weight" not in module:
            continue
        weight = module["weight"]
        if weight.ndim != 2 or not mx.issubdtype(weight.dtype, mx.floating):
            continue
        if not rows:
            chunks = to_chunks(weight)
            del module["weight"]
            module["chunks"] = chunks
        module.__class__ = kind  # by design, in place: every holder of the module sees the new path
        changed += 1
    _DONE.put(model, True)
    return changed
