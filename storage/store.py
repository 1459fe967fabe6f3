"""Block store: verified, deduplicated KV blocks on disk, keyed by 128-bit chain keys.

A state is cut into blocks of ``block_tokens`` tokens, each stored once under a key that
hashes its whole prefix, so every conversation sharing a prefix restores it instead of
computing it again; no byte is restored unverified. ``BlockStore`` builds its parts
(``index``, ``writer``, ``reader``, ``upkeep``, ``learned``, sharing a ``context``) and
hands each call to the one that does it. Its calls, the keys, the files and the rules
for sharing a folder between processes: docs/storage.md.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy.typing as npt

from mlxkv.storage import diskio
from mlxkv.storage.context import StoreContext, reset_warnings
from mlxkv.storage.diskio import KERNEL
from mlxkv.storage.folder import open_folder
from mlxkv.storage.format import LayoutLike, Learned, Manifest
from mlxkv.storage.index import Index
from mlxkv.storage.keys import (
    ZERO_KEY,
    CacheFolderError,
    Match,
    PutResult,
    Restore,
    Segment,
    StoreWriteError,
    check_namespace,
    namespace_id,
)
from mlxkv.storage.learned import LearnedFile, LearnedFiles
from mlxkv.storage.maintenance import Maintenance
from mlxkv.storage.restore import Reader
from mlxkv.storage.write import Writer


class BlockStore:
    """Content-addressed KV blocks under ``root`` (see the module docstring).

    The work is done by its parts: ``index`` (lookups, scan), ``writer`` (put_*),
    ``reader`` (get_*), ``upkeep`` (evict, gc, manifests) and ``learned`` (learned
    files), which share ``context``."""

    def __init__(
        self, root: str | os.PathLike[str], block_tokens: int = 256,
        max_bytes: int | None = None, durable: bool = True, direct_io: bool = True,
        read_threads: int | None = None, direct_reads: bool = False,
    ) -> None:
        if block_tokens <= 0:
            raise ValueError(f"block_tokens must be > 0, got {block_tokens}")
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        root = os.path.abspath(os.fspath(root))
        open_folder(root)  # CacheFolderError if it is not a usable cache folder
        self.context = StoreContext(root, int(block_tokens), durable)
        self.index = Index(self.context)
        self.learned = LearnedFiles(root, durable)
        self.upkeep = Maintenance(self.context, self.index, self.learned, max_bytes)
        self.writer = Writer(self.context, self.index, self.upkeep, direct_io)
        # Cold block files are read with O_DIRECT (storage.direct) only when asked:
        # the page cache's readahead is usually as fast (see storage.direct).
        # read_threads: threads that verify+scatter the blocks of one restore in
        # parallel (1 = the caller's)
        self.reader = Reader(self.context, self.index,
                             max(1, read_threads if read_threads is not None
                                 else min(4, os.cpu_count() or 1)),
                             direct_reads)

    # ------------------------------------------------------------------ settings
    @property
    def root(self) -> str:
        return self.context.root

    @property
    def block_tokens(self) -> int:
        return self.context.block_tokens

    @property
    def durable(self) -> bool:
        return self.context.durable

    @property
    def max_bytes(self) -> int | None:
        return self.upkeep.max_bytes

    @max_bytes.setter
    def max_bytes(self, value: int | None) -> None:
        self.upkeep.max_bytes = value

    @property
    def direct_io(self) -> bool:
        return self.writer.direct_io

    @property
    def direct_reads(self) -> bool:
        return self.reader.direct_reads

    @property
    def read_threads(self) -> int:
        return self.reader.read_threads

    @property
    def retain_clock(self) -> Callable[[], float]:
        """The clock retention hints count from (``time.monotonic``)."""
        return self.upkeep.retain_clock

    @retain_clock.setter
    def retain_clock(self, clock: Callable[[], float]) -> None:
        self.upkeep.retain_clock = clock

    # ------------------------------------------------------------------ lookups
    def chain_keys(self, ns: str, tokens: npt.ArrayLike) -> list[bytes]:
        return self.index.chain_keys(ns, tokens)

    def lookup(self, ns: str, tokens: npt.ArrayLike, max_tokens: int | None = None,
               keys: Sequence[bytes] | None = None) -> Match:
        return self.index.lookup(ns, tokens, max_tokens, keys)

    def longest_prefix(self, ns: str, tokens: npt.ArrayLike, max_tokens: int | None = None) -> int:
        return self.index.lookup(ns, tokens, max_tokens).n_tokens

    def lookup_checkpoint(self, ns: str, tokens: npt.ArrayLike, max_tokens: int | None = None,
                          keys: Sequence[bytes] | None = None) -> Match:
        return self.index.lookup_checkpoint(ns, tokens, max_tokens, keys)

    def latest_tokens(self, ns: str) -> int:
        return self.index.latest_tokens(ns)

    def scan(self) -> dict[str, float]:
        return self.index.scan()

    # ------------------------------------------------------------------ writes, reads
    def put_blocks(
        self, ns: str, tokens: npt.ArrayLike, layout: LayoutLike, segments: Sequence[Segment], *,
        tail: bool = True, manifest: str | None = None, durable: bool | None = None,
        pace: Callable[[], None] | None = None,
    ) -> PutResult:
        return self.writer.put_blocks(ns, tokens, layout, segments, tail=tail,
                                      manifest=manifest, durable=durable, pace=pace)

    def put_checkpoint(
        self, ns: str, tokens: npt.ArrayLike, layout: LayoutLike, segments: Sequence[Segment], *,
        manifest: str | None = None, durable: bool | None = None,
    ) -> PutResult:
        return self.writer.put_checkpoint(ns, tokens, layout, segments, manifest=manifest,
                                          durable=durable)

    def get_blocks(self, ns: str, tokens: npt.ArrayLike, layout: LayoutLike, segments: Sequence[Segment],
                   n_tokens: int | Match | None = None) -> Restore:
        return self.reader.get_blocks(ns, tokens, layout, segments, n_tokens)

    def get_checkpoint(self, ns: str, match: Match, layout: LayoutLike,
                       segments: Sequence[Segment]) -> Restore:
        return self.reader.get_checkpoint(ns, match, layout, segments)

    # ------------------------------------------------------------------ upkeep
    def retain(self, ns: str, keys: Iterable[bytes], ttl_s: float) -> None:
        self.upkeep.retain(ns, keys, ttl_s)

    def evict(self, max_bytes: int | None = None) -> dict[str, int]:
        return self.upkeep.evict(max_bytes)

    def gc(self, ns: str | None = None, min_age_s: float = 60.0) -> dict[str, int | dict[str, str]]:
        return self.upkeep.gc(ns, min_age_s)

    def clear(self, ns: str) -> dict[str, int | bool]:
        return self.upkeep.clear(ns)

    def remove(self, ns: str, keys: Iterable[bytes]) -> dict[str, int]:
        return self.upkeep.remove(ns, keys)

    def put_manifest(self, ns: str, name: str, tokens: npt.ArrayLike,
                     extra_keys: Sequence[bytes] = ()) -> Manifest:
        return self.upkeep.put_manifest(ns, name, tokens, extra_keys)

    def get_manifest(self, ns: str, name: str) -> Manifest | None:
        return self.upkeep.get_manifest(ns, name)

    def manifests(self, ns: str, errors: dict[str, str] | None = None) -> list[Manifest]:
        return self.upkeep.manifests(ns, errors)

    def damaged_manifests(self, ns: str) -> dict[str, str]:
        return self.upkeep.damaged_manifests(ns)

    def delete_manifest(self, ns: str, name: str) -> bool:
        return self.upkeep.delete_manifest(ns, name)

    # ------------------------------------------------------------------ learned files
    def put_learned(self, ns: str, name: str, learned: Learned) -> int:
        """Write a learned file; StoreWriteError when the disk refuses it (warned once per
        errno and process, as a block or manifest write that fails)."""
        try:
            return self.learned.put(ns, name, learned)
        except OSError as exc:
            raise self.context.write_failed(exc, "learned file") from exc
        except CacheFolderError as exc:
            raise self.context.folder_failed(exc, "learned file") from exc

    def get_learned(self, ns: str, name: str, remove: bool = True) -> Learned | None:
        return self.learned.get(ns, name, remove)

    def remove_learned(self, ns: str, name: str) -> bool:
        return self.learned.remove(ns, name)

    def learned_files(self, ns: str | None = None) -> list[LearnedFile]:
        return self.learned.files(ns)

    # ------------------------------------------------------------------ the store
    def stats(self) -> dict[str, Any]:
        context, index = self.context, self.index
        with context.lock:
            per_ns = {ns: {**space.counts(), "bytes": sum(e.file_size for e in space.entries())}
                      for ns, space in index.spaces.items()}
            totals = {k: sum(v[k] for v in per_ns.values())
                      for k in ("blocks", "tails", "checkpoints")}
            return {"root": diskio.printable(context.root), "kernel": KERNEL,
                    "block_tokens": context.block_tokens, "bytes": index.nbytes,
                    "max_bytes": self.upkeep.max_bytes, **totals,
                    "namespaces": per_ns, "skipped_unknown_version": dict(context.skipped),
                    "skipped": dict(context.left), **context.counters}

    def close(self) -> None:
        """Stop the helper threads (the store stays usable; they restart on demand)."""
        self.writer.close()
        self.reader.close()


__all__ = [
    "KERNEL",
    "ZERO_KEY",
    "BlockStore",
    "CacheFolderError",
    "Match",
    "PutResult",
    "Restore",
    "Segment",
    "StoreWriteError",
    "check_namespace",
    "namespace_id",
    "reset_warnings",
]
