"""Caches whose RAM entry was handed over whole to a request, until it is stored back.

A RAM entry that a request continues exactly is handed over (its buffers continue in
place, see ``RamTier._move``) and the entry is forgotten. If the request fails before its
``store``, :meth:`Lending.release` rebuilds the entry from the cache's first ``n`` rows
(which the request never rewrites) and keeps it again. A request that just drops its cache
is noticed by :meth:`Lending.sweep`: once only our record refers to the cache list, the
entry is taken back the same way.

Engine thread only.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from mlxkv.engine.cache import kvblocks

log = logging.getLogger("mlxkv.cache")

MAX_LENT = 8  # handed-over caches remembered for release()


@dataclass(frozen=True)
class Lent:
    """A RAM entry handed over to a request."""

    cache: kvblocks.PromptCache  # the request's prompt cache (the very list lookup returned)
    ns: str
    tokens: np.ndarray
    session: str | None
    retained_until: float = 0.0  # the entry's retention hint, kept for when it comes back


class Lending:
    """Handed-over caches by id; ``keep(ns, tokens, cache, session, retained_until)``
    stores one back."""

    def __init__(self, keep: Callable[[str, np.ndarray, kvblocks.PromptCache, str | None, float],
                                      object]) -> None:
        self._keep = keep
        self._lent: dict[int, Lent] = {}
        self.released = 0  # entries given back

    def __len__(self) -> int:
        return len(self._lent)

    def remember(self, cache: kvblocks.PromptCache, ns: str, toks: np.ndarray, session: str | None,
                 retained_until: float = 0.0) -> None:
        self._lent[id(cache)] = Lent(cache, ns, toks.copy(), session, retained_until)
        while len(self._lent) > MAX_LENT:
            rec = self._lent.pop(next(iter(self._lent)))
            if self._orphaned(rec):
                self._give_back(rec)

    def retention(self, cache: kvblocks.PromptCache) -> float:
        """The retention hint of the entry handed over as ``cache`` (0: none): the state
        stored from it holds that entry's tokens, and keeps its hint."""
        rec = self._lent.get(id(cache))
        return rec.retained_until if rec is not None and rec.cache is cache else 0.0

    def stored(self, cache: kvblocks.PromptCache) -> None:
        """The request stored its cache: nothing to give back."""
        rec = self._lent.get(id(cache))
        if rec is not None and rec.cache is cache:
            del self._lent[id(cache)]

    @staticmethod
    def _orphaned(rec: Lent) -> bool:
        # Only our record still refers to the cache list (getrefcount adds its argument):
        # the request is over and neither stored nor released it. Holding the list (and so
        # its layer objects) never holds an extra reference to an array, so it does not
        # stop MLX from writing the request's new tokens in place.
        return sys.getrefcount(rec.cache) <= 2

    def sweep(self) -> None:
        """Give back handed-over entries whose request dropped its cache unstored."""
        for key in [k for k, r in self._lent.items() if self._orphaned(r)]:
            self._give_back(self._lent.pop(key))

    def release(self, cache: kvblocks.PromptCache | None) -> bool:
        """The request that got ``cache`` will not store it: give back what it borrowed.
        Returns whether an entry was given back."""
        if cache is None:
            return False
        rec = self._lent.get(id(cache))
        if rec is None or rec.cache is not cache:
            return False
        del self._lent[id(cache)]
        return self._give_back(rec)

    def forget(self, pred: Callable[[Lent], bool]) -> None:
        """Drop the records ``pred`` selects (their state must not come back)."""
        for key in [k for k, r in self._lent.items() if pred(r)]:
            del self._lent[key]

    def clear(self) -> None:
        self._lent.clear()

    def _give_back(self, rec: Lent) -> bool:
        cache, n = rec.cache, len(rec.tokens)
        try:
            if not kvblocks.is_block_cache(cache):
                raise ValueError("the cache is no longer a block cache")
            arrays = [kvblocks.layer_arrays(c) for c in cache]
            mx.eval([a for layer in arrays for a in layer])
            if any(int(c.offset) < n or not arrs or arrs[0].shape[2] < n
                   for c, arrs in zip(cache, arrays)):
                raise ValueError(f"the cache no longer holds its first {n} tokens")
            back = [kvblocks.make_layer(kvblocks.layer_spec(c), arrs, n)
                    for c, arrs in zip(cache, arrays)]
            self._keep(rec.ns, rec.tokens, back, rec.session, rec.retained_until)
        except Exception as exc:  # noqa: BLE001  (a failed computation left lazy garbage)
            log.warning("could not take back a %d-token cached state: %s", n, exc)
            return False
        self.released += 1
        return True
