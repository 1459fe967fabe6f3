"""A draft model's decode step as one compiled MLX function (``engine.compiled_step``).

A small draft model's step is dominated by per-operation dispatch, not arithmetic: on the
CPU backend the fast RMSNorm, RoPE and attention kernels fall back to chains of primitive
ops, so one step of the demo draft model (2 layers of 128) runs ~330 ops and costs about a
third of a target step ten times its size. Speculation pays for k of those steps per round
while the verify that they feed costs little more than one plain step, so the draft's step
cost is most of what a round costs beyond a plain step. ``mx.compile`` fuses the
element-wise chains (~190 ops remain) and cuts the step by about 40%.

The draft's step takes inputs of 1..``MAX_WIDTH`` tokens (a round's missing tokens and its
pending one). Nothing here decides a token: drafts only propose, and the verifier keeps
exactly what the target would have produced.
"""

from __future__ import annotations

from typing import Any

from mlxkv.engine.compiled_step import CompiledStep

MAX_WIDTH = 4  # the widest input the compiled step takes (a round's missing tokens + pending)


class DraftModelStep(CompiledStep):
    """The draft model's step: inputs of up to :data:`MAX_WIDTH` tokens."""

    def __init__(self, model: Any):
        super().__init__(model, max_width=MAX_WIDTH, label="the draft model")
