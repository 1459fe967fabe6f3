"""The RAM tier of the prefix cache: a byte-capped LRU of conversation states.

Block caches (only ``KVCache`` / ``QuantizedKVCache`` layers) are indexed by hash-chained
token blocks, so conversations that share a prefix share its arrays: a stored entry keeps
the engine's own buffers when nothing of it is cached yet (no copy) and copies only its new
rows when a prefix is already held. Any cached prefix can be lent, trimmed to the longest
common prefix, down to a single token.

Other caches (rotating windows, SSM state) are kept as whole checkpoints at the exact
positions they were stored, and are lent only there.

Keys are the block store's chain keys (``engine.cache.tokens``), so a RAM block and the
SSD file holding the same tokens share a key; namespaces here are store namespaces, and
the facade hashes a prompt once per lookup and hands the keys in.

Everything here runs on the engine thread; nothing blocks.
"""

from __future__ import annotations

import functools
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from mlxkv.engine.cache import kvblocks
from mlxkv.engine.cache.tokens import (
    ZERO_KEY,
    chain_keys,
    common_prefix,
    entry_id,
    index_root,
    tail_key_of,
)


@dataclass(eq=False)
class Slab:
    """Arrays holding the rows of tokens [t0, t0 + ntokens) of one stored cache."""

    arrays: list[list[mx.array]]  # per layer, token axis 2; row 0 is token t0
    specs: tuple[kvblocks.LayerSpec, ...]  # per layer
    t0: int
    ntokens: int
    nbytes: int
    refs: int = 0


@dataclass(eq=False)
class Run:
    """A full block or a tail: tokens [t0, t0 + len(tokens)) chained under ``parent``."""

    key: bytes
    parent: bytes
    tokens: np.ndarray
    t0: int
    slab: Slab
    row0: int
    owner: RamEntry | None = None  # the entry that stored it (for LRU touches)
    refs: int = 0
    nbytes: int = 0  # bytes of its token rows (its share of the slab, headroom excluded)


@dataclass(eq=False)
class RamEntry:
    """One stored conversation state: its exact tokens and where they live."""

    ns: str
    tokens: np.ndarray
    specs: tuple[kvblocks.LayerSpec, ...]  # per layer (block caches) or () for checkpoints
    runs: list[Run] = field(default_factory=list)
    checkpoint: kvblocks.Checkpoint | None = None
    parent: bytes = ZERO_KEY  # index parent of the checkpoint (last full block or root)
    session: str | None = None
    pinned: bool = False  # kept over others and never handed over or superseded
    # A retention hint (a request's cache_control / prompt_cache_key): until this time of
    # the tier's clock it is evicted only after every entry without one, and never
    # superseded; then it is an entry like any other. 0: none.
    retained_until: float = 0.0
    nbytes: int = 0  # checkpoint bytes (block entries account through slabs)
    logical: int = 0  # bytes this entry would take alone (for the dedup ratio)
    created: float = field(default_factory=time.time)

    @property
    def key(self) -> tuple[str, bytes]:
        return (self.ns, self.tokens.tobytes())

    @property
    def id(self) -> str:
        return entry_id(self.ns, self.tokens)


@dataclass
class RamHit:
    """A RAM hit of ``n`` tokens; ``lend()`` builds the borrower's cache (only if used)."""

    n: int
    lend: Callable[[], kvblocks.PromptCache | None] = lambda: None
    entry: RamEntry | None = None
    moved: bool = False  # lend() hands the entry's own buffers over and forgets the entry


class RamTier:
    """Byte-capped LRU of entries with a shared block index (see module docstring)."""

    def __init__(self, max_bytes: int, block_tokens: int,
                 on_evict: Callable[[RamEntry, bool, RamEntry | None], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if block_tokens <= 0:
            raise ValueError(f"block_tokens must be > 0, got {block_tokens}")
        self.max_bytes = int(max_bytes)
        self.block_tokens = int(block_tokens)
        self.on_evict = on_evict
        self.clock = clock  # what retention hints are measured against
        self.entries: OrderedDict[tuple[str, bytes], RamEntry] = OrderedDict()
        self.runs: dict[bytes, Run] = {}
        # parent key -> first token -> runs (full blocks and tails) under it
        self.children: dict[bytes, dict[int, list[Run]]] = {}
        self.checkpoints: dict[bytes, list[RamEntry]] = {}  # parent key -> checkpoint entries
        self.pinned: dict[str, RamEntry] = {}  # session id -> its latest entry
        self.slab_bytes = 0  # buffers held, headroom past the last token included
        self.row_bytes = 0  # token rows of the indexed runs, each counted once
        self.checkpoint_bytes = 0
        self.logical_bytes = 0  # token bytes the entries would take without sharing
        self.moves = 0  # entries handed over to the request that continued them

    # ------------------------------------------------------------------ accounting
    @property
    def nbytes(self) -> int:
        return self.slab_bytes + self.checkpoint_bytes

    @property
    def token_bytes(self) -> int:
        """Bytes of the tokens held (shared rows once; no buffer headroom): what the
        entries' ``logical`` bytes compare to in the dedup ratio."""
        return self.row_bytes + self.checkpoint_bytes

    def bytes_by_namespace(self) -> dict[str, int]:
        """Token bytes held per store namespace (shared rows once, as ``token_bytes``)."""
        out: dict[str, int] = {}
        seen: set[int] = set()
        for e in list(self.entries.values()):
            n = e.nbytes if e.checkpoint is not None else 0
            for run in e.runs:
                if id(run) not in seen:
                    seen.add(id(run))
                    n += run.nbytes
            out[e.ns] = out.get(e.ns, 0) + n
        return out

    def __len__(self) -> int:
        return len(self.entries)

    def _ref_run(self, run: Run) -> None:
        run.refs += 1
        if run.refs == 1:
            self.row_bytes += run.nbytes
            run.slab.refs += 1
            if run.slab.refs == 1:
                self.slab_bytes += run.slab.nbytes

    def _unref_run(self, run: Run) -> None:
        run.refs -= 1
        if run.refs > 0:
            return
        self.row_bytes -= run.nbytes
        if self.runs.get(run.key) is run:
            del self.runs[run.key]
        kids = self.children.get(run.parent)
        if kids is not None:
            lst = kids.get(int(run.tokens[0]), [])
            if run in lst:
                lst.remove(run)
                if not lst:
                    del kids[int(run.tokens[0])]
            if not kids:
                del self.children[run.parent]
        run.slab.refs -= 1
        if run.slab.refs == 0:
            self.slab_bytes -= run.slab.nbytes
            run.slab.arrays = []  # drop the buffers now

    def _add_run(self, run: Run) -> Run:
        """Index ``run`` (or return the equal one already indexed)."""
        have = self.runs.get(run.key)
        if have is not None:
            return have
        self.runs[run.key] = run
        self.children.setdefault(run.parent, {}).setdefault(int(run.tokens[0]), []).append(run)
        return run

    # ------------------------------------------------------------------ store
    def store(self, ns: str, tokens: np.ndarray, cache: kvblocks.PromptCache,
              session: str | None = None,
              keys: list[bytes] | None = None, pinned: bool = False,
              retain_until: float = 0.0) -> RamEntry | None:
        """Keep ``cache`` (holding exactly ``tokens``) and return its entry (None if empty
        or evicted at once). ``keys``: ``chain_keys(ns, tokens)`` when already computed.
        ``retain_until``: a retention hint's end (the tier's clock; 0: none)."""
        n = len(tokens)
        if n == 0:
            return None
        key = (ns, tokens.tobytes())
        have = self.entries.get(key)
        if have is not None:
            self.entries.move_to_end(key)
            self._set_session(have, session)
            have.pinned = have.pinned or pinned
            have.retained_until = max(have.retained_until, retain_until)
            return have
        if keys is None:
            keys = chain_keys(ns, tokens, self.block_tokens)
        if kvblocks.is_block_cache(cache):
            entry = self._store_blocks(ns, tokens, cache, keys)
        else:
            entry = self._store_checkpoint(ns, tokens, cache, keys)
        entry.pinned = pinned
        entry.retained_until = retain_until
        self.entries[key] = entry
        self._set_session(entry, session)
        for other in self._prefixes_of(entry):
            self._drop(other, evicted=False, superseded_by=entry)
        self.evict()
        return entry if key in self.entries else None

    def _store_blocks(self, ns: str, tokens: np.ndarray, cache: kvblocks.PromptCache,
                      keys: list[bytes]
                      ) -> RamEntry:
        n, block_tokens = len(tokens), self.block_tokens
        specs = tuple(kvblocks.layer_spec(c) for c in cache)
        arrays = [kvblocks.layer_arrays(c) for c in cache]
        for i, c in enumerate(cache):
            if int(c.offset) != n:
                raise ValueError(f"layer {i} holds {c.offset} tokens but {n} tokens were given")
        k = 0
        while k < len(keys) and keys[k] in self.runs:
            k += 1
        start = k * block_tokens
        entry = RamEntry(ns, tokens, specs)
        runs = [self.runs[keys[i]] for i in range(k)]
        if start < n:
            if start == 0 or start * 2 < n:
                # Most of it is new: keep the engine's buffers as they are (no copy).
                slab_arrays = [[kvblocks.fresh(a) for a in layer] for layer in arrays]
                row_base, slab_t0 = 0, 0
            else:
                # Most of it is shared: copy only the new rows so the rest can be freed.
                slab_arrays = kvblocks.compact(arrays, start, n)
                row_base, slab_t0 = start, start
            mx.eval([a for layer in slab_arrays for a in layer])
            slab = Slab(slab_arrays, specs, slab_t0, n - slab_t0,
                        kvblocks.arrays_nbytes(slab_arrays))
            row = self._bytes_per_token(slab_arrays)
            parent = keys[k - 1] if k else index_root(ns)
            for i in range(k, n // block_tokens + (1 if n % block_tokens else 0)):
                t0, t1 = i * block_tokens, min((i + 1) * block_tokens, n)
                if t1 - t0 == block_tokens:
                    rk = keys[i]
                else:
                    rk = tail_key_of(ns, keys[i - 1] if i else ZERO_KEY, tokens[t0:t1])
                run = self._add_run(Run(rk, parent, tokens[t0:t1], t0, slab, t0 - row_base, entry,
                                        nbytes=(t1 - t0) * row))
                runs.append(run)
                parent = rk
        for r in runs:
            self._ref_run(r)
        entry.runs = runs
        entry.logical = self._bytes_per_token(arrays) * n
        self.logical_bytes += entry.logical
        return entry

    @staticmethod
    def _bytes_per_token(arrays: list[list[mx.array]]) -> int:
        return sum(a.nbytes // max(1, a.shape[2]) for layer in arrays for a in layer)

    def _prefixes_of(self, entry: RamEntry) -> list[RamEntry]:
        """Unpinned block entries whose tokens ``entry`` extends (reachable through it)."""
        out = []
        n = len(entry.tokens)
        for e in self.entries.values():
            if (e is not entry and e.ns == entry.ns and e.checkpoint is None
                    and entry.checkpoint is None and len(e.tokens) < n
                    and not self._is_pinned(e) and not self.retained(e)
                    and np.array_equal(e.tokens, entry.tokens[: len(e.tokens)])):
                out.append(e)
        return out

    def _is_pinned(self, e: RamEntry) -> bool:
        return e.pinned or (e.session is not None and self.pinned.get(e.session) is e)

    def retained(self, e: RamEntry) -> bool:
        """Whether ``e``'s retention hint still holds."""
        return e.retained_until > 0.0 and e.retained_until > self.clock()

    def _keep_rank(self, e: RamEntry) -> int:
        """Eviction order: entries of a lower rank go first (LRU within a rank): plain
        ones, then those a retention hint holds, then pinned ones."""
        if self._is_pinned(e):
            return 2
        return 1 if self.retained(e) else 0

    def _store_checkpoint(self, ns: str, tokens: np.ndarray, cache: kvblocks.PromptCache,
                          keys: list[bytes]
                          ) -> RamEntry:
        n = kvblocks.cache_tokens(cache)
        if n is not None and n != len(tokens):
            raise ValueError(f"cache holds {n} tokens but {len(tokens)} tokens were given")
        checkpoint = kvblocks.take_checkpoint(cache)
        parent = keys[-1] if keys else index_root(ns)
        entry = RamEntry(ns, tokens, (), checkpoint=checkpoint, parent=parent,
                         nbytes=checkpoint.nbytes, logical=checkpoint.nbytes)
        self.checkpoints.setdefault(parent, []).append(entry)
        self.checkpoint_bytes += checkpoint.nbytes
        self.logical_bytes += checkpoint.nbytes
        return entry

    # ------------------------------------------------------------------ lookup
    def lookup(self, ns: str, tokens: np.ndarray, session: str | None = None,
               keys: list[bytes] | None = None) -> RamHit:
        """Longest usable prefix (at most len(tokens) - 1), lent as a new cache.
        ``keys``: ``chain_keys(ns, tokens)`` when already computed."""
        limit = len(tokens) - 1
        if limit <= 0 or not self.entries:
            return RamHit(0)
        if keys is None:
            keys = chain_keys(ns, tokens, self.block_tokens)
        best = self._lookup_blocks(ns, tokens, keys, limit, session)
        checkpoint = self._lookup_checkpoint(ns, tokens, keys, limit)
        if checkpoint is not None and checkpoint.n > best.n:
            best = checkpoint
        if best.entry is not None:
            self.entries.move_to_end(best.entry.key)
        return best

    def _lookup_blocks(self, ns: str, tokens: np.ndarray, keys: list[bytes], limit: int,
                       session: str | None) -> RamHit:
        block_tokens = self.block_tokens
        m = 0
        while m < len(keys) and keys[m] in self.runs:
            m += 1
        pieces: list[Run] = [self.runs[keys[i]] for i in range(m)]
        n = m * block_tokens
        parent = keys[m - 1] if m else index_root(ns)
        if m * block_tokens < len(tokens):
            cands = self.children.get(parent, {}).get(int(tokens[m * block_tokens]), [])
            best_c, best_run = 0, None
            prev_slab = pieces[-1].slab if pieces else None
            for run in cands:
                c = common_prefix(run.tokens, tokens[m * block_tokens :])
                # Ties go to the run in the same slab as the prefix (a view, no copy).
                if c > best_c or (c == best_c and best_run is not None
                                  and run.slab is prev_slab and best_run.slab is not prev_slab):
                    best_c, best_run = c, run
            if best_run is not None:
                pieces.append(best_run)
                n += best_c
        n = min(n, limit)
        if n <= 0:
            return RamHit(0)
        owner = pieces[-1].owner
        if owner is not None and self.entries.get(owner.key) is not owner:
            owner = None
        pinned = self.pinned.get(session) if session else None
        if (pinned is not None and pinned.ns == ns and pinned.checkpoint is None
                and common_prefix(pinned.tokens, tokens) >= n):
            pieces, owner = list(pinned.runs), pinned
        total = len(tokens)
        if owner is not None and self._movable(owner, pieces, n, total, session):
            moving = owner
            return RamHit(n, lambda: self._move(moving, n), owner, moved=True)
        return RamHit(n, lambda: self._lend_runs(pieces, n, total), owner)

    def _movable(self, entry: RamEntry | None, pieces: list[Run], n: int, total: int,
                 session: str | None) -> bool:
        """Whether ``entry`` can be handed over instead of lent: the request continues it
        exactly, nothing else shares its buffers, and they have room for the new tokens."""
        if entry is None or entry.checkpoint is not None or len(entry.tokens) != n \
                or entry.pinned:
            return False
        if len(pieces) != len(entry.runs) or any(a is not b for a, b in zip(pieces, entry.runs)):
            return False
        slab = entry.runs[0].slab
        if slab.t0 != 0 or slab.refs != len(entry.runs):
            return False
        if any(r.slab is not slab or r.refs != 1 for r in entry.runs):
            return False
        if any(a.shape[2] < total for layer in slab.arrays for a in layer):
            return False  # the prefill reallocates anyway: keep the entry for others
        return not (self._is_pinned(entry) and entry.session != session)

    def _move(self, entry: RamEntry, n: int) -> kvblocks.PromptCache:
        """Hand the entry's buffers to the borrower and forget the entry: the borrower then
        writes its new tokens in place (MLX donates a buffer nobody else holds) instead of
        copying the whole conversation, and its ``store`` brings the state back. A buffer
        still pinned elsewhere (e.g. by a pending SSD write) is copied on write, as ever."""
        slab = entry.runs[0].slab
        arrays = [[kvblocks.fresh(a) for a in layer] for layer in slab.arrays]
        specs = slab.specs
        self._drop(entry, evicted=False)
        self.moves += 1
        return [kvblocks.make_layer(spec, layer, n) for spec, layer in zip(specs, arrays)]

    def _lend_runs(self, runs: list[Run], n: int, total_hint: int) -> kvblocks.PromptCache:
        spans: list[tuple[list[list[mx.array]], int, int]] = []
        specs = runs[0].slab.specs
        left = n
        for run in runs:
            if left <= 0:
                break
            take = min(len(run.tokens), left)
            if spans and spans[-1][0] is run.slab.arrays and spans[-1][1] + spans[-1][2] == run.row0:
                arrays, r0, cnt = spans[-1]
                spans[-1] = (arrays, r0, cnt + take)
            else:
                spans.append((run.slab.arrays, run.row0, take))
            left -= take
        arrays = kvblocks.assemble(spans, total_hint)
        cache = [kvblocks.make_layer(spec, layer, n) for spec, layer in zip(specs, arrays)]
        return cache

    def _lookup_checkpoint(self, ns: str, tokens: np.ndarray, keys: list[bytes], limit: int
                           ) -> RamHit | None:
        if not self.checkpoints:
            return None
        block_tokens, root = self.block_tokens, index_root(ns)
        for d in range(min(len(keys), limit // block_tokens), -1, -1):
            parent = keys[d - 1] if d else root
            best: RamEntry | None = None
            for e in self.checkpoints.get(parent, ()):
                L = len(e.tokens)
                if L <= limit and (best is None or L > len(best.tokens)) and \
                        np.array_equal(e.tokens[d * block_tokens :], tokens[d * block_tokens : L]):
                    best = e
            if best is not None and best.checkpoint is not None:
                return RamHit(len(best.tokens), functools.partial(kvblocks.lend_checkpoint,
                                                                  best.checkpoint), best)
        return None

    # ------------------------------------------------------------------ eviction
    def evict(self) -> None:
        """Drop least recently used entries until under the byte cap: entries without a
        retention hint first, then those whose hint still holds, pinned ones last."""
        while self.nbytes > self.max_bytes and self.entries:
            victim: RamEntry | None = None
            rank = 3
            for e in self.entries.values():
                r = self._keep_rank(e)
                if r < rank:
                    victim, rank = e, r
                    if r == 0:
                        break
            if victim is None:  # (every entry has a rank below 3)
                break
            self._drop(victim, evicted=True)

    def _drop(self, entry: RamEntry, evicted: bool, superseded_by: RamEntry | None = None) -> None:
        if self.on_evict is not None:
            # persist-before-demote: the callback makes sure the state is (being) written
            self.on_evict(entry, evicted, superseded_by)
        self.entries.pop(entry.key, None)
        if entry.session is not None and self.pinned.get(entry.session) is entry:
            del self.pinned[entry.session]
        for r in entry.runs:
            self._unref_run(r)
        if entry.checkpoint is not None:
            lst = self.checkpoints.get(entry.parent, [])
            if entry in lst:
                lst.remove(entry)
                if not lst:
                    del self.checkpoints[entry.parent]
            self.checkpoint_bytes -= entry.nbytes
        self.logical_bytes -= entry.logical
        entry.runs = []
        entry.checkpoint = None

    def clear(self) -> None:
        for e in list(self.entries.values()):
            self._drop(e, evicted=False)

    def drop(self, entry: RamEntry, evicted: bool = True) -> None:
        """Forget ``entry`` (``evicted``: it leaves RAM for good; the SSD tier keeps it)."""
        if self.entries.get(entry.key) is entry:
            self._drop(entry, evicted=evicted)

    def find(self, entry_id: str) -> RamEntry | None:
        for e in self.entries.values():
            if e.id == entry_id:
                return e
        return None

    def touch(self, entry: RamEntry) -> None:
        if self.entries.get(entry.key) is entry:
            self.entries.move_to_end(entry.key)

    def seeding(self, ns: str, tokens: np.ndarray) -> list[RamEntry]:
        """Entries of ``ns`` that could seed a prompt of ``tokens`` (share its first
        token: every run a lookup could use belongs to one of them)."""
        if len(tokens) == 0:
            return []
        return [e for e in self.entries.values()
                if e.ns == ns and len(e.tokens) and e.tokens[0] == tokens[0]]

    def shared_by(self, entry: RamEntry) -> list[int]:
        """Per run of ``entry``, how many entries use it (sharing through the index)."""
        return [r.refs for r in entry.runs]

    # ------------------------------------------------------------------ sessions
    def _set_session(self, entry: RamEntry, session: str | None) -> None:
        if session is None:
            return
        entry.session = session
        self.pinned[session] = entry

    def release_session(self, session: str) -> None:
        e = self.pinned.pop(session, None)
        if e is not None:
            e.session = None
