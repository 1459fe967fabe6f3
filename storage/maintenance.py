"""Upkeep of the block store: the folder lock shared by processes, LRU eviction under a
byte cap, garbage collection of what no manifest references, and the manifests.

Writers hold a shared flock on ``<root>/.lock``; scan, evict and gc hold it exclusively,
so no file is removed while another process is between writing and renaming it.
Readers take no lock and treat a vanished file as a miss.

Manifests are verified like blocks (their header hash covers every byte). One that
cannot be read (damaged, unreadable, not a regular file, from a newer mlxkv) is reported
by ``manifests(ns, errors)`` / ``damaged_manifests(ns)``, and gc then removes nothing in
its namespace: what it references is unknown, so no block there is provably unreferenced.
``clear(ns)`` removes a namespace whole, damaged manifests included.
"""

from __future__ import annotations

import os
import stat
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import xxhash

from mlxkv.storage import diskio as dio
from mlxkv.storage import format as fmt
from mlxkv.storage.entries import EMPTY_SPACE, MANIFEST_DIR, Space
from mlxkv.storage.folder import MAN_RE, SHARD_RE, folder_lock
from mlxkv.storage.format import FormatError, Manifest
from mlxkv.storage.keys import (
    ZERO_KEY,
    CacheFolderError,
    check_namespace,
    namespace_id,
    tail_key,
    token_ids,
)


class MaintenanceMixin:
    """Locks, eviction, GC and manifests of :class:`storage.store.BlockStore`."""

    root: str
    block_tokens: int
    durable: bool
    max_bytes: int | None
    retain_clock: Callable[[], float]
    _retained: dict[tuple[str, bytes], float]
    _lock: threading.RLock
    _c: dict[str, int]
    _spaces: dict[str, Space]
    _bytes: int
    _unlink: Callable[[str], bool]
    _clear_learned: Callable[[str], int]

    @contextmanager
    def _flock(self, shared: bool) -> Iterator[None]:
        """The folder lock (shared: writers; exclusive: scan/evict/gc), across processes;
        CacheFolderError if the folder stopped being usable (see storage.folder)."""
        with folder_lock(self.root, shared):
            yield

    def retain(self, ns: str, keys: Iterable[bytes], ttl_s: float) -> None:
        """Evict the files of ``keys`` in ``ns`` (written or still to come) only after every
        other file, for ``ttl_s`` seconds from now (a retention hint; this process only)."""
        until = self.retain_clock() + float(ttl_s)
        with self._lock:
            for k in keys:
                if self._retained.get((ns, k), 0.0) < until:
                    self._retained[(ns, k)] = until

    def _held(self) -> set[tuple[str, bytes]]:
        """The (ns, key) pairs a retention hint holds now (expired ones forgotten)."""
        now = self.retain_clock()
        for k in [k for k, until in self._retained.items() if until <= now]:
            del self._retained[k]
        return set(self._retained)

    def evict(self, max_bytes: int | None = None) -> dict[str, int]:
        """Remove least-recently-used entries until the store holds <= max_bytes; files a
        retention hint holds (``retain``) go only after all others."""
        cap = self.max_bytes if max_bytes is None else max_bytes
        if cap is None or self._bytes <= cap:
            return {"evicted": 0, "bytes": 0}
        removed = freed = 0
        with self._flock(shared=False):
            with self._lock:
                held = self._held()
                # deepest first among equals: evicting a parent would orphan its children
                order = sorted((e for sp in self._spaces.values() for e in sp.entries()),
                               key=lambda e: ((e.ns, e.key) in held, e.last_used, -e.t0))
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

    def gc(self, ns: str | None = None, min_age_s: float = 60.0) -> dict[str, Any]:
        """Remove blocks and tails no manifest references (older than ``min_age_s``, so a
        block another process wrote moments before its manifest survives). A manifest
        whose first block and tail are both gone (evicted) restores nothing: removed too.

        A namespace with a manifest that cannot be read is left whole (listed in
        ``unreadable_manifests``, path -> reason): nothing it may reference is removed."""
        removed = freed = live_n = stale = 0
        held: dict[str, str] = {}
        with self._flock(shared=False):
            self._scan_locked()
            with self._lock:
                names = [ns] if ns is not None else list(self._spaces)
            now = time.time()
            for name in names:
                live: set[bytes] = set()
                with self._lock:
                    present = {e.key for e in self._spaces.get(name, EMPTY_SPACE).entries()}
                problems: dict[str, str] = {}
                mans = self.manifests(name, problems)
                if problems:
                    held.update(problems)
                    continue
                for m in mans:
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
                "manifests_removed": stale, "unreadable_manifests": held}

    def clear(self, ns: str) -> dict[str, Any]:
        """Remove everything of namespace ``ns`` that is ours: its manifests (damaged ones
        too), blocks, tails, checkpoints and learned files, then its folders once empty. Files that are
        not ours are left, and so is the folder holding them (``folder_removed`` False)."""
        check_namespace(ns)
        nsd = os.path.join(self.root, ns)
        mdir = os.path.join(nsd, MANIFEST_DIR)
        with self._flock(shared=False):
            self._scan_locked()
            mans = sum(self._unlink(de.path) for de in _real_entries(nsd, mdir)
                       if MAN_RE.match(de.name))
            with self._lock:
                dead = list(self._spaces.get(ns, EMPTY_SPACE).entries())
                for e in dead:
                    self._retire(e)
                self._c["gc_removed"] += len(dead)
                self._c["gc_bytes"] += sum(e.file_size for e in dead)
            self._remove_retired(dead)
            learned = self._clear_learned(nsd)
            if _is_real_dir(nsd):
                for sub in dio.scandir(nsd):  # only our own (empty) folders
                    if ((SHARD_RE.match(sub.name) or sub.name == MANIFEST_DIR)
                            and sub.is_dir(follow_symlinks=False)):
                        dio.quiet(os.rmdir, sub.path)
                dio.quiet(os.rmdir, nsd)
        return {"removed": len(dead), "bytes": sum(e.file_size for e in dead),
                "manifests_removed": mans, "learned_removed": learned,
                "folder_removed": not os.path.lexists(nsd)}

    def remove(self, ns: str, keys: Iterable[bytes]) -> dict[str, int]:
        """Remove the blocks, tails and checkpoints of ``ns`` with these keys (index and
        files, under the exclusive folder lock); keys not indexed are ignored."""
        check_namespace(ns)
        want = set(keys)
        with self._flock(shared=False):
            with self._lock:
                dead = [e for e in self._spaces.get(ns, EMPTY_SPACE).entries() if e.key in want]
                for e in dead:
                    self._retire(e)
            self._remove_retired(dead)
        return {"removed": len(dead), "bytes": sum(e.file_size for e in dead)}

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
                dio.atomic_write(self.root, path, fmt.encode_manifest(man), self.durable)
        except OSError as exc:
            raise self._write_failed(exc, "manifest") from exc
        except CacheFolderError as exc:
            raise self._folder_failed(exc, "manifest") from exc
        return man

    def get_manifest(self, ns: str, name: str) -> Manifest | None:
        """The manifest ``name`` of ``ns``; None if there is none or it cannot be read
        (``damaged_manifests`` says which and why)."""
        try:
            m = _read_manifest(self._manifest_path(ns, name))
        except (OSError, FormatError):
            return None
        return m if m.name == name and m.ns == ns else None

    def manifests(self, ns: str, errors: dict[str, str] | None = None) -> list[Manifest]:
        """The readable manifests of ``ns``; each one that cannot be read is noted in
        ``errors`` (printable path -> reason), none is removed."""
        nsd = os.path.join(self.root, check_namespace(ns))
        d = os.path.join(nsd, MANIFEST_DIR)
        out = []
        for de in _real_entries(nsd, d, errors):
            if not MAN_RE.match(de.name):
                continue
            try:
                m = _read_manifest(de.path)
                if m.ns != ns or self._manifest_path(ns, m.name) != de.path:
                    raise FormatError(f"manifest of {m.ns!r}/{m.name!r} stored under another name")
                out.append(m)
            except FileNotFoundError:
                continue
            except (OSError, FormatError) as exc:
                if errors is not None:
                    why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
                    errors[dio.printable(de.path)] = str(why)
        return out

    def damaged_manifests(self, ns: str) -> dict[str, str]:
        """Manifests of ``ns`` that cannot be read: printable path -> reason."""
        errors: dict[str, str] = {}
        self.manifests(ns, errors)
        return errors

    def delete_manifest(self, ns: str, name: str) -> bool:
        return self._unlink(self._manifest_path(ns, name))


def _is_real_dir(path: str) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _real_entries(nsd: str, d: str, errors: dict[str, str] | None = None) -> list[os.DirEntry]:
    """The entries of the folder ``d`` inside the namespace folder ``nsd``, both reached
    without a symlink; a symlink on the way is noted in ``errors``, never followed."""
    if not os.path.lexists(d):
        return []
    if not (_is_real_dir(nsd) and _is_real_dir(d)):
        if errors is not None:
            errors[dio.printable(d)] = "not a folder (a symlink is never followed)"
        return []
    return dio.scandir(d, errors)


def _read_manifest(path: str) -> Manifest:
    fd = dio.open_ro(path)
    try:
        size = os.fstat(fd).st_size
        if size > fmt.MAX_MANIFEST:
            raise FormatError(f"{size} bytes: larger than any manifest")
        data = os.pread(fd, size, 0)
    finally:
        os.close(fd)
    return fmt.decode_manifest(data)
