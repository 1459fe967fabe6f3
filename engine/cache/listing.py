"""Entry listing: the facts of the RAM tier and the SSD tier merged into
:class:`~engine.cache.info.CacheEntryInfo` records (engine thread)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mlxkv.engine.cache.info import BlockInfo, CacheEntryDetail, CacheEntryInfo, draft_base
from mlxkv.engine.cache.ram_tier import Entry, RamTier
from mlxkv.engine.cache.stats import Usage
from mlxkv.engine.cache.tokens import ckpt_key_of


@dataclass
class Facts:
    """What the tiers know of one entry."""

    eid: str
    ns: str
    tokens: np.ndarray
    checkpoint: bool
    created: float
    ram: Entry | None = None
    saved: Any = None  # upkeep.Saved
    # key -> [tokens, bytes, shared_by] per tier
    ram_blocks: dict[bytes, list[int]] = field(default_factory=dict)
    ssd_blocks: dict[bytes, list[int]] = field(default_factory=dict)


def _row_bytes(arrays: list) -> int:
    return sum(a.nbytes // max(1, a.shape[2]) for layer in arrays for a in layer)


def ram_facts(ram: RamTier, e: Entry) -> Facts:
    f = Facts(e.id, e.ns, e.tokens, e.checkpoint is not None, e.created, ram=e)
    if e.checkpoint is not None:
        f.ram_blocks[ckpt_key_of(e.ns, e.tokens, ram.bt)] = [len(e.tokens), e.nbytes, 1]
    for r in e.runs:
        f.ram_blocks[r.key] = [len(r.tokens), _row_bytes(r.slab.arrays) * len(r.tokens), r.refs]
    return f


def gather(ram: RamTier, saved: list, sns: str | None) -> dict[str, Facts]:
    """Facts per entry id, of namespace ``sns`` (all when None)."""
    out: dict[str, Facts] = {}
    for e in ram.entries.values():
        if sns is None or e.ns == sns:
            out[e.id] = ram_facts(ram, e)
    uses: dict[tuple[str, bytes], int] = {}
    for s in saved:
        for k, _, _ in s.blocks:
            uses[(s.ns, k)] = uses.get((s.ns, k), 0) + 1
    for s in saved:
        f = out.get(s.eid)
        if f is None:
            f = out[s.eid] = Facts(s.eid, s.ns, s.tokens, s.checkpoint, s.created)
        f.saved = s
        for k, n, b in s.blocks:
            f.ssd_blocks[k] = [n, b, uses[(s.ns, k)]]
    return out


def _kind(f: Facts, by_ns: dict[str, list[Facts]]) -> str:
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


def restorable(f: Facts) -> int:
    """Tokens the entry gives back now: all of them from RAM; from SSD only, those up to
    the first block that is missing (``saved_states`` stops its blocks there)."""
    if f.ram is not None or f.saved is None:
        return len(f.tokens)
    return min(len(f.tokens), int(f.saved.cached))


def infos(facts: dict[str, Facts], ram: RamTier, pins: set[str], usage: Usage
          ) -> dict[str, CacheEntryInfo]:
    by_ns: dict[str, list[Facts]] = {}
    for f in facts.values():
        by_ns.setdefault(f.ns, []).append(f)
    now = ram.clock()
    out = {}
    for f in facts.values():
        blocks = {**f.ssd_blocks, **f.ram_blocks}
        total = sum(b for _, b, _ in blocks.values())
        shared = sum(b for k, (_, b, _) in blocks.items()
                     if max(f.ram_blocks.get(k, (0, 0, 1))[2], f.ssd_blocks.get(k, (0, 0, 1))[2]) > 1)
        tier = "both" if f.ram is not None and f.saved is not None else (
            "ram" if f.ram is not None else "ssd")
        hits, when = usage.get(f.eid)
        session = f.ram.session if f.ram is not None else None
        pinned = f.eid in pins or (f.ram is not None and f.ram.pinned)
        held = f.ram is not None and session is not None and ram.pinned.get(session) is f.ram
        retained = max(0.0, f.ram.retained_until - now) if f.ram is not None else 0.0
        out[f.eid] = CacheEntryInfo(
            id=f.eid, ns=f.ns, kind=_kind(f, by_ns), tokens=restorable(f), blocks=len(blocks),
            bytes=total, unique_bytes=total - shared, shared_bytes=shared, tier=tier,
            pinned=pinned, last_used=when if when is not None else f.created, hits=hits,
            session=session, session_pinned=held, retained_s=round(retained, 1))
    return out


def detail(info: CacheEntryInfo, f: Facts, verified: dict[bytes, bool]) -> CacheEntryDetail:
    blocks = []
    for k in dict.fromkeys([*f.ram_blocks, *f.ssd_blocks]):
        r, s = f.ram_blocks.get(k), f.ssd_blocks.get(k)
        n, b, _ = r or s
        tier = "both" if r and s else ("ram" if r else "ssd")
        blocks.append(BlockInfo(key=k.hex(), tokens=n, bytes=b, tier=tier,
                                shared_by=max(r[2] if r else 0, s[2] if s else 0),
                                verified=verified.get(k)))
    return CacheEntryDetail(info=info, token_ids=[int(t) for t in f.tokens[:restorable(f)]],
                            blocks=blocks)
