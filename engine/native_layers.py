"""A model's norms and rotary embeddings as one CPU operation each, and a llama-shaped
layer's decode step as four.

On the CPU, MLX runs ``mx.fast.rms_norm`` and ``mx.fast.rope`` as their decomposed graphs:
about 8 and 25 operations. A decode step of one token does little arithmetic in them, but
every operation pays its dispatch, and a llama-shaped layer runs two norms and two
rotations: on the real model (30 layers) they were about 6 ms of a 38 ms step.
:func:`use_native_layers` gives a model's ``nn.RMSNorm`` and ``nn.RoPE`` modules the
engine's primitives (``native_ops.rms_norm`` / ``native_ops.rope``, built by ``make ext``),
changing their class in place as ``engine.weight_layout`` does for the matrices. Each call
falls back to MLX's own where the primitive does not take it (another dtype or device, not
built). The results are MLX's up to float32 rounding (the rotation at position 8,000 by up
to 7e-4: its sine and cosine come from libm, MLX's from its own approximations).

Past those, a one-token step through a llama-shaped layer is still some 25 operations (the
products and their column views, the heads' reshapes and transposes, the cache writes,
the attention, the residuals): :func:`use_native_blocks` gives each such layer (mlx-lm's
llama, qwen2 and qwen3 blocks: :data:`BLOCKS`) of a laid-out model (``engine.weight_layout``:
its q, k, v and its gate, up grouped into one matrix each) a class whose call, for one token
over the compiled step's cache (``FixedKV``) or one token of each row over the compiled
batch step's (``FixedBatchKV``: each row at its own position, its left padding unseen), is
``native_ops.decode_layer``: four operations; anything else (a prompt chunk, a verify, a
fused pass, another cache) runs the layer's own code. The compiled step's first-use check compares the result with the
model's own forward pass. ``MLXKV_NATIVE_LAYERS=0`` keeps MLX's for all three.
"""

from __future__ import annotations

import os
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxkv.engine.compiled_step import FixedBatchKV, FixedKV
from mlxkv.engine.native_ops import decode_layer, rms_norm, rope
from mlxkv.engine.side_table import SideTable

ENABLED = os.environ.get("MLXKV_NATIVE_LAYERS", "1") != "0"


class NativeRMSNorm(nn.RMSNorm):
    """An ``nn.RMSNorm`` computed as one operation on the CPU."""

    def __call__(self, x: mx.array) -> mx.array:
        y = rms_norm(x, self["weight"], self.eps)
        return super().__call__(x) if y is None else y


class NativeRoPE(nn.RoPE):
    """An ``nn.RoPE`` computed as one operation on the CPU."""

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        y = rope(x, offset, self.dims, self.traditional, self.base, self.scale)
        return super().__call__(x, offset) if y is None else y


_KINDS: dict[type[nn.Module], type[nn.Module]] = {nn.RMSNorm: NativeRMSNorm, nn.RoPE: NativeRoPE}


def use_native_layers(model: nn.Module) -> int:
    """Give ``model``'s ``nn.RMSNorm`` and ``nn.RoPE`` modules (those classes exactly, not
    subclasses) the native operation; the number changed."""
    if not ENABLED:
        return 0
    changed = 0
    for _, module in model.named_modules():
        kind = _KINDS.get(type(module))
        if kind is not None:
            module.__class__ = kind  # by design, in place: every holder sees the new path
            changed += 1
    return changed


# The layer classes whose code is the one decode_layer computes (module, class): mlx-lm's
# llama block (llama, mistral, SmolLM and the other architectures built on it), qwen2's
# (biases on q, k and v) and qwen3's (each head of q and k normalized before the rotation).
# Another architecture goes in only once its block's code was read to be the same
# computation (and a test runs it against the block's own code).
BLOCKS = {("mlx_lm.models.llama", "TransformerBlock"), ("mlx_lm.models.qwen2", "TransformerBlock"),
          ("mlx_lm.models.qwen3", "TransformerBlock")}


class _Parts:
    """What a layer's native step reads: its modules (weights read at each call) and shape."""

    def __init__(self, block: Any):
        attn, mlp = block.self_attn, block.mlp
        self.qkv, self.gate_up = attn.q_proj.group, mlp.gate_proj.group
        self.modules = (block.input_layernorm, attn.o_proj, block.post_attention_layernorm, mlp.down_proj)
        rope_ = attn.rope
        self.shape: dict[str, Any] = {
            "eps1": float(block.input_layernorm.eps), "eps2": float(block.post_attention_layernorm.eps),
            "rope_dims": int(rope_.dims), "traditional": bool(rope_.traditional),
            "base": float(rope_.base), "rope_scale": float(rope_.scale), "scale": float(attn.scale)}
        # q, k and v's biases end to end, as their weights are (made once: mlx-lm's modules
        # keep theirs; another load of the weights makes another layout)
        projections = (attn.q_proj, attn.k_proj, attn.v_proj)
        self.bias = mx.concatenate([m["bias"] for m in projections]) if "bias" in attn.q_proj else None
        self.head_norms = (attn.q_norm, attn.k_norm) if "q_norm" in attn else None
        if self.head_norms is not None:
            self.shape["qk_eps"] = float(attn.q_norm.eps)

    def weights(self) -> tuple[mx.array, ...]:
        ln1, o, ln2, down = self.modules
        return (ln1["weight"], self.qkv.fused, o["weight"], ln2["weight"], self.gate_up.fused, down["weight"])

    def extras(self) -> dict[str, mx.array]:
        out = {} if self.bias is None else {"bqkv": self.bias}
        if self.head_norms is not None:
            out["q_norm"], out["k_norm"] = (n["weight"] for n in self.head_norms)
        return out


_PARTS: SideTable[_Parts] = SideTable()
_NATIVE_KINDS: dict[type, type] = {}


def _grouped(members: list[Any], biases: bool = False) -> bool:
    """The modules are one group's members, in order, without biases (with ``biases``: all
    with one or none with one)."""
    group = getattr(members[0], "group", None)
    biased = {"bias" in m for m in members}
    return (group is not None and len(group.bounds) == len(members)
            and all(getattr(m, "group", None) is group and getattr(m, "member", None) == i
                    for i, m in enumerate(members))
            and len(biased) == 1 and (biases or biased == {False}))


def _head_norms(attn: Any) -> bool:
    """No per-head norms, or a q_norm and a k_norm over the head size (qwen3's), native."""
    if "q_norm" not in attn and "k_norm" not in attn:
        return True
    if "q_norm" not in attn or "k_norm" not in attn:
        return False
    head = attn.q_proj["weight"].shape[0] // attn.n_heads
    return all(type(attn[name]) is NativeRMSNorm and attn[name]["weight"].shape == (head,)
               for name in ("q_norm", "k_norm"))


def _fits(block: Any) -> bool:
    attn, mlp = getattr(block, "self_attn", None), getattr(block, "mlp", None)
    if attn is None or mlp is None or getattr(block, "use_sliding", False):
        return False
    try:
        return (_grouped([attn.q_proj, attn.k_proj, attn.v_proj], biases=True)
                and _grouped([mlp.gate_proj, mlp.up_proj]) and _head_norms(attn)
                and "bias" not in attn.o_proj and "bias" not in mlp.down_proj
                and type(attn.rope) is NativeRoPE and type(block.input_layernorm) is NativeRMSNorm
                and type(block.post_attention_layernorm) is NativeRMSNorm
                and attn.o_proj["weight"].ndim == 2 and mlp.down_proj["weight"].ndim == 2)
    except (AttributeError, KeyError):
        return False


def _native_kind(kind: type) -> type:
    """``kind`` with a call that takes the native step where it applies."""
    native_kind = _NATIVE_KINDS.get(kind)
    if native_kind is None:
        def __call__(self: Any, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
            parts = _PARTS.get(self)
            done = None  # decode_layer takes one token a row, else the layer's own code runs
            if parts is not None and type(cache) is FixedKV:
                done = decode_layer(x, parts.weights(), cache.keys, cache.values, cache.offset,
                                    parts.extras(), **parts.shape)
            elif parts is not None and type(cache) is FixedBatchKV:  # each row's position, padding
                done = decode_layer(x, parts.weights(), cache.keys, cache.values, cache.at,
                                    parts.extras(), positions=cache.offset, start=cache.padding,
                                    **parts.shape)
            if done is not None:
                out, cache.keys, cache.values = done
                return out
            return kind.__call__(self, x, mask, cache)

        native_kind = type(f"Native{kind.__name__}", (kind,), {"__call__": __call__, "__module__": __name__})
        _NATIVE_KINDS[kind] = native_kind
    return native_kind


def use_native_blocks(model: nn.Module) -> int:
    """Give each of ``model``'s layers that :data:`BLOCKS` lists and whose parts are laid out
    for it (grouped products, biases on q, k and v only, the native norms and rotation) the
    native decode step; the number changed."""
    if not ENABLED:
        return 0
    changed = 0
    for _, module in model.named_modules():
        kind = type(module)
        if (kind.__module__, kind.__name__) in BLOCKS and _fits(module):
            _PARTS.put(module, _Parts(module))
            module.__class__ = _native_kind(kind)  # by design, in place, as the other layouts
            changed += 1
    return changed
