"""Saved states on the SSD tier: what each manifest names, verifying them (every byte
read back through the storage reader thread and checked against its content hash), and
removing them.

A saved state is a manifest (named after the entry id) plus the blocks, tail or
checkpoint it names that are still on disk. Engine thread.
"""

from __future__ import annotations

import logging
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from mlxkv.engine.cache.tokens import entry_id, manifest_name

if TYPE_CHECKING:
    from mlxkv.storage.format import Layout
    from mlxkv.storage.io import ReadRequest, StorageIO
    from mlxkv.storage.keys import Match, Segment
    from mlxkv.storage.store import BlockStore

log = logging.getLogger("mlxkv.cache")


@dataclass
class Saved:
    """One saved state of the SSD tier."""

    entry_id: str
    ns: str
    tokens: np.ndarray
    checkpoint: bool
    created: float
    blocks: list[tuple[bytes, int, int]] = field(default_factory=list)  # key, tokens, bytes
    cached: int = 0  # tokens a restore would give back now
    manifest: str = ""


def saved_states(disk: BlockStore, store_ns: str) -> list[Saved]:
    """The states saved in ``store_ns`` whose first block, tail or checkpoint is on disk."""
    from mlxkv.storage.format import bytes_per_token

    out = []
    for man in disk.manifests(store_ns):
        toks = np.ascontiguousarray(man.tokens, dtype="<u4")
        s = Saved(entry_id(store_ns, toks), store_ns, toks, bool(man.extra_keys), man.created,
                  manifest=man.name)
        block_tokens = disk.block_tokens
        if s.checkpoint:
            checkpoint_match = disk.lookup_checkpoint(store_ns, toks)
            if checkpoint_match.n_tokens != len(toks) or checkpoint_match.checkpoint_key is None:
                continue
            s.blocks.append((checkpoint_match.checkpoint_key, len(toks), checkpoint_match.nbytes))
            block_match = disk.lookup(store_ns, toks, max_tokens=len(toks))
            if block_match.n_tokens == len(toks) and block_match.layout is not None:
                _add_blocks(s, block_match, block_tokens, bytes_per_token(block_match.layout))
            s.cached = len(toks)
        else:
            block_match = disk.lookup(store_ns, toks)
            if block_match.n_tokens == 0 or block_match.layout is None:
                continue
            _add_blocks(s, block_match, block_tokens, bytes_per_token(block_match.layout))
            s.cached = block_match.n_tokens
        out.append(s)
    return out


def _add_blocks(s: Saved, block_match: Match, block_tokens: int, bytes_per_token: int) -> None:
    s.blocks.extend((k, block_tokens, block_tokens * bytes_per_token)
                    for k in block_match.block_keys)
    tail, tail_tokens = block_match.tail_key, block_match.tail_tokens
    if tail is not None and tail_tokens:
        s.blocks.append((tail, tail_tokens, tail_tokens * bytes_per_token))


def damaged_manifests(disk: BlockStore, store_ns: str) -> int:
    """Manifest files of ``store_ns`` that cannot be read back (damaged, truncated)."""
    return len(disk.damaged_manifests(store_ns))


def _scratch(layout: Layout, rows: int) -> list[Segment]:
    return [(np.empty(s.outer * rows * s.row_bytes, np.uint8), s.outer, rows, s.row_bytes)
            for s in layout]


def verify(io: StorageIO, s: Saved, timeout: float | None) -> tuple[bool, dict[bytes, bool]]:
    """Read every block of ``s`` back through the reader thread (into scratch buffers)
    and check it: (all ok, {key: verified}). A corrupt block is removed by the store."""
    from mlxkv.storage.io import ReadRequest

    disk, toks = io.store, s.tokens
    ok = True
    seen: dict[bytes, bool] = {}
    reads: list[tuple[ReadRequest, list[bytes]]] = []
    if s.checkpoint:
        checkpoint_match = disk.lookup_checkpoint(s.ns, toks)
        key, stored = checkpoint_match.checkpoint_key, checkpoint_match.layout
        if checkpoint_match.n_tokens == len(toks) and key is not None and \
                stored is not None:  # (a found checkpoint has both)
            reads.append((ReadRequest(s.ns, toks, stored, _scratch(stored, 1),
                                      n_tokens=checkpoint_match, checkpoint=True), [key]))
        else:
            ok = False
    block_match = disk.lookup(s.ns, toks, max_tokens=len(toks) if s.checkpoint else None)
    stored = block_match.layout
    if block_match.n_tokens and stored is not None:
        tail = block_match.tail_key
        keys = [*block_match.block_keys, *([tail] if tail is not None else [])]
        reads.append((ReadRequest(s.ns, toks, stored, _scratch(stored, block_match.n_tokens),
                                  n_tokens=block_match), keys))
    for req, keys in reads:
        try:
            res = io.submit_read(req).result(timeout=timeout)
        except FutureTimeout:
            log.warning("prefix cache: verifying %s took longer than %s s", s.entry_id, timeout)
            return False, seen
        except Exception as exc:  # noqa: BLE001  (an unreadable or foreign layout: damage)
            log.debug("verify %s: %s", s.entry_id, exc)
            return False, seen
        good = res.blocks_read
        for i, k in enumerate(keys):
            seen[k] = i < good
        if res.corrupt or res.missing or res.n_tokens < res.requested:
            ok = False
    return ok, seen


def remove(disk: BlockStore, store_ns: str, keys: set[bytes], manifests: list[str]) -> int:
    """Remove the files of ``keys`` and the named manifests from ``store_ns``; files removed."""
    n = sum(bool(disk.delete_manifest(store_ns, name)) for name in manifests)
    if not keys:
        return n
    return n + int(disk.remove(store_ns, keys).get("removed", 0))


__all__ = ["Saved", "damaged_manifests", "manifest_name", "remove", "saved_states", "verify"]
