"""A draft model's decode step as one compiled MLX function.

A small draft model's step is dominated by per-operation dispatch, not arithmetic: on the
CPU backend the fast RMSNorm, RoPE and attention kernels fall back to chains of primitive
ops, so one step of the demo draft model (2 layers of 128) runs ~330 ops and costs about a
third of a target step ten times its size. Speculation pays for k of those steps per round
while the verify that they feed costs little more than one plain step, so the draft's step
cost is most of what a round costs beyond a plain step. ``mx.compile`` fuses the
element-wise chains (~190 ops remain) and cuts the step by about 40%.

A compiled function must not depend on Python state that changes from call to call, and
mlx-lm's ``KVCache`` does: its offset is a Python int (a new trace per position) and it
returns keys sliced to the offset. So the step runs the model over :class:`_FixedKV`
layers holding the ``KVCache``'s own buffers at their full capacity: the offset is an
array input (RoPE takes it as one), the new keys and values go in with a dynamic slice
update, and the attention mask hides every slot at or after the offset. The function
returns the last position's logits and the updated buffers, which go back into the
``KVCache`` objects, so everything else (trim, capture, the prefix cache) sees the usual
caches. A trace serves one buffer capacity (a multiple of 256, grown here as needed) and
one input width (1..``MAX_WIDTH`` tokens); tracing again costs a few milliseconds.

Nothing here decides a token: drafts only propose, and the verifier keeps exactly what
the target would have produced. Still, the first compiled step of each model is compared
with the model's own forward pass from the same cache; an architecture whose forward
pass the fixed layers cannot run (it reads the offset as a Python number, or its cache is
not a plain ``KVCache``) or whose logits differ keeps the uncompiled step.
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx

log = logging.getLogger("mlxkv.spec")

MAX_WIDTH = 4  # the widest input the compiled step takes (a round's missing tokens + pending)
STEP = 256  # buffer capacities are kept at multiples of this (KVCache.step): one trace each
TOLERANCE = 1e-3  # most a compiled log-probability may differ from the forward pass's


class _FixedKV:
    """One attention layer's cache as the compiled step sees it: the full buffers, the
    offset as an array, writes at the offset, a mask over the filled slots."""

    def __init__(self, keys: mx.array, values: mx.array, offset: mx.array):
        self.keys, self.values, self.offset = keys, values, offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        at = self.offset.reshape(1)
        self.keys = mx.slice_update(self.keys, keys.astype(self.keys.dtype), at, axes=(2,))
        self.values = mx.slice_update(self.values, values.astype(self.values.dtype), at, axes=(2,))
        return self.keys, self.values

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> mx.array:
        if window_size is not None:
            raise TypeError("the compiled draft step has no sliding window")
        slots = mx.arange(self.keys.shape[2])[None]
        return slots <= (self.offset + mx.arange(n))[:, None]  # [n, capacity]: causal, filled slots


class CompiledStep:
    """``step(model, tokens, cache)``: ``model(tokens, cache=cache)[0, -1:]`` (the last
    position's logits, [1, V], unevaluated), through one compiled function when the cache
    allows it, else the model's own forward pass. ``enabled`` is None until the first
    compiled step was checked against the forward pass, then whether it matched."""

    def __init__(self, model: Any):
        self.model = model
        self.enabled: bool | None = None
        self._fn = mx.compile(self._step)

    def _step(self, tokens: mx.array, offset: mx.array, *buffers: mx.array) -> list[mx.array]:
        layers = [_FixedKV(buffers[i], buffers[i + 1], offset) for i in range(0, len(buffers), 2)]
        logits = self.model(tokens, cache=layers)[0, -1:]
        out = [logits]
        for c in layers:
            out += [c.keys, c.values]
        return out

    def _fits(self, cache: list, width: int) -> bool:
        """Plain KVCache layers at one offset, with room for ``width`` more (grown here to a
        multiple of STEP when needed: a cache restored from the prefix cache holds exactly
        its tokens, and a trace per odd capacity would pile up)."""
        from mlx_lm.models.cache import KVCache

        if not cache or not 0 < width <= MAX_WIDTH:
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
        buffers = [b for c in cache for b in (c.keys, c.values)]
        out = self._fn(tokens, mx.array(cache[0].offset, dtype=mx.int32), *buffers)
        for i, c in enumerate(cache):
            c.keys, c.values = out[1 + 2 * i], out[2 + 2 * i]
            c.offset += width
        return out[0]

    def __call__(self, tokens: mx.array, cache: list) -> mx.array:
        if self.enabled is False or not self._fits(cache, tokens.shape[1]):
            return self.model(tokens, cache=cache)[0, -1:]
        if self.enabled is None:
            return self._check(tokens, cache)
        return self._compiled(tokens, cache)

    def _check(self, tokens: mx.array, cache: list) -> mx.array:
        """The first step both ways from the same cache (slots at or past the offset are
        never read, so trimming the forward pass's step undoes it)."""
        width, start = tokens.shape[1], cache[0].offset
        want = self.model(tokens, cache=cache)[0, -1:]
        mx.eval(want)
        written = [(c.keys, c.values) for c in cache]
        for c in cache:
            c.trim(width)
        ok = False
        try:
            got = self._compiled(tokens, cache)
            mx.eval(got)
            diff = mx.abs((got - mx.logsumexp(got)) - (want - mx.logsumexp(want))).max().item()
            ok = got.shape == want.shape and diff <= TOLERANCE
            if not ok:
                log.debug("the draft model's compiled step differs from its forward pass by %g", diff)
        except Exception as e:  # an architecture the fixed layers cannot run
            log.debug("the draft model's step is not compiled (%s: %s)", type(e).__name__, e)
        self.enabled = ok
        if ok:
            return got
        for c, (keys, values) in zip(cache, written):  # back to what the forward pass wrote
            c.keys, c.values, c.offset = keys, values, start + width
        return want
