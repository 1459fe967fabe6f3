"""What each request's prefix-cache lookup found, and why it found no more: the record a
user reads to fix an agent whose cache never hits (``/stats``'s ``lookups``, the
``x-mlxkv-cache`` response header, the TUI inspector's misses view).

For every request the engine records the prompt's length, the tokens served from the
cache and their tier, and, from the cache's :meth:`~engine.cache.client.CacheClient.explain`,
the stored state closest to the prompt: where the prompt parts from it (a token index),
a short decoded excerpt on both sides of that point (the prompt's and the state's), and
which state it was. The engine thread records; :class:`LookupHistory` keeps the last few.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any

EXCERPT_TOKENS = 16  # tokens decoded on each side of the point where the prompt parts
EXCERPT_CHARS = 40  # characters of each excerpt kept


@dataclasses.dataclass(frozen=True)
class LookupReport:
    """One request's lookup. ``outcome``: ``hit`` (all but the last token cached),
    ``diverged`` (the prompt parts from the closest stored state at ``diverged_at``),
    ``extends`` (the prompt goes on past the end of the closest state: what follows is
    new), ``cold`` (no stored state starts like it) or ``off`` (no prefix cache)."""

    request: int  # the request's id (RequestHandle.id)
    at: float  # unix time of the lookup
    prompt_tokens: int
    matched: int  # tokens served from the cache
    tier: str | None  # "ram", "ssd" or None (nothing served)
    outcome: str
    diverged_at: int | None = None  # first token index where the prompt and the state differ
    entry: str | None = None  # the closest state's id
    entry_label: str | None = None  # as the inspector's entry column shows it
    entry_tokens: int = 0
    entry_tier: str | None = None  # where the closest state was found
    before: str = ""  # the prompt's (and the state's) text just before ``diverged_at``
    prompt_after: str = ""  # the prompt's text from there
    entry_after: str = ""  # the state's text from there

    def header(self) -> str:
        """The ``x-mlxkv-cache`` response header: short and ASCII (ids are hex); the
        excerpts are in ``/stats`` only."""
        parts = [f"matched={self.matched}/{self.prompt_tokens}"]
        if self.tier:
            parts.append(f"tier={self.tier}")
        parts.append(f"outcome={self.outcome}")
        if self.diverged_at is not None:
            parts.append(f"diverged_at={self.diverged_at}")
        if self.entry:
            parts.append(f"entry={self.entry}")
        return "; ".join(parts)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _decode(tokenizer: Any, ids: list[int]) -> str:
    try:
        return str(tokenizer.decode(ids)) if ids else ""
    except Exception:  # an id a tokenizer cannot show: the excerpt is left out
        return ""


def report(request: int, tokens: list[int], matched: int, tier: str | None, divergence: Any,
           tokenizer: Any, enabled: bool = True) -> LookupReport:
    """The report of one lookup: ``divergence`` is what the cache's ``explain`` gave (an
    ``engine.cache.misses.Divergence`` or None); excerpts are decoded with ``tokenizer``."""
    n = len(tokens)
    off = LookupReport(request=request, at=time.time(), prompt_tokens=n, matched=matched,
                       tier=tier if matched else None, outcome="off")
    if not enabled:
        return off
    if matched >= n - 1:
        return dataclasses.replace(off, outcome="hit")
    if divergence is None:
        return dataclasses.replace(off, outcome="cold")
    d = divergence.shared
    extends = dataclasses.replace(off, outcome="extends", entry=divergence.entry, entry_label=divergence.label,
                                  entry_tokens=divergence.tokens, entry_tier=divergence.tier)
    if d >= divergence.tokens:
        return extends
    return dataclasses.replace(
        extends, outcome="diverged", diverged_at=d,
        before=_decode(tokenizer, tokens[max(0, d - EXCERPT_TOKENS): d])[-EXCERPT_CHARS:],
        prompt_after=_decode(tokenizer, tokens[d: d + EXCERPT_TOKENS])[:EXCERPT_CHARS],
        entry_after=_decode(tokenizer, list(divergence.next_tokens))[:EXCERPT_CHARS])


class LookupHistory:
    """The last ``size`` reports (the engine thread adds; :meth:`as_dicts` copies them for
    a snapshot)."""

    def __init__(self, size: int):
        self._reports: collections.deque[LookupReport] = collections.deque(maxlen=max(0, size))

    def add(self, r: LookupReport) -> None:
        self._reports.append(r)

    def as_dicts(self) -> list[dict[str, Any]]:
        """Oldest first."""
        return [r.as_dict() for r in list(self._reports)]
