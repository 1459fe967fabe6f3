"""The target's sampling, position by position over a verify window, exactly as plain
decoding samples one token: the request's logits processors (with the history that
position would have had), then mlx-lm's sampler, whose filters and temperature also give
the explicit distribution p that rejection sampling needs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    make_logits_processors,
    make_sampler,
)


class TargetSampler:
    """Samples the target at every position of ``[pending] + drafts`` at once. ``history`` is
    every token the target has been fed before the window (prompt and output); processors
    see it plus the window's tokens up to that position, as ``generate_step`` would."""

    def __init__(self, params: Any, history: Sequence[int], constraint: Any = None):
        self.temperature = float(params.temperature)
        self.greedy = self.temperature == 0
        self.sampler = make_sampler(params.temperature, params.top_p, params.min_p, top_k=params.top_k)
        self.processors = make_logits_processors(
            repetition_penalty=params.repetition_penalty if params.repetition_penalty != 1.0 else None,
            repetition_context_size=params.repetition_context_size)
        # Processors read at most this many trailing tokens.
        self._context = max(int(params.repetition_context_size), 1)
        self.history: list[int] = list(history)
        # A request constraint masks what no allowed output continues with; it sees the
        # output (tokens after the prompt) up to each position.
        self.constraint = constraint
        self.output: list[int] = []
        filters = []
        if 0 < params.top_p < 1.0:
            filters.append(lambda x: apply_top_p(x, params.top_p))
        if params.min_p != 0.0:
            filters.append(lambda x: apply_min_p(x, params.min_p, 1))
        if params.top_k > 0:
            filters.append(lambda x: apply_top_k(x, params.top_k))
        self._filters = filters

    def logprobs(self, logits: mx.array, window: Sequence[int]) -> mx.array:
        """logits [T, V] of the window's positions -> processed log-probabilities [T, V]."""
        logits = logits.astype(mx.float32) if logits.dtype != mx.float32 else logits
        if self.processors:
            rows = []
            tail = self.history[-self._context:]
            for j in range(logits.shape[0]):
                seen = mx.array((tail + list(window[: j + 1]))[-self._context:])
                row = logits[j: j + 1]
                for processor in self.processors:
                    row = processor(seen, row)
                rows.append(row)
            logits = mx.concatenate(rows, axis=0)
        if self.constraint is not None:
            from engine.spec.constraints import mask_row

            vocab = logits.shape[-1]
            allowed = [self.constraint.allowed(self.output + list(window[: j + 1]))
                       for j in range(logits.shape[0])]
            if any(a is not None for a in allowed):
                logits = logits + mx.stack([mask_row(vocab, a) if a is not None else mx.zeros((vocab,))
                                            for a in allowed])
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    def sample(self, logprobs: mx.array) -> mx.array:
        """One token per position [T] (plain decoding's sampler, each position independent)."""
        return self.sampler(logprobs)

    def probs(self, logprobs: mx.array) -> mx.array:
        """The distribution ``sample`` draws from at each position [T, V]."""
        if self.greedy:
            return mx.eye(logprobs.shape[-1])[mx.argmax(logprobs, axis=-1)]
        for f in self._filters:
            logprobs = f(logprobs)
        return mx.softmax(logprobs * (1.0 / self.temperature), axis=-1)

    def advance(self, tokens: Sequence[int]) -> None:
        """``tokens`` were fed to the target."""
        self.history.extend(tokens)
        if self.constraint is not None:
            self.output.extend(tokens)
        if len(self.history) > 4 * self._context + 64:
            del self.history[: len(self.history) - self._context]


def top_logprobs(logprobs: mx.array, n: int) -> tuple[tuple[int, float], ...]:
    """The ``n`` most likely (token, log-probability) pairs of one position, best first."""
    if n <= 0:
        return ()
    n = min(n, logprobs.shape[-1])
    idx = mx.argpartition(-logprobs, kth=n - 1)[:n]
    vals = logprobs[idx]
    order = mx.argsort(-vals)
    idx, vals = idx[order].tolist(), vals[order].tolist()
    return tuple((int(i), float(v)) for i, v in zip(idx, vals))


def rejection_walk(p: mx.array, q: mx.array, drafts: Sequence[int], bonus: mx.array) -> tuple[int, int]:
    """Speculative rejection sampling over a window (Leviathan et al., Alg. 1).

    ``p`` [k+1, V]: the target's sampling distribution at each position; ``q`` [k, V]: the
    draft's, from which ``drafts`` were drawn; ``bonus`` [1]: a token already sampled from
    p[k]. Returns (accepted, next token): draft i is kept with probability
    min(1, p_i(d)/q_i(d)); the first rejected position is resampled from the normalised
    residual max(0, p - q); when all are kept the bonus token follows."""
    k = len(drafts)
    if k == 0:
        return 0, int(bonus.item())
    d = mx.array(list(drafts))
    rows = mx.arange(k)
    pd = p[rows, d]
    qd = q[rows, d]
    u = mx.random.uniform(shape=(k,))
    keep = u * qd < pd  # u < p/q without dividing by a zero q
    residual = mx.maximum(p[:k] - q, 0.0)
    mass = residual.sum(axis=-1, keepdims=True)
    residual = mx.where(mass > 0, residual / mx.maximum(mass, 1e-30), p[:k])
    resampled = mx.random.categorical(mx.log(mx.maximum(residual, 1e-38)) + mx.where(residual > 0, 0.0, -mx.inf))
    mx.eval(keep, resampled)
    keep_l = keep.tolist()
    for i in range(k):
        if not keep_l[i]:
            return i, int(resampled[i].item())
    return k, int(bonus.item())
