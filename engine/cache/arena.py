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

from mlxkv.engine.cache import kvblocks
from mlxkv.engine.cache.info import scope_base

if TYPE_CHECKING:
    from mlxkv.storage.format import SegmentSpec

KvSignature = tuple[tuple[int, tuple[int, ...], str], ...]  # per segment: (outer, row shape, dtype)


@dataclass
class _Space:
    sig: KvSignature  # the segments of the model's KV layers, in stored order
    dtypes: list[mx.Dtype]
    row_bytes: int  # bytes of one token over every segment
    capacity: int  # tokens a slot holds
    slots: int = 1  # free slots kept ready
    free: list[list[mx.array]] = field(default_factory=list)


def kv_signature(cache: kvblocks.PromptCache) -> tuple[KvSignature, list[mx.Dtype]] | None:
    """The stored segments of a cache's plain KV layers, as ``engine.cache.layout`` writes
    them (None when it has none: nothing to prepare)."""
    from mlx_lm.models.cache import KVCache

    sig: list[tuple[int, tuple[int, ...], str]] = []
    dtypes: list[mx.Dtype] = []
    for c in cache:
        if type(c) is not KVCache or c.keys is None:
            continue
        for a in kvblocks.layer_arrays(c):  # keys, values
            sig.append((int(a.shape[0] * a.shape[1]), (int(a.shape[3]),), str(a.dtype)))
            dtypes.append(a.dtype)
    return (tuple(sig), dtypes) if sig else None


def layout_signature(flat: list[SegmentSpec]) -> KvSignature:
    """The signature of a stored block layout (its SegmentSpecs, in order)."""
    from mlxkv.engine.cache.layout import DTYPES

    return tuple((int(s.outer), tuple(int(x) for x in s.shape), str(DTYPES[s.dtype]))
                 for s in flat)


class Arena:
    """Free restore slots per namespace (see the module docstring)."""

    def __init__(self, budget_bytes: int, step: int = 1024) -> None:
        self.budget_bytes = max(0, int(budget_bytes))
        self.step = max(kvblocks.KV_STEP, int(step))
        self._spaces: dict[str, _Space] = {}
        self.hits = 0  # restores served from a slot
        self.misses = 0  # restores that allocated (no fitting slot)
        self.allocated = 0  # slots allocated
        self._free_bytes = 0

    # ------------------------------------------------------------------ preparing
    def prepare(self, store_ns: str, cache: kvblocks.PromptCache, tokens_hint: int = 0) -> int:
        """Take the KV layout of ``cache`` (the model's own) for ``store_ns``, size its slot for
        ``tokens_hint`` tokens (the state most likely to be resumed) and allocate it now;
        returns the bytes now ready."""
        got = kv_signature(cache)
        if got is None:
            self._spaces.pop(store_ns, None)
            self._recount()
            return 0
        sig, dtypes = got
        row = sum(o * dt.size * _prod(shape) for (o, shape, _), dt in zip(sig, dtypes))
        cap = kvblocks.round_up(max(int(tokens_hint), 0) + self.step, kvblocks.KV_STEP)
        old = self._spaces.get(store_ns)
        if old is not None and old.sig == sig:
            old.capacity = max(old.capacity, cap)
        else:
            # nothing stored yet: no slot until a restore shows one is wanted
            self._spaces[store_ns] = _Space(sig, dtypes, row, cap, slots=int(tokens_hint > 0))
            self._recount()
        return self.replenish(store_ns)

    def replenish(self, store_ns: str | None = None) -> int:
        """Allocate the free slots that are missing (all namespaces, or ``store_ns``) within the
        budget; returns the bytes allocated. Call when nothing waits on the engine."""
        done = 0
        spaces = list(self._spaces.values()) if store_ns is None else \
            [self._spaces[store_ns]] if store_ns in self._spaces else []
        for space in spaces:
            space.free = [s for s in space.free if s[0].shape[2] >= space.capacity]  # outgrown
            self._recount()
            while len(space.free) < space.slots:
                need = space.row_bytes * space.capacity
                if self.nbytes + need > self.budget_bytes:
                    break  # over budget: restores of this size allocate as before
                shapes = [(1, o, space.capacity, *shape) for o, shape, _ in space.sig]
                space.free.append(kvblocks.writable_arrays(shapes, space.dtypes, huge=True))
                self._recount()
                self.allocated += 1
                done += need
        return done

    # ------------------------------------------------------------------ restores
    def take(self, store_ns: str, flat: list[SegmentSpec], cap: int) -> list[mx.array] | None:
        """Arrays for a restore of the stored segments ``flat`` with room for ``cap``
        tokens, from a free slot (the arena forgets them), or None (allocate as usual).
        A slot is used when it fits and wastes at most one ``cap`` of headroom."""
        # a tenant's namespace: its model's space
        space = self._spaces.get(store_ns) or self._spaces.get(scope_base(store_ns))
        if space is None or layout_signature(flat) != space.sig:
            return None
        for i, slot in enumerate(space.free):
            have = slot[0].shape[2]
            if cap <= have <= 2 * cap + self.step:
                self.hits += 1
                slot = space.free.pop(i)
                self._recount()
                return slot
        self.misses += 1
        space.slots = 1
        if cap > space.capacity:  # grown in steps, for the next one
            space.capacity = kvblocks.round_up(cap + self.step, kvblocks.KV_STEP)
        return None

    # ------------------------------------------------------------------ inspection
    @property
    def nbytes(self) -> int:
        """Bytes held in free slots (kept as a count: ``stats`` may run on any thread)."""
        return self._free_bytes

    def _recount(self) -> None:
        self._free_bytes = sum(a.nbytes for space in list(self._spaces.values())
                               for s in space.free for a in s)

    def free_arrays(self, store_ns: str | None = None) -> list[mx.array]:
        """The arrays of the free slots (what the next restores will write into)."""
        return [a for ns, space in self._spaces.items() if store_ns in (None, ns)
                for s in space.free for a in s]

    def capacity(self, store_ns: str) -> int:
        space = self._spaces.get(store_ns)
        return 0 if space is None else space.capacity

    def clear(self) -> None:
        for space in self._spaces.values():
            space.free.clear()
        self._free_bytes = 0

    def stats(self) -> dict[str, int | dict[str, int]]:
        return {"arena_bytes": self.nbytes, "arena_budget_bytes": self.budget_bytes,
                "arena_hits": self.hits, "arena_misses": self.misses,
                "arena_slots_allocated": self.allocated,
                "arena_capacity": {ns: space.capacity for ns, space in list(self._spaces.items())}}


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
