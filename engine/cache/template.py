"""What a cache of a given model looks like, so a restored cache is checked before use.

A stored state passed every content hash and carries this namespace (the model, the
dtype, the layout and mlx-lm schema versions), yet it is still checked against the
model's own caches before it is lent: per layer the cache class, the KV heads, the
head sizes and dtype, a rotating window's size, an SSM state's array shapes. A state that
does not fit is a miss with a reason (the prompt is recomputed), never a cache that
breaks the model or, worse, silently attends over the wrong window.

The expected signature of a namespace comes from :meth:`Templates.learn` with a cache
the model produced: the engine's own caches as they are stored, or one made by
:func:`engine.generate.probe_model` (one token through the model, the same pass that
decides how the model is prefilled) when the model is bound at load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, RotatingKVCache

from mlxkv.engine.cache import kvblocks
from mlxkv.engine.cache.info import scope_base
from mlxkv.engine.cache.layout import LayoutError


@dataclass(frozen=True)
class LayerSig:
    """What one layer's cache must look like (batch and token counts left out)."""

    kind: str  # "block", "rotating", "arrays", or the class name
    heads: tuple[int, ...] = ()  # KV heads of keys and values
    dims: tuple[Dims | None, ...] = ()  # keys' and values' (plain KV), or each array's
    window: tuple[int, int] | None = None  # (max_size, keep) of a rotating cache


# (head sizes, or an array's shape past the batch axis; dtype)
Dims: TypeAlias = tuple[tuple[int, ...], str]


def _dims(a: mx.array) -> Dims:
    return (tuple(int(s) for s in a.shape[1:2] + a.shape[3:]), str(a.dtype))


def layer_sig(c: kvblocks.LayerCache) -> LayerSig:
    """The signature of a live (filled) mlx-lm layer cache."""
    t = type(c)
    if t is KVCache:
        if c.keys is None:
            return LayerSig("block")
        return LayerSig("block", (int(c.keys.shape[1]), int(c.values.shape[1])),
                        (_dims(c.keys), _dims(c.values)))
    if t is QuantizedKVCache:
        if c.keys is None:
            return LayerSig("block")
        return LayerSig("block", (int(c.keys[0].shape[1]), int(c.values[0].shape[1])))
    if t is RotatingKVCache:
        dims = () if c.keys is None else (_dims(c.keys), _dims(c.values))
        return LayerSig("rotating", (), dims, (int(c.max_size), int(c.keep)))
    if t is ArraysCache:
        return LayerSig("arrays", (), tuple(None if a is None else (tuple(a.shape[1:]), str(a.dtype))
                                            for a in c.cache))
    return LayerSig(t.__name__)


def mismatch(restored: LayerSig, expected: LayerSig) -> str | None:
    """Why ``restored`` cannot stand for ``expected`` (None: it can)."""
    if restored.kind != expected.kind:
        return f"a {restored.kind} cache where the model has a {expected.kind} cache"
    if restored.window != expected.window:
        return f"window (size, keep) {restored.window}, the model's is {expected.window}"
    if restored.heads and expected.heads and restored.heads != expected.heads:
        return f"{restored.heads} KV heads, the model has {expected.heads}"
    if restored.dims and expected.dims and restored.dims != expected.dims:
        # a quantized block layer has no dims to compare; a plain one must match exactly
        return f"state shapes/dtypes {restored.dims}, the model's are {expected.dims}"
    return None


class Templates:
    """Expected layer signatures per namespace (engine thread)."""

    def __init__(self) -> None:
        self._sigs: dict[str, tuple[LayerSig, ...]] = {}

    def known(self, ns: str) -> bool:
        return ns in self._sigs

    def learn(self, ns: str, cache: kvblocks.PromptCache, replace: bool = False) -> None:
        """Take the signature of a cache the model produced (the first one wins unless
        ``replace``). Empty layers (nothing computed yet) teach nothing."""
        if ns in self._sigs and not replace:
            return
        sigs = tuple(layer_sig(c) for c in cache)
        if any(s.kind in ("block", "rotating") and not s.heads and not s.dims for s in sigs):
            return
        self._sigs[ns] = sigs

    def check(self, ns: str, cache: kvblocks.PromptCache) -> None:
        """LayoutError unless ``cache`` fits the namespace's model (unknown: accepted). A
        cache scope's namespace (a tenant's) is checked against its model's."""
        want = self._sigs.get(ns) or self._sigs.get(scope_base(ns))
        if want is None:
            return
        if len(cache) != len(want):
            raise LayoutError(f"a restored state has {len(cache)} layers, the model {len(want)}")
        for i, (c, w) in enumerate(zip(cache, want)):
            why = mismatch(layer_sig(c), w)
            if why is not None:
                raise LayoutError(f"layer {i} of a restored state does not fit the model: {why}")
