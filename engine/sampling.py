"""What a request samples with: :class:`SamplingParams` and the mlx-lm sampler and logits
processors that plain decoding, batching and speculation all build from it (one module
below them, so none of them imports another for it)."""

from __future__ import annotations

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
    """mlx-lm's sampler for ``p``'s temperature, top-p, min-p and top-k."""
    from mlx_lm.sample_utils import make_sampler

    return make_sampler(p.temperature, p.top_p, p.min_p, top_k=p.top_k)


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
