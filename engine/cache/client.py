"""What the engine needs of a prefix cache: :class:`CacheClient`.

Both :class:`~engine.cache.prefix_cache.PrefixCache` (RAM + SSD tiers) and
:class:`~engine.cache.prefix_cache.NullPrefixCache` (caching off) satisfy it, so the
engine calls every method without probing for it. ``tests/test_cache_facade.py`` checks
that both define each member with the same parameters. Every method is called on the
engine thread (``on_event`` may be called from the cache's own threads).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, runtime_checkable

import numpy as np
from numpy.typing import ArrayLike

from mlxkv.engine.cache.info import CacheEntryDetail, CacheEntryInfo, VerifyReport

if TYPE_CHECKING:
    import mlx.nn as nn

    from mlxkv.engine.cache.durability import FlushReport
    from mlxkv.engine.cache.events import Receiver
    from mlxkv.engine.cache.kvblocks import PromptCache
    from mlxkv.engine.cache.learned import LearnedSource
    from mlxkv.engine.cache.misses import Divergence
    from mlxkv.engine.cache.stats import LastLookup
    from mlxkv.engine.models import LoadedModel


@runtime_checkable
class CacheClient(Protocol):
    """A prefix cache as the engine uses it."""

    # False for the cache that keeps nothing (the engine then skips the store's work).
    enabled: bool
    # Receives the cache's events (dicts with a "type"); the engine chains its own.
    on_event: Receiver | None

    @property
    def last(self) -> LastLookup:
        """The last lookup: ``cached_tokens``, ``ram_tokens``, ``ssd_tokens``, ..."""

    def bind_model(self, ns: str, model: nn.Module) -> None:
        """Restored states of ``ns`` are checked against ``model``'s caches."""

    def lookup(self, tokens: ArrayLike, ns: str, session: str | None = None
               ) -> tuple[int, PromptCache | None]:
        """(cached tokens, a KV cache holding them) for the prompt ``tokens``, or (0, None)."""

    def store(self, tokens: ArrayLike, cache: PromptCache, ns: str, session: str | None = None,
              retain_s: float | None = None) -> None:
        """Keep the KV state ``cache`` of ``tokens`` (``retain_s``: a retention hint: kept
        over states without one for that many seconds)."""

    def explain(self, tokens: ArrayLike, ns: str) -> Divergence | None:
        """The stored state closest to the prompt ``tokens`` and where the prompt parts
        from it (an ``engine.cache.misses.Divergence``), or None."""

    def release(self, cache: PromptCache | None) -> bool:
        """Give back a cache lent by ``lookup`` that will not be stored."""

    def invalidate(self, tokens: ArrayLike, ns: str) -> None:
        """Drop every cached state that would seed ``tokens`` (it failed)."""

    def busy(self, active: bool) -> None:
        """Whether a request is being served (background writes yield meanwhile)."""

    def prefetch(self, tokens: ArrayLike, ns: str, session: str | None = None) -> int:
        """Warm the cached state of ``tokens`` into RAM: the tokens now warm."""

    def flush(self, timeout: float | None = None) -> FlushReport:
        """Persist every dirty state now."""

    def close(self, timeout: float | None = None) -> FlushReport:
        """Flush and stop the cache's threads."""

    def stats(self) -> dict[str, Any]:
        """Figures for ``Engine.stats()["cache"]``."""

    def gc(self, ns: str | None = None, min_age_s: float = 0.0) -> dict[str, Any]:
        """Remove SSD blocks no saved state names."""

    def open_session(self, session: str) -> None:
        """Keep ``session``'s states pinned while it is open."""

    def close_session(self, session: str) -> None:
        """Unpin ``session``'s states."""

    def entries(self, ns: str | None = None) -> list[CacheEntryInfo]:
        """Cached states, of ``ns`` or all."""

    def entry(self, entry_id: str) -> CacheEntryDetail | None:
        """One entry's details."""

    def pin(self, entry_id: str, pinned: bool = True) -> bool:
        """Pin (or unpin) an entry."""

    def evict(self, entry_id: str) -> bool:
        """Drop an entry from RAM (kept on SSD)."""

    def delete(self, entry_id: str) -> bool:
        """Drop an entry from every tier."""

    def verify(self, entry_id: str | None = None) -> VerifyReport:
        """Read and check SSD blocks (of one entry, or all)."""

    def load_learned(self, ns: str, name: str, schema: str) -> list[np.ndarray]:
        """What a speculation source saved in ``ns`` as ``name`` (token arrays, oldest
        first; [] when nothing usable is saved)."""

    def keep_learned(self, ns: str, name: str, source: LearnedSource) -> None:
        """Save ``source`` (``engine.cache.learned.LearnedSource``) as ``name`` in ``ns``
        whenever the cache persists."""


# (loaded model, namespace) -> the cache
CacheFactory: TypeAlias = "Callable[[LoadedModel, str], CacheClient]"

# What ``Engine(prefix_cache=...)`` takes: a cache, a factory called on the engine thread
# once the model is loaded, or None (no caching).
CacheArg: TypeAlias = "CacheClient | CacheFactory | None"

