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

The cost is learned as it is paid: every step with prefill is a point (tokens fed, seconds)
of a line ``c0 + c1 * tokens`` fitted by least squares with exponential forgetting
(:data:`DECAY` per step), so a machine that gets loaded or a context that grows moves the
line; a step without prefill gives the decode step's own time. The first step with prefill
takes :data:`PROBE_CHUNK` tokens; until two chunk sizes were seen (every other step then
takes a larger one) the fixed part is taken as two decode steps (the decode pass and the
chunk's pass each read the weights) and the slope as the rest of the last step per token.
A step with no decoding row is not budgeted: it feeds ``prefill_step_size`` tokens, what a
lone prompt's prefill runs at.
"""

from __future__ import annotations

DECAY = 0.8  # weight of the older observations at each new one
MIN_CHUNK = 16  # a prompt makes this much progress per step at least
PROBE_CHUNK = 128  # the first budgeted step's chunk, before any cost was measured


class StepBudget:
    """The prefill chunk of each batch step, for one loaded model (kept from batch to
    batch, like the speculation's round-length controller). Engine thread only."""

    def __init__(self, itl_factor: float, min_chunk: int = MIN_CHUNK):
        if itl_factor <= 1.0:
            raise ValueError(f"itl_factor must be above 1, got {itl_factor}")
        self.itl_factor = float(itl_factor)
        self.min_chunk = int(min_chunk)
        self.decode_s: float | None = None  # a step without prefill (EMA)
        # Decayed sums of the prefill steps' (tokens, seconds): weight, n, n^2, t, n*t.
        self._w = self._n = self._nn = self._t = self._nt = 0.0
        self._last: tuple[int, float] | None = None
        self.steps = 0  # budgeted steps so far
        self.chunk_last = 0

    def observe(self, tokens: int, seconds: float) -> None:
        """A batch step that prefilled ``tokens`` prompt tokens (0: decode only) took
        ``seconds``."""
        if seconds <= 0:
            return
        if tokens <= 0:
            if self.decode_s is None:
                self.decode_s = seconds
            else:  # one slow step (a trace, a store) moves it by a bounded amount
                seconds = min(seconds, 3.0 * self.decode_s)
                self.decode_s = DECAY * self.decode_s + (1 - DECAY) * seconds
            return
        n = float(tokens)
        self._w = DECAY * self._w + 1.0
        self._n = DECAY * self._n + n
        self._nn = DECAY * self._nn + n * n
        self._t = DECAY * self._t + seconds
        self._nt = DECAY * self._nt + n * seconds
        self._last = (tokens, seconds)

    def line(self) -> tuple[float, float] | None:
        """The fitted cost of a step with prefill, (c0 s, c1 s per token); None before the
        first such step."""
        if self._last is None:
            return None
        w, n, nn, t, nt = self._w, self._n, self._nn, self._t, self._nt
        if self._spread():
            spread = w * nn - n * n
            c1 = (w * nt - n * t) / spread
            c0 = (t - c1 * n) / w
            if c1 > 0 and c0 >= 0:
                return c0, c1
        # One chunk size so far: the slope past the fixed part, which is the decode pass and
        # the chunk's pass reading the weights again (each about a decode step).
        tokens, seconds = self._last
        base = 2.0 * self.decode_s if self.decode_s is not None else 0.5 * seconds
        base = min(base, 0.9 * seconds)
        return base, (seconds - base) / tokens

    def _spread(self) -> bool:
        return self._w * self._nn - self._n * self._n > 1e-6 * max(1.0, self._nn * self._w)

    def chunk(self, decoding: int, limit: int) -> int:
        """Prompt tokens the next step feeds when ``decoding`` rows decode in it, at most
        ``limit`` (the request's ``prefill_step_size``)."""
        if decoding <= 0:
            return limit
        self.steps += 1
        fit = self.line()
        if fit is None:
            n = PROBE_CHUNK
        else:
            c0, c1 = fit
            # The decode step's own time; without a measured one, half the fixed part of a
            # step with prefill (the decode pass and the chunk's pass each read the weights).
            alone = self.decode_s if self.decode_s is not None else 0.5 * c0
            n = max(self.min_chunk, int((self.itl_factor * alone - c0) / c1) if c1 > 0 else limit)
            if not self._spread() and self.steps % 2:
                n += n // 2  # two chunk sizes, so that the line can be fitted
        self.chunk_last = n = min(limit, n)
        return n

    def figures(self) -> dict[str, float | int | None]:
        """What ``/stats`` shows of it."""
        fit = self.line()
        return {"itl_factor": self.itl_factor, "chunk": self.chunk_last, "steps": self.steps,
                "decode_step_ms": None if self.decode_s is None else round(self.decode_s * 1e3, 2),
                "prefill_ms_per_token": None if fit is None else round(fit[1] * 1e3, 3)}
