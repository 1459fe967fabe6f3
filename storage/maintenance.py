"""Upkeep of the block store: LRU eviction under a byte cap, garbage collection of what
no manifest references, and the manifests.

Writers hold the folder lock (``StoreContext.folder_lock``) shared; scan, evict and gc
hold it exclusively, so no file is removed while another process is between writing and
renaming it.
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
import time
from collections.abc import Callable, Iterable, Sequence

import numpy.typing as npt
import xxhash

from mlxkv.storage import diskio
from mlxkv.storage import format as fmt
from mlxkv.storage.context import StoreContext
from mlxkv.storage.entries import EMPTY_SPACE, MANIFEST_DIR
from mlxkv.storage.folder import MAN_RE, SHARD_RE
from mlxkv.storage.format import FormatError, Manifest
from mlxkv.storage.index import Index
from mlxkv.storage.keys import (
    ZERO_KEY,
    CacheFolderError,
    check_namespace,
    namespace_id,
    tail_key,
    token_ids,
)
from mlxkv.storage.learned import LearnedFiles


class Maintenance:
    """Eviction, GC, removals and manifests of a block store (see the module docstring).
    ``max_bytes`` is the byte cap ``evict()`` keeps to; ``retain_clock`` the clock that
    retention hints count from."""

    def __init__(self, context: StoreContext, index: Index, learned: LearnedFiles,
                 max_bytes: int | None) -> None:
        self.context = context
        self.index = index
        self.learned = learned
        self.max_bytes = max_bytes
        # (ns, key) -> until when (``retain_clock``) eviction keeps it over the others
        self.retained: dict[tuple[str, bytes], float] = {}
        self.retain_clock: Callable[[], float] = time.monotonic

    def retain(self, ns: str, keys: Iterable[bytes], ttl_s: float) -> None:
        """Evict the files of ``keys`` in ``ns`` (written or still to come) only after every
        other file, for ``ttl_s`` seconds from now (a retention hint; this process only)."""
        until = self.retain_clock() + float(ttl_s)
        with self.context.lock:
            for k in keys:
                if self.retained.get((ns, k), 0.0) < until:
                    self.retained[(ns, k)] = until

    def _held(self) -> set[tuple[str, bytes]]:
        """The (ns, key) pairs a retention hint holds now (expired ones forgotten)."""
        now = self.retain_clock()
        for k in [k for k, until in self.retained.items() if until <= now]:
            del self.retained[k]
        return set(self.retained)

    def evict(self, max_bytes: int | None = None) -> dict[str, int]:
        """Remove least-recently-used entries until the store holds <= max_bytes; files a
        retention hint holds (``retain``) go only after all others."""
        cap = self.max_bytes if max_bytes is None else max_bytes
        if cap is None or self.index.nbytes <= cap:
            return {"evicted": 0, "bytes": 0}
        removed = freed = 0
        with self.context.folder_lock(shared=False):
            with self.context.lock:
                held = self._held()
                # deepest first among equals: evicting a parent would orphan its children
                order = sorted((e for space in self.index.spaces.values() for e in space.entries()),
                               key=lambda e: ((e.ns, e.key) in held, e.last_used, -e.t0))
                victims = []
                for e in order:
                    if self.index.nbytes <= cap:
                        break
                    self.index.retire(e)
                    victims.append(e)
                    removed += 1
                    freed += e.file_size
                self.context.counters["evicted"] += removed
                self.context.counters["evicted_bytes"] += freed
            self.index.remove_retired(victims)
        return {"evicted": removed, "bytes": freed}

    def gc(self, ns: str | None = None, min_age_s: float = 60.0) -> dict[str, int | dict[str, str]]:
        """Remove blocks and tails no manifest references (older than ``min_age_s``, so a
        block another process wrote moments before its manifest survives). A manifest
        whose first block and tail are both gone (evicted) restores nothing: removed too.

        A namespace with a manifest that cannot be read is left whole (listed in
        ``unreadable_manifests``, path -> reason): nothing it may reference is removed."""
        removed = freed = live_n = stale = 0
        held: dict[str, str] = {}
        with self.context.folder_lock(shared=False):
            self.index.scan_locked()
            with self.context.lock:
                names = [ns] if ns is not None else list(self.index.spaces)
            now = time.time()
            for name in names:
                live: set[bytes] = set()
                with self.context.lock:
                    present = {e.key for e in self.index.spaces.get(name, EMPTY_SPACE).entries()}
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
                with self.context.lock:
                    dead = [e for e in self.index.spaces.get(name, EMPTY_SPACE).entries()
                            if e.key not in live and e.mtime <= now - min_age_s]
                    for e in dead:
                        self.index.retire(e)
                self.index.remove_retired(dead)
                removed += len(dead)
                freed += sum(e.file_size for e in dead)
            with self.context.lock:
                self.context.counters["gc_removed"] += removed
                self.context.counters["gc_bytes"] += freed
        return {"removed": removed, "bytes": freed, "live_keys": live_n,
                "manifests_removed": stale, "unreadable_manifests": held}

    def clear(self, ns: str) -> dict[str, int | bool]:
        """Remove everything of namespace ``ns`` that is ours: its manifests (damaged ones
        too), blocks, tails, checkpoints and learned files, then its folders once empty. Files that are
        not ours are left, and so is the folder holding them (``folder_removed`` False)."""
        check_namespace(ns)
        ns_dir = os.path.join(self.context.root, ns)
        mdir = os.path.join(ns_dir, MANIFEST_DIR)
        with self.context.folder_lock(shared=False):
            self.index.scan_locked()
            mans = sum(self.context.unlink(dirent.path) for dirent in _real_entries(ns_dir, mdir)
                       if MAN_RE.match(dirent.name))
            with self.context.lock:
                dead = list(self.index.spaces.get(ns, EMPTY_SPACE).entries())
                for e in dead:
                    self.index.retire(e)
                self.context.counters["gc_removed"] += len(dead)
                self.context.counters["gc_bytes"] += sum(e.file_size for e in dead)
            self.index.remove_retired(dead)
            learned = self.learned.clear_namespace(ns_dir)
            if _is_real_dir(ns_dir):
                for sub in diskio.scandir(ns_dir):  # only our own (empty) folders
                    if ((SHARD_RE.match(sub.name) or sub.name == MANIFEST_DIR)
                            and sub.is_dir(follow_symlinks=False)):
                        diskio.quiet(os.rmdir, sub.path)
                diskio.quiet(os.rmdir, ns_dir)
        return {"removed": len(dead), "bytes": sum(e.file_size for e in dead),
                "manifests_removed": mans, "learned_removed": learned,
                "folder_removed": not os.path.lexists(ns_dir)}

    def remove(self, ns: str, keys: Iterable[bytes]) -> dict[str, int]:
        """Remove the blocks, tails and checkpoints of ``ns`` with these keys (index and
        files, under the exclusive folder lock); keys not indexed are ignored."""
        check_namespace(ns)
        want = set(keys)
        with self.context.folder_lock(shared=False):
            with self.context.lock:
                dead = [e for e in self.index.spaces.get(ns, EMPTY_SPACE).entries() if e.key in want]
                for e in dead:
                    self.index.retire(e)
            self.index.remove_retired(dead)
        return {"removed": len(dead), "bytes": sum(e.file_size for e in dead)}

    # ------------------------------------------------------------------ manifests
    def manifest_path(self, ns: str, name: str) -> str:
        name_hash = xxhash.xxh3_64_hexdigest(name.encode())
        return os.path.join(self.context.root, check_namespace(ns), MANIFEST_DIR, f"{name_hash}.man")

    def put_manifest(self, ns: str, name: str, tokens: npt.ArrayLike,
                     extra_keys: Sequence[bytes] = ()) -> Manifest:
        """Name the state of ``tokens`` (its block keys and tail key) so GC keeps it."""
        if not isinstance(name, str) or not name:
            raise ValueError("manifest name must be a non-empty string")
        toks = token_ids(tokens)
        keys = self.index.chain_keys(ns, toks)
        block_len = self.context.block_tokens
        tail_child_key = None
        if toks.size % block_len:
            tail_child_key = tail_key(keys[-1] if keys else ZERO_KEY, namespace_id(ns), toks[len(keys) * block_len :])
        man = Manifest(name, ns, toks, tuple(keys), tail_child_key, time.time(), tuple(extra_keys))
        path = self.manifest_path(ns, name)
        try:
            with self.context.folder_lock(shared=True):
                diskio.atomic_write(self.context.root, path, fmt.encode_manifest(man), self.context.durable)
        except OSError as exc:
            raise self.context.write_failed(exc, "manifest") from exc
        except CacheFolderError as exc:
            raise self.context.folder_failed(exc, "manifest") from exc
        return man

    def get_manifest(self, ns: str, name: str) -> Manifest | None:
        """The manifest ``name`` of ``ns``; None if there is none or it cannot be read
        (``damaged_manifests`` says which and why)."""
        try:
            m = _read_manifest(self.manifest_path(ns, name))
        except (OSError, FormatError):
            return None
        return m if m.name == name and m.ns == ns else None

    def manifests(self, ns: str, errors: dict[str, str] | None = None) -> list[Manifest]:
        """The readable manifests of ``ns``; each one that cannot be read is noted in
        ``errors`` (printable path -> reason), none is removed."""
        ns_dir = os.path.join(self.context.root, check_namespace(ns))
        d = os.path.join(ns_dir, MANIFEST_DIR)
        out = []
        for dirent in _real_entries(ns_dir, d, errors):
            if not MAN_RE.match(dirent.name):
                continue
            try:
                m = _read_manifest(dirent.path)
                if m.ns != ns or self.manifest_path(ns, m.name) != dirent.path:
                    raise FormatError(f"manifest of {m.ns!r}/{m.name!r} stored under another name")
                out.append(m)
            except FileNotFoundError:
                continue
            except (OSError, FormatError) as exc:
                if errors is not None:
                    why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
                    errors[diskio.printable(dirent.path)] = str(why)
        return out

    def damaged_manifests(self, ns: str) -> dict[str, str]:
        """Manifests of ``ns`` that cannot be read: printable path -> reason."""
        errors: dict[str, str] = {}
        self.manifests(ns, errors)
        return errors

    def delete_manifest(self, ns: str, name: str) -> bool:
        return self.context.unlink(self.manifest_path(ns, name))


def _is_real_dir(path: str) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _real_entries(ns_dir: str, d: str, errors: dict[str, str] | None = None) -> list[os.DirEntry[str]]:
    """The entries of the folder ``d`` inside the namespace folder ``ns_dir``, both reached
    without a symlink; a symlink on the way is noted in ``errors``, never followed."""
    if not os.path.lexists(d):
        return []
    if not (_is_real_dir(ns_dir) and _is_real_dir(d)):
        if errors is not None:
            errors[diskio.printable(d)] = "not a folder (a symlink is never followed)"
        return []
    return diskio.scandir(d, errors)


def _read_manifest(path: str) -> Manifest:
    fd = diskio.open_ro(path)
    try:
        size = os.fstat(fd).st_size
        if size > fmt.MAX_MANIFEST:
            raise FormatError(f"{size} bytes: larger than any manifest")
        data = os.pread(fd, size, 0)
    finally:
        os.close(fd)
    return fmt.decode_manifest(data)
