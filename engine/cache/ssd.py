"""The SSD tier of the prefix cache: restores from, and snapshots for, the block store.

* **Restore**: blocks (and checkpoints) are read by the storage reader thread straight
  into evaluated mx arrays allocated here, then checked against the namespace's model
  (``engine.cache.template``) before they are lent. The engine thread waits for a read at
  most ``restore_timeout_s``: a read that takes longer (a hung disk) is a miss, with one
  warning, its destination buffers are never used (the reader may still write into
  them), and the tier is skipped until that read finishes.
* **Persist**: ``store()`` hands an immutable snapshot of a state to the durability
  coordinator, which writes it on the storage writer thread (write-behind); a manifest
  named after the entry id keeps it through GC.
* **Upkeep**: listing saved states (manifests), verifying them through the reader
  thread, removing them (delete, invalidate).

Engine thread, except the writer callbacks (durability).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import numpy as np

from mlxkv.engine.cache import kvblocks, layout
from mlxkv.engine.cache.durability import Durability, FlushReport, StateWrite, WriteRequests, Written
from mlxkv.engine.cache.events import Events
from mlxkv.engine.cache.stats import Counters
from mlxkv.engine.cache.template import Templates
from mlxkv.engine.cache.tokens import ZERO_KEY, ckpt_key_of, entry_id, manifest_name, tail_key_of

if TYPE_CHECKING:
    from mlxkv.engine.cache.arena import Arena
    from mlxkv.storage.io import WriteRequest
    from mlxkv.storage.keys import Match, PutResult, Restore

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


@dataclass(eq=False)
class Restoring:
    """A block read under way (``SsdTier.begin_blocks``): its destinations stay with it."""

    store_ns: str
    toks: np.ndarray
    n_tokens: int  # what the read will restore if every block verifies
    layers: list[layout.RestoreLayer]
    future: Future[Restore]


@dataclass(frozen=True)
class _Written:
    """Several writes of one state, settled together."""

    bytes_written: int
    results: tuple[PutResult, ...]


class SsdTier:
    """Block store + reader/writer threads + durability (see the module docstring).
    Opening raises ``storage.CacheFolderError`` / OSError when the folder is unusable."""

    def __init__(self, root: str, block_tokens: int, max_bytes: int | None, durable: bool,
                 debounce_s: float, retries: int, restore_timeout_s: float | None,
                 events: Events, counters: Counters, templates: Templates,
                 pressure_bytes: int | None = None, arena: Arena | None = None) -> None:
        from mlxkv.storage.io import StorageIO
        from mlxkv.storage.store import BlockStore

        self.events, self.counters, self.templates = events, counters, templates
        self.restore_timeout_s = restore_timeout_s
        self.arena = arena  # ready restore destinations
        # BlockStore creates the folder, or raises CacheFolderError saying what to do.
        self.disk = BlockStore(root, block_tokens=block_tokens, max_bytes=max_bytes,
                               durable=durable)
        self.disk.scan()
        self.io = StorageIO(self.disk)
        self.durability = Durability(self._submit, debounce_s=debounce_s, retries=retries,
                                     on_settled=self._settled, warn=events.warn,
                                     pressure_bytes=pressure_bytes)
        self._stuck: list[Future[Restore]] = []  # reads that outlived the timeout, until they end

    # ------------------------------------------------------------------ restore
    def available(self) -> bool:
        """False while a read that timed out is still running (the reader is stuck)."""
        self._stuck = [f for f in self._stuck if not f.done()]
        if self._stuck:
            self.counters.add(ssd_skipped_stuck=1)
        return not self._stuck

    def lookup(self, store_ns: str, toks: np.ndarray, keys: list[bytes], limit: int, n_ram: int,
               worth: Callable[[int, int], bool]
               ) -> tuple[int, kvblocks.PromptCache | None, float]:
        """The longest prefix the SSD holds that beats ``n_ram`` (``worth(n_ssd, n_ram)``):
        ``(n, cache, restore_ms)``; ``(0, None, ms)`` when there is none. ``keys``: the
        prompt's chain keys (the store does not hash it again)."""
        restored: tuple[int, kvblocks.PromptCache] | None = None
        restore_ms = 0.0
        block_match = self.disk.lookup(store_ns, toks, max_tokens=limit, keys=keys)
        # blocks of some layers only (a hybrid model's KV) come back with a checkpoint
        if block_match.layout is not None and not layout.is_partial(block_match.layout) \
                and worth(block_match.n_tokens, n_ram):
            t1 = time.perf_counter()
            restored = self._restore_blocks(store_ns, toks, block_match)
            restore_ms += (time.perf_counter() - t1) * 1e3
        if self._stuck:  # that read timed out: the reader will not serve another one soon
            return 0, None, restore_ms
        best = max(n_ram, restored[0] if restored else 0)
        checkpoint_match = self.disk.lookup_checkpoint(store_ns, toks, max_tokens=limit, keys=keys)
        if checkpoint_match.n_tokens and worth(checkpoint_match.n_tokens, best):
            t1 = time.perf_counter()
            from_checkpoint = self._restore_checkpoint(store_ns, toks, checkpoint_match, keys)
            restore_ms += (time.perf_counter() - t1) * 1e3
            if from_checkpoint is not None and \
                    (restored is None or from_checkpoint[0] > restored[0]):
                restored = from_checkpoint
        if restored is None:
            return 0, None, restore_ms
        return restored[0], restored[1], restore_ms

    def _taker(self, store_ns: str) -> layout.Taker | None:
        arena = self.arena
        if arena is None:
            return None
        return lambda flat, cap: arena.take(store_ns, flat, cap)

    def latest_tokens(self, store_ns: str) -> int:
        """Tokens of the state the store used last in ``store_ns`` (0: none)."""
        return self.disk.latest_tokens(store_ns)

    def _unusable(self, store_ns: str, exc: Exception) -> None:
        self.counters.add(layout_mismatches=1)
        self.events.warn(f"layout:{store_ns}", "prefix cache: a state stored in %s does not fit "
                         "this model and is not used (the prompt is recomputed): %s", store_ns, exc)

    def _wait(self, fut: Future[Restore]) -> Restore | None:
        """The result of a read, or None (a failure or a timeout: counted, warned once)."""
        try:
            res = fut.result(timeout=self.restore_timeout_s)
        except FutureTimeout:
            self._stuck.append(fut)
            self.counters.add(ssd_restore_timeouts=1)
            self.events.warn("restore-timeout", "prefix cache: an SSD restore took longer "
                             "than %.0f s (a hung disk?); it counts as a miss and the SSD tier "
                             "is skipped until it finishes", self.restore_timeout_s or 0)
            return None
        except Exception as exc:  # noqa: BLE001  (unreadable folder, layout mismatch: a miss)
            self.counters.add(ssd_restore_failures=1)
            self.events.warn(f"restore-failed:{type(exc).__name__}",
                             "prefix cache: an SSD restore failed (recomputed): %s", exc)
            return None
        self.counters.add(restore_bytes=res.bytes_read, ssd_corrupt=res.corrupt)
        return res

    def _restore_blocks(self, store_ns: str, toks: np.ndarray, match: Match
                        ) -> tuple[int, kvblocks.PromptCache] | None:
        """Restore block ``match`` into arena slots or fresh mx arrays with headroom up to
        the prompt's length (its prefill then writes in place)."""
        pending = self.begin_blocks(store_ns, toks, match, kvblocks.round_up(len(toks)))
        return None if pending is None else self.finish_blocks(pending)

    def begin_blocks(self, store_ns: str, toks: np.ndarray, match: Match, cap: int,
                     populate: bool = True) -> Restoring | None:
        """Start reading block ``match`` on the reader thread into destinations with room
        for ``cap`` tokens (an arena slot, or arrays allocated now; ``populate=False``
        leaves their page faults to the reader thread). None when the layout is unusable."""
        from mlxkv.storage.io import ReadRequest

        try:
            layers, segs, arrays = layout.block_buffers(match.layout, cap, self._taker(store_ns),
                                                        populate=populate)
        except layout.LayoutError as exc:
            self._unusable(store_ns, exc)
            return None
        fut = self.io.submit_read(ReadRequest(store_ns, toks, match.layout, segs, n_tokens=match,
                                              keep=arrays))
        return Restoring(store_ns, toks, match.n_tokens, layers, fut)

    def finish_blocks(self, p: Restoring) -> tuple[int, kvblocks.PromptCache] | None:
        """Wait for a read begun by ``begin_blocks`` (bounded by the restore timeout) and
        build its checked cache; None when it failed, timed out or does not fit."""
        res = self._wait(p.future)
        if res is None or res.n_tokens <= 0:
            return None
        cache = [kvblocks.make_layer(spec, arrs, res.n_tokens) for _, spec, arrs in p.layers]
        try:
            self.templates.check(p.store_ns, cache)
        except layout.LayoutError as exc:
            self._unusable(p.store_ns, exc)
            return None
        return res.n_tokens, cache

    def _restore_checkpoint(self, store_ns: str, toks: np.ndarray, checkpoint_match: Match,
                            keys: list[bytes]) -> tuple[int, kvblocks.PromptCache] | None:
        """Restore the checkpoint ``checkpoint_match`` (and, for models that also have KV
        layers, their blocks up to exactly the same position); None unless all of it
        verifies and fits."""
        from mlxkv.storage.io import ReadRequest

        n = checkpoint_match.n_tokens
        try:
            carrays = layout.checkpoint_buffers(checkpoint_match.layout)
            blocks: list[layout.RestoreLayer] = []
            if layout.checkpoint_has_blocks(checkpoint_match.layout):
                block_match = self.disk.lookup(store_ns, toks, max_tokens=n, keys=keys)
                if block_match.n_tokens != n or not layout.is_partial(block_match.layout):
                    return None  # its KV layers are not all on disk: nothing to restore
                blocks, bsegs, barrays = layout.block_buffers(
                    block_match.layout, kvblocks.round_up(len(toks)), self._taker(store_ns))
        except layout.LayoutError as exc:
            self._unusable(store_ns, exc)
            return None
        bfut = None
        if blocks:
            bfut = self.io.submit_read(ReadRequest(store_ns, toks, block_match.layout, bsegs,
                                                   n_tokens=block_match, keep=barrays))
            del bsegs, barrays
        cres = self._wait(self.io.submit_read(ReadRequest(
            store_ns, toks, checkpoint_match.layout,
            [(kvblocks.byte_view(a), 1, 1, a.nbytes) for a in carrays],
            n_tokens=checkpoint_match, keep=carrays, checkpoint=True)))
        if bfut is not None:
            if self._stuck:  # the reader is stuck: the block read will not come soon
                self._stuck.append(bfut)
                return None
            bres = self._wait(bfut)
            if bres is None or bres.n_tokens != n:
                return None
        if cres is None or cres.n_tokens != n:
            return None
        try:
            layers = layout.checkpoint_layers(checkpoint_match.layout, carrays)
            for li, spec, arrs in blocks:
                layers[li] = kvblocks.make_layer(spec, arrs, n)
            if sorted(layers) != list(range(len(layers))):
                raise layout.LayoutError("a checkpoint does not cover every layer")
            cache = [layers[i] for i in range(len(layers))]
            if kvblocks.cache_tokens(cache) not in (None, n):
                raise layout.LayoutError(f"a checkpoint at {n} tokens holds another position")
            self.templates.check(store_ns, cache)
        except layout.LayoutError as exc:
            self._unusable(store_ns, exc)
            return None
        return n, cache

    # ------------------------------------------------------------------ persist
    def retain(self, store_ns: str, toks: np.ndarray, keys: list[bytes], ttl_s: float) -> None:
        """Keep the files of the state of ``toks`` (``keys``: its chain keys) over others
        when the store evicts, for ``ttl_s`` seconds (a retention hint)."""
        block_tokens = self.disk.block_tokens
        rest = toks[len(keys) * block_tokens:]
        held = list(keys) + [ckpt_key_of(store_ns, toks, block_tokens)]
        if len(rest):
            held.append(tail_key_of(store_ns, keys[-1] if keys else ZERO_KEY, rest))
        self.disk.retain(store_ns, held, ttl_s)

    def persist(self, store_ns: str, toks: np.ndarray, cache: kvblocks.PromptCache,
                block_mode: bool,
                checkpoint: kvblocks.Checkpoint | None) -> bool:
        """Hand a snapshot of ``cache`` (holding ``toks``) to the writer; False when it
        cannot be persisted (kept in RAM only)."""
        state_id = entry_id(store_ns, toks)
        snap: WriteRequests | None
        if block_mode:
            snap = self.block_snapshot(store_ns, toks, cache, state_id)
        else:
            snap = self._checkpoint_snapshot(store_ns, toks, cache, checkpoint, state_id)
        if snap is None:
            return False
        self.durability.mark(store_ns, toks, snap, coalesce=block_mode, entry_id=state_id)
        return True

    def block_snapshot(self, store_ns: str, toks: np.ndarray, cache: kvblocks.PromptCache,
                       state_id: str) -> WriteRequest:
        """New array objects over the cache's evaluated buffers, byte views of them, a
        manifest so GC keeps the state, and a low writer priority."""
        from mlxkv.storage.io import WriteRequest

        specs, segs, keep = layout.block_layout(cache, len(toks))
        return WriteRequest(store_ns, toks, tuple(specs), segs, manifest=manifest_name(state_id),
                        keep=keep, on_start=_background_priority)

    def _checkpoint_snapshot(self, store_ns: str, toks: np.ndarray, cache: kvblocks.PromptCache,
                             checkpoint: kvblocks.Checkpoint | None, state_id: str
                             ) -> WriteRequests | None:
        """WriteRequest(s) of a non-block cache: its non-trimmable layers as one checkpoint
        (after its KV layers as blocks, when it has any); None if it cannot be persisted."""
        from mlxkv.storage.io import WriteRequest

        block_idx, ckpt_idx = layout.split_layers(cache)
        try:
            if checkpoint is None:
                checkpoint = kvblocks.take_checkpoint(cache)
            specs, segs, keep = layout.checkpoint_layout(checkpoint, ckpt_idx, bool(block_idx))
            snaps: list[WriteRequest] = []
            if block_idx:
                bspecs, bsegs, bkeep = layout.block_layout(cache, len(toks), block_idx, part=True)
                # no manifest of its own: the checkpoint's names the blocks and tail too
                snaps.append(WriteRequest(store_ns, toks, tuple(bspecs), bsegs, keep=bkeep,
                                      on_start=_background_priority))
        except kvblocks.UnsupportedCache:
            return None
        snaps.append(WriteRequest(store_ns, toks, tuple(specs), segs, manifest=manifest_name(state_id),
                              keep=keep, on_start=_background_priority, checkpoint=True))
        return snaps[0] if len(snaps) == 1 else tuple(snaps)

    def _submit(self, snap: WriteRequests) -> Future[Written]:
        """Durability's submit: one snapshot, or several written in order (blocks, then the
        checkpoint that needs them) whose future settles when all have."""
        if not isinstance(snap, tuple):  # (a PutResult is Written; Future is invariant)
            return cast("Future[Written]", self.io.submit_write(snap, block=False))
        futs = [self.io.submit_write(s, block=False) for s in snap]
        out: Future[Written] = Future()
        left = [len(futs)]
        lock = threading.Lock()

        def done(_: Future[PutResult]) -> None:
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

    def _settled(self, job: StateWrite) -> None:
        """Writer thread: a write settled (durable or failed for good)."""
        if job.state == "durable":
            self.events.emit("persisted", id=job.entry_id, ns=job.ns, tokens=job.ntokens,
                             bytes=job.bytes_written)

    # ------------------------------------------------------------------ lifecycle
    def flush(self, timeout: float | None) -> FlushReport:
        return self.durability.flush(timeout)

    def close(self, timeout: float | None) -> FlushReport:
        report = self.durability.close(timeout)
        self.io.close(timeout)
        return report

    def stats(self) -> dict[str, object]:
        st = self.disk.stats()
        return {"ssd": True, "ssd_bytes": st["bytes"], "ssd_max_bytes": st.get("max_bytes"),
                "ssd_blocks": st["blocks"],
                "ssd_namespaces": {ns: v["bytes"] for ns, v in st.get("namespaces", {}).items()},
                "ssd_tails": st["tails"], "ssd_checkpoints": st.get("checkpoints", 0),
                "ssd_root": st["root"], "kernel": st["kernel"],
                "durability": self.durability.report(), **self.durability.timings(),
                "write_counts": dict(self.durability.counts),
                "queues": {**self.durability.queue_depth(),
                           "storage_pending_writes": self.io.pending_writes,
                           "storage_pending_reads": self.io.pending_reads}}
