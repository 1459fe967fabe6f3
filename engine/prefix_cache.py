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
* Non-trimmable caches (rotating windows, SSM state) are kept in RAM as exact
  checkpoints; the block store cannot hold them yet, so they are not persisted.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time
from typing import Any

import mlx.core as mx
import numpy as np
import xxhash

from engine import kvblocks as kb
from engine.durability import Durability
from engine.ram_tier import Entry, RamTier, as_tokens

log = logging.getLogger("mlxkv.prefix")

_STORE_NS = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_DTYPES = {str(getattr(mx, n)): n for n in (
    "float32", "float16", "bfloat16", "uint32", "int32", "uint8", "int8", "uint16", "int16")}


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


# ----------------------------------------------------------------------------- layouts
def _dtype_name(a: mx.array) -> str:
    name = _DTYPES.get(str(a.dtype))
    if name is None:
        raise kb.UnsupportedCache(f"KV dtype {a.dtype} cannot be persisted")
    return name


def _layout_and_segments(cache: list, ntokens: int) -> tuple[list, list, list]:
    """(layout specs, segments, arrays to pin) describing rows of every layer array."""
    from storage.format import SegmentSpec

    specs, segs, keep = [], [], []
    for li, c in enumerate(cache):
        spec = kb.layer_spec(c)
        tag = "kv" if spec.kind == "kv" else f"q{spec.bits}g{spec.group_size}"
        names = ("k", "v") if spec.kind == "kv" else ("kq", "ks", "kb", "vq", "vs", "vb")
        for name, a in zip(names, kb.layer_arrays(c)):
            if a.ndim != 4 or a.shape[2] < ntokens:
                raise ValueError(f"layer {li}: unexpected KV array shape {a.shape}")
            a = kb.fresh(a)
            mx.eval(a)
            if not memoryview(a).c_contiguous:
                a = mx.contiguous(a)
                mx.eval(a)
            outer = a.shape[0] * a.shape[1]
            row = a.shape[3] * a.itemsize
            specs.append(SegmentSpec(f"{li}.{tag}.{name}", _dtype_name(a), (a.shape[3],),
                                     outer, row))
            segs.append((kb.byte_view(a), outer, a.shape[2], row))
            keep.append(a)
    return specs, segs, keep


def _parse_layout(layout: Any) -> list[tuple[kb.LayerSpec, list]]:
    """Group a stored layout back into layers: [(LayerSpec, [SegmentSpec, ...]), ...]."""
    layers: list[tuple[kb.LayerSpec, list]] = []
    current = None
    for s in layout:
        li, tag, _ = s.name.split(".")
        if current is None or current[0] != li:
            if tag == "kv":
                spec = kb.LayerSpec("kv")
            else:
                m = re.fullmatch(r"q(\d+)g(\d+)", tag)
                if m is None:
                    raise ValueError(f"unknown layer tag {tag!r} in a stored layout")
                spec = kb.LayerSpec("qkv", int(m.group(2)), int(m.group(1)))
            current = (li, spec, [])
            layers.append((spec, current[2]))
        current[2].append(s)
    return layers


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


class NullPrefixCache:
    """Caching off: every lookup misses, stores are dropped."""

    def lookup(self, tokens: Any, ns: str, session: str | None = None) -> tuple[int, None]:
        return 0, None

    def store(self, tokens: Any, cache: list, ns: str, session: str | None = None) -> None:
        return None

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
    ``lookup``, ``store``; ``flush``/``close``/``stats`` may be called from any thread."""

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
        self._layouts: dict[str, Any] = {}
        self._s = {"lookups": 0, "ram_hits": 0, "ssd_hits": 0, "misses": 0,
                   "prompt_tokens": 0, "cached_tokens": 0, "ram_tokens": 0, "ssd_tokens": 0,
                   "restore_ms": 0.0, "restore_bytes": 0, "ssd_restore_failures": 0,
                   "ssd_corrupt": 0, "stores": 0, "store_ms": 0.0, "unsupported": 0,
                   "checkpoint_stores": 0}
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
            self.durability = Durability(lambda snap: self.io.submit_write(snap, block=False),
                                         debounce_s=debounce_s, retries=retries)

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
        match = self.ram.lookup(ns, toks, session)
        n, cache, tier, restore_ms = match.n, None, "ram" if match.n else None, 0.0
        if self.disk is not None and len(toks) > 1:
            sm = self.disk.lookup(sns, toks, max_tokens=len(toks) - 1)
            if sm.n_tokens >= n + self.min_ssd_gain or (n == 0 and sm.n_tokens > 0):
                t1 = time.perf_counter()
                restored = self._restore(ns, sns, toks, sm)
                restore_ms = (time.perf_counter() - t1) * 1e3
                if restored is not None and restored[0] > n:
                    n, cache, tier = restored[0], restored[1], "ssd"
        if tier == "ram":
            cache = match.lend()
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

    def _restore(self, ns: str, sns: str, toks: np.ndarray, match: Any) -> tuple[int, list] | None:
        """Restore ``match`` from SSD on the reader thread into fresh mx arrays."""
        from storage.io import ReadRequest

        layout = self._layout(ns, sns, match)
        if layout is None:
            return None
        # headroom up to the prompt's length: its prefill then writes in place
        cap = kb.round_up(len(toks))
        by_layer = _parse_layout(layout)
        flat = [s for _, seg_specs in by_layer for s in seg_specs]
        arrays = kb.writable_arrays([(1, s.outer, cap, *s.shape) for s in flat],
                                    [getattr(mx, s.dtype) for s in flat])
        segs = [(kb.byte_view(a), s.outer, cap, s.row_bytes) for a, s in zip(arrays, flat)]
        layers, i = [], 0
        for spec, seg_specs in by_layer:
            layers.append((spec, arrays[i : i + len(seg_specs)]))
            i += len(seg_specs)
        fut = self.io.submit_read(ReadRequest(sns, toks, layout, segs, n_tokens=match,
                                              keep=arrays))
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
        if res.n_tokens <= 0:
            return None
        del segs
        return res.n_tokens, [kb.make_layer(spec, arrs, res.n_tokens) for spec, arrs in layers]

    def _layout(self, ns: str, sns: str, match: Any) -> Any:
        """The stored layout of ``ns`` (from this process's stores or the store's index)."""
        layout = self._layouts.get(ns)
        if layout is not None:
            return layout
        # NOTE: BlockStore has no public accessor for an indexed block's layout yet.
        with self.disk._lock:
            space = self.disk._spaces.get(sns)
            if space is None:
                return None
            e = space.blocks.get(match.block_keys[0]) if match.block_keys else None
            if e is None and match.tail_key is not None:
                e = space.tails.get(bytes(16), {}).get(match.tail_key)
            if e is None:
                return None
            return e.layout

    # ------------------------------------------------------------------ store
    def store(self, tokens: Any, cache: list, ns: str, session: str | None = None) -> None:
        """Keep the state of ``cache`` (which holds ``tokens``) in RAM and persist it in the
        background. Raises ValueError when the cache and the tokens disagree."""
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
        if block_mode and self.durability is not None:
            self.durability.mark(store_namespace(ns), toks, self.snapshot(toks, cache, ns))
        with self._lock:
            self._s["stores"] += 1
            self._s["store_ms"] += (time.perf_counter() - t0) * 1e3
            if not block_mode:
                self._s["checkpoint_stores"] += 1
        self._emit("store", tokens=len(toks), ns=ns, in_ram=entry is not None)

    def snapshot(self, tokens: Any, cache: list, ns: str) -> Any:
        """An immutable storage snapshot of a block cache holding ``tokens`` (engine thread):
        new array objects over the cache's evaluated buffers, byte views of them, a
        manifest name so GC keeps the conversation, and a low writer priority."""
        from storage.io import Snapshot

        toks = as_tokens(tokens)
        sns = store_namespace(ns)
        specs, segs, keep = _layout_and_segments(cache, len(toks))
        self._layouts.setdefault(ns, tuple(specs))
        name = f"c-{xxhash.xxh3_64_hexdigest(toks.tobytes())}"
        return Snapshot(sns, toks, tuple(specs), segs, manifest=name, keep=keep,
                        on_start=_background_priority)

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
                      "ssd_tails": st["tails"], "ssd_root": st["root"], "kernel": st["kernel"]})
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
