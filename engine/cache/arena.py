"""The KV arena: restore destinations that already exist when an SSD hit comes.

Allocating and faulting in a restore's destination arrays is a large part of its cost, so
per bound model the arena keeps ready **slots** (one writable, pre-faulted array per
stored KV segment, with room for ``capacity`` tokens). A fitting SSD hit reads straight
into a slot, which the arena then forgets (the request owns it); slots grow in steps and
are replenished when the engine is idle. What a free slot holds is never observable: a
cache's ``offset`` covers only the rows a restore wrote. Engine thread only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import mlx.core as mx

from mlxkv.engine.cache import kvblocks as kb
from mlxkv.engine.cache.info import scope_base

if TYPE_CHECKING:
    from mlxkv.storage.format import SegmentSpec

Sig = tuple[tuple[int, tuple[int, ...], str], ...]  # per segment: (outer, row shape, dtype)


@dataclass
class _Space:
    sig: Sig  # the segments of the model's KV layers, in stored order
    dtypes: list[mx.Dtype]
    row_bytes: int  # bytes of one token over every segment
    capacity: int  # tokens a slot holds
    slots: int = 1  # free slots kept ready
    free: list[list[mx.array]] = field(default_factory=list)


def kv_signature(cache: kb.PromptCache) -> tuple[Sig, list[mx.Dtype]] | None:
    """The stored segments of a cache's plain KV layers, as ``engine.cache.layout`` writes
    them (None when it has none: nothing to prepare)."""
    from mlx_lm.models.cache import KVCache

    sig: list[tuple[int, tuple[int, ...], str]] = []
    dtypes: list[mx.Dtype] = []
    for c in cache:
        if type(c) is not KVCache or c.keys is None:
            continue
        for a in kb.layer_arrays(c):  # keys, values
            sig.append((int(a.shape[0] * a.shape[1]), (int(a.shape[3]),), str(a.dtype)))
            dtypes.append(a.dtype)
    return (tuple(sig), dtypes) if sig else None


def layout_signature(flat: list[SegmentSpec]) -> Sig:
    """The signature of a stored block layout (its SegmentSpecs, in order)."""
    from mlxkv.engine.cache.layout import DTYPES

    return tuple((int(s.outer), tuple(int(x) for x in s.shape), str(DTYPES[s.dtype]))
                 for s in flat)


class Arena:
    """Free restore slots per namespace (see the module docstring)."""

    def __init__(self, budget_bytes: int, step: int = 1024) -> None:
        self.budget_bytes = max(0, int(budget_bytes))
        self.step = max(kb.KV_STEP, int(step))
        self._spaces: dict[str, _Space] = {}
        self.hits = 0  # restores served from a slot
        self.misses = 0  # restores that allocated (no fitting slot)
        self.allocated = 0  # slots allocated
        self._free_bytes = 0

    # ------------------------------------------------------------------ preparing
    def prepare(self, sns: str, cache: kb.PromptCache, tokens_hint: int = 0) -> int:
        """Take the KV layout of ``cache`` (the model's own) for ``sns``, size its slot for
        ``tokens_hint`` tokens (the state most likely to be resumed) and allocate it now;
        returns the bytes now ready."""
        got = kv_signature(cache)
        if got is None:
            self._spaces.pop(sns, None)
            self._recount()
            return 0
        sig, dtypes = got
        row = sum(o * dt.size * _prod(shape) for (o, shape, _), dt in zip(sig, dtypes))
        cap = kb.round_up(max(int(tokens_hint), 0) + self.step, kb.KV_STEP)
        old = self._spaces.get(sns)
        if old is not None and old.sig == sig:
            old.capacity = max(old.capacity, cap)
        else:
            # nothing stored yet: no slot until a restore shows one is wanted
            self._spaces[sns] = _Space(sig, dtypes, row, cap, slots=int(tokens_hint > 0))
            self._recount()
        return self.replenish(sns)

    def replenish(self, sns: str | None = None) -> int:
        """Allocate the free slots that are missing (all namespaces, or ``sns``) within the
        budget; returns the bytes allocated. Call when nothing waits on the engine."""
        done = 0
        spaces = list(self._spaces.values()) if sns is None else \
            [self._spaces[sns]] if sns in self._spaces else []
        for sp in spaces:
            sp.free = [s for s in sp.free if s[0].shape[2] >= sp.capacity]  # outgrown
            self._recount()
            while len(sp.free) < sp.slots:
                need = sp.row_bytes * sp.capacity
                if self.nbytes + need > self.budget_bytes:
                    break  # over budget: restores of this size allocate as before
                shapes = [(1, o, sp.capacity, *shape) for o, shape, _ in sp.sig]
                sp.free.append(kb.writable_arrays(shapes, sp.dtypes, huge=True))
                self._recount()
                self.allocated += 1
                done += need
        return done

    # ------------------------------------------------------------------ restores
    def take(self, sns: str, flat: list[SegmentSpec], cap: int) -> list[mx.array] | None:
        """Arrays for a restore of the stored segments ``flat`` with room for ``cap``
        tokens, from a free slot (the arena forgets them), or None (allocate as usual).
        A slot is used when it fits and wastes at most one ``cap`` of headroom."""
        sp = self._spaces.get(sns) or self._spaces.get(scope_base(sns))  # a tenant's: its model's
        if sp is None or layout_signature(flat) != sp.sig:
            return None
        for i, slot in enumerate(sp.free):
            have = slot[0].shape[2]
            if cap <= have <= 2 * cap + self.step:
                self.hits += 1
                slot = sp.free.pop(i)
                self._recount()
                return slot
        self.misses += 1
        sp.slots = 1
        if cap > sp.capacity:  # grown in steps, for the next one
            sp.capacity = kb.round_up(cap + self.step, kb.KV_STEP)
        return None

    # ------------------------------------------------------------------ inspection
    @property
    def nbytes(self) -> int:
        """Bytes held in free slots (kept as a count: ``stats`` may run on any thread)."""
        return self._free_bytes

    def _recount(self) -> None:
        self._free_bytes = sum(a.nbytes for sp in list(self._spaces.values())
                               for s in sp.free for a in s)

    def free_arrays(self, sns: str | None = None) -> list[mx.array]:
        """The arrays of the free slots (what the next restores will write into)."""
        return [a for ns, sp in self._spaces.items() if sns in (None, ns)
                for s in sp.free for a in s]

    def capacity(self, sns: str) -> int:
        sp = self._spaces.get(sns)
        return 0 if sp is None else sp.capacity

    def clear(self) -> None:
        for sp in self._spaces.values():
            sp.free.clear()
        self._free_bytes = 0

    def stats(self) -> dict[str, int | dict[str, int]]:
        return {"arena_bytes": self.nbytes, "arena_budget_bytes": self.budget_bytes,
                "arena_hits": self.hits, "arena_misses": self.misses,
                "arena_slots_allocated": self.allocated,
                "arena_capacity": {ns: sp.capacity for ns, sp in list(self._spaces.items())}}


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
