"""How many prompt tokens a batch step prefills beside its decoding rows (stall-free
batching): the scheme of Sarathi-Serve and vLLM's chunked prefill, sized from the
measured cost of this model's steps on this machine.

A batch step decodes one token of every decoding row, then feeds the next chunk of the
prompts still prefilling. With a fixed chunk (``prefill_step_size``, 2,048 tokens) a step
takes as long as that chunk does, and every decoding row waits for it: on a CPU a chunk of
the real model is seconds, so a stream beside a cold 8,000-token prompt got a token every
few seconds. :class:`StepBudget` picks the chunk so that a step with prefill stays within
``itl_factor`` times a step without it: the rows keep decoding at ``1 / itl_factor`` of their
speed (as far as a chunk of :data:`MIN_CHUNK` tokens allows: a prompt always advances), and
the prompt takes whatever the rest of the step allows.

The chunk is steered by what the steps cost as they are paid, not by a model of them: each
step with prefill that took longer than ``itl_factor`` decode steps shrinks the next chunk
in proportion (down to :data:`SHRINK` of it in one step, so a step many times too long is
not repeated while the chunk walks down), one that took less grows it (by :data:`GROW` at
most), so a context that grows (every pass reads more KV) or a machine that gets loaded
moves the chunk within a few steps. The decode step's time is the median of the last
steps without prefill (a trace or a store now and then does not move it), seeded by the
request that decoded alone before a batch formed around it; before it is known the chunk
stays at :data:`PROBE_CHUNK` (short prompts joining together still prefill in one pass),
and it never goes below :data:`MIN_CHUNK`.
A step with no decoding row is not budgeted: it feeds ``prefill_step_size`` tokens, what a
lone prompt's prefill runs at.
"""

from __future__ import annotations

import statistics
from collections import deque

MIN_CHUNK = 16  # a prompt makes this much progress per step at least
PROBE_CHUNK = 128  # the chunk before any step with prefill was measured
DECODE_WINDOW = 16  # decode steps whose median is the decode step's time
GROW, SHRINK = 1.5, 0.1  # the most one step moves the chunk, up and down


class StepBudget:
    """The prefill chunk of each batch step, for one loaded model (kept from batch to
    batch, like the speculation's round-length controller). Engine thread only."""

    def __init__(self, itl_factor: float, min_chunk: int = MIN_CHUNK):
        if itl_factor <= 1.0:
            raise ValueError(f"itl_factor must be above 1, got {itl_factor}")
        self.itl_factor = float(itl_factor)
        self.min_chunk = int(min_chunk)
        self._decode: deque[float] = deque(maxlen=DECODE_WINDOW)
        self._chunk = float(PROBE_CHUNK)
        self.steps = 0  # budgeted steps so far
        self.fused_steps = 0  # steps whose decode pass fed the chunk too (engine.fused_step)
        self.last_step_s: float | None = None  # the last step with prefill

    @property
    def decode_s(self) -> float | None:
        """A decode step's time: the median of the last :data:`DECODE_WINDOW` (None: none
        seen yet)."""
        return statistics.median(self._decode) if self._decode else None

    def observe(self, tokens: int, seconds: float) -> None:
        """A batch step with decoding rows that prefilled ``tokens`` prompt tokens (0: a
        decode step) took ``seconds``."""
        if seconds <= 0:
            return
        if tokens <= 0:
            self._decode.append(seconds)
            return
        self.last_step_s = seconds
        alone = self.decode_s
        if alone is None:  # nothing to aim at yet: keep the chunk
            return
        ratio = min(GROW, max(SHRINK, self.itl_factor * alone / seconds))
        self._chunk = max(float(self.min_chunk), tokens * ratio)

    def chunk(self, decoding: int, limit: int) -> int:
        """Prompt tokens the next step feeds when ``decoding`` rows decode in it, at most
        ``limit`` (the request's ``prefill_step_size``)."""
        if decoding <= 0:
            return limit
        self.steps += 1
        return max(1, min(limit, int(self._chunk)))

    def figures(self) -> dict[str, float | int | None]:
        """What ``/stats`` shows of it."""
        decode, step = self.decode_s, self.last_step_s
        return {"itl_factor": self.itl_factor, "chunk": int(self._chunk), "steps": self.steps,
                "fused_steps": self.fused_steps,
                "decode_step_ms": None if decode is None else round(decode * 1e3, 2),
                "last_prefill_step_ms": None if step is None else round(step * 1e3, 2)}
