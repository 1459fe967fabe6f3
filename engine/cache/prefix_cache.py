"""Tiered prefix cache: RAM first, then SSD; the engine's seam (see ENGINE_SEAM).

    pc = PrefixCache(ram_bytes=2 << 30, cache_dir="~/.cache/mlxkv", block_tokens=256)
    n, cache = pc.lookup(prompt_tokens, ns, session=None)   # engine thread
    ... prefill prompt_tokens[n:] into cache (or a fresh cache when None) and generate ...
    pc.store(tokens_in_cache, cache, ns, session=None)     # engine thread
    pc.flush(timeout) ; pc.stats() ; pc.close(timeout)

* ``lookup`` returns the longest cached prefix (at most ``len(tokens) - 1``) as a new
  mlx-lm prompt cache the request owns. RAM hits lend shared buffers (copy-on-write); a
  request that continues an unshared entry exactly is handed its buffers instead, so the
  new turn is written in place and its ``store`` brings the state back. SSD hits are
  restored by the storage reader thread straight into evaluated mx arrays allocated here,
  and the engine thread waits only for that restore.
* ``store`` keeps the state in RAM (sharing blocks with other conversations) and, for
  block caches, hands an immutable snapshot to the durability coordinator, which persists
  it on the storage writer thread (write-behind). RAM eviction never loses a dirty state:
  its snapshot stays with the coordinator until it is on disk.
* Namespaces: KV of one namespace never seeds another (keys and folders include it).
* Non-trimmable caches (rotating windows, SSM / linear-attention state, and hybrids of
  those with KV layers) are kept as exact checkpoints at the end of each turn: in RAM, and
  on SSD as a block-store checkpoint of the non-trimmable layers plus the KV layers as
  ordinary (deduplicated) blocks marked partial (see ``engine.cache.layout``). They are
  restored only at exactly a checkpointed position, never trimmed.
* A RAM entry handed over whole to the request that continues it (see ``RamTier._move``)
  is given back by ``release(cache)`` if that request fails before its ``store``.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
import xxhash

from engine.cache import kvblocks as kb
from engine.cache import layout as dl
from engine.cache.durability import Durability
from engine.cache.ram_tier import Entry, RamTier, as_tokens

log = logging.getLogger("mlxkv.prefix")

_STORE_NS = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_MAX_LENT = 8  # handed-over caches remembered for release()


def default_ram_bytes(fraction: float = 0.25) -> int:
    """A fraction of physical memory (2 GiB when it cannot be read)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * fraction)
    except (ValueError, OSError, AttributeError):
        return 2 << 30


def store_namespace(ns: str) -> str:
    """The block store's folder name for an engine namespace (readable, collision-free)."""
    if not isinstance(ns, str) or not ns:
        raise ValueError(f"namespace must be a non-empty string, got {ns!r}")
    if _STORE_NS.match(ns):
        return ns
    clean = re.sub(r"[^A-Za-z0-9._-]", "_", ns).lstrip("._-")[:100] or "ns"
    return f"{clean}-{xxhash.xxh3_64_hexdigest(ns.encode())}"


_lowered: set[int] = set()


def _background_priority() -> None:
    """Runs on the storage writer thread before each write: lower that thread's scheduling
    priority once, so that on a busy machine persistence yields to generation (Linux
    applies nice values per thread; elsewhere this is a no-op)."""
    tid = threading.get_native_id()
    if tid in _lowered or not sys.platform.startswith("linux"):
        return
    _lowered.add(tid)
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + 10))
    except (OSError, AttributeError):
        pass


def _manifest_name(toks: np.ndarray) -> str:
    """The manifest that names a conversation state (so GC keeps what it needs)."""
    return f"c-{xxhash.xxh3_64_hexdigest(toks.tobytes())}"


@dataclass(frozen=True)
class _Lent:
    """A RAM entry handed over to a request (see ``PrefixCache.release``)."""

    cache: list  # the request's prompt cache (the very list lookup returned)
    ns: str
    tokens: np.ndarray
    session: str | None


@dataclass(frozen=True)
class _Written:
    """Several writes of one state, settled together."""

    bytes_written: int
    results: tuple


class NullPrefixCache:
    """Caching off: every lookup misses, stores are dropped."""

    def lookup(self, tokens: Any, ns: str, session: str | None = None) -> tuple[int, None]:
        return 0, None

    def store(self, tokens: Any, cache: list, ns: str, session: str | None = None) -> None:
        return None

    def release(self, cache: list | None) -> bool:
        return False

    def flush(self, timeout: float | None = None) -> dict[str, int]:
        return {"durable": 0, "flushed": 0, "pending": 0, "failed": 0, "missing": 0}

    def close(self, timeout: float | None = None) -> dict[str, int]:
        return self.flush(timeout)

    def stats(self) -> dict[str, Any]:
        return {"enabled": False}

    def open_session(self, session: str) -> None:
        return None

    def close_session(self, session: str) -> None:
        return None


class PrefixCache:
    """RAM + SSD prefix cache (see the module docstring). Engine-thread methods:
    ``lookup``, ``store``, ``release``; ``flush``/``close``/``stats`` may be called from any
    thread."""

    def __init__(self, ram_bytes: int | None = None, cache_dir: str | os.PathLike | None = None,
                 block_tokens: int = 256, ssd: bool = True, ssd_bytes: int | None = None,
                 durable: bool = True, debounce_s: float = 0.0, retries: int = 2,
                 min_ssd_gain: int | None = None, on_event: Any = None) -> None:
        if block_tokens <= 0:
            raise ValueError(f"block_tokens must be > 0, got {block_tokens}")
        self.block_tokens = int(block_tokens)
        self.ram = RamTier(default_ram_bytes() if ram_bytes is None else int(ram_bytes),
                           self.block_tokens, on_evict=self._on_ram_drop)
        self.on_event = on_event
        # restore from SSD only when it saves at least this many tokens over the RAM hit
        self.min_ssd_gain = max(1, self.block_tokens // 4 if min_ssd_gain is None
                                else int(min_ssd_gain))
        self._lock = threading.Lock()  # stats are read from other threads
        self._sessions: set[str] = set()
        # caches whose RAM entry was handed over, by id, until stored or given back
        self._lent: dict[int, _Lent] = {}
        self._s = {"lookups": 0, "ram_hits": 0, "ssd_hits": 0, "misses": 0,
                   "prompt_tokens": 0, "cached_tokens": 0, "ram_tokens": 0, "ssd_tokens": 0,
                   "restore_ms": 0.0, "restore_bytes": 0, "ssd_restore_failures": 0,
                   "ssd_corrupt": 0, "stores": 0, "store_ms": 0.0, "unsupported": 0,
                   "checkpoint_stores": 0, "checkpoints_persisted": 0, "released": 0}
        self.last: dict[str, Any] = {}
        self.disk = self.io = self.durability = None
        if ssd and cache_dir is not None:
            from storage.io import StorageIO
            from storage.store import BlockStore

            root = os.path.expanduser(os.fspath(cache_dir))
            try:
                os.makedirs(root, exist_ok=True)
            except OSError as exc:
                raise OSError(exc.errno, f"cannot create the cache folder {root}: "
                              f"{exc.strerror}; pass another cache_dir or disable the SSD tier"
                              ) from exc
            self.disk = BlockStore(root, block_tokens=self.block_tokens, max_bytes=ssd_bytes,
                                    durable=durable)
            self.disk.scan()
            self.io = StorageIO(self.disk)
            self.durability = Durability(self._submit, debounce_s=debounce_s, retries=retries)

    @classmethod
    def from_settings(cls, settings: Any) -> PrefixCache | NullPrefixCache:
        """Build from the engine's settings object (fields prefix_cache, cache_dir, ...)."""
        if not getattr(settings, "prefix_cache", True):
            return NullPrefixCache()
        return cls(ram_bytes=getattr(settings, "ram_cache_bytes", None),
                   cache_dir=getattr(settings, "cache_dir", None),
                   block_tokens=getattr(settings, "block_tokens", 256),
                   ssd_bytes=getattr(settings, "ssd_cache_bytes", None))

    # ------------------------------------------------------------------ lookup
    def lookup(self, tokens: Any, ns: str, session: str | None = None) -> tuple[int, list | None]:
        """Longest cached prefix of ``tokens`` in ``ns``: ``(n, cache)``; ``(0, None)`` on a
        miss. ``cache`` holds exactly ``tokens[:n]`` and belongs to the caller."""
        t0 = time.perf_counter()
        toks = as_tokens(tokens)
        sns = store_namespace(ns)
        self._sweep_lent()
        match = self.ram.lookup(ns, toks, session)
        n, cache, tier, restore_ms = match.n, None, "ram" if match.n else None, 0.0
        limit = len(toks) - 1
        # The SSD tier is consulted only when it could beat the RAM hit (see _worth): a RAM
        # hit that already covers the prompt skips hashing it for, and probing, the disk.
        if self.disk is not None and limit > 0 and self._worth(limit, n):
            restored = None
            sm = self.disk.lookup(sns, toks, max_tokens=limit)
            # blocks of some layers only (a hybrid model's KV) come back with a checkpoint
            if not dl.is_partial(sm.layout) and self._worth(sm.n_tokens, n):
                t1 = time.perf_counter()
                restored = self._restore(sns, toks, sm)
                restore_ms += (time.perf_counter() - t1) * 1e3
            cm = self.disk.lookup_checkpoint(sns, toks, max_tokens=limit)
            if cm.n_tokens and self._worth(cm.n_tokens, max(n, restored[0] if restored else 0)):
                t1 = time.perf_counter()
                r2 = self._restore_checkpoint(sns, toks, cm)
                restore_ms += (time.perf_counter() - t1) * 1e3
                if r2 is not None and (restored is None or r2[0] > restored[0]):
                    restored = r2
            if restored is not None and restored[0] > n:
                n, cache, tier = restored[0], restored[1], "ssd"
        if tier == "ram":
            cache = match.lend()
            if match.moved and cache is not None:
                self._remember_lent(cache, ns, toks[:n], session)
        with self._lock:
            s = self._s
            s["lookups"] += 1
            s["prompt_tokens"] += len(toks)
            s["cached_tokens"] += n
            if tier == "ram":
                s["ram_hits"] += 1
                s["ram_tokens"] += n
            elif tier == "ssd":
                s["ssd_hits"] += 1
                s["ssd_tokens"] += n
            else:
                s["misses"] += 1
            s["restore_ms"] += restore_ms
            self.last = {"prompt_tokens": len(toks), "cached_tokens": n, "tier": tier,
                         "restore_ms": restore_ms, "lookup_ms": (time.perf_counter() - t0) * 1e3}
        self._emit("lookup", **self.last)
        return (n, cache) if n > 0 else (0, None)

    def _worth(self, n_ssd: int, n_ram: int) -> bool:
        """Restore ``n_ssd`` tokens from SSD when RAM already offers ``n_ram``?"""
        return n_ssd >= n_ram + self.min_ssd_gain or (n_ram == 0 and n_ssd > 0)

    def _read(self, req: Any) -> Any:
        """Run a restore on the reader thread; None (counted, logged) when it fails."""
        return self._wait(self.io.submit_read(req))

    def _wait(self, fut: Future) -> Any:
        try:
            res = fut.result()
        except Exception as exc:  # noqa: BLE001  (unreadable folder, layout mismatch: a miss)
            log.warning("mlxkv cache: SSD restore failed: %s", exc)
            with self._lock:
                self._s["ssd_restore_failures"] += 1
            return None
        with self._lock:
            self._s["restore_bytes"] += res.bytes_read
            self._s["ssd_corrupt"] += res.corrupt
        return res

    def _block_buffers(self, layout: Any, cap: int) -> tuple[list, list, list]:
        """(per layer (index, LayerSpec, arrays), segments, all arrays) to restore blocks
        of ``layout`` into, with room for ``cap`` tokens."""
        by_layer = dl.parse_block_layout(layout)
        flat = [s for _, _, seg_specs in by_layer for s in seg_specs]
        arrays = kb.writable_arrays([(1, s.outer, cap, *s.shape) for s in flat],
                                    [getattr(mx, s.dtype) for s in flat])
        segs = [(kb.byte_view(a), s.outer, cap, s.row_bytes) for a, s in zip(arrays, flat)]
        layers, i = [], 0
        for li, spec, seg_specs in by_layer:
            layers.append((li, spec, arrays[i : i + len(seg_specs)]))
            i += len(seg_specs)
        return layers, segs, arrays

    def _restore(self, sns: str, toks: np.ndarray, match: Any) -> tuple[int, list] | None:
        """Restore block ``match`` from SSD on the reader thread into fresh mx arrays, with
        headroom up to the prompt's length (its prefill then writes in place)."""
        from storage.io import ReadRequest

        if match.layout is None:
            return None
        layers, segs, arrays = self._block_buffers(match.layout, kb.round_up(len(toks)))
        if [li for li, _, _ in layers] != list(range(len(layers))):
            return None  # not a whole model's layers: never a partial cache
        res = self._read(ReadRequest(sns, toks, match.layout, segs, n_tokens=match,
                                     keep=arrays))
        del segs
        if res is None or res.n_tokens <= 0:
            return None
        return res.n_tokens, [kb.make_layer(spec, arrs, res.n_tokens)
                              for _, spec, arrs in layers]

    def _restore_checkpoint(self, sns: str, toks: np.ndarray, cm: Any
                            ) -> tuple[int, list] | None:
        """Restore the checkpoint ``cm`` (and, for models that also have KV layers, their
        blocks up to exactly the same position); None unless all of it verifies."""
        from storage.io import ReadRequest

        n = cm.n_tokens
        try:
            carrays = dl.checkpoint_buffers(cm.layout)
            with_blocks = dl.checkpoint_has_blocks(cm.layout)
        except ValueError as exc:
            log.warning("mlxkv cache: unusable checkpoint layout: %s", exc)
            return None
        blocks: list = []
        if with_blocks:
            bm = self.disk.lookup(sns, toks, max_tokens=n)
            if bm.n_tokens != n or not dl.is_partial(bm.layout):
                return None  # its KV layers are not all on disk: nothing to restore
            blocks, bsegs, barrays = self._block_buffers(bm.layout, kb.round_up(len(toks)))
            bfut = self.io.submit_read(ReadRequest(sns, toks, bm.layout, bsegs, n_tokens=bm,
                                                   keep=barrays))
        cres = self._read(ReadRequest(sns, toks, cm.layout,
                                      [(kb.byte_view(a), 1, 1, a.nbytes) for a in carrays],
                                      n_tokens=cm, keep=carrays, checkpoint=True))
        if with_blocks:
            bres = self._wait(bfut)
            if bres is None or bres.n_tokens != n:
                return None
        if cres is None or cres.n_tokens != n:
            return None
        try:
            layers = dl.checkpoint_layers(cm.layout, carrays)
        except (ValueError, TypeError, KeyError) as exc:
            log.warning("mlxkv cache: unusable checkpoint: %s", exc)
            return None
        for li, spec, arrs in blocks:
            layers[li] = kb.make_layer(spec, arrs, n)
        if sorted(layers) != list(range(len(layers))):
            log.warning("mlxkv cache: a checkpoint does not cover every layer; not used")
            return None
        cache = [layers[i] for i in range(len(layers))]
        if kb.cache_tokens(cache) not in (None, n):
            log.warning("mlxkv cache: a checkpoint holds another position; not used")
            return None
        return n, cache

    # ------------------------------------------------------------------ store
    def store(self, tokens: Any, cache: list, ns: str, session: str | None = None) -> None:
        """Keep the state of ``cache`` (which holds ``tokens``) in RAM and persist it in the
        background. Raises ValueError when the cache and the tokens disagree (a handed-over
        entry is then given back, as by ``release``)."""
        try:
            self._store(tokens, cache, ns, session)
        except BaseException:
            self.release(cache)
            raise
        self._lent.pop(id(cache), None)

    def _store(self, tokens: Any, cache: list, ns: str, session: str | None) -> None:
        t0 = time.perf_counter()
        toks = as_tokens(tokens)
        if len(toks) == 0 or not cache:
            return
        try:
            kb.check_supported(cache)
        except kb.UnsupportedCache as exc:
            with self._lock:
                self._s["unsupported"] += 1
            log.debug("not caching: %s", exc)
            return
        held = kb.cache_tokens(cache)
        block_mode = kb.is_block_cache(cache)
        if held is not None and held != len(toks) and not (block_mode and held > len(toks)):
            raise ValueError(f"the cache holds {held} tokens but {len(toks)} were given")
        if block_mode and held is not None and held > len(toks):
            # extra rows past len(toks) (e.g. a token computed ahead) are simply not used
            cache = [kb.make_layer(kb.layer_spec(c), kb.layer_arrays(c), len(toks))
                     for c in cache]
        entry = self.ram.store(ns, toks, cache, session)
        persisted = False
        if self.durability is not None:
            if block_mode:
                snap = self.snapshot(toks, cache, ns)
            else:
                cp = entry.checkpoint if entry is not None and entry.checkpoint else None
                snap = self._checkpoint_snapshot(toks, cache, ns, cp)
            if snap is not None:
                self.durability.mark(store_namespace(ns), toks, snap, coalesce=block_mode)
                persisted = True
        with self._lock:
            self._s["stores"] += 1
            self._s["store_ms"] += (time.perf_counter() - t0) * 1e3
            if not block_mode:
                self._s["checkpoint_stores"] += 1
                self._s["checkpoints_persisted"] += persisted
        self._emit("store", tokens=len(toks), ns=ns, in_ram=entry is not None)

    def snapshot(self, tokens: Any, cache: list, ns: str) -> Any:
        """An immutable storage snapshot of a block cache holding ``tokens`` (engine thread):
        new array objects over the cache's evaluated buffers, byte views of them, a
        manifest name so GC keeps the conversation, and a low writer priority."""
        from storage.io import Snapshot

        toks = as_tokens(tokens)
        specs, segs, keep = dl.block_layout(cache, len(toks))
        return Snapshot(store_namespace(ns), toks, tuple(specs), segs,
                        manifest=_manifest_name(toks), keep=keep,
                        on_start=_background_priority)

    def _checkpoint_snapshot(self, toks: np.ndarray, cache: list, ns: str,
                             cp: kb.Checkpoint | None) -> Any:
        """Snapshot(s) of a non-block cache: its non-trimmable layers as one checkpoint
        (after its KV layers as blocks, when it has any); None if it cannot be persisted
        (kept in RAM only)."""
        from storage.io import Snapshot

        sns = store_namespace(ns)
        block_idx, ckpt_idx = dl.split_layers(cache)
        try:
            if cp is None:
                cp = kb.take_checkpoint(cache)
            specs, segs, keep = dl.checkpoint_layout(cp, ckpt_idx, bool(block_idx))
            snaps = []
            if block_idx:
                bspecs, bsegs, bkeep = dl.block_layout(cache, len(toks), block_idx, part=True)
                # no manifest of its own: the checkpoint's names the blocks and tail too
                snaps.append(Snapshot(sns, toks, tuple(bspecs), bsegs, keep=bkeep,
                                      on_start=_background_priority))
        except kb.UnsupportedCache as exc:
            log.debug("checkpoint kept in RAM only: %s", exc)
            return None
        snaps.append(Snapshot(sns, toks, tuple(specs), segs, manifest=_manifest_name(toks),
                              keep=keep, on_start=_background_priority, checkpoint=True))
        return snaps[0] if len(snaps) == 1 else tuple(snaps)

    def _submit(self, snap: Any) -> Future:
        """Durability's submit: one snapshot, or several written in order (blocks, then the
        checkpoint that needs them) whose future settles when all have."""
        if not isinstance(snap, tuple):
            return self.io.submit_write(snap, block=False)
        futs = [self.io.submit_write(s, block=False) for s in snap]
        out: Future = Future()
        left = [len(futs)]
        lock = threading.Lock()

        def done(_: Future) -> None:
            with lock:
                left[0] -= 1
                if left[0]:
                    return
            exc = next((f.exception() for f in futs if f.exception() is not None), None)
            if exc is not None:
                out.set_exception(exc)
            else:
                out.set_result(_Written(sum(f.result().bytes_written for f in futs),
                                        tuple(f.result() for f in futs)))

        for f in futs:
            f.add_done_callback(done)
        return out

    # ------------------------------------------------------------------ handed-over entries
    def _remember_lent(self, cache: list, ns: str, toks: np.ndarray, session: str | None
                       ) -> None:
        self._lent[id(cache)] = _Lent(cache, ns, toks.copy(), session)
        while len(self._lent) > _MAX_LENT:
            rec = self._lent.pop(next(iter(self._lent)))
            if self._orphaned(rec):
                self._give_back(rec)

    @staticmethod
    def _orphaned(rec: _Lent) -> bool:
        # Only our record still refers to the cache list (getrefcount adds its argument):
        # the request is over and neither stored nor released it. Holding the list (and so
        # its layer objects) never holds an extra reference to an array, so it does not
        # stop MLX from writing the request's new tokens in place.
        return sys.getrefcount(rec.cache) <= 2

    def _sweep_lent(self) -> None:
        """Give back handed-over entries whose request dropped its cache without storing
        it (a failure the engine did not report through ``release``)."""
        for key in [k for k, r in self._lent.items() if self._orphaned(r)]:
            self._give_back(self._lent.pop(key))

    def release(self, cache: list | None) -> bool:
        """The request that got ``cache`` from ``lookup`` will not ``store`` it (it failed or
        was dropped): give back what it borrowed. A lent (shared) cache borrowed nothing;
        a RAM entry that was handed over whole (its buffers continue in place) is rebuilt
        from the cache's first ``n`` rows, which the request never rewrites, and kept
        again. Engine thread. Returns whether an entry was given back. (Without this call
        the entry comes back at the next ``lookup`` once nothing else holds the cache.)"""
        if cache is None:
            return False
        rec = self._lent.get(id(cache))
        if rec is None or rec.cache is not cache:
            return False
        del self._lent[id(cache)]
        return self._give_back(rec)

    def _give_back(self, rec: _Lent) -> bool:
        cache, n = rec.cache, len(rec.tokens)
        try:
            if not kb.is_block_cache(cache):
                raise ValueError("the cache is no longer a block cache")
            arrays = [kb.layer_arrays(c) for c in cache]
            mx.eval([a for layer in arrays for a in layer])
            if any(int(c.offset) < n or not arrs or arrs[0].shape[2] < n
                   for c, arrs in zip(cache, arrays)):
                raise ValueError(f"the cache no longer holds its first {n} tokens")
            back = [kb.make_layer(kb.layer_spec(c), arrs, n) for c, arrs in zip(cache, arrays)]
            self.ram.store(rec.ns, rec.tokens, back, rec.session)
        except Exception as exc:  # noqa: BLE001  (a failed computation left lazy garbage)
            log.warning("mlxkv cache: could not take back a %d-token state: %s", n, exc)
            return False
        with self._lock:
            self._s["released"] += 1
        return True

    def _on_ram_drop(self, entry: Entry, evicted: bool, superseded_by: Entry | None) -> None:
        # The coordinator already holds a snapshot of every dirty block state (it was taken
        # at store time), so leaving RAM never loses one: persist-before-demote holds by
        # construction. A state whose write failed for good is now gone for real.
        if self.durability is not None and evicted:
            self.durability.forget(store_namespace(entry.ns), entry.tokens)

    # ------------------------------------------------------------------ sessions
    def open_session(self, session: str) -> None:
        """Prefer and keep warm this session's latest entry until ``close_session``."""
        self._sessions.add(session)

    def close_session(self, session: str) -> None:
        self._sessions.discard(session)
        self.ram.release_session(session)
        self.ram.evict()

    # ------------------------------------------------------------------ durability
    def flush(self, timeout: float | None = None) -> dict[str, int]:
        """Persist every dirty state now (up to ``timeout`` s):
        ``{durable, flushed, pending, failed, missing}``."""
        if self.durability is None:
            return {"durable": 0, "flushed": 0, "pending": 0, "failed": 0, "missing": 0}
        return self.durability.flush(timeout)

    def close(self, timeout: float | None = 10.0) -> dict[str, int]:
        """Flush (bounded by ``timeout``), stop the storage threads, free RAM."""
        if self.durability is None:
            rep = self.flush(timeout)
        else:
            rep = self.durability.close(timeout)
            self.io.close(timeout)
        self._lent.clear()
        self.ram.clear()
        return rep

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict[str, Any]:
        with self._lock:
            s = dict(self._s)
            s["last"] = dict(self.last)
        ram = self.ram
        s.update({
            "enabled": True, "block_tokens": self.block_tokens,
            "ram_bytes": ram.nbytes, "ram_max_bytes": ram.max_bytes, "ram_entries": len(ram),
            "ram_blocks": len(ram.runs), "ram_logical_bytes": ram.logical_bytes,
            "ram_moves": ram.moves,
            "dedup_ratio": (ram.logical_bytes / ram.nbytes) if ram.nbytes else 1.0,
            "hit_fraction": (s["cached_tokens"] / s["prompt_tokens"]) if s["prompt_tokens"] else 0.0,
            "sessions": len(self._sessions),
        })
        if self.disk is not None:
            st = self.disk.stats()
            s.update({"ssd": True, "ssd_bytes": st["bytes"], "ssd_blocks": st["blocks"],
                      "ssd_tails": st["tails"], "ssd_checkpoints": st.get("checkpoints", 0),
                      "ssd_root": st["root"], "kernel": st["kernel"]})
            s["durability"] = self.durability.report()
            s["write_counts"] = dict(self.durability.counts)
            s["queues"] = {**self.durability.queue_depth(),
                           "storage_pending_writes": self.io.pending_writes}
        else:
            s["ssd"] = False
        return s

    def _emit(self, kind: str, **data: Any) -> None:
        if self.on_event is not None:
            try:
                self.on_event({"type": f"cache.{kind}", **data})
            except Exception:
                log.exception("cache event callback failed")
