"""Upkeep of the block store: the folder lock shared by processes, LRU eviction under a
byte cap, garbage collection of what no manifest references, and the manifests.

Writers hold a shared flock on ``<root>/.lock``; scan, evict and gc hold it exclusively,
so no file is removed while another process is between writing and renaming it.
Readers take no lock and treat a vanished file as a miss.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import xxhash

from storage import diskio as dio
from storage import format as fmt
from storage.entries import EMPTY_SPACE, MANIFEST_DIR, Space
from storage.format import FormatError, Manifest
from storage.keys import ZERO_KEY, check_namespace, namespace_id, tail_key, token_ids


class MaintenanceMixin:
    """Locks, eviction, GC and manifests of :class:`storage.store.BlockStore`."""

    root: str
    block_tokens: int
    durable: bool
    max_bytes: int | None
    _lock: threading.RLock
    _c: dict[str, int]
    _spaces: dict[str, Space]
    _bytes: int

    @contextmanager
    def _flock(self, shared: bool) -> Iterator[None]:
        """The folder lock (shared: writers; exclusive: scan/evict/gc), across processes."""
        os.makedirs(self.root, exist_ok=True)
        fd = os.open(os.path.join(self.root, ".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing the descriptor releases the lock

    def evict(self, max_bytes: int | None = None) -> dict[str, int]:
        """Remove least-recently-used entries until the store holds <= max_bytes."""
        cap = self.max_bytes if max_bytes is None else max_bytes
        if cap is None or self._bytes <= cap:
            return {"evicted": 0, "bytes": 0}
        removed = freed = 0
        with self._flock(shared=False):
            with self._lock:
                # deepest first among equals: evicting a parent would orphan its children
                order = sorted((e for sp in self._spaces.values() for e in sp.entries()),
                               key=lambda e: (e.last_used, -e.t0))
                victims = []
                for e in order:
                    if self._bytes <= cap:
                        break
                    self._retire(e)
                    victims.append(e)
                    removed += 1
                    freed += e.file_size
                self._c["evicted"] += removed
                self._c["evicted_bytes"] += freed
            self._remove_retired(victims)
        return {"evicted": removed, "bytes": freed}

    def gc(self, ns: str | None = None, min_age_s: float = 60.0) -> dict[str, int]:
        """Remove blocks and tails no manifest references (older than ``min_age_s``, so a
        block another process wrote moments before its manifest survives). A manifest
        whose first block and tail are both gone (evicted) restores nothing: removed too."""
        removed = freed = live_n = stale = 0
        with self._flock(shared=False):
            self._scan_locked()
            with self._lock:
                names = [ns] if ns is not None else list(self._spaces)
            now = time.time()
            for name in names:
                live: set[bytes] = set()
                with self._lock:
                    present = {e.key for e in self._spaces.get(name, EMPTY_SPACE).entries()}
                for m in self.manifests(name):
                    # it restores something while its first block, its tail or one of
                    # its checkpoints is still there
                    heads = {*m.block_keys[:1], *m.extra_keys, *([m.tail_key] if m.tail_key else [])}
                    if heads and not heads & present and m.created <= now - min_age_s:
                        stale += self.delete_manifest(name, m.name)
                        continue
                    live.update(m.block_keys)
                    live.update(m.extra_keys)
                    if m.tail_key:
                        live.add(m.tail_key)
                live_n += len(live)
                with self._lock:
                    dead = [e for e in self._spaces.get(name, EMPTY_SPACE).entries()
                            if e.key not in live and e.mtime <= now - min_age_s]
                    for e in dead:
                        self._retire(e)
                self._remove_retired(dead)
                removed += len(dead)
                freed += sum(e.file_size for e in dead)
            with self._lock:
                self._c["gc_removed"] += removed
                self._c["gc_bytes"] += freed
        return {"removed": removed, "bytes": freed, "live_keys": live_n,
                "manifests_removed": stale}

    # ------------------------------------------------------------------ manifests
    def _manifest_path(self, ns: str, name: str) -> str:
        h = xxhash.xxh3_64_hexdigest(name.encode())
        return os.path.join(self.root, check_namespace(ns), MANIFEST_DIR, f"{h}.man")

    def put_manifest(self, ns: str, name: str, tokens: Any,
                     extra_keys: Sequence[bytes] = ()) -> Manifest:
        """Name the state of ``tokens`` (its block keys and tail key) so GC keeps it."""
        if not isinstance(name, str) or not name:
            raise ValueError("manifest name must be a non-empty string")
        toks = token_ids(tokens)
        keys = self.chain_keys(ns, toks)
        bt = self.block_tokens
        tkey = None
        if toks.size % bt:
            tkey = tail_key(keys[-1] if keys else ZERO_KEY, namespace_id(ns), toks[len(keys) * bt :])
        man = Manifest(name, ns, toks, tuple(keys), tkey, time.time(), tuple(extra_keys))
        path = self._manifest_path(ns, name)
        try:
            with self._flock(shared=True):
                dio.atomic_write(path, fmt.encode_manifest(man), self.durable)
        except OSError as exc:
            raise self._write_failed(exc, "manifest") from exc
        return man

    def get_manifest(self, ns: str, name: str) -> Manifest | None:
        try:
            m = _read_manifest(self._manifest_path(ns, name))
        except (FileNotFoundError, FormatError):
            return None
        return m if m.name == name and m.ns == ns else None

    def manifests(self, ns: str) -> list[Manifest]:
        d = os.path.join(self.root, check_namespace(ns), MANIFEST_DIR)
        out = []
        for de in dio.scandir(d):
            if de.name.endswith(".man"):
                try:
                    out.append(_read_manifest(de.path))
                except (OSError, FormatError):
                    continue
        return out

    def delete_manifest(self, ns: str, name: str) -> bool:
        try:
            os.unlink(self._manifest_path(ns, name))
            return True
        except FileNotFoundError:
            return False


def _read_manifest(path: str) -> Manifest:
    with open(path, "rb") as f:
        return fmt.decode_manifest(f.read())
