"""A model's decode step as one compiled MLX function (the target's plain decoding and a
draft model's steps both run through it).

A small model's step is dominated by per-operation dispatch, not arithmetic; ``mx.compile``
traces it once and fuses the element-wise chains. A compiled function must not depend on
Python state that changes per call, and mlx-lm's ``KVCache`` does (its offset), so the step
runs the model over :class:`FixedKV` layers holding the cache's buffers at full capacity
(a multiple of :data:`STEP`), the offset an array input and the mask hiding unfilled
slots; the updated buffers go back into the ``KVCache`` objects. The first compiled step
of each model is checked against its forward pass over :data:`CHECK_STEPS` greedy steps
(within :data:`TOLERANCE`, the same tokens); an architecture that does not fit, or
differs, keeps the forward pass with one debug line.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from mlxkv.engine.arrays import float_item
from mlxkv.engine.native_ops import slot_attention
from mlxkv.engine.traced import Traced

log = logging.getLogger("mlxkv.engine")

STEP = 256  # buffer capacities are kept at multiples of this (KVCache.step): one trace each
TOLERANCE = 1e-3  # most a compiled log-probability may differ from the forward pass's
CHECK_STEPS = 3  # greedy steps the first compiled use is compared over


class FixedKV:
    """One attention layer's cache as the compiled step sees it: the full buffers, the
    offset as an array, writes at the offset, a mask over the filled slots."""

    def __init__(self, keys: mx.array, values: mx.array, offset: mx.array):
        self.keys, self.values, self.offset = keys, values, offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        at = self.offset.reshape(1)
        self.keys = mx.slice_update(self.keys, keys.astype(self.keys.dtype), at, axes=(2,))
        self.values = mx.slice_update(self.values, values.astype(self.values.dtype), at, axes=(2,))
        return self.keys, self.values

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float) -> mx.array | None:
        """The step's attention over the filled slots by the CPU primitive
        (``engine.native_ops.slot_attention``: no mask, K and V read once over every core),
        or None where it does not apply (the model's attention then takes the mask)."""
        if keys is not self.keys or values is not self.values:
            return None  # the model changed them (e.g. repeated heads): not our buffers
        return slot_attention(queries, keys, values, self.offset, scale)

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> mx.array:
        if window_size is not None:
            raise TypeError("the compiled step has no sliding window")
        slots = mx.arange(self.keys.shape[2])[None]
        return slots <= (self.offset + mx.arange(n))[:, None]  # [n, capacity]: causal, filled slots


class FixedBatchKV:
    """One attention layer of a batch as the compiled step sees it: the full buffers
    [B, heads, capacity, dim], the write index ``at`` ([1]), each row's position
    ``offset`` ([B]) and left padding ``padding`` ([B]) as arrays."""

    def __init__(self, keys: mx.array, values: mx.array, at: mx.array, offset: mx.array, padding: mx.array):
        self.keys, self.values = keys, values
        self.at, self.offset, self.padding = at, offset, padding

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.keys = mx.slice_update(self.keys, keys.astype(self.keys.dtype), self.at, axes=(2,))
        self.values = mx.slice_update(self.values, values.astype(self.values.dtype), self.at, axes=(2,))
        return self.keys, self.values

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float) -> mx.array | None:
        """The step's attention by the CPU primitive (``native_ops.slot_attention``): row
        ``b``'s query sees slots ``[padding[b], at]``, what :meth:`make_mask` lets through,
        with no mask built and no masked slot read; None where it does not apply (the
        model's attention then takes the mask)."""
        if keys is not self.keys or values is not self.values:
            return None  # the model changed them (e.g. repeated heads): not our buffers
        return slot_attention(queries, keys, values, self.at, scale, start=self.padding.astype(mx.int32))

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> mx.array:
        if window_size is not None:
            raise TypeError("the compiled batch step has no sliding window")
        slots = mx.arange(self.keys.shape[2])[None]
        causal = slots <= (self.at + mx.arange(n))[:, None]  # [n, capacity]
        filled = slots >= self.padding[:, None]  # [B, capacity]: not a row's left padding
        return causal[None, None] & filled[:, None, None, :]  # [B, 1, n, capacity]


def log_softmax(logits: mx.array) -> mx.array:
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def agrees(got: list[mx.array], want: list[mx.array]) -> tuple[bool, float, bool]:
    """Whether a compiled step's logits (``got``, one array per checked step) match the
    forward pass's (``want``): the same shapes, log-probabilities within
    :data:`TOLERANCE` and the same greedy tokens; with the largest difference and whether
    the greedy tokens were the same, for the debug line of a failed check."""
    diff = max(float_item(mx.abs(log_softmax(g) - log_softmax(w)).max()) for g, w in zip(got, want))
    same = all(mx.array_equal(mx.argmax(g, axis=-1), mx.argmax(w, axis=-1)).item() for g, w in zip(got, want))
    ok = all(g.shape == w.shape for g, w in zip(got, want)) and diff <= TOLERANCE and same
    return ok, diff, same


def greedy_steps(step: Callable[[mx.array], mx.array], tokens: mx.array, steps: int) -> list[mx.array]:
    """The logits of ``steps`` steps of ``step`` ([rows, V] from a [rows, width] input),
    ``tokens`` first, then each row's greedy token: the check's input, run both ways."""
    out, x = [], tokens
    for _ in range(steps):
        logits = step(x)
        mx.eval(logits)
        out.append(logits)
        x = mx.argmax(logits, axis=-1)[:, None].astype(tokens.dtype)
    return out


def checked_run(label: str, step: str, run: Callable[[], list[mx.array]],
                want: list[mx.array]) -> list[mx.array] | None:
    """``run()`` (a compiled step's logits over the check) if it runs and :func:`agrees`
    with ``want`` (the forward pass's), else None, with one debug line saying why;
    ``step`` names it in that line ("decode step", "batch decode step")."""
    try:
        got = run()
        ok, diff, same = agrees(got, want)
    except Exception as e:  # an architecture the fixed layers cannot run
        log.debug("%s: the %s is not compiled (%s: %s)", label, step, type(e).__name__, e)
        return None
    if not ok:
        log.debug("%s: the compiled %s differs from the forward pass (log-probabilities by %g, "
                  "greedy tokens %s); the forward pass decodes", label, step, diff,
                  "the same" if same else "differ")
        return None
    return got


class CompiledStep:
    """``step(tokens, cache)``: ``model(tokens, cache=cache)[0, -1:]`` (the last position's
    logits, [1, V], unevaluated), through one compiled function when the cache allows it,
    else the model's own forward pass. ``enabled`` is None until the first compiled step
    was checked against the forward pass, then whether it matched. ``label`` names the
    model in the debug line of a failed check."""

    def __init__(self, model: Any, max_width: int = 1, label: str = "the model"):
        self.model = model
        self.max_width = max_width
        self.label = label
        self.enabled: bool | None = None
        self._fn = Traced(self._step, f"decode step: {label}")
        self._last: mx.array | None = None  # the last step's logits (see _compiled)

    def _step(self, tokens: mx.array, offset: mx.array, *buffers: mx.array) -> list[mx.array]:
        layers = [FixedKV(buffers[i], buffers[i + 1], offset) for i in range(0, len(buffers), 2)]
        logits = self.model(tokens, cache=layers)[0, -1:]
        out = [logits]
        for c in layers:
            out += [c.keys, c.values]
        return out

    def fits(self, cache: list, width: int) -> bool:
        """Plain KVCache layers at one offset, with room for ``width`` more (grown here to a
        multiple of STEP when needed: a cache restored from the prefix cache holds exactly
        its tokens, and a trace per odd capacity would pile up)."""
        from mlx_lm.models.cache import KVCache

        if not cache or not 0 < width <= self.max_width:
            return False
        first = cache[0]
        for c in cache:
            if type(c) is not KVCache or c.keys is None or c.offset != first.offset:
                return False
        need = first.offset + width
        for c in cache:
            size = c.keys.shape[2]
            if size < need or size % STEP:
                grow = -(-need // STEP) * STEP - c.offset
                k, v = c.keys[..., : c.offset, :], c.values[..., : c.offset, :]
                c.keys = mx.concatenate([k, mx.zeros((*k.shape[:2], grow, k.shape[3]), k.dtype)], axis=2)
                c.values = mx.concatenate([v, mx.zeros((*v.shape[:2], grow, v.shape[3]), v.dtype)], axis=2)
        return True

    def _compiled(self, tokens: mx.array, cache: list) -> mx.array:
        width = tokens.shape[1]
        out = self._fn((width, cache[0].keys.shape[2]), tokens, mx.array(cache[0].offset, dtype=mx.int32),
                       *[b for c in cache for b in (c.keys, c.values)])
        # The cache now holds the step's outputs only, so the old buffers have no owner but
        # the step's graph, which then writes the new keys into them in place. MLX donates a
        # buffer only once no queued operation still holds it: a caller that queues this step
        # while the last one runs (plain decoding's pipeline) would have every layer copy its
        # whole buffers instead, so the last step is waited for here, once this one is built
        # (a no-op for a caller that already waited).
        if self._last is not None:
            mx.eval(self._last)
        self._last = out[0]
        for i, c in enumerate(cache):
            c.keys, c.values = out[1 + 2 * i], out[2 + 2 * i]
            c.offset += width
        return out[0]

    def __call__(self, tokens: mx.array, cache: list) -> mx.array:
        if self.enabled is False or not self.fits(cache, tokens.shape[1]):
            return self.model(tokens, cache=cache)[0, -1:]
        if self.enabled is None:
            return self.check(tokens, cache)
        return self._compiled(tokens, cache)

    def check(self, tokens: mx.array, cache: list, steps: int = CHECK_STEPS) -> mx.array:
        """The first input and ``steps - 1`` greedy steps after it, both ways from the same
        cache (slots at or past the offset are never read, so trimming the forward pass's
        steps undoes them); the first input's logits, and ``enabled`` set. The cache ends
        holding the first input only, as one step leaves it."""
        width, start = tokens.shape[1], cache[0].offset

        want = greedy_steps(lambda x: self.model(x, cache=cache)[0, -1:], tokens, steps)
        written = [(c.keys, c.values) for c in cache]
        for c in cache:
            c.trim(c.offset - start)

        def compiled(x: mx.array) -> mx.array:
            return self._compiled(x, cache) if self.fits(cache, x.shape[1]) else self.model(x, cache=cache)[0, -1:]

        got = checked_run(self.label, "decode step", lambda: greedy_steps(compiled, tokens, steps), want)
        self.enabled = ok = got is not None
        if not ok:  # back to what the forward pass wrote
            for c, (keys, values) in zip(cache, written):
                c.keys, c.values = keys, values
        for c in cache:
            c.offset = start + width
        return got[0] if got is not None else want[0]
