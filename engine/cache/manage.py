"""Entry management for front ends: list entries, pin, evict, delete, verify and
invalidate them (engine thread).

Entries are the states ``store()`` kept, in RAM (``ram_tier``), on SSD (a manifest named
after the entry id, see ``upkeep``) or both; ``listing`` merges what the tiers know.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

from mlxkv.engine.cache import listing, misses, upkeep
from mlxkv.engine.cache.events import Events
from mlxkv.engine.cache.info import (
    CacheEntryDetail,
    CacheEntryInfo,
    VerifyReport,
    empty_verify_report,
)
from mlxkv.engine.cache.lending import Lending
from mlxkv.engine.cache.ram_tier import RamTier
from mlxkv.engine.cache.ssd import SsdTier
from mlxkv.engine.cache.stats import Counters, Usage
from mlxkv.engine.cache.tokens import as_tokens, common_prefix, store_namespace
from mlxkv.engine.cache.tokens import entry_id as entry_id_of


def folder_errors() -> tuple[type[BaseException], ...]:
    """What opening or using an unusable cache folder raises."""
    from mlxkv.storage import CacheFolderError

    return (CacheFolderError, OSError)


class EntryManager:
    """Entry management of the prefix cache: list, pin, evict, delete, verify and
    invalidate entries. ``pins`` (pinned entry ids) is the cache's own set, shared."""

    def __init__(self, ram: RamTier, ssd: SsdTier | None, lending: Lending, usage: Usage,
                 counters: Counters, saved_tokens: misses.SavedTokens, events: Events,
                 pins: set[str]) -> None:
        self.ram, self.ssd, self.lending = ram, ssd, lending
        self.usage, self.counters, self.saved_tokens = usage, counters, saved_tokens
        self.events, self.pins = events, pins
        self.verified: dict[bytes, bool] = {}  # block key -> last verify result

    # ------------------------------------------------------------------ entries
    def saved(self, store_ns: str | None) -> list[upkeep.Saved]:
        """The SSD tier's saved states (of ``store_ns``, or all), oldest first per namespace."""
        if self.ssd is None:
            return []
        try:
            names = [store_ns] if store_ns is not None else \
                sorted(self.ssd.disk.stats()["namespaces"])
            out = []
            for name in names:
                states = sorted(upkeep.saved_states(self.ssd.disk, name), key=lambda s: s.created)
                self.saved_tokens.listed(name, ((s.entry_id, s.tokens) for s in states))
                out += states
            return out
        except folder_errors() as exc:
            self.events.warn("list-failed", "prefix cache: cannot list the SSD tier: %s", exc)
            return []

    def _views(self, store_ns: str | None) -> dict[str, listing.TierView]:
        return listing.gather(self.ram, self.saved(store_ns), store_ns)

    def entries(self, ns: str | None = None) -> list[CacheEntryInfo]:
        """Every stored state (of ``ns``, or all), most recently used first."""
        infos = listing.infos(self._views(None if ns is None else store_namespace(ns)),
                              self.ram, self.pins, self.usage)
        return sorted(infos.values(), key=lambda i: -i.last_used)

    def entry(self, entry_id: str) -> CacheEntryDetail | None:
        views = self._views(None)
        f = views.get(entry_id)
        if f is None:
            return None
        info = listing.infos(views, self.ram, self.pins, self.usage)[entry_id]
        return listing.detail(info, f, self.verified)

    def explain(self, tokens: ArrayLike, ns: str) -> misses.Divergence | None:
        """The stored state of ``ns`` that shares the longest prefix with ``tokens`` (RAM
        entries first, then the SSD tier's saved states; most recent first), and where
        the prompt parts from it; None when none starts like it."""
        toks, store_ns = as_tokens(tokens), store_namespace(ns)
        if len(toks) == 0:
            return None
        first = toks[0]
        cands = [misses.Candidate(e.tokens, "ram", session=e.session)
                 for e in reversed(self.ram.entries.values())
                 if e.ns == store_ns and len(e.tokens) and e.tokens[0] == first]
        if self.ssd is not None:
            try:
                cands += self.saved_tokens.candidates(self.ssd.disk, store_ns, first)
            except folder_errors() as exc:
                self.events.warn("list-failed", "prefix cache: cannot list the SSD tier: %s",
                                 exc)
        return misses.closest(toks, store_ns, cands)

    def pin(self, entry_id: str, pinned: bool = True) -> bool:
        """Keep an entry over others in RAM (never superseded or handed over)."""
        e = self.ram.find(entry_id)
        found = e is not None or any(s.entry_id == entry_id for s in self.saved(None))
        if not found:
            return False
        if pinned:
            self.pins.add(entry_id)
        else:
            self.pins.discard(entry_id)
        if e is not None:
            e.pinned = pinned
            if not pinned:
                self.ram.evict()
        self.events.emit("pin", id=entry_id, pinned=pinned)
        return True

    def evict(self, entry_id: str) -> bool:
        """Drop an entry from RAM; the SSD tier keeps it (its write goes first)."""
        e = self.ram.find(entry_id)
        if e is None:
            return False
        if self.ssd is not None:
            self.ssd.durability.hurry(e.ns, e.tokens)
        self.ram.drop(e, evicted=True)
        self.counters.add(evicted=1)
        return True

    def delete(self, entry_id: str) -> bool:
        """Drop an entry from every tier (blocks other entries use stay)."""
        found = False
        e = self.ram.find(entry_id)
        if e is not None:
            self.ram.drop(e, evicted=False)
            self._cancel_write(e.ns, e.tokens)  # before listing: a running write lands first
            found = True
        self.lending.forget(lambda r: entry_id_of(r.ns, r.tokens) == entry_id)
        if self.ssd is not None:
            saved = self.saved(None)
            mine = next((s for s in saved if s.entry_id == entry_id), None)
            if mine is not None:
                if e is None:
                    self._cancel_write(mine.ns, mine.tokens)
                others = {k for s in saved if s is not mine and s.ns == mine.ns
                          for k, _, _ in s.blocks}
                self._remove(self.ssd, mine.ns, {k for k, _, _ in mine.blocks} - others,
                             [mine.manifest])
                found = True
        self.pins.discard(entry_id)
        self.usage.forget(entry_id)
        self.saved_tokens.removed(entry_id)
        if found:
            self.counters.add(deleted=1)
            self.events.emit("delete", id=entry_id)
        return found

    def _cancel_write(self, store_ns: str, toks: np.ndarray) -> None:
        if self.ssd is not None and not self.ssd.durability.cancel(store_ns, toks):
            self.events.warn("delete-writing", "prefix cache: a deleted state was still being "
                             "written after 10 s; it may come back on disk")

    def _remove(self, ssd: SsdTier, store_ns: str, keys: set[bytes], manifests: list[str]
                ) -> None:
        try:
            upkeep.remove(ssd.disk, store_ns, keys, manifests)
        except folder_errors() as exc:
            self.events.warn("remove-failed", "prefix cache: cannot remove from the SSD "
                             "tier: %s", exc)

    def invalidate(self, tokens: ArrayLike, ns: str) -> None:
        """Drop every cached state that could seed a prompt of ``tokens`` (both tiers):
        a generation from such a state failed."""
        toks, store_ns = as_tokens(tokens), store_namespace(ns)
        if len(toks) == 0:
            return
        dropped = self.ram.seeding(store_ns, toks)
        for e in dropped:
            self.ram.drop(e, evicted=False)
            self._cancel_write(e.ns, e.tokens)
        self.lending.forget(lambda r: r.ns == store_ns and common_prefix(r.tokens, toks) > 0)
        if self.ssd is not None:
            keys = self._seeding_keys(self.ssd, store_ns, toks)
            mans = [s.manifest for s in self.saved(store_ns)
                    if keys & {k for k, _, _ in s.blocks}]
            self._remove(self.ssd, store_ns, keys, mans)
            self.saved_tokens.forget(store_ns)
        self.counters.add(invalidated=1)
        self.events.emit("invalidate", ns=ns, tokens=len(toks), ram_entries=len(dropped))

    @staticmethod
    def _seeding_keys(ssd: SsdTier, store_ns: str, toks: np.ndarray) -> set[bytes]:
        disk = ssd.disk
        block_match = disk.lookup(store_ns, toks)
        keys = set(block_match.block_keys) | (
            {block_match.tail_key} if block_match.tail_key is not None else set())
        limit = len(toks)
        while limit > 0:
            checkpoint_match = disk.lookup_checkpoint(store_ns, toks, max_tokens=limit)
            if not checkpoint_match.n_tokens or checkpoint_match.checkpoint_key is None:
                break
            keys.add(checkpoint_match.checkpoint_key)
            limit = checkpoint_match.n_tokens - 1
        return keys

    def verify(self, entry_id: str | None = None) -> VerifyReport:
        """Read back saved states (one, or all) and check every block's content hash; a
        ``verify`` event (``done`` of ``total``) follows each state checked. Nothing is
        checked while a restore is stuck on the reader thread."""
        out = empty_verify_report()
        if self.ssd is None or not self.ssd.available():
            return out
        saved = self.saved(None)
        if entry_id is None:
            for name in sorted({s.ns for s in saved} | set(self.ssd.disk.stats()["namespaces"])):
                out["manifests_damaged"] += upkeep.damaged_manifests(self.ssd.disk, name)
        todo = [s for s in saved if entry_id is None or s.entry_id == entry_id]
        for done, s in enumerate(todo, 1):
            ok, seen = upkeep.verify(self.ssd.io, s, self.ssd.restore_timeout_s)
            self.verified.update(seen)
            out["checked"] += 1
            if ok:
                out["ok"] += 1
            else:
                out["damaged"].append(s.entry_id)
            self.events.emit("verify", done=done, total=len(todo), id=s.entry_id, ok=ok)
        if len(self.verified) > 100_000:
            self.verified.clear()
        return out

