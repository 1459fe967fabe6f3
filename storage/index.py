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
from collections.abc import Sequence

import numpy.typing as npt

from mlxkv.storage import diskio
from mlxkv.storage.context import StoreContext
from mlxkv.storage.entries import (
    EMPTY_SPACE,
    MANIFEST_DIR,
    Entry,
    EntryFile,
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
from mlxkv.storage.format import KIND_BLOCK, KIND_TAIL, FormatError, Layout, UnknownVersion
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


class Index:
    """The in-memory index of a block store: its entries per namespace, the bytes they
    hold, the clock that orders their use, and the files being removed (see the module
    docstring). Every field is guarded by ``context.lock``."""

    def __init__(self, context: StoreContext) -> None:
        self.context = context
        self.lock = context.lock
        self.spaces: dict[str, Space] = {}
        self.nbytes = 0  # file bytes of every indexed entry
        self.clock = 0.0  # the latest use stamp handed out (``touch``)
        self.removing: set[str] = set()  # paths of retired entries whose files are being unlinked
        self.removals = 0  # bumped when a removal starts or ends (probes compare it)

    # ------------------------------------------------------------------ lookups
    def chain_keys(self, ns: str, tokens: npt.ArrayLike) -> list[bytes]:
        """Keys of every full block of ``tokens`` in ``ns``."""
        toks = token_ids(tokens)
        nsid = namespace_id(check_namespace(ns))
        block_len, parent, keys = self.context.block_tokens, ZERO_KEY, []
        for b in range(toks.size // block_len):
            parent = block_key(parent, nsid, toks[b * block_len : (b + 1) * block_len])
            keys.append(parent)
        return keys

    def lookup(self, ns: str, tokens: npt.ArrayLike, max_tokens: int | None = None,
               keys: Sequence[bytes] | None = None) -> Match:
        """Longest cached prefix of ``tokens`` (at most ``max_tokens``): the index, plus
        one probe of the disk for the first key it lacks (another process's write).
        ``keys``: ``chain_keys(ns, tokens)`` (or a prefix of them) when the caller already
        computed them: those blocks are not hashed again."""
        given = keys
        toks = token_ids(tokens)
        nsid = namespace_id(check_namespace(ns))
        limit = usable(toks, max_tokens)
        block_len = self.context.block_tokens
        nfull = limit // block_len
        found: list[bytes] = []
        parent, nbytes = ZERO_KEY, 0
        layout: Layout | None = None
        e: Entry | None = None
        while len(found) < nfull:
            with self.lock:  # held across the walk: one acquisition, not one per block
                blocks = self.spaces.get(ns, EMPTY_SPACE).blocks
                for b in range(len(found), nfull):
                    k = given[b] if given is not None and b < len(given) else \
                        block_key(parent, nsid, toks[b * block_len : (b + 1) * block_len])
                    if (e := blocks.get(k)) is None:
                        break
                    found.append(k)
                    nbytes += e.payload_len
                    parent = k
                    layout = layout or e.layout
            # the disk is probed outside the lock: a cold header read may take a while
            if e is not None or (e := self._probe(ns, nsid, k, KIND_BLOCK, parent)) is None:
                break
            found.append(k)
            nbytes += e.payload_len
            parent = k
            layout = layout or e.layout
        n = len(found) * block_len
        rest = toks[n:limit]
        best: Entry | None = None
        best_m = 0
        with self.lock:
            space = self.spaces.get(ns, EMPTY_SPACE)
            # A tail, or a full block the prompt ends inside (a state stored past this
            # prompt: its first rows serve the prompt up to its last token).
            for e in (*space.tails.get(parent, {}).values(),
                      *(space.kids.get(parent, {}).values() if rest.size else ())):
                m = common(e.tokens, rest)
                if m > best_m or (m == best_m and best is not None and m and
                                  e.kind == KIND_TAIL and best.kind != KIND_TAIL):
                    best, best_m = e, m
        if len(found) == nfull and 0 < rest.size and best_m < rest.size:
            # Another process's tail is found by its exact tokens only (its name hashes
            # them): a query that continues past it needs a scan() to see it. No block
            # probe failed on this path, so this is still one failed open per lookup.
            e = self._probe(ns, nsid, tail_key(parent, nsid, rest), KIND_TAIL, parent)
            if e is not None:
                best, best_m = e, rest.size
        if best is not None:
            nbytes += best.payload_len * best_m // (best.t1 - best.t0)
            return Match(ns, n + best_m, tuple(found), best.key, best_m, nbytes,
                         layout or best.layout)
        return Match(ns, n, tuple(found), None, 0, nbytes, layout)

    def longest_prefix(self, ns: str, tokens: npt.ArrayLike, max_tokens: int | None = None) -> int:
        return self.lookup(ns, tokens, max_tokens).n_tokens

    def lookup_checkpoint(self, ns: str, tokens: npt.ArrayLike, max_tokens: int | None = None,
                          keys: Sequence[bytes] | None = None) -> Match:
        """The longest checkpoint at an exact prefix of ``tokens`` (at most ``max_tokens``);
        Match.n_tokens == 0 when there is none. Index only. ``keys`` as for ``lookup``."""
        toks = token_ids(tokens)
        nsid = namespace_id(check_namespace(ns))
        limit = usable(toks, max_tokens)
        block_len, parent = self.context.block_tokens, ZERO_KEY
        best: Entry | None = None
        with self.lock:
            space = self.spaces.get(ns)
            if space is None or not space.ckpts:
                return Match(ns, 0, ())
            for b in range(limit // block_len + 1):
                for e in space.ckpts.get(parent, {}).values():
                    n = e.tokens.size
                    if b * block_len + n <= limit and (best is None or e.t1 > best.t1) and \
                            common(e.tokens, toks[b * block_len : b * block_len + n]) == n:
                        best = e
                if (b + 1) * block_len > limit:
                    break
                parent = keys[b] if keys is not None and b < len(keys) else \
                    block_key(parent, nsid, toks[b * block_len : (b + 1) * block_len])
        if best is None:
            return Match(ns, 0, ())
        return Match(ns, best.t1, (), None, 0, best.payload_len, best.layout, best.key)

    def latest_tokens(self, ns: str) -> int:
        """The end position of the state used (or written) last in ``ns``: the deepest
        of its most recently used entries (0 when the namespace is empty). What a reader
        sizes its destinations for before the first lookup."""
        with self.lock:
            space = self.spaces.get(ns)
            if space is None:
                return 0
            best = max(space.entries(), key=lambda e: (e.last_used, e.t1), default=None)
            return 0 if best is None else int(best.t1)

    def _probe(self, ns: str, nsid: bytes, key: bytes, kind: int, parent: bytes) -> Entry | None:
        """Index the file ``key`` maps to if it exists and its header verifies (one open;
        a missing file costs one failed open). A damaged file is removed, as scan() would;
        one that cannot be read (or is not a regular file) is a miss and stays."""
        path = self.path(ns, key, kind)
        with self.lock:
            removals = self.removals
        try:
            e = read_entry(path, ns, nsid, kind)
        except UnknownVersion as exc:
            with self.lock:
                self.context.skipped[diskio.printable(path)] = str(exc)
            return None
        except FormatError as exc:  # files are renamed into place whole: this is damage
            removed = self.context.unlink(path)
            if removed:
                log.warning("mlxkv cache: removed %s: %s", diskio.printable(path), exc)
            with self.lock:
                self.context.counters["bad_removed"] += removed
            return None
        except FileNotFoundError:  # the usual miss
            return None
        except OSError as exc:  # unreadable, or not a regular file: a miss, left alone
            self.context.leave(path, f"{exc.strerror or exc}")
            return None
        if e.parent != parent:
            return None  # a key collision would be needed to get here; never trust it
        e.last_used = e.mtime
        with self.lock:
            space = self.spaces.setdefault(ns, Space())
            cur = space.get(kind, key, parent)
            if cur is not None:  # our own writer indexed it meanwhile
                return cur
            # our evict/gc may have dropped this very file while we read it: never index
            # a file being removed (no removal can start while we hold the lock)
            if path in self.removing or (removals != self.removals and not os.path.exists(path)):
                return None
            self.add(space, e)
            self.context.counters["probed"] += 1
        return e

    # ------------------------------------------------------------------ index upkeep
    def path(self, ns: str, key: bytes, kind: int) -> str:
        hex_key = key.hex()
        return f"{self.context.root}{os.sep}{ns}{os.sep}{hex_key[:2]}{os.sep}{hex_key}{EXT[kind]}"  # on every probe

    def add(self, space: Space, e: Entry) -> None:
        old = space.get(e.kind, e.key, e.parent)
        if e.kind == KIND_BLOCK:
            space.blocks[e.key] = e
            space.kids.setdefault(e.parent, {})[e.key] = e
        else:
            space.side(e.kind).setdefault(e.parent, {})[e.key] = e
        self.nbytes += e.file_size - (old.file_size if old else 0)

    def drop(self, e: Entry) -> None:
        space = self.spaces.get(e.ns)
        if space is None or space.get(e.kind, e.key, e.parent) is not e:
            return
        self.nbytes -= e.file_size
        if e.kind == KIND_BLOCK:
            del space.blocks[e.key]
            kids = space.kids.get(e.parent)
            if kids is not None:
                kids.pop(e.key, None)
                if not kids:
                    del space.kids[e.parent]
            return
        side = space.side(e.kind)
        del side[e.parent][e.key]
        if not side[e.parent]:
            del side[e.parent]

    def retire(self, e: Entry) -> None:
        """Drop ``e`` before its file is removed (the caller holds ``lock``, then calls
        ``remove_retired``): until then a probe does not index the file again."""
        self.drop(e)
        self.removing.add(e.path)
        self.removals += 1

    def remove_retired(self, entries: Sequence[Entry]) -> None:
        """Unlink the files of retired entries (outside ``lock``: removals can be many)."""
        if not entries:
            return
        for e in entries:
            self.context.unlink(e.path)
        with self.lock:
            self.removing.difference_update(e.path for e in entries)
            self.removals += 1

    def touch(self, ns: str, keys: Sequence[bytes], child_key: bytes | None) -> None:
        """Mark a chain used; deeper entries get older stamps so they are evicted first."""
        space = self.spaces.get(ns)
        if space is None:
            return
        now = max(time.time(), self.clock)
        step = 1e-5  # well above float resolution at epoch scale (~4e-7 s)
        if child_key is not None:  # a tail's or a checkpoint's key (or a block used in part)
            e = space.find_child(child_key) or space.blocks.get(child_key)
            if e is not None:
                e.last_used = now
        for i, k in enumerate(reversed(keys)):
            e = space.blocks.get(k)
            if e is not None:
                e.last_used = now + (i + 1) * step
        self.clock = now + (len(keys) + 1) * step

    def entries_of(self, ns: str, m: Match) -> list[Entry | None]:
        """The index entries of a match (None where one was dropped since the lookup); the
        last one is its tail, or the full block the match ends inside."""
        with self.lock:
            space = self.spaces.get(ns, EMPTY_SPACE)
            out: list[Entry | None] = [space.blocks.get(k) for k in m.block_keys]
            if m.tail_key is not None and m.tail_tokens:
                parent = m.block_keys[-1] if m.block_keys else ZERO_KEY
                e = space.tails.get(parent, {}).get(m.tail_key)
                if e is None:
                    e = space.kids.get(parent, {}).get(m.tail_key)
                out.append(e)
        return out

    # ------------------------------------------------------------------ scan
    def scan(self) -> dict[str, float]:
        """Rebuild the index from the files' headers; remove temp orphans and bad files."""
        with self.context.folder_lock(shared=False):
            return self.scan_locked()

    def scan_locked(self) -> dict[str, float]:
        """``scan`` for a caller that holds the exclusive folder lock: counts per kind of
        what was found, added, dropped and removed, and the seconds it took."""
        t_start = time.perf_counter()
        report: dict[str, float] = {
            "blocks": 0, "tails": 0, "checkpoints": 0, "added": 0, "dropped": 0,
            "tmp_removed": 0, "bad_removed": 0, "skipped": 0, "foreign": 0, "unreadable": 0}
        with self.lock:
            known = {e.path: e for space in self.spaces.values() for e in space.entries()}
        todo, seen = self._walk(known, report)
        found = self._read_new(todo, report)
        self._merge(known, seen, found, report)
        report["seconds"] = time.perf_counter() - t_start
        return report

    def _walk(self, known: dict[str, Entry], report: dict[str, float]) -> tuple[list[EntryFile], set[str]]:
        """The folder's entry files: those the index does not know yet (to read), and the
        paths of all of them; temp files removed, anything not ours left and counted."""
        todo: list[EntryFile] = []
        seen: set[str] = set()
        unlistable: dict[str, str] = {}
        # only real folders (never a symlink) named as ours are entered: the marker, the
        # lock and anything else at the root are not looked at
        for ns_dir in diskio.scandir(self.context.root, unlistable):
            if not NS_RE.match(ns_dir.name) or ns_dir.name == MARKER or MARKER_TMP_RE.match(ns_dir.name):
                continue
            if not _real_dir(ns_dir):
                self.context.leave(ns_dir.path, "not a folder (a symlink is never followed)")
                report["foreign"] += 1
                continue
            ns, nsid = ns_dir.name, namespace_id(ns_dir.name)
            for sub in diskio.scandir(ns_dir.path, unlistable):
                manifests = sub.name == MANIFEST_DIR
                learned = sub.name == LEARNED_DIR
                if not (manifests or learned or SHARD_RE.match(sub.name)) or not _real_dir(sub):
                    self.context.leave(sub.path, "not a folder of the cache")
                    report["foreign"] += 1
                    continue
                names, temps = ((MAN_RE, MAN_TMP_RE) if manifests else
                                (LEARNED_RE, LEARNED_TMP_RE) if learned else (ENTRY_RE, ENTRY_TMP_RE))
                for dirent in diskio.scandir(sub.path, unlistable):
                    regular = _regular(dirent)
                    if regular and temps.match(dirent.name):  # a writer died before its rename
                        report["tmp_removed"] += self.context.unlink(dirent.path)
                        continue
                    if not regular or not names.match(dirent.name) or \
                            not (manifests or learned or dirent.name[:2] == sub.name):
                        self.context.leave(dirent.path, "not a cache file" if regular else
                                    "not a regular file")
                        report["foreign"] += 1
                        continue
                    if manifests or learned:  # read on demand (manifests(), gc, get_learned())
                        continue
                    seen.add(dirent.path)
                    kind = kind_of(dirent.name)  # never None: the name matched ENTRY_RE
                    if dirent.path not in known and kind is not None:
                        todo.append((dirent.path, ns, nsid, kind))
        for path, why in unlistable.items():
            self.context.leave(path, why)
            report["unreadable"] += 1
        return todo, seen

    def _read_new(self, todo: list[EntryFile], report: dict[str, float]) -> list[Entry]:
        """The entries of the files in ``todo`` that read whole; a damaged one removed, one
        of an unknown version or unreadable left in place, each counted."""
        found: list[Entry] = []
        for path, res in read_entries(todo):
            if isinstance(res, Entry):
                found.append(res)
            elif isinstance(res, UnknownVersion):
                self.context.skipped[diskio.printable(path)] = str(res)
                report["skipped"] += 1
            elif isinstance(res, FormatError):  # read whole and wrong: ours, and damaged
                if self.context.unlink(path):
                    log.warning("mlxkv cache: removed %s: %s", diskio.printable(path), res)
                    report["bad_removed"] += 1
            elif not isinstance(res, FileNotFoundError):  # never removed on a read error
                self.context.leave(path, f"{res.strerror or res}")
                report["unreadable"] += 1
        return found

    def _merge(self, known: dict[str, Entry], seen: set[str], found: list[Entry],
               report: dict[str, float]) -> None:
        """The index after a walk: entries whose files are gone dropped, the ``found`` ones
        added with their files' times as their last use, and the totals counted."""
        with self.lock:
            for e in known.values():
                if e.path not in seen:
                    self.drop(e)
                    report["dropped"] += 1
            # older files are less recently used; a parent is never older than its child
            found.sort(key=lambda e: e.mtime)
            for e in found:
                self.add(self.spaces.setdefault(e.ns, Space()), e)
                e.last_used = e.mtime
            for e in sorted(found, key=lambda e: -e.t0):
                p = self.spaces[e.ns].blocks.get(e.parent)
                if p is not None and p.last_used < e.last_used:
                    p.last_used = e.last_used
            self.clock = max([self.clock] + [e.last_used for e in found])
            report["added"] = len(found)
            for space in self.spaces.values():
                for what, n in space.counts().items():
                    report[what] += n
            self.context.counters["tmp_removed"] += int(report["tmp_removed"])
            self.context.counters["bad_removed"] += int(report["bad_removed"])


def _real_dir(dirent: os.DirEntry[str]) -> bool:
    try:
        return dirent.is_dir(follow_symlinks=False)
    except OSError:
        return False


def _regular(dirent: os.DirEntry[str]) -> bool:
    try:
        return dirent.is_file(follow_symlinks=False)
    except OSError:
        return False
