"""Why a lookup matched no more: the stored state that shares the longest prefix with a
prompt, and where the two part (engine thread).

A lookup walks the hash chain to the longest block-aligned match and then compares token
ids inside the next block, so it knows how far the prompt matched, but not which stored
state it matched nor what that state holds after the point where they part. Both tiers
keep every stored state's token ids beside its KV (a RAM entry its ``tokens``; an SSD
manifest its token ids), and token ids are far smaller than their KV rows, so
the closest state is found by comparing token ids: each candidate that starts like the
prompt costs one vectorised comparison, and the candidates are the namespace's RAM
entries and the SSD tier's saved states.

The SSD tier's states come from :class:`SavedTokens`: the manifests of a namespace read
once, on its first explanation, then kept up to date by this process's own stores and
removals and by every listing (which reads the manifests anyway). States another process
saves meanwhile are seen from the next listing on.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from mlxkv.engine.cache.tokens import common_prefix
from mlxkv.engine.cache.tokens import entry_id as entry_id_of

if TYPE_CHECKING:
    from mlxkv.storage.store import BlockStore

NEXT_TOKENS = 16  # the closest state's tokens kept after the point where the prompt parts
MAX_CANDIDATES = 4096  # states compared at most per explanation, most recent first


@dataclass(frozen=True)
class Divergence:
    """The stored state closest to a prompt: ``shared`` tokens are the same in both; the
    prompt parts from it there when ``shared < tokens`` (else it continues past its end)."""

    entry: str  # the state's id
    label: str  # what the inspector's entry column shows: its conversation, or its id
    tokens: int  # the state's length
    shared: int
    next_tokens: tuple[int, ...]  # the state's tokens from ``shared`` on (a few)
    tier: str  # "ram" or "ssd": where it was found


@dataclass(frozen=True)
class Candidate:
    tokens: np.ndarray
    tier: str
    entry_id: str | None = None  # None: worked out (hashed) only for the winner
    session: str | None = None


def closest(prompt: np.ndarray, store_ns: str, candidates: Iterable[Candidate]
            ) -> Divergence | None:
    """The candidate sharing the longest prefix with ``prompt`` (at least one token); a tie
    goes to the first (RAM before SSD, most recent first). The caller passes only
    candidates that start with the prompt's first token."""
    if len(prompt) == 0:
        return None
    best, best_n = None, 0
    for i, c in enumerate(candidates):
        if i >= MAX_CANDIDATES:
            break
        n = common_prefix(c.tokens, prompt)
        if n > best_n:
            best, best_n = c, n
            if n >= len(prompt):
                break
    if best is None:
        return None
    entry_id = best.entry_id or entry_id_of(store_ns, best.tokens)
    nxt = tuple(int(t) for t in best.tokens[best_n: best_n + NEXT_TOKENS])
    return Divergence(entry_id, best.session or entry_id[:12], len(best.tokens), best_n, nxt,
                      best.tier)


class SavedTokens:
    """Token ids of the SSD tier's saved states, per store namespace (engine thread)."""

    def __init__(self) -> None:
        self._by_ns: dict[str, dict[str, np.ndarray]] = {}

    def load(self, disk: BlockStore, store_ns: str) -> dict[str, np.ndarray]:
        """The saved states of ``store_ns`` (id -> token ids, oldest first), their manifests
        read on first use (``PrefixCache.bind_model`` reads the model's namespace while
        the model loads, so no request waits for it)."""
        known = self._by_ns.get(store_ns)
        if known is None:
            mans = sorted(disk.manifests(store_ns), key=lambda m: m.created)
            known = self._by_ns[store_ns] = {
                entry_id_of(store_ns, t): t for t in
                (np.ascontiguousarray(m.tokens, dtype="<u4") for m in mans)}
        return known

    def candidates(self, disk: BlockStore, store_ns: str, first: int) -> list[Candidate]:
        """The saved states of ``store_ns`` whose first token is ``first``, newest first."""
        return [Candidate(t, "ssd", entry_id)
                for entry_id, t in reversed(self.load(disk, store_ns).items())
                if len(t) and t[0] == first]

    def saved(self, store_ns: str, entry_id: str, tokens: np.ndarray) -> None:
        """This process saved a state (its manifest is being written)."""
        known = self._by_ns.get(store_ns)
        if known is not None:
            known.pop(entry_id, None)
            known[entry_id] = tokens  # most recent last

    def listed(self, store_ns: str, states: Iterable[tuple[str, np.ndarray]]) -> None:
        """A listing read the manifests of ``store_ns``: ``(id, tokens)`` of each."""
        self._by_ns[store_ns] = dict(states)

    def removed(self, entry_id: str) -> None:
        for known in self._by_ns.values():
            known.pop(entry_id, None)

    def forget(self, store_ns: str | None = None) -> None:
        """Read ``store_ns`` (every namespace: None) again on its next use."""
        if store_ns is None:
            self._by_ns.clear()
        else:
            self._by_ns.pop(store_ns, None)
