"""Converting mlx-lm prompt caches to and from the prefix cache's pieces.

Two shapes of state exist:

* **Token-indexed layers** (``KVCache``, ``QuantizedKVCache``): every array has the token
  axis at position 2 (``[B, H, T, X]``), so any token range can be cut out, shared between
  conversations and trimmed. A prompt cache made only of these is a *block cache*.
* **Everything else** (``RotatingKVCache`` rings, ``ArraysCache`` SSM / linear-attention
  state, hybrids): the state is only meaningful at the exact position it was taken, so it is
  kept as a whole *checkpoint* and restored only there.

Lending never copies: a restored cache gets new ``mx.array`` objects that share their
buffers with the stored state. MLX arrays are values, and a slice assignment into a shared
buffer cannot donate it, so the first write made by the borrower copies (copy-on-write);
the stored state never changes.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeAlias

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, RotatingKVCache

from mlxkv.engine.cache import buffers

log = logging.getLogger("mlxkv.cache")

# mlx-lm grows KV buffers in steps of this many tokens; lent caches get headroom in the same
# unit so the first prefill writes in place instead of reallocating.
KV_STEP = 256

# One layer of an mlx-lm prompt cache (KVCache, QuantizedKVCache, RotatingKVCache,
# ArraysCache): mlx-lm leaves their attributes unannotated, so they are used untyped.
LayerCache: TypeAlias = Any
# An mlx-lm prompt cache: one layer cache per model layer.
PromptCache: TypeAlias = list[LayerCache]
# A checkpointed layer's ``state``: arrays, ints and None in nested tuples and lists.
LayerState: TypeAlias = Any

BLOCK_TYPES = (KVCache, QuantizedKVCache)
CHECKPOINT_TYPES = (KVCache, QuantizedKVCache, RotatingKVCache, ArraysCache)


class UnsupportedCache(TypeError):
    """A prompt cache with a layer type the prefix cache does not know how to keep."""


def is_block_cache(cache: PromptCache) -> bool:
    """True when every layer is token-indexed (cut, shared and trimmed at any token)."""
    return bool(cache) and all(type(c) in BLOCK_TYPES for c in cache)


def check_supported(cache: PromptCache) -> None:
    for i, c in enumerate(cache):
        if type(c) not in CHECKPOINT_TYPES:
            raise UnsupportedCache(f"layer {i}: cache type {type(c).__name__} is not supported")


def cache_tokens(cache: PromptCache) -> int | None:
    """Tokens the cache holds, from its first offset-carrying layer (None: no such layer)."""
    for c in cache:
        if isinstance(c, (KVCache, QuantizedKVCache, RotatingKVCache)):
            return int(c.offset)
    return None


def fresh(a: mx.array) -> mx.array:
    """A new array object sharing ``a``'s buffer (no copy)."""
    return copy.copy(a)


def _map_arrays(obj: LayerState, fn: Callable[[mx.array], mx.array]) -> LayerState:
    if isinstance(obj, mx.array):
        return fn(obj)
    if isinstance(obj, tuple):
        return tuple(_map_arrays(o, fn) for o in obj)
    if isinstance(obj, list):
        return [_map_arrays(o, fn) for o in obj]
    return obj


def _collect_arrays(obj: LayerState, out: list[mx.array]) -> list[mx.array]:
    if isinstance(obj, mx.array):
        out.append(obj)
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            _collect_arrays(o, out)
    return out


# ----------------------------------------------------------------------------- block layers
@dataclass(frozen=True)
class LayerSpec:
    """What a token-indexed layer is, apart from its arrays."""

    kind: str  # "kv" or "qkv"
    group_size: int = 0
    bits: int = 0


def layer_spec(c: LayerCache) -> LayerSpec:
    if type(c) is KVCache:
        return LayerSpec("kv")
    if type(c) is QuantizedKVCache:
        return LayerSpec("qkv", int(c.group_size), int(c.bits))
    raise UnsupportedCache(f"{type(c).__name__} is not a token-indexed cache")


def layer_arrays(c: LayerCache) -> list[mx.array]:
    """The token-axis-2 arrays of a block layer: [K, V] or [Kq, Ks, Kb, Vq, Vs, Vb]."""
    if c.keys is None:
        return []
    if type(c) is KVCache:
        return [c.keys, c.values]
    return [*c.keys, *c.values]


def make_layer(spec: LayerSpec, arrays: list[mx.array], offset: int) -> LayerCache:
    """A new mlx-lm layer cache holding ``arrays`` (token axis 2) with ``offset`` tokens."""
    c: LayerCache
    if spec.kind == "kv":
        c = KVCache()  # type: ignore[no-untyped-call]  # mlx-lm leaves __init__ unannotated
        if arrays:
            c.keys, c.values = arrays
    else:
        c = QuantizedKVCache(group_size=spec.group_size, bits=spec.bits)
        if arrays:
            c.keys, c.values = tuple(arrays[:3]), tuple(arrays[3:])
    c.offset = int(offset)
    return c


def round_up(n: int, step: int = KV_STEP) -> int:
    return (n + step - 1) // step * step


def assemble(pieces: list[tuple[list[list[mx.array]], int, int]], total_hint: int
             ) -> list[list[mx.array]]:
    """Per-layer arrays for consecutive token ranges taken from several slabs.

    ``pieces``: ``(slab_arrays, row0, ntokens)`` in token order. One piece gives views
    (no copy); several are concatenated once, with headroom up to ``total_hint`` tokens so
    the borrower's prefill writes in place instead of copying again.
    """
    n_layers = len(pieces[0][0])
    out: list[list[mx.array]] = []
    if len(pieces) == 1:
        arrays, row0, n = pieces[0]
        for layer in arrays:
            out.append([a[:, :, row0 : row0 + n] for a in layer])
        return out
    total = sum(p[2] for p in pieces)
    cap = max(round_up(total_hint), round_up(total))
    for li in range(n_layers):
        layer_out = []
        for ai in range(len(pieces[0][0][li])):
            parts = [arrays[li][ai][:, :, row0 : row0 + n] for arrays, row0, n in pieces]
            ref = parts[0]
            if cap > total:
                parts.append(mx.zeros((*ref.shape[:2], cap - total, *ref.shape[3:]), ref.dtype))
            layer_out.append(mx.concatenate(parts, axis=2))
        out.append(layer_out)
    return out


def compact(arrays: list[list[mx.array]], row0: int, row1: int) -> list[list[mx.array]]:
    """A copy of rows [row0, row1) of every array, owning its own (exactly sized) buffers."""
    return [[mx.contiguous(a[:, :, row0:row1]) for a in layer] for layer in arrays]


def arrays_nbytes(arrays: LayerState) -> int:
    return sum(a.nbytes for a in _collect_arrays(arrays, []))


# ----------------------------------------------------------------------------- checkpoints
@dataclass
class Checkpoint:
    """The whole state of a prompt cache at one position (any layer types)."""

    layers: list[tuple[type[LayerCache], LayerState]]  # (cache class, state: shared views)
    nbytes: int

    def arrays(self) -> list[mx.array]:
        return _collect_arrays([s for _, s in self.layers], [])


def take_checkpoint(cache: PromptCache) -> Checkpoint:
    """Capture ``cache`` without copying: new array objects over the same buffers."""
    check_supported(cache)
    layers = []
    for c in cache:
        layers.append((type(c), _map_arrays(c.state, fresh)))
    checkpoint = Checkpoint(layers, 0)
    arrs = checkpoint.arrays()
    mx.eval(arrs)
    checkpoint.nbytes = sum(a.nbytes for a in arrs)
    return checkpoint


def lend_checkpoint(checkpoint: Checkpoint) -> PromptCache:
    """A new prompt cache in the checkpoint's state, sharing its buffers (copy-on-write)."""
    out = []
    for cls, state in checkpoint.layers:
        out.append(cls.from_state(_map_arrays(state, fresh)))
    return out


# ----------------------------------------------------------------------------- buffers
def writable_arrays(shapes: list[tuple[int, ...]], dtypes: list[mx.Dtype],
                    huge: bool = False, populate: bool = True) -> list[mx.array]:
    """Evaluated arrays, each backed by its own writable, C-contiguous buffer.

    Restores write into them through the buffer protocol (on the reader thread) with no
    second copy. They are allocated without a zero fill (see :mod:`engine.cache.buffers`):
    their bytes are unspecified until the restore writes them, and only restored rows are
    ever inside a cache's ``offset``. Where that allocation fails, zero-filled arrays are
    used instead. A broadcast of one element, a shared or read-only buffer are checked for,
    never assumed away. ``huge``: ask for transparent huge pages, ``populate``: pre-fault
    the pages here (see ``buffers.prefault``).
    """
    arrays = None
    if buffers.unfilled_usable():
        try:
            arrays = buffers.unfilled_arrays(shapes, dtypes, populate=populate, huge=huge)
        except Exception as exc:  # noqa: BLE001  (an MLX without the .npy stream path)
            buffers.give_up_unfilled(f"cannot allocate unfilled restore buffers ({exc})")
    if arrays is None:
        arrays = buffers.zeroed_arrays(shapes, dtypes)
    seen: set[int] = set()
    for i, a in enumerate(arrays):
        if tuple(a.shape) != tuple(shapes[i]) or a.dtype != dtypes[i]:
            raise RuntimeError(f"allocated {a.dtype} {a.shape}, not {dtypes[i]} {shapes[i]}")
        mv = buffers.memory_of(a)
        n = a.size * a.itemsize
        addr = _address(mv)
        if mv.readonly or not mv.c_contiguous or mv.nbytes != n or (n and addr in seen):
            a = mx.contiguous(mx.zeros(a.shape, a.dtype) + mx.zeros(a.shape, a.dtype))
            mx.eval(a)
            mv = buffers.memory_of(a)
            addr = _address(mv)
            if mv.readonly or not mv.c_contiguous or mv.nbytes != n or (n and addr in seen):
                raise RuntimeError(f"cannot allocate a writable {a.dtype} buffer of {a.shape}")
            arrays[i] = a
        seen.add(addr)
    return arrays


def _address(mv: memoryview) -> int:
    import numpy as np

    return int(np.frombuffer(mv.cast("B"), dtype=np.uint8).ctypes.data) if mv.nbytes else 0


def byte_view(a: mx.array) -> memoryview:
    """A flat byte view of an evaluated, C-contiguous array (no copy)."""
    mv = buffers.memory_of(a)
    if not mv.c_contiguous:
        raise ValueError("array is not C-contiguous")
    return mv.cast("B")
