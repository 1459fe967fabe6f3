"""Durability coordinator: write-behind of prefix-cache state to the SSD tier.

Every ``store()`` marks its state dirty with an immutable snapshot; the coordinator hands
snapshots to the storage writer thread without ever blocking the engine thread. It
debounces and coalesces (a newer state that extends a waiting one supersedes it), bounds
the writes in flight, retries failures, and yields to decoding while the engine is
``busy`` (bounded by ``max_delay_s`` and ``pressure_bytes``). ``flush`` reports
``{durable, flushed, pending, failed, missing}`` and counts as durable only writes that
returned with fsync. Settled writes shrink to small records; future callbacks run on the
writer thread, so all state is guarded by one condition.
"""

from __future__ import annotations

import functools
import logging
import statistics
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypeAlias, TypedDict

import numpy as np
import xxhash

if TYPE_CHECKING:
    from mlxkv.storage.io import WriteRequest
    from mlxkv.storage.keys import BufferLike

# What one write hands the writer: a snapshot, or several written together in order.
WriteRequests: TypeAlias = "WriteRequest | tuple[WriteRequest, ...]"


class FlushReport(TypedDict):
    """States by where their writes stand (``flushed``: written by this flush)."""

    durable: int
    flushed: int
    pending: int
    failed: int
    missing: int


def empty_flush_report() -> FlushReport:
    return {"durable": 0, "flushed": 0, "pending": 0, "failed": 0, "missing": 0}


class Written(Protocol):
    """What a write that landed reports (``storage.keys.PutResult``, or several)."""

    @property
    def bytes_written(self) -> int: ...


def _nbytes(buffer: BufferLike) -> int:
    return int(buffer.nbytes) if isinstance(buffer, np.ndarray) else memoryview(buffer).nbytes


def _log_warning(condition: str, msg: str, *args: object, logged: bool = False) -> bool:
    log.log(logging.DEBUG if logged else logging.WARNING, msg, *args)
    return True

log = logging.getLogger("mlxkv.cache")

PENDING, WRITING, DURABLE, FAILED, SUPERSEDED, MISSING = (
    "pending", "writing", "durable", "failed", "superseded", "missing")


def write_key(ns: str, tokens: np.ndarray) -> tuple[str, bytes]:
    """A state's key: its namespace and a 128-bit hash of its tokens (not the tokens)."""
    return (ns, xxhash.xxh3_128_digest(np.ascontiguousarray(tokens, dtype="<u4").tobytes()))


@dataclass(eq=False, slots=True)
class StateWrite:
    """The write of one stored state to the SSD tier, from its store until it settles."""

    ns: str  # storage namespace
    tokens: np.ndarray | None  # None once settled (only a pending write needs them)
    snapshot: WriteRequests | None  # None once settled
    key: tuple[str, bytes] = ("", b"")
    ntokens: int = 0
    entry_id: str = ""  # the entry id, for events
    bytes_written: int = 0
    state: str = PENDING
    due: float = 0.0
    attempts: int = 0
    error: str | None = None
    superseded_by: StateWrite | None = None
    nbytes: int = 0  # bytes the snapshot pins until it settles
    evicted: bool = False  # the RAM tier no longer holds this state
    coalesce: bool = True  # False: an exact-position checkpoint, never covered by another
    yielded: bool = False  # waited for the engine to go idle
    marked: float = field(default_factory=time.monotonic)

    def settle(self, state: str) -> None:
        """Enter a final-ish state: drop what only a pending write needs."""
        self.state = state
        if state in (DURABLE, SUPERSEDED, MISSING):
            self.snapshot = self.tokens = None

    def final(self) -> StateWrite:
        j = self
        while j.state == SUPERSEDED and j.superseded_by is not None:
            j = j.superseded_by
        return j


class Durability:
    """Tracks dirty states and drives the writer (see the module docstring)."""

    def __init__(self, submit: Callable[[WriteRequests], Future[Written]], debounce_s: float = 0.0,
                 max_inflight: int = 2, retries: int = 2, keep_settled: int = 4096,
                 on_settled: Callable[[StateWrite], None] | None = None,
                 warn: Callable[..., object] | None = None, max_delay_s: float = 5.0,
                 pressure_bytes: int | None = None) -> None:
        self._submit = submit
        self.max_delay_s = max(0.0, float(max_delay_s))
        self.pressure_bytes = pressure_bytes  # None: no bound from memory
        self._busy = False
        self._idle = threading.Event()  # set while the engine is idle (wakes a paced write)
        self._idle.set()
        self.pace_s = 0.05
        self.paced = 0  # pauses taken between block files while the engine was busy
        self._durable_s: deque[float] = deque(maxlen=256)  # store -> durable, recent writes
        self.yielded = 0  # writes that waited for the engine to go idle
        self._on_settled = on_settled  # called on the writer thread, lock not held
        self._warn = warn or _log_warning
        self.debounce_s = max(0.0, float(debounce_s))
        self.max_inflight = max(1, int(max_inflight))
        self.retries = max(0, int(retries))
        self._cond = threading.Condition()
        self._jobs: OrderedDict[tuple[str, bytes], StateWrite] = OrderedDict()
        self._queue: list[StateWrite] = []  # pending, in submission order
        self._inflight = 0
        self._timer: threading.Timer | None = None
        self._closed = False
        self._keep_settled = keep_settled
        self._flushing = False
        self.counts = {"marked": 0, "written": 0, "superseded": 0, "retried": 0,
                       "failed": 0, "missing": 0, "bytes_written": 0}

    # ------------------------------------------------------------------ engine side
    def mark(self, ns: str, tokens: np.ndarray, snapshot: WriteRequests, coalesce: bool = True,
             entry_id: str = "") -> StateWrite:
        """Record a dirty state; returns its job. Never blocks on I/O. ``snapshot`` is one
        storage snapshot or a tuple of them (written together). ``coalesce=False``: the
        state is only valid at exactly ``tokens`` (a checkpoint), so a longer state does
        not supersede it nor it a shorter one."""
        key = write_key(ns, tokens)
        with self._cond:
            have = self._jobs.get(key)
            if have is not None and have.state in (PENDING, WRITING, DURABLE):
                return have  # the same state is already on its way (or on disk)
            snaps = snapshot if isinstance(snapshot, tuple) else (snapshot,)
            job = StateWrite(ns, tokens, snapshot, key, len(tokens), entry_id,
                             due=time.monotonic() + self.debounce_s,
                             nbytes=sum(_nbytes(seg[0]) for s in snaps for seg in s.segments),
                             coalesce=coalesce)
            self.counts["marked"] += 1
            for old in self._queue:
                if (coalesce and old.coalesce and old.ns == ns and old.tokens is not None
                        and len(old.tokens) < len(tokens)
                        and np.array_equal(old.tokens, tokens[: len(old.tokens)])):
                    old.superseded_by = job
                    old.settle(SUPERSEDED)
                    self.counts["superseded"] += 1
            self._queue = [j for j in self._queue if j.state == PENDING]
            self._jobs.pop(key, None)
            self._jobs[key] = job
            self._queue.append(job)
            self._trim_settled()
            self._pump(force=False)
            return job

    def state(self, ns: str, tokens: np.ndarray) -> str | None:
        with self._cond:
            j = self._jobs.get(write_key(ns, tokens))
            return None if j is None else j.final().state

    def forget(self, ns: str, tokens: np.ndarray) -> None:
        """The RAM tier dropped this state: a write that already failed can never happen."""
        with self._cond:
            j = self._jobs.get(write_key(ns, tokens))
            if j is None:
                return
            j.evicted = True
            if j.state == FAILED:
                j.settle(MISSING)
                self.counts["missing"] += 1
            elif j.state == PENDING:  # the snapshot is its only copy now: no more waiting
                self._pump(force=False)

    def hurry(self, ns: str, tokens: np.ndarray) -> None:
        """Write this state next (it is leaving RAM): skip its debounce."""
        with self._cond:
            j = self._jobs.get(write_key(ns, tokens))
            if j is None or j.state != PENDING or j not in self._queue:
                return
            self._queue.remove(j)
            j.due = 0.0
            self._queue.insert(0, j)
            self._pump(force=False)

    def cancel(self, ns: str, tokens: np.ndarray, timeout: float | None = 10.0) -> bool:
        """Forget this state: a pending write is dropped, a running one is waited for (up
        to ``timeout``). False when a write of it may still land on disk after this."""
        deadline = None if timeout is None else time.monotonic() + timeout
        key = write_key(ns, tokens)
        with self._cond:
            while True:
                j = self._jobs.get(key)
                if j is None:
                    return True
                if j.state != WRITING:
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
            if j in self._queue:
                self._queue.remove(j)
            del self._jobs[key]
            j.settle(MISSING)
            return True

    def busy(self, active: bool) -> None:
        """The engine started (True) or stopped (False) serving: while busy, due writes
        wait (see the module docstring); going idle submits them."""
        with self._cond:
            if self._busy == bool(active):
                return
            self._busy = bool(active)
            if self._busy:
                self._idle.clear()
            else:
                self._idle.set()
                self._pump(force=False)

    def _pace(self) -> None:
        """Writer thread, between two block files: pause while the engine is busy."""
        with self._cond:
            pause = self._busy and not self._flushing and not self._closed and not (
                self.pressure_bytes is not None
                and sum(j.nbytes for j in self._queue) > self.pressure_bytes)
            if pause:
                self.paced += 1
        if pause:
            self._idle.wait(self.pace_s)

    def _must_go(self, job: StateWrite, now: float) -> bool:
        """Whether a due write goes although the engine is busy (lock held)."""
        if job.evicted or job.due <= 0.0 or now - job.marked >= self.max_delay_s:
            return True
        if self.pressure_bytes is not None:
            waiting = sum(j.nbytes for j in self._queue)
            return waiting > self.pressure_bytes
        return False

    # ------------------------------------------------------------------ pumping
    def _pump(self, force: bool) -> None:
        """Submit due jobs while there is room (called with the lock held)."""
        now = time.monotonic()
        next_due = None
        while self._queue and self._inflight < self.max_inflight and not self._closed:
            job = self._queue[0]
            if not force and job.due > now:
                next_due = job.due
                break
            if not force and self._busy and not self._must_go(job, now):
                # yield to decoding; look again when its maximum delay runs out
                next_due = job.marked + self.max_delay_s
                if not job.yielded:
                    job.yielded = True
                    self.yielded += 1
                break
            self._queue.pop(0)
            job.state = WRITING
            job.attempts += 1
            self._inflight += 1
            snapshot = job.snapshot
            for snap in () if snapshot is None else \
                    snapshot if isinstance(snapshot, tuple) else (snapshot,):
                if hasattr(snap, "pace"):
                    snap.pace = self._pace
            try:
                if snapshot is None:  # (a queued write holds its snapshot until it settles)
                    raise ValueError("a write without its snapshot")
                fut = self._submit(snapshot)
            except Exception as exc:  # noqa: BLE001  (closed storage...: settle as a failure)
                fut = Future[Written]()
                fut.set_exception(exc)
            fut.add_done_callback(functools.partial(self._done, job))
        if next_due is not None and self._timer is None:
            self._timer = threading.Timer(max(0.0, next_due - now), self._tick)
            self._timer.daemon = True
            self._timer.start()

    def _tick(self) -> None:
        with self._cond:
            self._timer = None
            self._pump(force=False)

    def _done(self, job: StateWrite, fut: Future[Written]) -> None:
        from mlxkv.storage.io import WriteQueueFull
        from mlxkv.storage.keys import StoreWriteError

        warning = None
        with self._cond:
            self._inflight -= 1
            exc = fut.exception()
            told = isinstance(exc, StoreWriteError)  # the store warned the user about it
            if exc is None:
                job.bytes_written = int(getattr(fut.result(), "bytes_written", 0))
                self._durable_s.append(time.monotonic() - job.marked)
                job.settle(DURABLE)
                self.counts["written"] += 1
                self.counts["bytes_written"] += job.bytes_written
                settled = job
            elif isinstance(exc, WriteQueueFull) and not self._closed:
                # The storage queue is shared and full: try again shortly, off this stack.
                job.attempts -= 1
                job.state, job.due = PENDING, time.monotonic() + 0.05
                self._queue.insert(0, job)
                if self._timer is None:
                    self._timer = threading.Timer(0.05, self._tick)
                    self._timer.daemon = True
                    self._timer.start()
                self._cond.notify_all()
                return
            elif job.attempts <= self.retries and not self._closed:
                self.counts["retried"] += 1
                warning = ("write-retry", "prefix cache: a write of %d tokens to the SSD "
                           "failed (%s); retrying", job.ntokens, exc, told)
                job.state = PENDING
                self._queue.insert(0, job)
                settled = None
            else:
                job.state, job.error = FAILED, f"{type(exc).__name__}: {exc}"
                self.counts["failed"] += 1
                if job.evicted:  # nothing else holds this state any more
                    job.settle(MISSING)
                    self.counts["missing"] += 1
                warning = ("write-failed", "prefix cache: giving up on a write of %d tokens "
                           "to the SSD: %s", job.ntokens, exc, told)
                settled = job
            self._pump(force=self._flushing)
            self._cond.notify_all()
        # outside the lock: a receiver may call back in (stats, report)
        if warning is not None:
            self._warn(*warning[:-1], logged=warning[-1])
        if settled is not None and self._on_settled is not None:
            self._on_settled(settled)

    def _trim_settled(self) -> None:
        extra = len(self._jobs) - self._keep_settled
        if extra <= 0:
            return
        for key in [k for k, j in self._jobs.items() if j.state in (DURABLE, SUPERSEDED,
                                                                     MISSING)][:extra]:
            del self._jobs[key]

    # ------------------------------------------------------------------ flush / close
    def flush(self, timeout: float | None = None) -> FlushReport:
        """Write every dirty state now; wait up to ``timeout`` seconds; report."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            before = self.counts["written"]
            for j in self._jobs.values():  # a flush tries failed writes again (space freed?)
                if j.state == FAILED and j.snapshot is not None and not self._closed:
                    j.state, j.attempts, j.error = PENDING, 0, None
                    self._queue.append(j)
            self._flushing = True
            try:
                self._pump(force=True)
                while self._queue or self._inflight:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        break
                    self._cond.wait(left)
                    self._pump(force=True)
            finally:
                self._flushing = False
            return self._report(self.counts["written"] - before)

    def _report(self, flushed: int) -> FlushReport:
        report = empty_flush_report()
        report["flushed"] = flushed
        for j in self._jobs.values():
            s = j.final().state
            if s == DURABLE:
                report["durable"] += 1
            elif s in (PENDING, WRITING):
                report["pending"] += 1
            elif s == FAILED:
                report["failed"] += 1
            elif s == MISSING:
                report["missing"] += 1
        return report

    def report(self) -> FlushReport:
        with self._cond:
            return self._report(0)

    def timings(self) -> dict[str, float | int | None]:
        """``durable_after_turn_s``: median seconds from a state's store to its write being
        durable (recent writes; None before the first); ``yielded``: writes that waited
        for the engine to go idle; ``paced``: pauses between block files while busy."""
        with self._cond:
            d = list(self._durable_s)
            return {"durable_after_turn_s": statistics.median(d) if d else None,
                    "yielded": self.yielded, "paced": self.paced}

    def wait(self, ns: str, tokens: np.ndarray, timeout: float | None = None) -> str | None:
        """Wait (up to ``timeout``) until this state's write settles; its state then."""
        deadline = None if timeout is None else time.monotonic() + timeout
        key = write_key(ns, tokens)
        with self._cond:
            while True:
                j = self._jobs.get(key)
                state = None if j is None else j.final().state
                if state not in (PENDING, WRITING):
                    return state
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return state
                self._cond.wait(left)

    def queue_depth(self) -> dict[str, int]:
        with self._cond:
            pinned = sum(j.nbytes for j in self._jobs.values() if j.snapshot is not None)
            return {"waiting": len(self._queue), "inflight": self._inflight,
                    "pinned_bytes": pinned}

    def close(self, timeout: float | None = None) -> FlushReport:
        report = self.flush(timeout)
        with self._cond:
            self._closed = True
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            for j in self._queue:  # never written: their state is gone with this process
                j.settle(MISSING)
                self.counts["missing"] += 1
            self._queue.clear()
            report = self._report(report["flushed"])
        return report
