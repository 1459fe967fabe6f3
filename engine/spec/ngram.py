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
from typing import Any

from engine.spec.base import DraftProvider, DraftRowGroup, DraftSource, Proposal

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


class NgramSource(DraftSource):
    def __init__(self, min_n: int, max_n: int):
        self.index = NgramIndex(min_n, max_n)

    def prefill(self, prompt_tokens: list[int], processed: int = 0, hidden: Any = None) -> None:
        self.index.extend(prompt_tokens[len(self.index.tokens):])

    def propose(self, pending: int, n: int) -> Proposal:
        return Proposal(self.index.lookup(pending, n))

    def commit(self, accepted: list[int], hidden: Any = None) -> None:
        self.index.extend(accepted)

    def consume(self, tokens: Sequence[int]) -> None:
        self.index.extend(tokens)


class NgramProvider(DraftProvider):
    kind = "ngram"
    weights_bytes = 0
    supports_external_tokens = True
    needs_hidden = False

    def __init__(self, min_n: int = 2, max_n: int = 4):
        NgramIndex(min_n, max_n)  # checks the sizes now, not at the first request
        self.min_n, self.max_n = min_n, max_n

    def checkpoint_namespace(self) -> str:
        return f"{SCHEMA}-n{self.min_n}-{self.max_n}"

    def open(self, target: Any, sampling: Any, constraints: Any = None) -> NgramSource:
        return NgramSource(self.min_n, self.max_n)

    def group(self) -> NgramRowGroup:
        return NgramRowGroup()


class NgramRowGroup(DraftRowGroup):
    """Rows of a batch, each with its own index; proposals are ragged."""

    def __init__(self) -> None:
        self.rows: list[DraftSource] = []

    def append(self, rows: Sequence[DraftSource]) -> None:
        self.rows.extend(rows)

    def filter_rows(self, keep: Sequence[int]) -> None:
        self.rows = [self.rows[i] for i in keep]

    def propose(self, pending: Sequence[int], depth: int) -> list[list[int]]:
        if len(pending) != len(self.rows):
            raise ValueError(f"{len(pending)} pending tokens for {len(self.rows)} rows")
        return [row.propose(int(p), depth).tokens for row, p in zip(self.rows, pending)]

    def commit(self, accepted: Sequence[Sequence[int]]) -> None:
        for row, toks in zip(self.rows, accepted):
            row.commit(list(toks))

    def capture(self, row: int) -> Any:
        return self.rows[row].capture()

    def consume(self, tokens: Sequence[Sequence[int]], lengths: Sequence[int]) -> None:
        for row, toks, n in zip(self.rows, tokens, lengths):
            row.consume(list(toks)[:n])
