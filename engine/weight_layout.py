"""How a model's float matrices lie in memory on the CPU backend.

mlx-lm's ``nn.Linear`` computes ``x @ weight.T`` with ``weight`` stored [out, in], and the
tied LM head ``embed_tokens.as_linear`` does the same with the [vocab, hidden] embedding.
On the CPU backend every matmul is one ``sgemm`` call, and a decode step's matmuls have a
single row: BLAS then packs the transposed operand, and on this project's machines (the
bundled reference BLAS and OpenBLAS alike) the product of one row with a transposed
[out, in] matrix runs 1.2-2.3x slower than with the same numbers stored [in, out]
(measured on the real model's shapes; the 49,152 x 576 LM head most of all). A decode
step reads every weight once, so that layout decides its speed.

:func:`transpose_for_cpu` therefore stores each float ``nn.Linear`` / ``nn.Embedding``
weight as a contiguous [in, out] array and leaves the module a transposed view of it
(``module.weight`` keeps its [out, in] shape): ``weight.T`` in the model's own forward is
then the contiguous matrix, with no copy, and nothing else changes. The products are the
same dot products over the same ``in`` axis, equal up to the rounding of the order BLAS
sums them in (bit for bit on the bundled reference BLAS; OpenBLAS's small-matrix kernels
may round apart, as a batch of rows does against one row): greedy output is checked
token-identical to mlx-lm's, and the prefix cache's namespace does not change. The embedding lookup reads a strided
column per token, a few microseconds for a whole prompt.

The copy costs about as long as a few decode steps (strided reads: 0.6 s for the real
model's 540 MB on a quiet machine, several seconds on a loaded one), so it is not made at
load, where a one-shot ``mlxkv generate`` would wait for it before its first token, but at
a model's first decoding (``engine.decoding.decode_step``). Not on Metal or CUDA (their
matrix-vector kernels read [out, in] rows), not for quantized layers, and not for module
classes other than these two exactly (a subclass may read its weight another way).
"""

from __future__ import annotations

from typing import Any

_DONE = "_mlxkv_cpu_layout"


def transpose_for_cpu(model: Any) -> int:
    """Store ``model``'s float Linear and Embedding weights [in, out] (see above) when the
    default device is the CPU; the number of weights changed (0 elsewhere, or when done
    before). One matrix at a time, so the load needs one extra matrix of memory at most."""
    import mlx.core as mx
    import mlx.nn as nn

    if mx.default_device() != mx.cpu or not isinstance(model, nn.Module) or getattr(model, _DONE, False):
        return 0  # (a model wrapped in a plain object keeps its layout: nothing to walk)
    changed = 0
    for _, module in model.named_modules():
        if type(module) not in (nn.Linear, nn.Embedding) or "weight" not in module:
            continue
        weight = module.weight
        if weight.ndim != 2 or not mx.issubdtype(weight.dtype, mx.floating):
            continue
        stored = mx.contiguous(weight.T)
        mx.eval(stored)
        module.weight = stored.T
        changed += 1
    object.__setattr__(model, _DONE, True)
    return changed
