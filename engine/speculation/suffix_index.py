"""The suffix index behind suffix speculation, and the choice of the path it proposes.

:class:`SuffixIndex` keeps, for every position of the sequences added to it and every
length L in :data:`LENGTHS`, how often each token followed the L tokens ending there: a
suffix tree cut at depth 32, stored as one hash table per length. A context is hashed
with a polynomial rolling hash (mod 2^64) over prefix hashes, so adding a token costs one
multiplication and one table update per length, and a lookup one probe per length,
longest first. Most contexts were followed by one token only; that count is one packed
int (``token * PACK + count``) instead of a dict, which keeps the index near 100 bytes a
table entry. Hash collisions only make a proposal worse, never the output: the verifier
decides every token.

:func:`propose_path` chooses, token by token, the most frequent continuation of the
longest context any index matches (their counts added where several match equally long),
re-anchored after every proposed token. Its score is the product of the continuations'
shares (SuffixDecoding's path probability): the path stops where that falls below
``min_score``, and it is at most ``alpha`` times as long as the match of the text itself
(speculation grows with the match; the path's own tokens extend their match as they go,
so only the first one is evidence). Several candidate continuations of a context are
kept in the index; the path takes the best of them at each step (a tree verified
together needs a target that takes a tree mask and per-node positions, which mlx-lm's
models do not: see the architecture notes for the measurement).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

# Suffix lengths indexed (tokens). Long ones anchor precisely in repeated files and JSON;
# short ones keep proposing after a paraphrase.
LENGTHS = (32, 24, 16, 12, 8, 6, 4, 3, 2, 1)
MASK = (1 << 64) - 1
BASE = 0x9E3779B97F4A7C15  # odd: multiplication by it is a bijection mod 2^64
PACK = 1 << 32  # one follower, packed: token * PACK + count


def prefix_hashes(tokens: Iterable[int], start: int = 0) -> list[int]:
    """Prefix hashes H[0..n] of ``tokens`` (H[i+1] = H[i] * BASE + token_i + 1 mod 2^64),
    H[0] = ``start``."""
    out = [start]
    h = start
    for t in tokens:
        h = (h * BASE + int(t) + 1) & MASK
        out.append(h)
    return out


class SuffixIndex:
    """Counts of the token that followed every context of length in ``lengths`` in the
    sequences added (``extend`` appends to the current sequence, ``end_sequence`` starts a
    new one, so no context spans two sequences)."""

    def __init__(self, lengths: Sequence[int] = LENGTHS):
        if not lengths or min(lengths) < 1:
            raise ValueError(f"suffix lengths must be >= 1, got {lengths!r}")
        self.lengths = tuple(sorted({int(n) for n in lengths}, reverse=True))
        self.window = self.lengths[0]
        self._ascending = tuple(sorted(self.lengths))
        self._pow = {n: pow(BASE, n, 1 << 64) for n in self.lengths}
        self._tables: dict[int, dict] = {n: {} for n in self.lengths}
        self.tokens: list[int] = []  # the current sequence
        self._prefix: list[int] = [0]  # its prefix hashes

    def __len__(self) -> int:
        """Table entries (contexts indexed, over every length)."""
        return sum(len(t) for t in self._tables.values())

    def _update(self, prefix: list[int], end: int, token: int, delta: int) -> None:
        """Count ``token`` (``delta`` times) after every indexed context ending at ``end``."""
        h_end = prefix[end]
        for n in self._ascending:
            if n > end:
                break
            key = (h_end - prefix[end - n] * self._pow[n]) & MASK
            table = self._tables[n]
            v = table.get(key)
            if v is None:
                if delta > 0:
                    table[key] = token * PACK + delta
            elif type(v) is int:
                if v // PACK == token:
                    c = v % PACK + delta
                    if c > 0:
                        table[key] = token * PACK + c
                    else:
                        del table[key]
                elif delta > 0:
                    table[key] = {v // PACK: v % PACK, token: delta}
            else:
                c = v.get(token, 0) + delta
                if c > 0:
                    v[token] = c
                else:
                    v.pop(token, None)
                    if len(v) == 1:
                        (t, c1), = v.items()
                        table[key] = t * PACK + c1

    def extend(self, tokens: Iterable[int]) -> None:
        # _update(prefix, end, t, 1) inlined: this loop indexes whole prompts
        seq, prefix = self.tokens, self._prefix
        plan = [(n, self._pow[n], self._tables[n]) for n in self._ascending]
        for t in tokens:
            t = int(t)
            end = len(seq)
            h_end = prefix[end]
            packed = t * PACK + 1
            for n, pw, table in plan:
                if n > end:
                    break
                key = (h_end - prefix[end - n] * pw) & MASK
                v = table.get(key)
                if v is None:
                    table[key] = packed
                elif type(v) is int:
                    if v // PACK == t:
                        table[key] = v + 1
                    else:
                        table[key] = {v // PACK: v % PACK, t: 1}
                else:
                    v[t] = v.get(t, 0) + 1
            seq.append(t)
            prefix.append((h_end * BASE + t + 1) & MASK)

    def end_sequence(self) -> list[int]:
        """Close the current sequence (returns it); the next ``extend`` starts a new one."""
        done, self.tokens, self._prefix = self.tokens, [], [0]
        return done

    def forget(self, seq: Sequence[int]) -> None:
        """Remove a sequence added earlier (its counts go down by what it added)."""
        prefix = prefix_hashes(seq)
        for end in range(len(seq)):
            self._update(prefix, end, int(seq[end]), -1)

    def keys(self, prefix: Sequence[int], n: int) -> list[tuple[int, int]]:
        """(length, key) of every indexed length of the context that ends a sequence whose
        prefix hashes are ``prefix`` (``prefix[n]``: all n of its tokens), longest first."""
        h_end = prefix[n]
        return [(m, (h_end - prefix[n - m] * self._pow[m]) & MASK) for m in self.lengths if m <= n]

    def lookup(self, keys: Sequence[tuple[int, int]]) -> tuple[int, object]:
        """(length, raw counts) of the longest of ``keys`` indexed here; (0, None) when none
        is."""
        tables = self._tables
        for m, key in keys:
            table = tables.get(m)
            v = table.get(key) if table is not None else None
            if v is not None:
                return m, v
        return 0, None

    def match(self, context: Sequence[int]) -> tuple[int, dict[int, int] | None]:
        """(length of the longest indexed suffix of ``context``, the counts of what followed
        it), or (0, None)."""
        tail = list(context[-self.window:])
        length, raw = self.lookup(self.keys(prefix_hashes(tail), len(tail)))
        return (length, counts_of(raw)) if raw is not None else (0, None)


def counts_of(raw: object) -> dict[int, int]:
    """A table value as {token: count}."""
    if type(raw) is int:
        return {raw // PACK: raw % PACK}
    return dict(raw)  # type: ignore[call-overload]


def _add_counts(into: dict[int, int], raw: object) -> None:
    if type(raw) is int:
        t = raw // PACK
        into[t] = into.get(t, 0) + raw % PACK
    else:
        for t, c in raw.items():  # type: ignore[attr-defined]
            into[t] = into.get(t, 0) + c


def _longest(indexes: Sequence[SuffixIndex], keys: Sequence[tuple[int, int]]) -> tuple[int, list]:
    """(the longest match length over ``indexes``, the raw counts of each index matching
    that long)."""
    best_len, raws = 0, []
    for ix in indexes:
        length, raw = ix.lookup(keys)
        if raw is None or length < best_len:
            continue
        if length > best_len:
            best_len, raws = length, [raw]
        else:
            raws.append(raw)
    return best_len, raws


def continuations(indexes: Sequence[SuffixIndex], keys: Sequence[tuple[int, int]]
                  ) -> tuple[int, dict[int, int]]:
    """(match length, {token: count} of every continuation seen after it) over ``indexes``
    (the candidates a tree would branch into; see :func:`best_continuation`)."""
    best_len, raws = _longest(indexes, keys)
    counts: dict[int, int] = {}
    for raw in raws:
        _add_counts(counts, raw)
    return best_len, counts


def best_continuation(indexes: Sequence[SuffixIndex], keys: Sequence[tuple[int, int]]
                      ) -> tuple[int, int, float, int]:
    """(match length, the most frequent token after it, its share, how often the context
    was seen) over ``indexes`` for a context's ``keys`` (``SuffixIndex.keys``; every index
    has the same lengths): the longest match wins; where several indexes match equally
    long their counts add up. (0, -1, 0.0, 0) when nothing matches."""
    best_len, raws = _longest(indexes, keys)
    if not raws:
        return 0, -1, 0.0, 0
    first = raws[0]
    if type(first) is int and all(type(r) is int and r // PACK == first // PACK for r in raws):
        return best_len, first // PACK, 1.0, sum(r % PACK for r in raws)  # one follower
    counts: dict[int, int] = {}
    for raw in raws:
        _add_counts(counts, raw)
    token = max(counts, key=counts.__getitem__)
    total = sum(counts.values())
    return best_len, token, counts[token] / total, total


def match_length(indexes: Sequence[SuffixIndex], context: Sequence[int]) -> int:
    """How many of ``context``'s last tokens the longest earlier match in ``indexes`` covers
    (0: none; the context itself is never indexed as its own match, since a context is
    indexed only once a token follows it)."""
    if not indexes:
        return 0
    tail = [int(t) for t in context[-indexes[0].window:]]
    return best_continuation(indexes, indexes[0].keys(prefix_hashes(tail), len(tail)))[0]


def propose_path(indexes: Sequence[SuffixIndex], context: Sequence[int], n: int, *, alpha: float,
                 min_score: float, min_match: int = 1) -> tuple[list[int], list[int]]:
    """Up to ``n`` tokens to follow ``context``, and the match length each was proposed
    from (see the module docstring); nothing when the text's own match is shorter than
    ``min_match``."""
    if n <= 0 or not indexes:
        return [], []
    first = indexes[0]
    tail = [int(t) for t in context[-first.window:]]
    prefix = prefix_hashes(tail)
    out: list[int] = []
    matched: list[int] = []
    score = 1.0
    budget = n
    while len(out) < budget:
        length, token, share, _ = best_continuation(indexes, first.keys(prefix, len(tail)))
        if length == 0 or not out and length < min_match:
            break
        if not out:  # a short match of the real text predicts little: the depth grows with it
            budget = min(n, max(1, int(alpha * length)))
        score *= share
        if score < min_score:
            break
        out.append(token)
        matched.append(length)
        tail.append(token)
        prefix.append((prefix[-1] * BASE + token + 1) & MASK)
    return out, matched
