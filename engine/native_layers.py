"""A model's norms and rotary embeddings as one CPU operation each.

On the CPU, MLX runs ``mx.fast.rms_norm`` and ``mx.fast.rope`` as their decomposed graphs:
about 8 and 25 operations. A decode step of one token does little arithmetic in them, but
every operation pays its dispatch, and a llama-shaped layer runs two norms and two
rotations: on the real model (30 layers) they were about 6 ms of a 38 ms step.
:func:`use_native_layers` gives a model's ``nn.RMSNorm`` and ``nn.RoPE`` modules the
engine's primitives (``native_ops.rms_norm`` / ``native_ops.rope``, built by ``make ext``),
changing their class in place as ``engine.weight_layout`` does for the matrices. Each call
falls back to MLX's own where the primitive does not take it (another dtype or device, not
built). The results are MLX's up to float32 rounding (the rotation's angles at long
positions by up to 3e-4, its sine and cosine taken by libm rather than MLX's
approximations). ``MLXKV_NATIVE_LAYERS=0`` keeps MLX's.
"""

from __future__ import annotations

import os
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxkv.engine.native_ops import rms_norm, rope

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
