"""Plain decoding after the prefill: mlx-lm's ``generate_step`` loop, token for token, with
the model's step compiled (``engine.compiled_step``) where the architecture allows it.

The loop is ``generate_step``'s own: the next step is built and queued (``async_eval``)
before the current token is handed out, the logits processors see the tokens fed so far,
log-probabilities are ``logits - logsumexp(logits)``, the sampler picks from them, and
MLX's buffer cache is cleared every 256 tokens. Only the forward pass differs: one call of
the compiled step where the cache is a plain ``KVCache`` and the model's step passed its
check, the model's own forward pass otherwise (a sliding window, SSM state, an
architecture that does not trace), so greedy output is the same token for token
(tests/test_decoding.py).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Generator
from typing import Any

from mlxkv.engine.arrays import int_item
from mlxkv.engine.compiled_step import CompiledStep
from mlxkv.engine.side_table import SideTable
from mlxkv.engine.weight_layout import layout_for_cpu

_STEPS: SideTable[CompiledStep] = SideTable()  # each model's compiled step


def decode_step(model: Any) -> CompiledStep:
    """The model's compiled single-token step (one per model, kept beside it: its traces are
    reused by every request). Made at the model's first decoding, which also switches its
    matrices to few-row products on the CPU (``engine.weight_layout``): where that copies
    the weights (the column-chunk fallback), the copy is paid where it pays back, not by
    the load or the first token."""
    step = _STEPS.get(model)
    if step is None:
        layout_for_cpu(model)
        # the step holds the model weakly: its table entry must not keep the model alive
        step = CompiledStep(weakref.proxy(model), max_width=1, label="the model")
        _STEPS.put(model, step)
    return step


def plain_decode(model: Any, first: Any, cache: list, sampler: Callable,
                 processors: list[Callable] | None, max_tokens: int,
                 before_feed: Callable[[], None] | None = None) -> Generator[tuple[int, Any], None, None]:
    """``max_tokens`` tokens after ``first`` (an unevaluated [1] token array, sampled but not
    fed yet): (token, log-probabilities [V]) pairs, as ``generate_step(first, model, ...)``
    yields them. ``before_feed()``, when given, runs before each token's step is built."""
    import mlx.core as mx
    from mlx_lm.generate import generation_stream

    step = decode_step(model)
    history = None  # the tokens fed so far, for the processors (generate_step's ``tokens``)

    def next_of(y: mx.array) -> tuple[mx.array, mx.array]:
        nonlocal history
        if before_feed is not None:
            before_feed()
        with mx.stream(generation_stream):
            logits = step(y[None], cache)
            if processors:
                history = y if history is None else mx.concat([history, y])
                for processor in processors:
                    logits = processor(history, logits)
            logprobs = logits - mx.logsumexp(logits, keepdims=True)
            return sampler(logprobs), logprobs.squeeze(0)

    y, logprobs = next_of(first)
    mx.async_eval(y, logprobs)
    n = 0
    while True:
        if n != max_tokens:
            next_y, next_logprobs = next_of(y)
            mx.async_eval(next_y, next_logprobs)
        if n == 0:
            mx.eval(y)
        if n == max_tokens:
            break
        yield int_item(y), logprobs
        if n % 256 == 0:
            mx.clear_cache()
        y, logprobs = next_y, next_logprobs
        n += 1
