"""Prefetch: a conversation's state read from SSD into RAM before the request that needs
it (engine thread).

Idle, a prefetch restores here and now (nothing waits on the engine). While the engine is
busy (``PrefixCache.busy(True)``) nothing here waits: the blocks are read on the storage
reader thread (into a KV arena slot, or into arrays whose page faults the reader takes)
and the state enters RAM at the next engine-thread call that finds the read done, or at
the lookup that needs it, which waits for it as it would for its own restore. A queued
prefetch that a lookup would wait behind is cancelled, and one that RAM cannot hold
without evicting is dropped: memory goes to what is used.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from mlxkv.engine.cache import kvblocks, layout
from mlxkv.engine.cache.events import Events
from mlxkv.engine.cache.lending import Lending
from mlxkv.engine.cache.ram_tier import RamTier
from mlxkv.engine.cache.ssd import Restoring, SsdTier
from mlxkv.engine.cache.stats import Counters
from mlxkv.engine.cache.tokens import as_tokens, chain_keys, common_prefix, store_namespace
from mlxkv.engine.cache.tokens import entry_id as entry_id_of


@dataclass(eq=False)
class _BackgroundRead:
    """A prefetch whose blocks are being read (``SsdTier.begin_blocks``)."""

    read: Restoring
    keys: list[bytes]
    session: str | None


class Prefetcher:
    """Warms states from the SSD tier into the RAM tier, ahead of the lookups that need
    them. ``pins`` (pinned entry ids) and ``sessions`` (open sessions) are the cache's own
    sets, shared; ``worth(n_ssd, n_ram)`` says whether a restore beats a RAM hit."""

    def __init__(self, ram: RamTier, ssd: SsdTier | None, lending: Lending,
                 counters: Counters, events: Events, pins: set[str], sessions: set[str],
                 block_tokens: int, worth: Callable[[int, int], bool]) -> None:
        self.ram, self.ssd, self.lending = ram, ssd, lending
        self.counters, self.events = counters, events
        self.pins, self.sessions = pins, sessions
        self.block_tokens = block_tokens
        self.worth = worth
        self.busy = False  # the engine is serving (set by PrefixCache.busy)
        self.under_way: list[_BackgroundRead] = []  # background block reads

    def prefetch(self, tokens: ArrayLike, ns: str, session: str | None = None) -> int:
        """Warm the longest cached prefix of ``tokens`` into RAM, restoring it from SSD
        when RAM holds less of it (as a lookup would); the tokens a lookup will find in
        RAM. While busy the read runs in the background (see the module docstring)."""
        toks, store_ns = as_tokens(tokens), store_namespace(ns)
        limit = len(toks) - 1  # as lookup: at least one token is left to compute
        if limit <= 0:
            return 0
        self.lending.sweep()
        self.adopt()
        keys = chain_keys(store_ns, toks, self.block_tokens)
        n = self.ram.lookup(store_ns, toks, session, keys=keys).n  # (touches it: kept warm)
        for background in self.under_way:  # already on its way
            if background.read.store_ns == store_ns and background.read.n_tokens > n and \
                    common_prefix(background.read.toks, toks) >= background.read.n_tokens:
                return background.read.n_tokens
        restored = 0
        if self.busy and self.ssd is not None and self.worth(limit, n) and \
                self.ssd.available():
            return self._behind(self.ssd, store_ns, toks, keys, limit, n, ns, session)
        if self.ssd is not None and self.worth(limit, n) and self.ssd.available():
            ssd_n, cache, restore_ms = self.ssd.lookup(store_ns, toks, keys, limit, n, self.worth)
            if cache is not None and ssd_n > n:
                entry = self.ram.store(store_ns, toks[:ssd_n], cache, session,
                                       keys=keys[: ssd_n // self.block_tokens],
                                       pinned=entry_id_of(store_ns, toks[:ssd_n]) in self.pins)
                if entry is not None:
                    n = restored = ssd_n
            self.counters.add(restore_ms=restore_ms)
        self.counters.add(prefetches=1, prefetched_tokens=restored)
        self.events.emit("prefetch", ns=ns, tokens=n, restored=restored)
        return n

    def _behind(self, ssd: SsdTier, store_ns: str, toks: np.ndarray, keys: list[bytes], limit: int,
                n: int, ns: str, session: str | None) -> int:
        """Start a prefetch's block read on the reader thread; the tokens it will warm."""
        self.counters.add(prefetches=1)
        found = ssd.disk.lookup(store_ns, toks, max_tokens=limit, keys=keys)
        if found.layout is None or layout.is_partial(found.layout) or \
                not self.worth(found.n_tokens, n):
            return n  # (exact checkpoints are warmed when the engine is idle)
        # headroom for the turn that follows, so the request can take the buffers over
        cap = kvblocks.round_up(len(toks) + kvblocks.KV_STEP)
        pending = ssd.begin_blocks(store_ns, toks, found, cap, populate=False)
        if pending is None:
            return n
        self.under_way.append(_BackgroundRead(pending, keys, session))
        self.counters.add(prefetches_background=1)
        self.events.emit("prefetch", ns=ns, tokens=found.n_tokens, restored=0,
                         background=True)
        return int(found.n_tokens)

    def wait(self, timeout: float | None = None) -> int:
        """Wait (up to ``timeout`` s in all) for the reads under way and move them into
        RAM; returns how many are still under way."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for background in list(self.under_way):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                background.read.future.exception(timeout=left)
            except Exception:  # noqa: BLE001, S112  (timed out or cancelled: the next one)
                continue
        self.adopt()
        return len(self.under_way)

    def cancel(self) -> None:
        """Cancel every read under way and forget them (the cache closes)."""
        for background in self.under_way:
            background.read.future.cancel()
        self.under_way = []

    def adopt(self, toks: np.ndarray | None = None, store_ns: str | None = None) -> None:
        """Move finished prefetches into RAM. With a prompt (a lookup): wait for the one
        that serves it, cancel the queued ones that do not (the lookup's own read would
        queue behind them)."""
        if not self.under_way or self.ssd is None:
            return
        keep: list[_BackgroundRead] = []
        for background in self.under_way:
            read = background.read
            serves = toks is not None and read.store_ns == store_ns and \
                common_prefix(read.toks, toks) > 0
            if not (read.future.done() or serves):
                if toks is not None and read.future.cancel():
                    self.counters.add(prefetches_cancelled=1)
                else:
                    keep.append(background)
                continue
            got = self.ssd.finish_blocks(read)
            if got is None:
                continue
            n, cache = got
            size = kvblocks.arrays_nbytes([kvblocks.layer_arrays(c) for c in cache])
            pinned = entry_id_of(read.store_ns, read.toks[:n]) in self.pins
            if self.ram.nbytes + size > self.ram.max_bytes and not pinned and \
                    not (background.session is not None and background.session in self.sessions):
                self.counters.add(prefetches_cancelled=1)  # RAM is needed for more
                continue
            entry = self.ram.store(read.store_ns, read.toks[:n], cache, background.session,
                                   keys=background.keys[: n // self.block_tokens], pinned=pinned)
            if entry is not None:
                self.counters.add(prefetched_tokens=n)
                self.events.emit("prefetched", ns=read.store_ns, tokens=n)
        self.under_way = keep
