"""Tiered prefix cache: RAM first, then SSD; the engine's seam.

    pc = PrefixCache(ram_bytes=2 << 30, cache_dir="~/.cache/mlxkv", block_tokens=256)
    n, cache = pc.lookup(prompt_tokens, ns, session=None)   # engine thread
    ... prefill prompt_tokens[n:] into cache (or a fresh cache when None) and generate ...
    pc.store(tokens_in_cache, cache, ns, session=None)     # engine thread

``PrefixCache`` composes the parts (``ram_tier``, ``ssd`` with ``durability``, ``arena``,
``prefetch``, ``manage``, ``learned``, ``stats`` / ``events``) and keeps the engine's
interface (``engine.cache.client``). ``lookup`` returns the longest cached prefix (at most
``len(tokens) - 1``) as a new mlx-lm prompt cache the caller owns; namespaces never mix;
non-trimmable caches are exact checkpoints. Engine thread, except ``stats``.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import ArrayLike

from mlxkv.engine.cache import kvblocks
from mlxkv.engine.cache.arena import Arena
from mlxkv.engine.cache.durability import FlushReport, empty_flush_report
from mlxkv.engine.cache.events import Events, Receiver
from mlxkv.engine.cache.info import (
    CacheEntryDetail,
    CacheEntryInfo,
    VerifyReport,
    empty_verify_report,
)
from mlxkv.engine.cache.learned import LearnedFiles, LearnedSource
from mlxkv.engine.cache.lending import Lending
from mlxkv.engine.cache.manage import EntryManager, folder_errors
from mlxkv.engine.cache.misses import Divergence, SavedTokens
from mlxkv.engine.cache.prefetch import Prefetcher
from mlxkv.engine.cache.ram_tier import RamEntry, RamTier
from mlxkv.engine.cache.ssd import SsdTier
from mlxkv.engine.cache.stats import Counters, LastLookup, Usage
from mlxkv.engine.cache.template import Templates
from mlxkv.engine.cache.tokens import as_tokens, chain_keys, store_namespace
from mlxkv.engine.cache.tokens import entry_id as entry_id_of
from mlxkv.engine.settings import FIELD_BY_NAME, Settings

if TYPE_CHECKING:
    from collections.abc import Callable

    import mlx.nn as nn

    from mlxkv.engine.cache.durability import Durability
    from mlxkv.storage.io import StorageIO, WriteRequest
    from mlxkv.storage.store import BlockStore

__all__ = ["NullPrefixCache", "PrefixCache", "default_ram_bytes", "store_namespace"]

log = logging.getLogger("mlxkv.cache")

_EMPTY_GC = {"removed": 0, "bytes": 0, "live_keys": 0, "manifests_removed": 0,
             "unreadable_manifests": {}}
DEFAULT_RESTORE_TIMEOUT_S: float = FIELD_BY_NAME["restore_timeout_s"].default


def default_ram_bytes(fraction: float = 0.25) -> int:
    """A fraction of physical memory (2 GiB when it cannot be read)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * fraction)
    except (ValueError, OSError, AttributeError):
        return 2 << 30


class NullPrefixCache:
    """Caching off: every lookup misses, stores are dropped, listings are empty."""

    enabled = False
    on_event: Receiver | None = None

    last: LastLookup = {}

    def lookup(self, tokens: ArrayLike, ns: str, session: str | None = None) -> tuple[int, None]:
        return 0, None

    def prefetch(self, tokens: ArrayLike, ns: str, session: str | None = None) -> int:
        return 0

    def busy(self, active: bool) -> None:
        return None

    def gc(self, ns: str | None = None, min_age_s: float = 0.0) -> dict[str, Any]:
        return {**_EMPTY_GC, "unreadable_manifests": {}}

    def store(self, tokens: ArrayLike, cache: kvblocks.PromptCache, ns: str,
              session: str | None = None,
              retain_s: float | None = None) -> None:
        return None

    def explain(self, tokens: ArrayLike, ns: str) -> Divergence | None:
        return None

    def release(self, cache: kvblocks.PromptCache | None) -> bool:
        return False

    def flush(self, timeout: float | None = None) -> FlushReport:
        return empty_flush_report()

    def close(self, timeout: float | None = None) -> FlushReport:
        return self.flush(timeout)

    def stats(self) -> dict[str, Any]:
        return {"enabled": False}

    def open_session(self, session: str) -> None:
        return None

    def close_session(self, session: str) -> None:
        return None

    def load_learned(self, ns: str, name: str, schema: str) -> list[np.ndarray]:
        return []

    def keep_learned(self, ns: str, name: str, source: LearnedSource) -> None:
        return None

    def bind_model(self, ns: str, model: nn.Module) -> None:
        return None

    def entries(self, ns: str | None = None) -> list[CacheEntryInfo]:
        return []

    def entry(self, entry_id: str) -> CacheEntryDetail | None:
        return None

    def pin(self, entry_id: str, pinned: bool = True) -> bool:
        return False

    def evict(self, entry_id: str) -> bool:
        return False

    def delete(self, entry_id: str) -> bool:
        return False

    def verify(self, entry_id: str | None = None) -> VerifyReport:
        return empty_verify_report()

    def invalidate(self, tokens: ArrayLike, ns: str) -> None:
        return None


class PrefixCache:
    """RAM + SSD prefix cache (see the module docstring); the front end's entry management
    (entries, pin, evict, delete, verify, invalidate) is ``manager``
    (``engine.cache.manage``), prefetch is ``prefetcher`` (``engine.cache.prefetch``)."""

    enabled = True

    def __init__(self, ram_bytes: int | None = None,
                 cache_dir: str | os.PathLike[str] | None = None,
                 block_tokens: int = FIELD_BY_NAME["block_tokens"].default, ssd: bool = True,
                 ssd_bytes: int | None = None,
                 durable: bool = True, debounce_s: float = 0.0, retries: int = 2,
                 min_ssd_gain: int | None = None, on_event: Receiver | None = None,
                 restore_timeout_s: float | None = DEFAULT_RESTORE_TIMEOUT_S,
                 arena_bytes: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if block_tokens <= 0:
            raise ValueError(f"block_tokens must be > 0, got {block_tokens}")
        self.block_tokens = int(block_tokens)
        self._events = Events(on_event)
        self.counters = Counters()
        self.usage = Usage()
        self.templates = Templates()
        self.clock = clock  # retention hints are measured against it
        self.ram = RamTier(default_ram_bytes() if ram_bytes is None else int(ram_bytes),
                           self.block_tokens, on_evict=self._on_ram_drop, clock=clock)
        self.saved_tokens = SavedTokens()  # the SSD tier's token ids, for explain()
        self.lending = Lending(self._keep)
        # restore from SSD only when it saves at least this many tokens over the RAM hit
        self.min_ssd_gain = max(1, self.block_tokens // 4 if min_ssd_gain is None
                                else int(min_ssd_gain))
        self._sessions: set[str] = set()
        self._pins: set[str] = set()  # entry ids pinned (kept pinned when they come back)
        self.ssd: SsdTier | None = None
        self.ssd_disabled_reason: str | None = None  # None: on, or off on purpose
        # restore destinations prepared ahead (by default a quarter of the RAM budget)
        self.arena = Arena(self.ram.max_bytes // 4 if arena_bytes is None else arena_bytes)
        if ssd and cache_dir is not None and ssd_bytes != 0:
            root = os.path.expanduser(os.fspath(cache_dir))
            try:
                self.ssd = SsdTier(root, self.block_tokens, ssd_bytes, durable, debounce_s,
                                   retries, restore_timeout_s, self._events, self.counters,
                                   self.templates, pressure_bytes=self.ram.max_bytes // 2,
                                   arena=self.arena)
            except folder_errors() as exc:
                self.ssd_disabled_reason = str(exc)
                self._events.warn("ssd-unusable", "prefix cache: running without the SSD "
                                  "tier (RAM only): %s", exc)
        # what speculation sources learned, saved beside the SSD tier (none without it)
        self.learned = LearnedFiles(self.ssd.disk, self._events) if self.ssd is not None else None
        self.manager = EntryManager(self.ram, self.ssd, self.lending, self.usage, self.counters,
                                    self.saved_tokens, self._events, self._pins)
        self.prefetcher = Prefetcher(self.ram, self.ssd, self.lending, self.counters,
                                     self._events, self._pins, self._sessions,
                                     self.block_tokens, self._worth)

    @classmethod
    def from_settings(cls, settings: Settings) -> PrefixCache | NullPrefixCache:
        """Build from the engine's settings (prefix_cache, cache_dir, ram_cache_bytes,
        ssd_cache_bytes (0: no SSD tier), block_tokens, restore_timeout_s)."""
        if not settings.prefix_cache:
            return NullPrefixCache()
        return cls(ram_bytes=settings.ram_cache_bytes, cache_dir=settings.cache_dir,
                   block_tokens=settings.block_tokens, ssd_bytes=settings.ssd_cache_bytes,
                   restore_timeout_s=settings.restore_timeout_s)

    # the tiers' parts, by their old names
    @property
    def disk(self) -> BlockStore | None:
        return None if self.ssd is None else self.ssd.disk

    @property
    def io(self) -> StorageIO | None:
        return None if self.ssd is None else self.ssd.io

    @property
    def durability(self) -> Durability | None:
        return None if self.ssd is None else self.ssd.durability

    @property
    def on_event(self) -> Receiver | None:
        return self._events.receiver

    @on_event.setter
    def on_event(self, fn: Receiver | None) -> None:
        self._events.receiver = fn

    def bind_model(self, ns: str, model: nn.Module) -> None:
        """Restored states of ``ns`` must fit ``model``'s caches (one token through it, at
        load), and the KV arena prepares restore destinations for them (sized for the state
        the SSD tier used last in ``ns``; see ``engine.cache.arena``). A model that cannot
        be probed is learned from its first stored cache."""
        from mlxkv.engine.generate import probe_model

        try:
            cache = probe_model(model)
        except Exception as exc:  # noqa: BLE001  (an unusual model: fall back, never fail a load)
            log.debug("cannot probe the model's cache layout: %s", exc)
            return
        store_ns = store_namespace(ns)
        self.templates.learn(store_ns, cache, replace=True)
        if self.ssd is not None:
            try:
                self.arena.prepare(store_ns, cache, self.ssd.latest_tokens(store_ns))
            except Exception as exc:  # noqa: BLE001  (no arena: restores allocate as before)
                log.debug("cannot prepare the KV arena: %s", exc)
            try:  # what explain() compares prompts with, read now rather than in a request
                self.saved_tokens.load(self.ssd.disk, store_ns)
            except folder_errors() as exc:
                log.debug("cannot read the saved states' tokens: %s", exc)

    # ------------------------------------------------------------------ lookup
    def lookup(self, tokens: ArrayLike, ns: str, session: str | None = None
               ) -> tuple[int, kvblocks.PromptCache | None]:
        """Longest cached prefix of ``tokens`` in ``ns``: ``(n, cache)``; ``(0, None)`` on a
        miss. ``cache`` holds exactly ``tokens[:n]`` and belongs to the caller."""
        t0 = time.perf_counter()
        toks = as_tokens(tokens)
        store_ns = store_namespace(ns)
        self.lending.sweep()
        # a prefetch of this prompt enters RAM (waited for) first
        self.prefetcher.adopt(toks, store_ns)
        # hashed once, here: the RAM tier and the store both walk these keys
        keys = chain_keys(store_ns, toks, self.block_tokens)
        match = self.ram.lookup(store_ns, toks, session, keys=keys)
        n, cache, tier, restore_ms = match.n, None, "ram" if match.n else None, 0.0
        limit = len(toks) - 1
        # The SSD tier is consulted only when it could beat the RAM hit (see _worth): a RAM
        # hit that already covers the prompt skips probing the disk.
        if self.ssd is not None and limit > 0 and self._worth(limit, n) and self.ssd.available():
            ssd_n, ssd_cache, restore_ms = self.ssd.lookup(store_ns, toks, keys, limit, n,
                                                           self._worth)
            if ssd_cache is not None and ssd_n > n:
                n, cache, tier = ssd_n, ssd_cache, "ssd"
        if tier == "ram":
            cache = match.lend()
            if match.moved and cache is not None:
                self.lending.remember(cache, store_ns, toks[:n], session,
                                      match.entry.retained_until if match.entry else 0.0)
            if match.entry is not None:
                self.usage.hit(match.entry.id)
        elif tier == "ssd":
            self.usage.hit(entry_id_of(store_ns, toks[:n]))
        self.counters.add(lookups=1, prompt_tokens=len(toks), cached_tokens=n,
                          restore_ms=restore_ms,
                          **({"ram_hits": 1, "ram_tokens": n} if tier == "ram" else
                             {"ssd_hits": 1, "ssd_tokens": n} if tier == "ssd" else {"misses": 1}))
        last: LastLookup = {
            "prompt_tokens": len(toks), "cached_tokens": n, "tier": tier,
            "ram_tokens": n if tier == "ram" else 0, "ssd_tokens": n if tier == "ssd" else 0,
            "restore_ms": restore_ms, "lookup_ms": (time.perf_counter() - t0) * 1e3}
        self.counters.set_last(last)
        self._events.emit("lookup", **last)
        if n > 0:
            self._events.emit("hit", tokens=n, tier=tier, ns=ns)
        return (n, cache) if n > 0 else (0, None)

    @property
    def last(self) -> LastLookup:
        """The last lookup: ``cached_tokens`` and which tier served them (``tier``;
        ``ram_tokens`` / ``ssd_tokens``), ``restore_ms``, ``lookup_ms``."""
        return self.counters.last_lookup()

    def gc(self, ns: str | None = None, min_age_s: float = 0.0) -> dict[str, Any]:
        """Remove the SSD tier's blocks that no saved state names (of ``ns``, or all),
        older than ``min_age_s``: ``{removed, bytes, live_keys, manifests_removed,
        unreadable_manifests}`` (see ``storage.maintenance``). States still being written
        land first, so their blocks are named when GC looks."""
        if self.ssd is None:
            return {**_EMPTY_GC, "unreadable_manifests": {}}
        self.ssd.flush(10.0)
        try:
            report = self.ssd.disk.gc(None if ns is None else store_namespace(ns),
                                      min_age_s=min_age_s)
        except folder_errors() as exc:
            self._events.warn("gc-failed", "prefix cache: cannot collect the SSD tier: %s", exc)
            return {**_EMPTY_GC, "unreadable_manifests": {}}
        self.saved_tokens.forget(None if ns is None else store_namespace(ns))
        self._events.emit("gc", ns=ns, removed=report.get("removed", 0),
                          bytes=report.get("bytes", 0))
        return report

    def _worth(self, n_ssd: int, n_ram: int) -> bool:
        """Restore ``n_ssd`` tokens from SSD when RAM already offers ``n_ram``?"""
        return n_ssd >= n_ram + self.min_ssd_gain or (n_ram == 0 and n_ssd > 0)

    # ------------------------------------------------------------------ store
    def store(self, tokens: ArrayLike, cache: kvblocks.PromptCache, ns: str,
              session: str | None = None,
              retain_s: float | None = None) -> None:
        """Keep the state of ``cache`` (which holds ``tokens``) in RAM and persist it in the
        background. Raises ValueError when the cache and the tokens disagree (a handed-over
        entry is then given back, as by ``release``). ``retain_s``: a retention hint (a
        request's ``cache_control`` or ``prompt_cache_key``): for that long the state is
        evicted only after every state without one, from RAM and from the SSD tier. A
        state stored from an entry that was handed over keeps that entry's hint too."""
        self.prefetcher.adopt()
        until = self.lending.retention(cache)
        if retain_s is not None and retain_s > 0:
            until = max(until, self.clock() + float(retain_s))
        try:
            self._store(tokens, cache, ns, session, until)
        except BaseException:
            self.release(cache)
            raise
        self.lending.stored(cache)

    def _store(self, tokens: ArrayLike, cache: kvblocks.PromptCache, ns: str, session: str | None,
               retain_until: float) -> None:
        t0 = time.perf_counter()
        toks = as_tokens(tokens)
        if len(toks) == 0 or not cache:
            return
        try:
            kvblocks.check_supported(cache)
        except kvblocks.UnsupportedCache:
            self.counters.add(unsupported=1)
            return
        held = kvblocks.cache_tokens(cache)
        block_mode = kvblocks.is_block_cache(cache)
        if held is not None and held != len(toks) and not (block_mode and held > len(toks)):
            raise ValueError(f"the cache holds {held} tokens but {len(toks)} were given")
        if block_mode and held is not None and held > len(toks):
            # extra rows past len(toks) (e.g. a token computed ahead) are simply not used
            cache = [kvblocks.make_layer(kvblocks.layer_spec(c), kvblocks.layer_arrays(c),
                                         len(toks))
                     for c in cache]
        store_ns = store_namespace(ns)
        self.templates.learn(store_ns, cache)
        entry_id = entry_id_of(store_ns, toks)
        keys = chain_keys(store_ns, toks, self.block_tokens)
        entry = self.ram.store(store_ns, toks, cache, session, keys=keys,
                               pinned=entry_id in self._pins,
                               retain_until=retain_until)
        persisted = False
        if self.ssd is not None:
            checkpoint = entry.checkpoint if entry is not None and entry.checkpoint else None
            persisted = self.ssd.persist(store_ns, toks, cache, block_mode, checkpoint)
            if persisted:
                self.saved_tokens.saved(store_ns, entry_id, toks)
            left = retain_until - self.clock()
            if left > 0:
                self.ssd.retain(store_ns, toks, keys, left)
        self.counters.add(stores=1, store_ms=(time.perf_counter() - t0) * 1e3,
                          **({} if block_mode else {"checkpoint_stores": 1,
                                                    "checkpoints_persisted": int(persisted)}))
        self._events.emit("store", id=entry_id, tokens=len(toks), ns=ns, in_ram=entry is not None,
                          persisting=persisted)

    def snapshot(self, tokens: ArrayLike, cache: kvblocks.PromptCache, ns: str) -> WriteRequest:
        """An immutable storage snapshot of a block cache holding ``tokens``."""
        if self.ssd is None:
            raise ValueError("the SSD tier is off: nothing to snapshot for")
        store_ns, toks = store_namespace(ns), as_tokens(tokens)
        return self.ssd.block_snapshot(store_ns, toks, cache, entry_id_of(store_ns, toks))

    # ------------------------------------------------------------------ handed-over entries
    def release(self, cache: kvblocks.PromptCache | None) -> bool:
        """The request that got ``cache`` from ``lookup`` will not ``store`` it (it failed or
        was dropped): give back what it borrowed (see ``engine.cache.lending``). Returns
        whether an entry was given back."""
        return self.lending.release(cache)

    def _keep(self, store_ns: str, toks: np.ndarray, cache: kvblocks.PromptCache,
              session: str | None,
              retained_until: float = 0.0) -> RamEntry | None:
        return self.ram.store(store_ns, toks, cache, session,
                              pinned=entry_id_of(store_ns, toks) in self._pins,
                              retain_until=retained_until)

    def _on_ram_drop(self, entry: RamEntry, evicted: bool, superseded_by: RamEntry | None
                     ) -> None:
        # The coordinator already holds a snapshot of every dirty block state (it was taken
        # at store time), so leaving RAM never loses one: persist-before-demote holds by
        # construction. A state whose write failed for good is now gone for real.
        if evicted:
            if self.ssd is not None:
                self.ssd.durability.forget(entry.ns, entry.tokens)
            self._events.emit("evict", id=entry.id, ns=entry.ns, tokens=len(entry.tokens))

    # ------------------------------------------------------------------ prefetch
    def prefetch(self, tokens: ArrayLike, ns: str, session: str | None = None) -> int:
        """Warm the longest cached prefix of ``tokens`` into RAM, restoring it from SSD
        when RAM holds less of it, so the request that sends ``tokens`` starts from RAM;
        the tokens a lookup will find in RAM (see ``engine.cache.prefetch``)."""
        return self.prefetcher.prefetch(tokens, ns, session)

    def prefetch_wait(self, timeout: float | None = None) -> int:
        """Wait (up to ``timeout`` s in all) for the prefetch reads under way and move them
        into RAM; returns how many are still under way."""
        return self.prefetcher.wait(timeout)

    # ------------------------------------------------------------------ entries
    def entries(self, ns: str | None = None) -> list[CacheEntryInfo]:
        """Every stored state (of ``ns``, or all), most recently used first."""
        return self.manager.entries(ns)

    def entry(self, entry_id: str) -> CacheEntryDetail | None:
        return self.manager.entry(entry_id)

    def explain(self, tokens: ArrayLike, ns: str) -> Divergence | None:
        """The stored state of ``ns`` that shares the longest prefix with ``tokens``, and
        where the prompt parts from it; None when none starts like it."""
        return self.manager.explain(tokens, ns)

    def pin(self, entry_id: str, pinned: bool = True) -> bool:
        """Keep an entry over others in RAM (never superseded or handed over)."""
        return self.manager.pin(entry_id, pinned)

    def evict(self, entry_id: str) -> bool:
        """Drop an entry from RAM; the SSD tier keeps it (its write goes first)."""
        return self.manager.evict(entry_id)

    def delete(self, entry_id: str) -> bool:
        """Drop an entry from every tier (blocks other entries use stay)."""
        return self.manager.delete(entry_id)

    def invalidate(self, tokens: ArrayLike, ns: str) -> None:
        """Drop every cached state that could seed a prompt of ``tokens`` (both tiers)."""
        self.manager.invalidate(tokens, ns)

    def verify(self, entry_id: str | None = None) -> VerifyReport:
        """Read back saved states (one, or all) and check every block's content hash."""
        return self.manager.verify(entry_id)

    # ------------------------------------------------------------------ sessions
    def open_session(self, session: str) -> None:
        """Prefer and keep warm this session's latest entry until ``close_session``."""
        self._sessions.add(session)

    def close_session(self, session: str) -> None:
        self._sessions.discard(session)
        self.ram.release_session(session)
        self.ram.evict()

    # ------------------------------------------------------------------ learned files
    def load_learned(self, ns: str, name: str, schema: str) -> list[np.ndarray]:
        """What a speculation source saved in namespace ``ns`` as ``name`` (token arrays,
        oldest first; [] when nothing usable is saved, or without an SSD tier; see
        ``engine.cache.learned``)."""
        return [] if self.learned is None else self.learned.load(store_namespace(ns), name, schema)

    def keep_learned(self, ns: str, name: str, source: LearnedSource) -> None:
        """Save ``source`` (an ``engine.cache.learned.LearnedSource``) as ``name`` in ``ns``
        whenever the cache persists: flush, close, and now and then while idle."""
        if self.learned is not None:
            self.learned.keep(store_namespace(ns), name, source)

    # ------------------------------------------------------------------ durability
    def busy(self, active: bool) -> None:
        """The engine started serving (True: a prefill or decode is running) or has
        nothing in flight (False). While busy, persistence yields to generation: the
        writer waits, bounded by a maximum delay and by memory (see
        ``engine.cache.durability``); going idle lets it write at once."""
        self.prefetcher.busy = bool(active)
        if self.ssd is not None:
            self.ssd.durability.busy(active)
            if not active:  # nothing waits on the engine: finished prefetches, arena slots
                self.prefetcher.adopt()
                self.arena.replenish()
                if self.learned is not None:  # (there is one beside every SSD tier)
                    self.learned.idle()

    def flush(self, timeout: float | None = None) -> FlushReport:
        """Persist every dirty state now (up to ``timeout`` s):
        ``{durable, flushed, pending, failed, missing}``."""
        if self.ssd is None:
            return empty_flush_report()
        if self.learned is not None:  # (there is one beside every SSD tier)
            self.learned.flush(timeout)
        return self.ssd.flush(timeout)

    def close(self, timeout: float | None = 10.0) -> FlushReport:
        """Flush (bounded by ``timeout``), stop the storage threads, free RAM."""
        self.prefetcher.cancel()
        if self.learned is not None:
            self.learned.close(timeout)
        report = empty_flush_report() if self.ssd is None else self.ssd.close(timeout)
        self.arena.clear()
        self.lending.clear()
        self.ram.clear()
        return report

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict[str, Any]:
        s = self.counters.snapshot()
        ram = self.ram
        s.update({
            "enabled": True, "block_tokens": self.block_tokens,
            "ram_bytes": ram.nbytes, "ram_max_bytes": ram.max_bytes, "ram_entries": len(ram),
            "ram_blocks": len(ram.runs), "ram_logical_bytes": ram.logical_bytes,
            "ram_moves": ram.moves, "released": self.lending.released,
            # token bytes the entries would take alone over the token bytes held: sharing,
            # not buffer headroom (a stored cache keeps its preallocated rows)
            "ram_token_bytes": ram.token_bytes,
            "dedup_ratio": (ram.logical_bytes / ram.token_bytes) if ram.token_bytes else 1.0,
            "hit_fraction": (s["cached_tokens"] / s["prompt_tokens"]) if s["prompt_tokens"] else 0.0,
            "sessions": len(self._sessions), "pinned": len(self._pins),
            "retained": sum(1 for e in list(ram.entries.values()) if ram.retained(e)),
            "ssd_disabled_reason": self.ssd_disabled_reason,
        })
        s.update(self.ssd.stats() if self.ssd is not None else {"ssd": False})
        # each namespace's (each model's) share of the tiers, in bytes
        ssd_ns = s.pop("ssd_namespaces", {})
        ram_ns = ram.bytes_by_namespace()
        s["namespaces"] = {ns: {"ram_bytes": ram_ns.get(ns, 0), "ssd_bytes": ssd_ns.get(ns, 0)}
                           for ns in sorted(set(ram_ns) | set(ssd_ns))}
        if self.learned is not None:
            s.update(self.learned.stats())
        s.update(self.arena.stats())
        return s
