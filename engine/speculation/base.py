"""The speculation seam: what a source of proposed tokens implements, and the view of the
target model it gets.

A :class:`ProposalProvider` is built once per loaded target (``engine.speculation.load_providers``);
it opens one :class:`ProposalSource` per request. The verifier (``engine.speculation.verify``) feeds
the target ``[pending] + proposal`` in one forward pass and decides every token; a source
only ever proposes. ``commit`` tells the source what the target really took, so a source
never has to undo anything itself.

:class:`ProposalRowGroup` is the same contract for several rows decoded together (ragged
proposals, one call per round), and :class:`RequestConstraints` is what a request owns
(``guided_choice``, a JSON skeleton) proposing the continuations it already knows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import mlx.core as mx

    from mlxkv.engine.sampling import SamplingParams

KINDS = ("draft", "ngram", "suffix", "mtp", "constraint")


class TargetView:
    """The loaded target as a source sees it: its model and tokenizer, its embeddings, its
    LM head, and a forward pass that also returns the last hidden state (after the final
    norm: what the LM head consumes)."""

    def __init__(self, model: Any, tokenizer: Any):
        self.model = model
        self.tokenizer = tokenizer
        inner = _inner_model(model)
        self._inner = inner
        args = getattr(getattr(model, "language_model", model), "args", None)  # VLM-style: the text model's
        embed = inner.embed_tokens  # (_inner_model checked it is there)
        self.vocab_size: int = int(getattr(args, "vocab_size", 0) or embed.weight.shape[0])
        self.hidden_size: int = int(getattr(args, "hidden_size", 0) or embed.weight.shape[-1])

    def embed(self, tokens: mx.array) -> mx.array:
        """The target's input embeddings of ``tokens`` ([1, T] -> [1, T, D])."""
        return self._inner.embed_tokens(tokens)

    def logits(self, hidden: mx.array) -> mx.array:
        """The target's LM head (tied or not) on normed ``hidden`` ([..., D] -> [..., V])."""
        model = getattr(self.model, "language_model", self.model)  # qwen3_5: language_model.lm_head
        head = getattr(model, "lm_head", None)
        if head is not None and not getattr(getattr(model, "args", None), "tie_word_embeddings", False):
            return head(hidden)
        return self._inner.embed_tokens.as_linear(hidden)

    def forward(self, tokens: mx.array, cache: list) -> tuple[mx.array, mx.array]:
        """tokens [1, T] -> (logits [1, T, V], hidden [1, T, D]); ``cache`` advances by T."""
        hidden = self.forward_hidden(tokens, cache)
        return self.logits(hidden), hidden

    def forward_hidden(self, tokens: mx.array, cache: list) -> mx.array:
        """tokens [B, T] -> the last hidden states [B, T, D] (no head); ``cache`` advances by T."""
        return self._inner(tokens, cache=cache)


def _inner_model(model: Any) -> Any:
    # mlx-lm models wrap the decoder stack as .model (most) or .language_model.model (VLM-style)
    inner = getattr(model, "model", None)
    if inner is None and hasattr(model, "language_model"):
        inner = getattr(model.language_model, "model", None)
    if inner is None or not hasattr(inner, "embed_tokens"):
        raise TypeError(f"{type(model).__name__} has no decoder with embed_tokens")
    return inner


@dataclass
class Proposal:
    """Tokens a source proposes after the pending one. ``probs`` is the proposal distribution q
    ([len(tokens), V]) of sources that sample; None marks an exact-match source."""

    tokens: list[int]
    probs: mx.array | None = None
    # Optional: the tokens as a not yet evaluated array (``tokens`` left empty). The verifier
    # evaluates them in one graph with its own forward pass (one wait per round instead of
    # two) and then fills ``tokens`` before ``commit``.
    lazy: mx.array | None = None


@dataclass
class KVState:
    """A capture that is a KV cache: ``cache`` holds exactly ``tokens`` (offset ==
    len(tokens)). It is stored in the prefix cache under the provider's namespace
    (``f"{namespace}+draft-{provider.checkpoint_namespace()}"``), so RAM, SSD, verification and
    restarts work for it as for the target's own entries."""

    tokens: list[int]
    cache: list


class ProposalSource:
    """One request's source of proposals. The verifier calls ``prefill`` once, then per round
    ``propose(pending, n)`` and ``commit(accepted)``."""

    # A source whose proposals end by themselves where they turn unlikely (suffix: the match
    # length and the path's probability) is asked for up to the most tokens a round takes
    # whenever the length controller speculates at all; the controller's length, fitted to
    # one acceptance rate for every position, would cut a 40-token repeated tool call into
    # rounds of 4, 8, 16 tokens as it grows.
    sizes_itself: bool = False
    # Proposals from this request alone: nothing learned from other requests' outputs (a
    # request of a cache scope, a tenant, whose speed must not tell what others wrote).
    private: bool = False

    def prefill(self, prompt_tokens: list[int], processed: int = 0, hidden: mx.array | None = None) -> None:
        """The prompt is in the target's KV; ``processed`` of its tokens were already known to
        this source (restored state). ``hidden``: target hidden rows [T - processed, D] of
        the prompt positions from ``processed`` on (only when the provider needs_hidden)."""

    def propose(self, pending: int, n: int) -> Proposal:
        """Up to ``n`` tokens to follow ``pending`` (the token the target sampled last and has
        not been fed yet). The returned length is authoritative; 0 = one plain step."""
        return Proposal([])

    def commit(self, accepted: list[int], hidden: mx.array | None = None) -> None:
        """``accepted`` are now in the target's KV: the old pending token plus the accepted
        proposed tokens. ``hidden``: the target hidden rows of exactly those positions."""

    def worth_probing(self) -> bool:
        """After a plain step fed the target (``commit`` told the source): whether it now
        sees a long earlier run repeated, so that a pause in speculation should end and the
        next round propose."""
        return False

    def capture(self) -> Any:
        """State to store beside the target's cache entry (None: nothing to store; a
        :class:`KVState` goes to the prefix cache under the provider's namespace)."""
        return None

    def restore(self, state: Any) -> None:
        """Take back what :meth:`capture` returned (before ``prefill``); for a
        :class:`KVState` the prefix cache may return a shorter prefix of what was stored."""

    def close(self) -> None:
        """Release what the source holds (its KV)."""


class ProposalProvider:
    """One per loaded target: opens a :class:`ProposalSource` per request."""

    kind: str = ""  # one of KINDS
    weights_bytes: int = 0
    supports_external_tokens: bool = False
    needs_hidden: bool = False
    # The most tokens a round proposes unless ``--spec-tokens`` says otherwise: a proposed
    # token costs a forward pass of the source here, so a round stays short.
    proposal_tokens: int = 12
    model: Any = None  # a provider that stores KVState: the model that KV belongs to (bind_model)

    def checkpoint_namespace(self) -> str:
        """The identity of the source state this provider stores (folded into the prefix
        cache namespace of that state): a content fingerprint, or kind and schema."""
        raise NotImplementedError

    def open(self, target: TargetView, sampling: SamplingParams, constraints: Any = None) -> ProposalSource:
        raise NotImplementedError

    def attach(self, cache: Any, namespace: str) -> None:
        """Once, at load: the model's prefix cache (an ``engine.cache.client.CacheClient``)
        and its namespace, for a provider that keeps what it learned beside the cache."""

    def learn(self, output: Sequence[int]) -> None:
        """A request of the target finished with ``output`` (whatever its speculation, alone
        or batched; engine thread)."""

    def figures(self) -> dict[str, Any]:
        """The provider's own figures for ``engine.stats()["spec"][kind]``."""
        return {}


class RequestConstraints:
    """What a request owns that knows its continuation (``guided_choice``, forced spans of a
    JSON skeleton). It proposes without changing its committed state, and advances only
    with the tokens the verifier accepted."""

    def propose(self, row: int, max_tokens: int) -> list[int]:
        """Known continuation of ``row`` (0..max_tokens tokens; [] = nothing forced)."""
        return []

    def allowed(self, row: int, prefix: Sequence[int]) -> Sequence[int] | None:
        """Token ids that may follow the committed text plus ``prefix`` (None = any)."""
        return None

    def commit(self, row: int, tokens: Sequence[int]) -> None:
        """The verifier accepted ``tokens`` for ``row``."""

    def done(self, row: int) -> bool:
        """The row's output is complete (no token but EOS may follow)."""
        return False


class ProposalRowGroup:
    """Proposals for several rows decoded together. Rows are addressed by their index in the
    group; ``append``/``filter_rows`` keep it in step with the batch."""

    def append(self, rows: Sequence[ProposalSource]) -> None:
        raise NotImplementedError

    def filter_rows(self, keep: Sequence[int]) -> None:
        """Keep only rows ``keep`` (indices, in the new order)."""
        raise NotImplementedError

    def propose(self, pending: Sequence[int], depth: int) -> list[list[int]]:
        """Ragged proposals, one list per row (verification right-pads to the widest)."""
        raise NotImplementedError

    def commit(self, accepted: Sequence[Sequence[int]]) -> None:
        raise NotImplementedError

    def capture(self, row: int) -> Any:
        raise NotImplementedError

    def consume(self, tokens: Sequence[Sequence[int]], lengths: Sequence[int]) -> None:
        """At a committed round boundary: take in target inputs the rows did not propose
        (``tokens[i][:lengths[i]]``: constraint-forced tokens, a new user turn)."""
        raise NotImplementedError
