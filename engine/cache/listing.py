"""Entry listing: what the RAM tier and the SSD tier hold of each entry, merged into
:class:`~engine.cache.info.CacheEntryInfo` records (engine thread)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from mlxkv.engine.cache.info import (
    BlockInfo,
    CacheEntryDetail,
    CacheEntryInfo,
    Kind,
    Tier,
    draft_base,
)
from mlxkv.engine.cache.ram_tier import RamEntry, RamTier
from mlxkv.engine.cache.stats import Usage
from mlxkv.engine.cache.tokens import ckpt_key_of
from mlxkv.engine.cache.upkeep import Saved


class TierBlock(NamedTuple):
    """One block (or tail, or checkpoint) of an entry, as one tier holds it."""

    tokens: int
    nbytes: int
    shared_by: int  # entries of the tier that use it


@dataclass
class TierView:
    """One entry as the tiers hold it: its RAM entry, its saved manifest, their blocks."""

    entry_id: str
    ns: str
    tokens: np.ndarray
    checkpoint: bool
    created: float
    ram: RamEntry | None = None
    saved: Saved | None = None
    ram_blocks: dict[bytes, TierBlock] = field(default_factory=dict)
    ssd_blocks: dict[bytes, TierBlock] = field(default_factory=dict)


def _row_bytes(arrays: list[list[mx.array]]) -> int:
    return sum(a.nbytes // max(1, a.shape[2]) for layer in arrays for a in layer)


def ram_view(ram: RamTier, e: RamEntry) -> TierView:
    f = TierView(e.id, e.ns, e.tokens, e.checkpoint is not None, e.created, ram=e)
    if e.checkpoint is not None:
        key = ckpt_key_of(e.ns, e.tokens, ram.block_tokens)
        f.ram_blocks[key] = TierBlock(len(e.tokens), e.nbytes, 1)
    for r in e.runs:
        f.ram_blocks[r.key] = TierBlock(len(r.tokens), _row_bytes(r.slab.arrays) * len(r.tokens),
                                         r.refs)
    return f


def gather(ram: RamTier, saved: list[Saved], store_ns: str | None) -> dict[str, TierView]:
    """TierView per entry id, of namespace ``store_ns`` (all when None)."""
    out: dict[str, TierView] = {}
    for e in ram.entries.values():
        if store_ns is None or e.ns == store_ns:
            out[e.id] = ram_view(ram, e)
    uses: dict[tuple[str, bytes], int] = {}
    for s in saved:
        for k, _, _ in s.blocks:
            uses[(s.ns, k)] = uses.get((s.ns, k), 0) + 1
    for s in saved:
        f = out.get(s.entry_id)
        if f is None:
            f = out[s.entry_id] = TierView(s.entry_id, s.ns, s.tokens, s.checkpoint, s.created)
        f.saved = s
        for k, n, b in s.blocks:
            f.ssd_blocks[k] = TierBlock(n, b, uses[(s.ns, k)])
    return out


def _kind(f: TierView, by_ns: dict[str, list[TierView]]) -> Kind:
    if draft_base(f.ns) is not None:  # speculation's draft state, beside its conversation
        return "draft"
    if f.checkpoint:
        return "checkpoint"
    n = len(f.tokens)
    for g in by_ns[f.ns]:
        if g is not f and not g.checkpoint and len(g.tokens) > n and \
                np.array_equal(g.tokens[:n], f.tokens):
            return "prefix"
    return "conversation"


def restorable(f: TierView) -> int:
    """Tokens the entry gives back now: all of them from RAM; from SSD only, those up to
    the first block that is missing (``saved_states`` stops its blocks there)."""
    if f.ram is not None or f.saved is None:
        return len(f.tokens)
    return min(len(f.tokens), int(f.saved.cached))


def infos(views: dict[str, TierView], ram: RamTier, pins: set[str], usage: Usage
          ) -> dict[str, CacheEntryInfo]:
    by_ns: dict[str, list[TierView]] = {}
    for f in views.values():
        by_ns.setdefault(f.ns, []).append(f)
    now = ram.clock()
    out: dict[str, CacheEntryInfo] = {}
    for f in views.values():
        blocks = {**f.ssd_blocks, **f.ram_blocks}
        total = sum(b for _, b, _ in blocks.values())
        unshared = TierBlock(0, 0, 1)
        shared = sum(b for k, (_, b, _) in blocks.items()
                     if max(f.ram_blocks.get(k, unshared).shared_by,
                            f.ssd_blocks.get(k, unshared).shared_by) > 1)
        tier: Tier = "both" if f.ram is not None and f.saved is not None else (
            "ram" if f.ram is not None else "ssd")
        hits, when = usage.get(f.entry_id)
        session = f.ram.session if f.ram is not None else None
        pinned = f.entry_id in pins or (f.ram is not None and f.ram.pinned)
        held = f.ram is not None and session is not None and ram.pinned.get(session) is f.ram
        retained = max(0.0, f.ram.retained_until - now) if f.ram is not None else 0.0
        out[f.entry_id] = CacheEntryInfo(
            id=f.entry_id, ns=f.ns, kind=_kind(f, by_ns), tokens=restorable(f), blocks=len(blocks),
            bytes=total, unique_bytes=total - shared, shared_bytes=shared, tier=tier,
            pinned=pinned, last_used=when if when is not None else f.created, hits=hits,
            session=session, session_pinned=held, retained_s=round(retained, 1))
    return out


def detail(info: CacheEntryInfo, f: TierView, verified: dict[bytes, bool]) -> CacheEntryDetail:
    blocks: list[BlockInfo] = []
    for k in dict.fromkeys([*f.ram_blocks, *f.ssd_blocks]):
        r, s = f.ram_blocks.get(k), f.ssd_blocks.get(k)
        either = r or s
        if either is None:  # (every key is in one of them)
            continue
        n, b, _ = either
        tier: Tier = "both" if r and s else ("ram" if r else "ssd")
        blocks.append(BlockInfo(key=k.hex(), tokens=n, bytes=b, tier=tier,
                                shared_by=max(r.shared_by if r else 0, s.shared_by if s else 0),
                                verified=verified.get(k)))
    return CacheEntryDetail(info=info, token_ids=[int(t) for t in f.tokens[:restorable(f)]],
                            blocks=blocks)
