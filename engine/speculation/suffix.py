"""Suffix speculation: propose what followed the longest earlier match of the text's end,
one token at a time, choosing the most frequent continuation, from the request itself
(prompt and output) and from what earlier requests of the same model wrote.

The idea is SuffixDecoding's (Oliaro et al., NeurIPS 2025): agents repeat themselves —
tool-call JSON, file contents read back and rewritten, a plan re-emitted turn after turn —
so a suffix structure over the conversation and over earlier outputs predicts long runs
of tokens with no model at all. Prompt lookup (``ngram``) copies what followed the last
occurrence of a short fixed n-gram and gives up at the first difference; here every
proposed token is chosen again against the longest suffix that matches the text *with the
tokens proposed so far*, so after a paraphrased word the proposal re-anchors on the next
matching run instead of stopping, and where a context was followed by different tokens at
different times the most frequent one wins (``engine.speculation.suffix_index``).

Two indexes per request: its own (prompt and output, built at its prefill), and its
provider's global index (one per loaded model, that is per prefix-cache namespace), which
learns the output of every finished request of the model, whatever its speculation
(``learn``: the engine calls it for single-stream and batched rows alike), and forgets the
oldest outputs beyond ``global_tokens`` tokens. The global index is saved beside the SSD
cache (``attach``: the prefix cache reads it back at load and writes it when it flushes,
closes, and now and then while idle), so an agent's next turn after a restart is proposed
from what the process before it learned.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from mlxkv.engine.logs import warn_once
from mlxkv.engine.speculation.base import Proposal, ProposalProvider, ProposalRowGroup, ProposalSource
from mlxkv.engine.speculation.suffix_index import LENGTHS, SuffixIndex, match_length, propose_path

if TYPE_CHECKING:
    import mlx.core as mx

    from mlxkv.engine.sampling import SamplingParams
    from mlxkv.engine.speculation.base import TargetView

log = logging.getLogger("mlxkv.spec")

# What the learned file holds: the outputs, oldest first, as token ids (the index is built
# from them at load, so its own layout may change without a new schema).
SCHEMA = "suffix-outputs-v1"
LEARNED_NAME = "suffix"  # the learned file's name in the cache folder's namespace
ALPHA = 2.0  # a proposal is at most ALPHA times as deep as the match it continues
MIN_SCORE = 0.3  # a proposal stops where its path probability falls below this
# Nothing is proposed after a match of one token: what followed an earlier occurrence of
# the last token alone comes next too rarely for a round to cost less than the plain step
# it replaces; matches of two tokens and more predict far better.
MIN_MATCH = 2
GLOBAL_TOKENS = 32768  # output tokens the global index keeps (about 1 KiB of index each)
# A plain stretch (speculation paused because it lost) ends early where the text's end
# repeats an earlier run at least this long: eight tokens in a row rarely repeat by chance.
PROBE_MATCH = 8


class SuffixSource(ProposalSource):
    sizes_itself = True

    def __init__(self, provider: SuffixProvider):
        self.provider = provider
        self.local = SuffixIndex(provider.lengths)

    def prefill(self, prompt_tokens: list[int], processed: int = 0, hidden: mx.array | None = None) -> None:
        self.local.extend(prompt_tokens[len(self.local.tokens):])

    def propose(self, pending: int, n: int) -> Proposal:
        p = self.provider
        context = self.local.tokens[-p.window:] + [int(pending)]
        tokens, _ = propose_path(self._indexes(), context, n, alpha=p.alpha,
                                 min_score=p.min_score, min_match=p.min_match)
        return Proposal(tokens)

    def commit(self, accepted: list[int], hidden: mx.array | None = None) -> None:
        self.local.extend(accepted)

    def worth_probing(self) -> bool:
        """The text's end repeats an earlier run of at least PROBE_MATCH tokens (in the
        request or an earlier reply): the model is likely copying it."""
        tokens = self.local.tokens
        return len(tokens) >= PROBE_MATCH and match_length(
            self._indexes(), tokens[-self.provider.window:]) >= PROBE_MATCH

    def _indexes(self) -> tuple[SuffixIndex, ...]:
        return (self.local,) if self.private else (self.local, self.provider.global_index)

    def consume(self, tokens: Sequence[int]) -> None:
        self.local.extend(tokens)

    def close(self) -> None:
        self.local = SuffixIndex(self.provider.lengths)


class SuffixProvider(ProposalProvider):
    kind = "suffix"
    weights_bytes = 0
    supports_external_tokens = True
    needs_hidden = False
    schema = SCHEMA
    # A proposal costs nothing to make and stops by itself where the match is short or the
    # path unlikely (ALPHA, MIN_SCORE): a file or a tool call repeated whole is verified in
    # windows of up to 33 tokens, where a verified token costs least.
    proposal_tokens = 32

    def __init__(self, *, lengths: Sequence[int] = LENGTHS, alpha: float = ALPHA,
                 min_score: float = MIN_SCORE, global_tokens: int = GLOBAL_TOKENS,
                 min_match: int = MIN_MATCH,
                 vocab_size: int | None = None):
        if alpha <= 0 or not 0 <= min_score <= 1 or global_tokens < 0:
            raise ValueError("suffix speculation needs alpha > 0, 0 <= min_score <= 1, global_tokens >= 0")
        self.lengths = tuple(lengths)
        self.window = max(self.lengths)
        self.alpha, self.min_score = float(alpha), float(min_score)
        self.min_match = max(1, int(min_match))
        self.global_tokens = int(global_tokens)
        self.vocab_size = vocab_size
        self.global_index = SuffixIndex(self.lengths)
        self._learned: deque[np.ndarray] = deque()  # oldest first, never changed in place
        self._learned_tokens = 0
        self.revision = 0  # changes whenever what the global index learned changes

    def checkpoint_namespace(self) -> str:
        return f"suffix-v2-l{'-'.join(map(str, self.lengths))}"

    # the global index ---------------------------------------------------------------
    def learn(self, output: Sequence[int] | np.ndarray) -> None:
        """Add a finished request's output to the global index; forget the oldest outputs
        beyond ``global_tokens`` tokens (engine thread)."""
        if not self.global_tokens or not len(output):
            return
        seq = np.asarray(output, dtype=np.uint32)[-self.global_tokens:]
        self.global_index.extend(seq.tolist())
        self.global_index.end_sequence()
        self._learned.append(seq)
        self._learned_tokens += len(seq)
        while self._learned_tokens > self.global_tokens:
            old = self._learned.popleft()
            self._learned_tokens -= len(old)
            self.global_index.forget(old.tolist())
        self.revision += 1

    def clear(self) -> None:
        """Forget everything the global index learned."""
        self.global_index = SuffixIndex(self.lengths)
        self._learned.clear()
        self._learned_tokens = 0
        self.revision += 1

    @property
    def learned_tokens(self) -> int:
        return self._learned_tokens

    def figures(self) -> dict[str, Any]:
        return {"learned_replies": len(self._learned), "learned_tokens": self._learned_tokens,
                "learned_limit": self.global_tokens}

    def learned_sequences(self) -> list[np.ndarray]:
        """What the global index learned, oldest first (arrays never changed later)."""
        return list(self._learned)

    def restore_learned(self, sequences: Sequence[np.ndarray]) -> int:
        """Learn saved ``sequences`` (oldest first) again, the newest within the bound;
        ValueError, learning nothing, when one holds a token id the model does not have.
        Returns the tokens learned."""
        seqs = [np.asarray(s, dtype=np.uint32) for s in sequences if len(s)]
        if self.vocab_size is not None:
            bad = next((s for s in seqs if int(s.max()) >= self.vocab_size), None)
            if bad is not None:
                raise ValueError(f"token id {int(bad.max())} is outside the model's vocabulary "
                                 f"({self.vocab_size})")
        keep, total = [], 0
        for s in reversed(seqs):
            if total + len(s) > self.global_tokens:
                break
            keep.append(s)
            total += len(s)
        for s in reversed(keep):
            self.learn(s)
        return total

    def attach(self, cache: Any, namespace: str) -> None:
        """Learn what the cache saved for this namespace, and have the cache save what is
        learned from now on (at its flush, close, and now and then while idle)."""
        sequences = cache.load_learned(namespace, LEARNED_NAME, self.schema)
        if sequences:
            try:
                n = self.restore_learned(sequences)
                log.debug("suffix speculation: %d learned tokens restored", n)
            except ValueError as e:
                warn_once(log, "suffix-restore", "the saved suffix index of this model is not "
                          "used: %s", e)
        cache.keep_learned(namespace, LEARNED_NAME, self)

    # sources ------------------------------------------------------------------------
    def open(self, target: TargetView, sampling: SamplingParams, constraints: Any = None) -> SuffixSource:
        return SuffixSource(self)

    def group(self) -> ProposalRowGroup:
        from mlxkv.engine.speculation.rows import SourceRowGroup

        return SourceRowGroup()
