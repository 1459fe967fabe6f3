"""What the prefix cache holds, as the front end sees it: one record per stored state.

An entry is one state ``store()`` kept (the end of a turn), identified by
:func:`engine.cache.tokens.entry_id` of its namespace and tokens, in RAM, on SSD (a
manifest names it there) or both. ``kind`` is ``"checkpoint"`` for exact-position states
of non-trimmable caches, ``"prefix"`` for a state another entry of the namespace extends
(its blocks are all shared), ``"draft"`` for speculation's draft state (a draft model's
or MTP head's KV, kept beside its conversation under ``{ns}+draft-...``),
``"conversation"`` otherwise. ``tokens`` and ``blocks`` are
what a restore gives back now: an SSD-only state whose block went missing (damaged,
removed by verify) counts the tokens before that block.

Nothing here does I/O or touches mlx: :mod:`engine.cache.listing` gathers the facts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, TypedDict

import xxhash

Kind = Literal["conversation", "prefix", "checkpoint", "draft"]
Tier = Literal["ram", "ssd", "both"]


SCOPE_MARK = ".t-"  # between a model's namespace and a scope's digest (a valid store name)


def scoped_namespace(ns: str, scope: str | None) -> str:
    """The namespace of ``scope`` (a tenant: an API key's, a request's ``cache_salt``) inside
    the model namespace ``ns``: its states share nothing with the model's own or another
    scope's (the chain keys start from another namespace id). None: ``ns`` itself."""
    if not scope:
        return ns
    return f"{ns}{SCOPE_MARK}{xxhash.xxh3_64_hexdigest(scope.encode())}"


def scope_base(ns: str) -> str:
    """The model namespace a scoped namespace is inside (``ns`` itself when unscoped)."""
    return ns.split(SCOPE_MARK, 1)[0]


def model_namespace(ns: str) -> str:
    """The model namespace any namespace belongs to: a draft's target's, a scope's model's."""
    return scope_base(draft_base(ns) or ns)


def draft_base(ns: str) -> str | None:
    """The target namespace a draft namespace belongs to (None: not a draft's). Speculation
    keeps its draft state under f"{ns}+draft-{identity}", which the block store spells
    with "_" for "+"."""
    for mark in ("+draft-", "_draft-"):
        if mark in ns:
            return ns.split(mark, 1)[0]
    return None


@dataclass(frozen=True)
class CacheEntryInfo:
    id: str
    ns: str
    kind: Kind
    tokens: int
    blocks: int  # full blocks and tail (block caches) or 1 (a checkpoint)
    bytes: int  # what the state takes alone
    unique_bytes: int  # of which no other entry shares
    shared_bytes: int  # of which some other entry shares
    tier: Tier
    pinned: bool  # pinned explicitly (``pin``): kept over others, in RAM and when it comes back
    last_used: float  # unix time
    hits: int  # lookups this process served from it
    session: str | None
    session_pinned: bool = False  # held in RAM as the latest entry of an open session
    # seconds a retention hint (cache_control, prompt_cache_key) still keeps it over the
    # entries without one (0: none); unlike ``pinned`` it ends by itself
    retained_s: float = 0.0


@dataclass(frozen=True)
class BlockInfo:
    key: str  # hex of the chain key
    tokens: int
    bytes: int
    tier: str  # "ram", "ssd" or "both"
    shared_by: int  # entries using this block (1: only this one)
    verified: bool | None  # None: not read back in this process


@dataclass(frozen=True)
class CacheEntryDetail:
    info: CacheEntryInfo
    token_ids: list[int]
    blocks: list[BlockInfo]


class VerifyReport(TypedDict):
    """What ``verify`` found: states checked, whole, damaged (their ids), and manifest
    files that cannot be read back."""

    checked: int
    ok: int
    damaged: list[str]
    manifests_damaged: int


def empty_verify_report() -> VerifyReport:
    return {"checked": 0, "ok": 0, "damaged": [], "manifests_damaged": 0}
