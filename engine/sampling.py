"""What a request samples with: :class:`SamplingParams` and the mlx-lm sampler and logits
processors that plain decoding, batching and speculation all build from it (one module
below them, so none of them imports another for it)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mlxkv.engine.settings import FIELD_BY_NAME


def _default(name: str) -> Any:
    """The settings' default of ``name``: one set of sampling defaults, not two."""
    return FIELD_BY_NAME[name].default


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation options. The defaults are the settings' defaults
    (``engine.settings``), so a request built without the CLI samples as the CLI does."""

    max_tokens: int = _default("max_tokens")
    temperature: float = _default("temperature")
    top_p: float = _default("top_p")
    top_k: int = _default("top_k")
    min_p: float = _default("min_p")
    repetition_penalty: float = _default("repetition_penalty")
    repetition_context_size: int = 20
    seed: int | None = _default("seed")
    stop: tuple[str, ...] = ()
    prefill_step_size: int = _default("prefill_step_size")

    def __post_init__(self) -> None:
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0 or self.min_p < 0 or self.repetition_penalty <= 0:
            raise ValueError("top_k and min_p must be >= 0, repetition_penalty > 0")
        if self.prefill_step_size <= 0:
            raise ValueError("prefill_step_size must be positive")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")


def request_sampler(p: SamplingParams) -> Callable:
    """mlx-lm's sampler for ``p``'s temperature, top-p, min-p and top-k; a seeded sampled
    request gets a :class:`SeededSampler` of its own."""
    if p.seed is not None and p.temperature > 0:
        return SeededSampler(p)
    return mlx_lm_sampler(p)


def mlx_lm_sampler(p: SamplingParams) -> Callable:
    """mlx-lm's own sampler for ``p``: its draws come from MLX's global key (a speculative
    verify samples every position of a window with it)."""
    from mlx_lm.sample_utils import make_sampler

    return make_sampler(p.temperature, p.top_p, p.min_p, top_k=p.top_k)


def sample_filters(p: SamplingParams) -> list[Callable]:
    """The filters mlx-lm's ``make_sampler`` applies to log-probabilities before its draw,
    in its order: top-p, min-p (keeping at least one token), top-k."""
    from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

    filters: list[Callable] = []
    if 0 < p.top_p < 1.0:
        filters.append(lambda x: apply_top_p(x, p.top_p))
    if p.min_p != 0.0:
        filters.append(lambda x: apply_min_p(x, p.min_p, 1))
    if p.top_k > 0:
        filters.append(lambda x: apply_top_k(x, p.top_k))
    return filters


class SeededSampler:
    """A seeded sampled request's sampler: the filters of mlx-lm's ``make_sampler`` in its
    order (top-p, min-p, top-k) and its draw, ``categorical(logprobs / temperature)``, each
    draw with the next key of a sequence of the request's own, split as MLX splits its
    global key after ``mx.random.seed(seed)``. So it draws the tokens mlx-lm draws after
    seeding, whether the request decodes alone or in a batch beside others (one call per
    token either way), and it leaves the process's global random state alone.

    Called on several positions at once (a plain row's window in a batch's speculative
    round, of which only the first position is kept), the first takes the next draw and
    the others the most likely token, drawing nothing. ``rewind(calls)`` puts the sequence
    back to where it was after ``calls`` calls: a request that moves into a batch samples
    again the token its pipelined step alone had drawn ahead."""

    KEEP = 8  # keys kept back for rewind: a lone decode draws one step ahead

    def __init__(self, p: SamplingParams):
        import mlx.core as mx

        assert p.seed is not None and p.temperature > 0
        self.temperature = p.temperature
        self.filters = sample_filters(p)
        self.calls = 0
        self._keys: deque[Any] = deque([mx.random.key(p.seed)], maxlen=self.KEEP)  # [-1]: the next

    def __call__(self, logprobs: Any) -> Any:
        import mlx.core as mx

        pair = mx.random.split(self._keys[-1])
        self._keys.append(pair[0])
        self.calls += 1
        first = logprobs[:1]
        for f in self.filters:
            first = f(first)
        token = mx.random.categorical(first * (1.0 / self.temperature), key=pair[1])
        if logprobs.shape[0] > 1:
            token = mx.concatenate([token, mx.argmax(logprobs[1:], axis=-1)])
        return token

    def rewind(self, calls: int) -> None:
        """Back to the key sequence as it was after ``calls`` calls (at most ``KEEP - 1``
        back)."""
        back = self.calls - calls
        if not 0 <= back < len(self._keys):
            raise ValueError(f"cannot rewind {back} draws (the sampler keeps {len(self._keys) - 1})")
        for _ in range(back):
            self._keys.pop()
        self.calls = calls


def request_processors(p: SamplingParams, history: Sequence[int] = ()) -> list[Callable]:
    """The logits processors of plain decoding for ``p`` (its repetition penalty; empty when
    it has none). ``generate_step`` shows them only the tokens it is given, so ``history``
    (the cached prefix before those) is put in front: penalties see the same context with
    or without a cache hit."""
    import mlx.core as mx
    from mlx_lm.sample_utils import make_logits_processors

    processors = make_logits_processors(
        repetition_penalty=p.repetition_penalty if p.repetition_penalty != 1.0 else None,
        repetition_context_size=p.repetition_context_size)
    if processors and len(history):
        before = mx.array(list(history))
        processors = [with_history(proc, before) for proc in processors]
    return processors


def with_history(processor: Callable, history: Any) -> Callable:
    """``processor`` seeing ``history`` (an mx array) in front of the tokens it is shown."""
    import mlx.core as mx

    return lambda tokens, logits: processor(mx.concatenate([history, tokens]), logits)
