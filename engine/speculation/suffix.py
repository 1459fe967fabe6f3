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
different times the most frequent one wins.

The structure is a bounded-length suffix index rather than a full suffix tree: for every
position and every length L in :data:`LENGTHS`, the hash of the L tokens ending there maps
to the counts of the tokens that followed them. A lookup tries the lengths longest first
(one dictionary probe each), so a proposed token costs ``len(LENGTHS)`` probes, and adding
a token costs as many insertions; hashes that collide only make a proposal worse, never the
output (the verifier decides every token). A proposal stops where the most frequent
continuation's share falls below ``min_share``, and is at most ``alpha`` times the length
of the match it starts from (a short match predicts little).

The global index of a provider (one per loaded model) learns the output of every finished
request and forgets the oldest outputs beyond ``global_tokens`` tokens.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

from mlxkv.engine.speculation.base import DraftProvider, DraftRowGroup, DraftSource, Proposal

SCHEMA = "suffix-v1"
# Suffix lengths indexed (tokens). Long ones anchor precisely in repeated files and JSON;
# short ones keep proposing after a paraphrase.
LENGTHS = (32, 24, 16, 12, 8, 6, 4, 3, 2, 1)


class SuffixIndex:
    """Counts of the token that followed every suffix of length in :data:`LENGTHS` of the
    sequences added to it (``extend`` appends to the current sequence; ``end_sequence``
    starts a new one, so no suffix spans two sequences)."""

    def __init__(self, lengths: Sequence[int] = LENGTHS):
        if not lengths or min(lengths) < 1:
            raise ValueError(f"suffix lengths must be >= 1, got {lengths!r}")
        self.lengths = tuple(sorted(set(int(n) for n in lengths), reverse=True))
        self.tokens: list[int] = []  # the current sequence
        self._follow: dict[int, dict[int, int]] = {}

    def __len__(self) -> int:
        return len(self._follow)

    def _add(self, seq: Sequence[int], end: int, token: int, delta: int) -> None:
        follow = self._follow
        for n in self.lengths:
            if n > end:
                continue
            key = hash(tuple(seq[end - n: end]))
            counts = follow.get(key)
            if counts is None:
                if delta < 0:
                    continue
                follow[key] = {token: delta}
                continue
            c = counts.get(token, 0) + delta
            if c > 0:
                counts[token] = c
            else:
                counts.pop(token, None)
                if not counts:
                    del follow[key]

    def extend(self, tokens: Sequence[int]) -> None:
        seq = self.tokens
        for t in tokens:
            t = int(t)
            self._add(seq, len(seq), t, 1)
            seq.append(t)

    def end_sequence(self) -> list[int]:
        """Close the current sequence (returns it); the next ``extend`` starts a new one."""
        done, self.tokens = self.tokens, []
        return done

    def forget(self, seq: Sequence[int]) -> None:
        """Remove a sequence added earlier (its counts go down by what it added)."""
        for end in range(len(seq)):
            self._add(seq, end, int(seq[end]), -1)

    def match(self, context: Sequence[int]) -> tuple[int, dict[int, int] | None]:
        """(length of the longest indexed suffix of ``context``, the counts of what followed
        it), or (0, None)."""
        follow = self._follow
        for n in self.lengths:
            if n <= len(context):
                counts = follow.get(hash(tuple(context[len(context) - n:])))
                if counts:
                    return n, counts
        return 0, None


def _best(counts: dict[int, int]) -> tuple[int, float]:
    token = max(counts, key=counts.__getitem__)
    return token, counts[token] / sum(counts.values())


def propose_from(indexes: Sequence[SuffixIndex], context: list[int], n: int, *, alpha: float,
                 min_share: float) -> list[int]:
    """Up to ``n`` tokens to follow ``context``: each one the most frequent continuation of
    the longest suffix (of the context and the tokens proposed before it) that any index
    knows; the longer match wins between indexes, the first index on a tie."""
    out: list[int] = []
    budget = n
    window = max(indexes[0].lengths) if indexes else 0
    tail = list(context[-window:]) if window else []
    while len(out) < budget:
        best_len, best_counts = 0, None
        for index in indexes:
            length, counts = index.match(tail)
            if length > best_len:
                best_len, best_counts = length, counts
        if best_counts is None:
            break
        if not out:  # a short match predicts little: the proposal grows with the match
            budget = min(n, max(1, int(alpha * best_len)))
        token, share = _best(best_counts)
        if share < min_share:
            break
        out.append(token)
        tail.append(token)
        if len(tail) > window:
            del tail[0]
    return out


class SuffixSource(DraftSource):
    def __init__(self, provider: SuffixProvider):
        self.provider = provider
        self.local = SuffixIndex(provider.lengths)
        self.prompt_len = 0

    def prefill(self, prompt_tokens: list[int], processed: int = 0, hidden: Any = None) -> None:
        self.local.extend(prompt_tokens[len(self.local.tokens):])
        self.prompt_len = len(prompt_tokens)

    def propose(self, pending: int, n: int) -> Proposal:
        context = self.local.tokens[-self.provider.window:] + [int(pending)]
        p = self.provider
        return Proposal(propose_from((self.local, p.global_index), context, n, alpha=p.alpha,
                                     min_share=p.min_share))

    def commit(self, accepted: list[int], hidden: Any = None) -> None:
        self.local.extend(accepted)

    def consume(self, tokens: Sequence[int]) -> None:
        self.local.extend(tokens)

    def close(self) -> None:
        output = self.local.tokens[self.prompt_len:]
        if output:
            self.provider.learn(output)
        self.local = SuffixIndex(self.provider.lengths)


class SuffixProvider(DraftProvider):
    kind = "suffix"
    weights_bytes = 0
    supports_external_tokens = True
    needs_hidden = False

    def __init__(self, *, lengths: Sequence[int] = LENGTHS, alpha: float = 2.0, min_share: float = 0.3,
                 global_tokens: int = 16384):
        if alpha <= 0 or not 0 <= min_share <= 1 or global_tokens < 0:
            raise ValueError("suffix speculation needs alpha > 0, 0 <= min_share <= 1, global_tokens >= 0")
        self.lengths = tuple(lengths)
        self.window = max(self.lengths)
        self.alpha, self.min_share = float(alpha), float(min_share)
        self.global_tokens = int(global_tokens)
        self.global_index = SuffixIndex(self.lengths)
        self._learned: deque[list[int]] = deque()
        self._learned_tokens = 0

    def checkpoint_namespace(self) -> str:
        return f"{SCHEMA}-l{'-'.join(map(str, self.lengths))}"

    def learn(self, output: Sequence[int]) -> None:
        """Add a finished request's output to the global index; forget the oldest outputs
        beyond ``global_tokens`` tokens."""
        seq = [int(t) for t in output][-self.global_tokens:] if self.global_tokens else []
        if not seq:
            return
        self.global_index.extend(seq)
        self._learned.append(self.global_index.end_sequence())
        self._learned_tokens += len(seq)
        while self._learned_tokens > self.global_tokens:
            old = self._learned.popleft()
            self._learned_tokens -= len(old)
            self.global_index.forget(old)

    @property
    def learned_tokens(self) -> int:
        return self._learned_tokens

    def open(self, target: Any, sampling: Any, constraints: Any = None) -> SuffixSource:
        return SuffixSource(self)

    def group(self) -> DraftRowGroup:
        from mlxkv.engine.speculation.rows import SourceRowGroup

        return SourceRowGroup()
