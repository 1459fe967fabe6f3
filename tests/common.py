"""Helpers the tests share: the bound on every wait, greedy sampling parameters, and greedy
decoding straight through an mlx-lm model (the reference the engine's output is held to)."""

from __future__ import annotations

from typing import Any

T = 120  # seconds any one wait in a test may take before the test fails (it never hangs)


def greedy(**kwargs: Any) -> Any:
    """Greedy decoding, whatever the defaults are (``SamplingParams`` keywords on top)."""
    from mlxkv.engine.generate import SamplingParams

    base = dict(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0)
    return SamplingParams(**{**base, **kwargs})


def greedy_tokens(model: Any, tokens: list[int], cache: list | None = None, n_cached: int = 0,
                  n_new: int = 6, quantize: bool = False, feed_last: bool = False) -> tuple[list[int], list]:
    """``n_new`` greedy tokens after ``tokens`` (the first ``n_cached`` already in ``cache``),
    computed by the model itself. The cache then holds the prompt and every new token but
    the last, or every new token with ``feed_last``. ``quantize``: 8-bit quantized KV from
    the first token on, as the engine's ``kv_bits`` does."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    if cache is None:
        cache = make_prompt_cache(model)
        if quantize:
            model(mx.array(tokens[:1])[None], cache=cache)
            cache = [c.to_quantized(group_size=32, bits=8) for c in cache]
            n_cached = 1
    logits = model(mx.array(tokens[n_cached:])[None], cache=cache)[0, -1]
    out: list[int] = []
    for _ in range(n_new):
        t = int(mx.argmax(logits).item())
        out.append(t)
        if feed_last or len(out) < n_new:
            logits = model(mx.array([[t]]), cache=cache)[0, -1]
    return out, cache


def scaled_logits(inner: Any, honest: type) -> Any:
    """``inner`` (an mlx-lm model) wrapped so that its logits are halved unless the cache
    it is called with is of class ``honest`` (or absent): a stand-in for an architecture
    whose compiled step would compute other numbers than its forward pass."""
    import mlx.nn as nn
    from mlx_lm.models.cache import make_prompt_cache

    class ScaledLogits(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner

        def __call__(self, x: Any, cache: Any = None) -> Any:
            out = self.inner(x, cache=cache)
            return out if cache is None or type(cache[0]) is honest else out * 0.5

        def make_cache(self) -> list:
            return make_prompt_cache(self.inner)

    return ScaledLogits()
