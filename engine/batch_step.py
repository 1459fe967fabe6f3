"""The decode step of rows decoded together, as one compiled MLX function.

A batch step, like a lone request's (``engine.compiled_step``), is dominated by building
and dispatching many small ops in Python. :class:`BatchStepModel` is the model mlx-lm's
``BatchGenerator`` runs: one-token steps over plain ``BatchKVCache`` layers go through
:class:`CompiledBatchStep`, anything else is the model's own forward pass. The compiled
function runs over :class:`FixedBatchKV` layers holding each cache's buffers at full
capacity, with the write index, row offsets and left padding as array inputs, and hands
the updated buffers back, so everything else sees the usual caches; only their public
``state`` is read. The first compiled step of each model is checked against the forward
pass (:data:`CHECK_STEPS` greedy steps); a mismatch keeps the forward pass.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import mlx.core as mx

from mlxkv.engine.compiled_step import CHECK_STEPS, STEP, FixedBatchKV, checked_run, greedy_steps
from mlxkv.engine.fused_step import FusedStep, fusable
from mlxkv.engine.layer_steps import LayerSteps
from mlxkv.engine.side_table import SideTable
from mlxkv.engine.traced import Traced
from mlxkv.engine.weight_layout import layout_for_cpu

_STEPS: SideTable[CompiledBatchStep] = SideTable()  # each model's compiled batch step
_FUSED: SideTable[FusedStep] = SideTable()  # each model's fused decode-and-prefill pass


class CompiledBatchStep:
    """``step(tokens, cache)``: ``model(tokens, cache=cache)[:, -1]`` ([B, V], unevaluated)
    for a batch's ``BatchKVCache`` layers, through one compiled function when they allow
    it (:meth:`fits`). ``enabled`` is None until the first compiled step was checked
    against the forward pass, then whether it matched."""

    def __init__(self, model: Any, label: str = "the model"):
        self.model = model
        self.label = label
        self.enabled: bool | None = None
        self._fn = Traced(self._step, f"batch decode step: {label}")

    def _step(self, tokens: mx.array, at: mx.array, offset: mx.array, padding: mx.array,
              *buffers: mx.array) -> list[mx.array]:
        layers = [FixedBatchKV(buffers[i], buffers[i + 1], at, offset, padding)
                  for i in range(0, len(buffers), 2)]
        out = [self.model(tokens, cache=layers)[:, -1, :]]
        for c in layers:
            out += [c.keys, c.values]
        return out

    @staticmethod
    def fits(cache: list, width: int) -> bool:
        """One token per row (a prefill pass of rows of different lengths is wider), over
        plain ``BatchKVCache`` layers holding keys at one write index, with room for it
        (grown here to a multiple of STEP: joins and removals leave buffers of any size,
        and a trace per odd capacity would pile up)."""
        from mlx_lm.models.cache import BatchKVCache

        if not cache or width != 1:
            return False
        for c in cache:
            if type(c) is not BatchKVCache or c.keys is None:
                return False
        index = cache[0].state[4]
        for c in cache:
            keys, values, offset, padding, at = c.state
            if at != index:
                return False
            size = keys.shape[2]
            if size < at + width or size % STEP:
                grow = -(-(at + width) // STEP) * STEP - at
                keys, values = keys[..., :at, :], values[..., :at, :]
                keys = mx.concatenate([keys, mx.zeros((*keys.shape[:2], grow, keys.shape[3]), keys.dtype)], axis=2)
                values = mx.concatenate([values, mx.zeros((*values.shape[:2], grow, values.shape[3]), values.dtype)],
                                        axis=2)
                c.state = (keys, values, offset, padding, at)
        return True

    def _compiled(self, tokens: mx.array, cache: list) -> mx.array:
        width = tokens.shape[1]
        _, _, offset, padding, at = cache[0].state
        out = self._fn((tokens.shape[0], cache[0].state[0].shape[2]), tokens, mx.array([at], dtype=mx.int32),
                       offset, padding,
                       *[b for c in cache for b in c.state[:2]])
        # The caches now hold the step's outputs only, so the old buffers have no owner but
        # the step's graph, which writes the new keys into them in place. Each layer keeps
        # arrays of its own: BatchKVCache updates its left padding in place (``+=``).
        for i, c in enumerate(cache):
            _, _, offset, padding, at = c.state
            c.state = (out[1 + 2 * i], out[2 + 2 * i], offset + width, padding, at + width)
        return out[0]

    def __call__(self, tokens: mx.array, cache: list) -> mx.array:
        if self.enabled is False or not self.fits(cache, tokens.shape[1]):
            return self.model(tokens, cache=cache)[:, -1, :]
        if self.enabled is None:
            return self.check(tokens, cache)
        return self._compiled(tokens, cache)

    def check(self, tokens: mx.array, cache: list, steps: int = CHECK_STEPS) -> mx.array:
        """The first input and ``steps - 1`` greedy steps after it, both ways from the same
        cache (slots past the write index are never read, so trimming the forward pass's
        steps undoes them); the first input's logits, and ``enabled`` set. The cache ends
        holding the first input, as one step leaves it."""
        width, start = tokens.shape[1], cache[0].state[4]

        def back_to(n: int) -> None:
            for c in cache:
                c.trim(c.state[4] - n)

        want = greedy_steps(lambda x: self.model(x, cache=cache)[:, -1, :], tokens, steps)
        written = [c.state for c in cache]
        back_to(start)

        def compiled(x: mx.array) -> mx.array:
            return self._compiled(x, cache) if self.fits(cache, x.shape[1]) else self.model(x, cache=cache)[:, -1, :]

        got = checked_run(self.label, "batch decode step", lambda: greedy_steps(compiled, tokens, steps), want)
        self.enabled = ok = got is not None
        if not ok:  # back to what the forward pass wrote
            for c, state in zip(cache, written):
                c.state = state
        back_to(start + width)
        return got[0] if got is not None else want[0]


class CausalView:
    """A one-row ``BatchKVCache`` layer with no left padding, as a prefill pass sees it: the
    same cache, but its mask is the plain causal one (``"causal"``) instead of a boolean array
    as wide as the cache. The two select the same keys, and the string lets attention skip
    the masking pass over every key: at 8k tokens of context that pass made a 16-token
    chunk's attention about 1.7 times what a lone request's costs."""

    __slots__ = ("cache",)

    def __init__(self, cache: Any):
        self.cache = cache

    @property
    def offset(self) -> mx.array:
        return self.cache.offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return self.cache.update_and_fetch(keys, values)

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> Any:
        if return_array or window_size is not None:
            return self.cache.make_mask(n, return_array=return_array, window_size=window_size)
        return "causal" if n > 1 else None


def _empty(layer: Any) -> bool:
    """Whether a cache layer holds nothing (mlx-lm's ``empty()``, where it has one)."""
    empty = getattr(layer, "empty", None)
    return bool(empty()) if callable(empty) else False


def _causal_views(cache: list | None) -> list | None:
    """``cache`` with each layer behind a :class:`CausalView` when it is one row of plain
    ``BatchKVCache`` layers without left padding (a prompt prefilling on its own in a batch
    step); else ``cache`` itself."""
    from mlx_lm.models.cache import BatchKVCache

    if not cache or any(type(c) is not BatchKVCache for c in cache):
        return cache
    padding = cache[0].left_padding
    if padding.size != 1 or padding.item() != 0:
        return cache
    return [CausalView(c) for c in cache]


T = TypeVar("T")


def _beside(table: SideTable[T], model: Any, make: Callable[[Any], T]) -> T:
    """``table``'s value for ``model``, made by ``make`` at the first call, after the CPU
    weight layout (``engine.weight_layout``) that compiled functions capture. It holds the
    model weakly (a proxy): its table entry must not keep the model alive."""
    value = table.get(model)
    if value is None:
        layout_for_cpu(model)
        value = make(weakref.proxy(model))
        table.put(model, value)
    return value


def batch_decode_step(model: Any) -> CompiledBatchStep:
    """The model's compiled batch step (one per model, kept beside it: its traces serve every
    batch), made at the model's first batched decoding."""
    return _beside(_STEPS, model, CompiledBatchStep)


def fused_step(model: Any) -> FusedStep:
    """The model's fused decode-and-prefill pass (one per model, kept beside it, like its
    batch step)."""
    return _beside(_FUSED, model, FusedStep)


class BatchStepModel:
    """What ``BatchGenerator`` runs as its model: one-token steps over a batch's
    ``BatchKVCache`` layers through the model's :class:`CompiledBatchStep`, everything else
    through the model itself. ``BatchGenerator`` calls it only as ``model(tokens,
    cache=...)``: :class:`engine.batch.Batch` makes every row's prompt cache itself.

    With ``upcoming`` set (``upcoming()``: the prompt chunk the step will feed after its
    decode pass, and the prompt's cache layers, or None; ``engine.batch.Batch`` reads it
    from its ``BatchGenerator`` through ``mlx_lm_compat.next_prompt_chunk``), a decode step
    whose step goes on to feed one prompt's next chunk feeds that chunk in the same pass
    (``engine.fused_step``); the prompt pass that follows finds it fed and returns at once."""

    def __init__(self, model: Any):
        self.model = model
        self.step = batch_decode_step(model)
        self.fused = fused_step(model)
        self.upcoming: Callable[[], tuple[list[int], list] | None] | None = None  # None: no fused passes
        self._fed: tuple[list, list[int]] | None = None  # (prompt layers, chunk) fed by the last decode step
        self.fused_steps = 0  # decode steps that fed a chunk too
        # Called after each layer of a prefill pass with (layers done, layers) (it may raise
        # to abandon the pass; the caches then go back to before it): None, no per-layer stops.
        self.between_layers: Callable[[int, int], None] | None = None
        # Whether the last pass rolled back left some layer empty (every row's first pass:
        # an empty layer has no rows to extract, and nothing was there to keep).
        self.rolled_back_empty = False

    def _fused(self, tokens: mx.array, cache: list) -> mx.array | None:
        """The rows' logits from a pass that also feeds the prompt chunk the step feeds next,
        or None (no such chunk, or the model does not fuse)."""
        fused = self.fused
        if fused.enabled is False or self.upcoming is None:
            return None
        upcoming = self.upcoming()
        if upcoming is None or not fusable(cache, upcoming[1]):
            return None
        chunk, prompt = upcoming
        if fused.enabled is None:
            out = fused.check(tokens, chunk, cache, prompt, lambda: self._two_passes(tokens, chunk, cache, prompt))
        else:
            out = fused.forward(tokens, chunk, cache, prompt)
            self.fused_steps += 1
        self._fed = (prompt, chunk)
        return out

    def _two_passes(self, tokens: mx.array, chunk: list[int], cache: list, prompt: list) -> mx.array:
        out = self.step(tokens, cache)[:, None, :]
        self.model(mx.array([chunk], dtype=tokens.dtype), cache=_causal_views(prompt))
        return out

    def __call__(self, tokens: mx.array, cache: list | None = None) -> mx.array:
        if cache is not None and tokens.shape[1] == 1:
            self._fed = None
            out = self._fused(tokens, cache)
            if out is not None:
                return out
            return self.step(tokens, cache)[:, None, :]  # (the forward pass where it does not fit)
        fed, self._fed = self._fed, None
        if fed is not None and cache is fed[0]:
            if tokens.shape[0] != 1 or tokens[0].tolist() != fed[1]:
                raise RuntimeError("the prompt pass after a fused step is not the chunk it fed")
            return mx.zeros((1, tokens.shape[1], 1), dtype=mx.float32)  # nothing reads a prompt pass's output
        return self._prompt_pass(tokens, cache, self.model)

    def last_logits(self, tokens: mx.array, cache: list, view: Any) -> mx.array:
        """A prompt pass of ``tokens`` ([1, T]) over ``cache`` whose output is only the last
        position's logits ([1, V], unevaluated): ``view`` (the model's
        ``engine.speculation.base.TargetView``) applies the head to that position alone."""
        hidden = self._prompt_pass(tokens, cache, lambda x, cache: view.forward_hidden(x, cache))
        return view.logits(hidden[:, -1, :])

    def _prompt_pass(self, tokens: mx.array, cache: list | None, forward: Callable[..., mx.array]) -> mx.array:
        hook = self.between_layers
        if hook is None or not cache:
            return forward(tokens, cache=_causal_views(cache))
        # Each layer's cache state in order, as for one request (engine.layer_steps): the
        # same operations on the same inputs, only evaluated in steps; a hook that raises
        # puts every layer back as it was before the pass, so the chunks before it stay.
        steps = LayerSteps(cache, tokens.shape[1])
        out = forward(tokens, cache=_causal_views(cache))
        self.rolled_back_empty = False
        try:
            steps.run(hook)
        except BaseException:
            for c in cache:  # the right padding mlx-lm prepared for this pass goes with it
                if getattr(c, "_right_padding", None) is not None:
                    c._right_padding = None
            self.rolled_back_empty = any(_empty(c) for c in cache)
            raise
        return out
