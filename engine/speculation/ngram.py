"""Prompt lookup: propose what followed the last occurrence of the trailing n-gram of the
conversation (prompt and output), longest n first.

The index maps every n-gram (min_n <= n <= max_n) to the position after its latest
occurrence, updated as tokens are committed: O(max_n - min_n + 1) dictionary operations
per token, never a rescan. An n-gram is indexed one token late, so the trailing n-gram
never matches itself. The history is the conversation's own tokens, so a restored
conversation rebuilds it in its prefill from the prompt: there is no other state to store.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from mlxkv.engine.speculation.base import Proposal, ProposalProvider, ProposalRowGroup, ProposalSource

if TYPE_CHECKING:
    import mlx.core as mx

    from mlxkv.engine.sampling import SamplingParams
    from mlxkv.engine.speculation.base import TargetView

SCHEMA = "ngram-v1"


class NgramIndex:
    def __init__(self, min_n: int = 2, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min <= max, got {min_n}..{max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self._index: dict[tuple[int, ...], int] = {}

    def extend(self, tokens: Sequence[int]) -> None:
        h, index = self.tokens, self._index
        lo, hi = self.min_n, self.max_n
        for t in tokens:
            end = len(h)  # the n-grams ending here are followed by t: index them now
            for n in range(lo, min(hi, end) + 1):
                index[tuple(h[end - n: end])] = end
            h.append(int(t))

    def lookup(self, pending: int, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest
        trailing n-gram of history + [pending]."""
        h = self.tokens
        if k <= 0 or not h:
            return []
        for n in range(min(self.max_n, len(h) + 1), self.min_n - 1, -1):
            key = tuple(h[len(h) - n + 1:]) + (pending,) if n > 1 else (pending,)
            e = self._index.get(key)
            if e is not None:
                out = h[e: e + k]
                if len(out) < k:
                    # The match runs into the end: the text repeats with period
                    # len(history + [pending]) - e, so the proposal continues that cycle.
                    ext = h[e:] + [pending]
                    out = [ext[i % len(ext)] for i in range(k)]
                return out
        return []


class NgramSource(ProposalSource):
    def __init__(self, min_n: int, max_n: int):
        self.index = NgramIndex(min_n, max_n)

    def prefill(self, prompt_tokens: list[int], processed: int = 0, hidden: mx.array | None = None) -> None:
        self.index.extend(prompt_tokens[len(self.index.tokens):])

    def propose(self, pending: int, n: int) -> Proposal:
        return Proposal(self.index.lookup(pending, n))

    def commit(self, accepted: list[int], hidden: mx.array | None = None) -> None:
        self.index.extend(accepted)

    def consume(self, tokens: Sequence[int]) -> None:
        self.index.extend(tokens)


class NgramProvider(ProposalProvider):
    kind = "ngram"
    weights_bytes = 0
    supports_external_tokens = True
    needs_hidden = False

    def __init__(self, min_n: int = 2, max_n: int = 4):
        NgramIndex(min_n, max_n)  # checks the sizes now, not at the first request
        self.min_n, self.max_n = min_n, max_n

    def checkpoint_namespace(self) -> str:
        return f"{SCHEMA}-n{self.min_n}-{self.max_n}"

    def open(self, target: TargetView, sampling: SamplingParams, constraints: Any = None) -> NgramSource:
        return NgramSource(self.min_n, self.max_n)

    def group(self) -> ProposalRowGroup:
        return NgramRowGroup()


def NgramRowGroup() -> ProposalRowGroup:  # noqa: N802  (the group type of this provider)
    from mlxkv.engine.speculation.rows import SourceRowGroup

    return SourceRowGroup()
