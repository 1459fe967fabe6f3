"""The block store's in-memory index: prefix lookups over chain keys, its upkeep, and
the startup scan that rebuilds it from the files' headers.

Lookups walk the index; where the walk stops at a chain key it does not hold, one open()
of the path that key maps to tells whether another process wrote it since our scan (its
header is read and verified, and the entry indexed), so processes sharing a folder see
each other's blocks without a rescan at the cost of one failed open per lookup on a miss.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from mlxkv.storage import diskio as dio
from mlxkv.storage.entries import (
    EMPTY_SPACE,
    MANIFEST_DIR,
    Entry,
    Space,
    kind_of,
    read_entries,
    read_entry,
)
from mlxkv.storage.folder import (
    ENTRY_RE,
    ENTRY_TMP_RE,
    LEARNED_DIR,
    LEARNED_RE,
    LEARNED_TMP_RE,
    MAN_RE,
    MAN_TMP_RE,
    MARKER,
    MARKER_TMP_RE,
    SHARD_RE,
)
from mlxkv.storage.format import KIND_BLOCK, KIND_TAIL, FormatError, UnknownVersion
from mlxkv.storage.keys import (
    EXT,
    NS_RE,
    ZERO_KEY,
    Match,
    block_key,
    check_namespace,
    common,
    namespace_id,
    tail_key,
    token_ids,
    usable,
)

log = logging.getLogger("mlxkv.storage")


class IndexMixin:
    """Index state and lookups of :class:`storage.store.BlockStore` (which sets
    ``root``, ``block_tokens``, ``_lock``, ``_spaces``, ``_bytes``, ``_clock``, ``_c``,
    ``_skipped`` and provides ``_flock``, ``_unlink`` and ``_leave``)."""

    root: str
    block_tokens: int
    _spaces: dict[str, Space]
    _bytes: int
    _clock: float
    _c: dict[str, int]
    _skipped: dict[str, str]
    _removing: set[str]  # paths of retired entries whose files are being unlinked
    _removals: int  # bumped when a removal starts or ends (probes compare it)
    _unlink: Callable[[str], bool]
    _leave: Callable[[str, str], None]

    # ------------------------------------------------------------------ lookups
    def chain_keys(self, ns: str, tokens: Any) -> list[bytes]:
        """Keys of every full block of ``tokens`` in ``ns``."""
        toks = token_ids(tokens)
        nsid = namespace_id(check_namespace(ns))
        bt, parent, keys = self.block_tokens, ZERO_KEY, []
        for b in range(toks.size // bt):
            parent = block_key(parent, nsid, toks[b * bt : (b + 1) * bt])
            keys.append(parent)
        return keys

    def lookup(self, ns: str, tokens: Any, max_tokens: int | None = None,
               keys: Sequence[bytes] | None = None) -> Match:
        """Longest cached prefix of ``tokens`` (at most ``max_tokens``): the index, plus
        one probe of the disk for the first key it lacks (another process's write).
        ``keys``: ``chain_keys(ns, tokens)`` (or a prefix of them) when the caller already
        computed them: those blocks are not hashed again."""
        given = keys
        toks = token_ids(tokens)
        nsid = namespace_id(check_namespace(ns))
        limit = usable(toks, max_tokens)
        bt, nfull = self.block_tokens, limit // self.block_tokens
        keys: list[bytes] = []
        parent, nbytes, layout = ZERO_KEY, 0, None
        e: Entry | None = None
        while len(keys) < nfull:
            with self._lock:  # held across the walk: one acquisition, not one per block
                blocks = self._spaces.get(ns, EMPTY_SPACE).blocks
                for b in range(len(keys), nfull):
                    k = given[b] if given is not None and b < len(given) else \
                        block_key(parent, nsid, toks[b * bt : (b + 1) * bt])
                    if (e := blocks.get(k)) is None:
                        break
                    keys.append(k)
                    nbytes += e.payload_len
                    parent = k
                    layout = layout or e.layout
            # the disk is probed outside the lock: a cold header read may take a while
            if e is not None or (e := self._probe(ns, nsid, k, KIND_BLOCK, parent)) is None:
                break
            keys.append(k)
            nbytes += e.payload_len
            parent = k
            layout = layout or e.layout
        n = len(keys) * bt
        rest = toks[n:limit]
        best, best_m = None, 0
        with self._lock:
            space = self._spaces.get(ns, EMPTY_SPACE)
            # A tail, or a full block the prompt ends inside (a state stored past this
            # prompt: its first rows serve the prompt up to its last token).
            for e in (*space.tails.get(parent, {}).values(),
                      *(space.kids.get(parent, {}).values() if rest.size else ())):
                m = common(e.tokens, rest)
                if m > best_m or (m == best_m and best is not None and m and
                                  e.kind == KIND_TAIL and best.kind != KIND_TAIL):
                    best, best_m = e, m
        if len(keys) == nfull and 0 < rest.size and best_m < rest.size:
            # Another process's tail is found by its exact tokens only (its name hashes
            # them): a query that continues past it needs a scan() to see it. No block
            # probe failed on this path, so this is still one failed open per lookup.
            e = self._probe(ns, nsid, tail_key(parent, nsid, rest), KIND_TAIL, parent)
            if e is not None:
                best, best_m = e, rest.size
        if best is not None:
            nbytes += best.payload_len * best_m // (best.t1 - best.t0)
            return Match(ns, n + best_m, tuple(keys), best.key, best_m, nbytes,
                         layout or best.layout)
        return Match(ns, n, tuple(keys), None, 0, nbytes, layout)

    def longest_prefix(self, ns: str, tokens: Any, max_tokens: int | None = None) -> int:
        return self.lookup(ns, tokens, max_tokens).n_tokens

    def lookup_checkpoint(self, ns: str, tokens: Any, max_tokens: int | None = None,
                          keys: Sequence[bytes] | None = None) -> Match:
        """The longest checkpoint at an exact prefix of ``tokens`` (at most ``max_tokens``);
        Match.n_tokens == 0 when there is none. Index only. ``keys`` as for ``lookup``."""
        toks = token_ids(tokens)
        nsid = namespace_id(check_namespace(ns))
        limit = usable(toks, max_tokens)
        bt, parent = self.block_tokens, ZERO_KEY
        best: Entry | None = None
        with self._lock:
            space = self._spaces.get(ns)
            if space is None or not space.ckpts:
                return Match(ns, 0, ())
            for b in range(limit // bt + 1):
                for e in space.ckpts.get(parent, {}).values():
                    n = e.tokens.size
                    if b * bt + n <= limit and (best is None or e.t1 > best.t1) and \
                            common(e.tokens, toks[b * bt : b * bt + n]) == n:
                        best = e
                if (b + 1) * bt > limit:
                    break
                parent = keys[b] if keys is not None and b < len(keys) else \
                    block_key(parent, nsid, toks[b * bt : (b + 1) * bt])
        if best is None:
            return Match(ns, 0, ())
        return Match(ns, best.t1, (), None, 0, best.payload_len, best.layout, best.key)

    def latest_tokens(self, ns: str) -> int:
        """The end position of the state used (or written) last in ``ns``: the deepest
        of its most recently used entries (0 when the namespace is empty). What a reader
        sizes its destinations for before the first lookup."""
        with self._lock:
            sp = self._spaces.get(ns)
            if sp is None:
                return 0
            best = max(sp.entries(), key=lambda e: (e.last_used, e.t1), default=None)
            return 0 if best is None else int(best.t1)

    def _probe(self, ns: str, nsid: bytes, key: bytes, kind: int, parent: bytes) -> Entry | None:
        """Index the file ``key`` maps to if it exists and its header verifies (one open;
        a missing file costs one failed open). A damaged file is removed, as scan() would;
        one that cannot be read (or is not a regular file) is a miss and stays."""
        path = self._path(ns, key, kind)
        with self._lock:
            removals = self._removals
        try:
            e = read_entry(path, ns, nsid, kind)
        except UnknownVersion as exc:
            with self._lock:
                self._skipped[dio.printable(path)] = str(exc)
            return None
        except FormatError as exc:  # files are renamed into place whole: this is damage
            removed = self._unlink(path)
            if removed:
                log.warning("mlxkv cache: removed %s: %s", dio.printable(path), exc)
            with self._lock:
                self._c["bad_removed"] += removed
            return None
        except FileNotFoundError:  # the usual miss
            return None
        except OSError as exc:  # unreadable, or not a regular file: a miss, left alone
            self._leave(path, f"{exc.strerror or exc}")
            return None
        if e.parent != parent:
            return None  # a key collision would be needed to get here; never trust it
        e.last_used = e.mtime
        with self._lock:
            sp = self._spaces.setdefault(ns, Space())
            cur = sp.get(kind, key, parent)
            if cur is not None:  # our own writer indexed it meanwhile
                return cur
            # our evict/gc may have dropped this very file while we read it: never index
            # a file being removed (no removal can start while we hold the lock)
            if path in self._removing or (removals != self._removals and not os.path.exists(path)):
                return None
            self._add(sp, e)
            self._c["probed"] += 1
        return e

    # ------------------------------------------------------------------ index upkeep
    def _path(self, ns: str, key: bytes, kind: int) -> str:
        h = key.hex()
        return f"{self.root}{os.sep}{ns}{os.sep}{h[:2]}{os.sep}{h}{EXT[kind]}"  # on every probe

    def _add(self, sp: Space, e: Entry) -> None:
        old = sp.get(e.kind, e.key, e.parent)
        if e.kind == KIND_BLOCK:
            sp.blocks[e.key] = e
            sp.kids.setdefault(e.parent, {})[e.key] = e
        else:
            sp.side(e.kind).setdefault(e.parent, {})[e.key] = e
        self._bytes += e.file_size - (old.file_size if old else 0)

    def _drop(self, e: Entry) -> None:
        sp = self._spaces.get(e.ns)
        if sp is None or sp.get(e.kind, e.key, e.parent) is not e:
            return
        self._bytes -= e.file_size
        if e.kind == KIND_BLOCK:
            del sp.blocks[e.key]
            kids = sp.kids.get(e.parent)
            if kids is not None:
                kids.pop(e.key, None)
                if not kids:
                    del sp.kids[e.parent]
            return
        side = sp.side(e.kind)
        del side[e.parent][e.key]
        if not side[e.parent]:
            del side[e.parent]

    def _retire(self, e: Entry) -> None:
        """Drop ``e`` before its file is removed (the caller holds ``_lock``, then calls
        ``_remove_retired``): until then a probe does not index the file again."""
        self._drop(e)
        self._removing.add(e.path)
        self._removals += 1

    def _remove_retired(self, entries: Sequence[Entry]) -> None:
        """Unlink the files of retired entries (outside ``_lock``: removals can be many)."""
        if not entries:
            return
        for e in entries:
            self._unlink(e.path)
        with self._lock:
            self._removing.difference_update(e.path for e in entries)
            self._removals += 1

    def _touch(self, ns: str, keys: Sequence[bytes], child_key: bytes | None) -> None:
        """Mark a chain used; deeper entries get older stamps so they are evicted first."""
        sp = self._spaces.get(ns)
        if sp is None:
            return
        now = max(time.time(), self._clock)
        step = 1e-5  # well above float resolution at epoch scale (~4e-7 s)
        if child_key is not None:  # a tail's or a checkpoint's key (or a block used in part)
            e = sp.find_child(child_key) or sp.blocks.get(child_key)
            if e is not None:
                e.last_used = now
        for i, k in enumerate(reversed(keys)):
            e = sp.blocks.get(k)
            if e is not None:
                e.last_used = now + (i + 1) * step
        self._clock = now + (len(keys) + 1) * step

    def _entries(self, ns: str, m: Match) -> list[Entry | None]:
        """The index entries of a match (None where one was dropped since the lookup); the
        last one is its tail, or the full block the match ends inside."""
        with self._lock:
            space = self._spaces.get(ns, EMPTY_SPACE)
            out: list[Entry | None] = [space.blocks.get(k) for k in m.block_keys]
            if m.tail_key is not None and m.tail_tokens:
                parent = m.block_keys[-1] if m.block_keys else ZERO_KEY
                e = space.tails.get(parent, {}).get(m.tail_key)
                if e is None:
                    e = space.kids.get(parent, {}).get(m.tail_key)
                out.append(e)
        return out

    # ------------------------------------------------------------------ scan
    def scan(self) -> dict[str, Any]:
        """Rebuild the index from the files' headers; remove temp orphans and bad files."""
        with self._flock(shared=False):
            return self._scan_locked()

    def _scan_locked(self) -> dict[str, Any]:
        t_start = time.perf_counter()
        rep = {"blocks": 0, "tails": 0, "checkpoints": 0, "added": 0, "dropped": 0,
               "tmp_removed": 0, "bad_removed": 0, "skipped": 0, "foreign": 0, "unreadable": 0}
        todo: list[tuple[str, str, bytes, int]] = []
        seen: set[str] = set()
        unlistable: dict[str, str] = {}
        with self._lock:
            known = {e.path: e for sp in self._spaces.values() for e in sp.entries()}
        # only real folders (never a symlink) named as ours are entered: the marker, the
        # lock and anything else at the root are not looked at
        for nsd in dio.scandir(self.root, unlistable):
            if not NS_RE.match(nsd.name) or nsd.name == MARKER or MARKER_TMP_RE.match(nsd.name):
                continue
            if not _real_dir(nsd):
                self._leave(nsd.path, "not a folder (a symlink is never followed)")
                rep["foreign"] += 1
                continue
            ns, nsid = nsd.name, namespace_id(nsd.name)
            for sub in dio.scandir(nsd.path, unlistable):
                manifests = sub.name == MANIFEST_DIR
                learned = sub.name == LEARNED_DIR
                if not (manifests or learned or SHARD_RE.match(sub.name)) or not _real_dir(sub):
                    self._leave(sub.path, "not a folder of the cache")
                    rep["foreign"] += 1
                    continue
                names, temps = ((MAN_RE, MAN_TMP_RE) if manifests else
                                (LEARNED_RE, LEARNED_TMP_RE) if learned else (ENTRY_RE, ENTRY_TMP_RE))
                for de in dio.scandir(sub.path, unlistable):
                    regular = _regular(de)
                    if regular and temps.match(de.name):  # a writer died before its rename
                        rep["tmp_removed"] += self._unlink(de.path)
                        continue
                    if not regular or not names.match(de.name) or \
                            not (manifests or learned or de.name[:2] == sub.name):
                        self._leave(de.path, "not a cache file" if regular else
                                    "not a regular file")
                        rep["foreign"] += 1
                        continue
                    if manifests or learned:  # read on demand (manifests(), gc, get_learned())
                        continue
                    seen.add(de.path)
                    if de.path not in known:
                        todo.append((de.path, ns, nsid, kind_of(de.name)))
        for path, why in unlistable.items():
            self._leave(path, why)
            rep["unreadable"] += 1
        found: list[Entry] = []
        for path, res in read_entries(todo):
            if isinstance(res, Entry):
                found.append(res)
            elif isinstance(res, UnknownVersion):
                self._skipped[dio.printable(path)] = str(res)
                rep["skipped"] += 1
            elif isinstance(res, FormatError):  # read whole and wrong: ours, and damaged
                if self._unlink(path):
                    log.warning("mlxkv cache: removed %s: %s", dio.printable(path), res)
                    rep["bad_removed"] += 1
            elif not isinstance(res, FileNotFoundError):  # never removed on a read error
                self._leave(path, f"{res.strerror or res}")
                rep["unreadable"] += 1
        with self._lock:
            for e in known.values():
                if e.path not in seen:
                    self._drop(e)
                    rep["dropped"] += 1
            # older files are less recently used; a parent is never older than its child
            found.sort(key=lambda e: e.mtime)
            for e in found:
                self._add(self._spaces.setdefault(e.ns, Space()), e)
                e.last_used = e.mtime
            for e in sorted(found, key=lambda e: -e.t0):
                p = self._spaces[e.ns].blocks.get(e.parent)
                if p is not None and p.last_used < e.last_used:
                    p.last_used = e.last_used
            self._clock = max([self._clock] + [e.last_used for e in found])
            rep["added"] = len(found)
            for sp in self._spaces.values():
                for what, n in sp.counts().items():
                    rep[what] += n
            self._c["tmp_removed"] += rep["tmp_removed"]
            self._c["bad_removed"] += rep["bad_removed"]
        rep["seconds"] = time.perf_counter() - t_start
        return rep


def _real_dir(de: os.DirEntry) -> bool:
    try:
        return de.is_dir(follow_symlinks=False)
    except OSError:
        return False


def _regular(de: os.DirEntry) -> bool:
    try:
        return de.is_file(follow_symlinks=False)
    except OSError:
        return False
