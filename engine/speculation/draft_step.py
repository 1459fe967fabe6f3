"""A draft model's decode step as one compiled MLX function (``engine.compiled_step``).

A small draft model's step is dominated by per-operation dispatch, and speculation pays k
of them per round, so compiling it matters most here. The step takes inputs of
1..``MAX_WIDTH`` tokens (a round's missing tokens and its pending one). Nothing here
decides a token: a draft model only proposes, and the verifier keeps exactly what the
target would have produced.
"""

from __future__ import annotations

from typing import Any

from mlxkv.engine.compiled_step import CompiledStep

MAX_WIDTH = 4  # the widest input the compiled step takes (a round's missing tokens + pending)


class DraftModelStep(CompiledStep):
    """The draft model's step: inputs of up to :data:`MAX_WIDTH` tokens."""

    def __init__(self, model: Any):
        super().__init__(model, max_width=MAX_WIDTH, label="the draft model")
