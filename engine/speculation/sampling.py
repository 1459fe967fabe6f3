"""The target's sampling, position by position over a verify window, exactly as plain
decoding samples one token: the request's logits processors (with the history that
position would have had), then mlx-lm's sampler, whose filters and temperature also give
the explicit distribution p that rejection sampling needs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from mlxkv.engine.arrays import float_list, int_list
from mlxkv.engine.sampling import SamplingParams, mlx_lm_sampler, request_processors, sample_filters


class TargetSampler:
    """Samples the target at every position of ``[pending] + proposed`` at once. ``history`` is
    every token the target has been fed before the window (prompt and output); processors
    see it plus the window's tokens up to that position, as ``generate_step`` would."""

    def __init__(self, params: SamplingParams, history: Sequence[int], constraint: Any = None):
        self.temperature = float(params.temperature)
        self.greedy = self.temperature == 0
        self.sampler = mlx_lm_sampler(params)  # every position drawn (seeded: the global key)
        self.processors = request_processors(params)
        # Processors read at most this many trailing tokens.
        self._context = max(int(params.repetition_context_size), 1)
        self.history: list[int] = list(history)
        # A request constraint masks what no allowed output continues with; it sees the
        # output (tokens after the prompt) up to each position.
        self.constraint = constraint
        self.output: list[int] = []
        self._filters = sample_filters(params)

    def logprobs(self, logits: mx.array, window: Sequence[int]) -> mx.array:
        """logits [T, V] of the window's positions -> processed log-probabilities [T, V]."""
        logits = logits.astype(mx.float32) if logits.dtype != mx.float32 else logits
        if self.processors:
            logits = process_window(self.processors, mx.array(self.history[-self._context:]), window, logits)
        if self.constraint is not None:
            from mlxkv.engine.speculation.constraints import constraint_mask

            vocab = logits.shape[-1]
            masks = [constraint_mask(self.constraint, self.output + list(window[: j + 1]), vocab)
                     for j in range(logits.shape[0])]
            if any(m is not None for m in masks):
                logits = logits + mx.stack([m if m is not None else mx.zeros((vocab,)) for m in masks])
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


def process_window(processors: Sequence[Any], history: mx.array, window: Sequence[int],
                   logits: mx.array) -> mx.array:
    """logits [T, V] of a verify window's positions through ``processors``, position j seeing
    ``history`` (the tokens fed before the window) and the window up to j: what a plain step
    at that position would have seen."""
    tokens = mx.concatenate([history.astype(mx.int32), mx.array(list(window), dtype=mx.int32)])
    rows = []
    for j in range(logits.shape[0]):
        seen = tokens[: history.shape[0] + j + 1]
        row = logits[j: j + 1]
        for processor in processors:
            row = processor(seen, row)
        rows.append(row)
    return mx.concatenate(rows, axis=0)


def top_logprobs(logprobs: mx.array, n: int) -> tuple[tuple[int, float], ...]:
    """The ``n`` most likely (token, log-probability) pairs of one position, best first."""
    if n <= 0:
        return ()
    n = min(n, logprobs.shape[-1])
    idx = mx.argpartition(-logprobs, kth=n - 1)[:n]
    vals = logprobs[idx]
    order = mx.argsort(-vals)
    ids, values = int_list(idx[order]), float_list(vals[order])
    return tuple((int(i), float(v)) for i, v in zip(ids, values))


def _categorical(probs: mx.array) -> mx.array:
    """One draw per row of ``probs`` [..., V] (rows sum to 1; zeros are never drawn)."""
    logits = mx.where(probs > 0, mx.log(mx.maximum(probs, 1e-38)), -mx.inf)
    return mx.random.categorical(logits)


def rejection_walk_rows(p: mx.array, q: mx.array, proposed: mx.array, lengths: mx.array | None = None
                        ) -> tuple[mx.array, mx.array]:
    """Speculative rejection sampling (Leviathan et al., Alg. 1) over B windows at once.

    ``p`` [B, k+1, V]: the target's sampling distribution at each position of
    ``[pending] + proposed``; ``q`` [B, k, V]: the distributions ``proposed`` [B, k] were drawn
    from; ``lengths`` [B]: proposed tokens per row (ragged rows are right-padded; None = k).
    Token i is kept with probability min(1, p_i(d)/q_i(d)); the first rejected position is
    resampled from the normalised residual max(0, p - q); a row that keeps all its proposed tokens
    gets a bonus token from p at its length. Returns (accepted [B], next token [B]); the
    emitted tokens are then distributed exactly as sampling p one token at a time."""
    b, k = proposed.shape
    if lengths is None:
        lengths = mx.full((b,), k, dtype=mx.int32)
    if k == 0:
        return mx.zeros((b,), dtype=mx.int32), _categorical(p[:, 0])
    pd = mx.take_along_axis(p[:, :k], proposed[..., None], axis=-1)[..., 0]
    qd = mx.take_along_axis(q, proposed[..., None], axis=-1)[..., 0]
    u = mx.random.uniform(shape=(b, k))
    inside = mx.arange(k)[None] < lengths[:, None]
    keep = (u * qd < pd) & inside  # u < p/q without dividing by a zero q
    accepted = mx.cumprod(keep.astype(mx.int32), axis=1).sum(axis=1)
    residual = mx.maximum(p[:, :k] - q, 0.0)
    mass = residual.sum(axis=-1, keepdims=True)
    residual = mx.where(mass > 0, residual / mx.maximum(mass, 1e-30), p[:, :k])
    resampled = _categorical(residual)  # [B, k]
    bonus = _categorical(p)  # [B, k+1]
    at = accepted[:, None]
    from_residual = mx.take_along_axis(resampled, mx.minimum(at, k - 1), axis=1)[:, 0]
    from_bonus = mx.take_along_axis(bonus, at, axis=1)[:, 0]
    nxt = mx.where(accepted < lengths, from_residual, from_bonus)
    return accepted, nxt
