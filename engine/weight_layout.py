"""How a model's float matrices are multiplied on the CPU backend.

A decode step's products have a few rows and read every weight once, so they are bound by
memory; MLX's CPU ``sgemm`` runs each on one thread and packs the matrix first, which
nothing amortises at a few rows. :func:`layout_for_cpu` gives each float ``nn.Linear`` /
``nn.Embedding`` one of two paths for products of up to ``native_ops.MAX_ROWS`` rows: the
row product (``engine/native/row_product.cpp``, built by ``make ext``: the weight read in
place, the columns split over every core) or, where that is not built, column chunks (the
weight copied once into [n, in, c] chunks a batched small-matrix product reads unpacked).
Either way each output is one dot product summed the same way for every row, so a batched
row computes what it computes alone, and mlx-lm's results are matched up to rounding.
Modules change class in place so every holder sees the new path; not on Metal or CUDA,
not for quantized layers or subclasses. ``MLXKV_ROW_PRODUCT=0`` keeps the chunked path.
"""

from __future__ import annotations

import os
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxkv.engine.native_layers import use_native_blocks, use_native_layers
from mlxkv.engine.native_ops import native, row_product
from mlxkv.engine.side_table import SideTable

_DONE: SideTable[bool] = SideTable()  # the models laid out already
SMALL_PRODUCT = 10**6  # OpenBLAS's small-matrix kernels take rows * cols * depth up to this
ROWS = 8  # rows a chunk's product keeps within SMALL_PRODUCT (the default max_batch)
GROUPED = os.environ.get("MLXKV_GROUPED_PRODUCTS", "1") != "0"  # see group_products


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


class _Group:
    """Products that read one input through several matrices stored as one (a layer's q, k
    and v projections; its gate and up): the first member's call multiplies the input by
    all of them in one row product, the others take their columns of that result. A
    product reads its matrix at the memory's speed only once it is large enough to keep
    every core streaming, and each one pays a dispatch and a wake of the pool; a layer's k
    and v (192 x 576 on the real model) are neither. ``fused`` is the members' weights end
    to end (each member's ``weight`` a view of its rows); ``bounds[i]``: member ``i``'s
    columns. Members must be called in order with the same input, as the architectures do;
    the first call with another input ends the grouping (each member then multiplies
    alone)."""

    def __init__(self, fused: mx.array, bounds: list[tuple[int, int]]):
        self.fused, self.bounds = fused, bounds
        self.on = True
        self._x: mx.array | None = None
        self._y: mx.array | None = None

    def product(self, i: int, x: mx.array) -> mx.array | None:
        """Member ``i``'s ``x @ weight.T`` from the group's product, or None where the row
        product does not take ``x`` (the member multiplies by its own weight)."""
        if i == 0:
            self._x, self._y = x, row_product(x, self.fused)
        elif self._x is not x:  # not the input the first member had: no grouping from now on
            self.on, self._x, self._y = False, None, None
            return None
        y = self._y
        if i == len(self.bounds) - 1:
            self._x = self._y = None
        if y is None:
            return None
        a, b = self.bounds[i]
        return y[..., a:b]


class GroupedRowLinear(RowLinear):
    """A :class:`RowLinear` whose few-row product is its share of a :class:`_Group`'s."""

    group: _Group
    member: int

    def __call__(self, x: mx.array) -> mx.array:
        group = self.group
        y = group.product(self.member, x) if group.on else None
        if y is None:
            return RowLinear.__call__(self, x)
        return y + self["bias"] if "bias" in self else y


# Sibling projections that take the same input (mlx-lm's names), grouped into one product.
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def group_products(model: nn.Module) -> int:
    """Store each layer's sibling projections (:data:`GROUPS`) as one matrix whose products
    run once (:class:`_Group`); the number of groups made. Only plain ``RowLinear`` members
    of one dtype and input width, all with a bias or none."""
    made = 0
    for _, module in model.named_modules():
        for names in GROUPS:
            found = [module.get(n) for n in names]
            members = [m for m in found if type(m) is RowLinear]
            if len(members) != len(names):
                continue
            weights = [m["weight"] for m in members]
            if (len({(w.shape[1], w.dtype) for w in weights}) != 1
                    or len({"bias" in m for m in members}) != 1):
                continue
            fused = mx.concatenate(weights, axis=0)
            mx.eval(fused)
            bounds: list[tuple[int, int]] = []
            group, at = _Group(fused, bounds), 0
            for i, (m, w) in enumerate(zip(members, weights)):
                bounds.append((at, at + w.shape[0]))
                m["weight"] = fused[at:at + w.shape[0]]  # a view: the rows are stored once
                at += w.shape[0]
                m.__class__ = GroupedRowLinear
                m.group, m.member = group, i
            mx.eval([m["weight"] for m in members])
            made += 1
    return made


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
    if rows and GROUPED:
        group_products(model)
    if rows:  # the norms and rotations too, then whole layers' decode steps (not counted)
        use_native_layers(model)
        if GROUPED:
            use_native_blocks(model)
    _DONE.put(model, True)
    return changed
