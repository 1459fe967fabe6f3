"""One writer thread and one reader thread in front of a :class:`BlockStore`.

    io = StorageIO(store, max_pending_writes=4)
    fut = io.submit_write(WriteRequest(ns, tokens, layout, segments))  # -> Future[PutResult]
    fut = io.submit_read(ReadRequest(ns, tokens, layout, dst_segments, n_tokens=match))
                                                                     # -> Future[Restore]
    io.close(timeout=10.0)   # drains; -> {"written", "failed", "pending", ...}

The threads call into the store (and its Cython kernels, which release the GIL); each
opens, uses and closes its own descriptors. A submitted request (its buffers,
and whatever ``keep`` holds, e.g. the mx arrays behind the memoryviews) stays referenced
until its future settles: the caller must not mutate those buffers before then. Reads
have their own thread and queue, so a read never waits behind queued writes. The write
queue is bounded: ``submit_write`` blocks for a slot, or with ``block=False`` / a
``timeout`` returns a future that has failed with :class:`WriteQueueFull` — a write
is never dropped silently.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TypeVar

import numpy.typing as npt

from mlxkv.storage.format import LayoutLike
from mlxkv.storage.keys import CacheFolderError, Segment
from mlxkv.storage.store import BlockStore, Match, PutResult, Restore

log = logging.getLogger("mlxkv.storage")


class WriteQueueFull(RuntimeError):
    """The bounded write queue had no free slot in time; the write was not queued."""


class StorageClosed(RuntimeError):
    """The StorageIO was closed before this request ran."""


@dataclass
class WriteRequest:
    """Immutable KV state of ``tokens`` to persist (rows [0, len(tokens)) of segments)."""

    ns: str
    tokens: npt.ArrayLike
    layout: LayoutLike
    segments: Sequence[Segment]
    tail: bool = True
    manifest: str | None = None
    durable: bool | None = None
    keep: object = None  # kept alive until the future settles (e.g. the mx arrays)
    on_start: Callable[[], None] | None = None  # called on the writer thread first
    checkpoint: bool = False  # whole states at exactly len(tokens): put_checkpoint
    pace: Callable[[], None] | None = None  # called between the files of a block write


@dataclass
class ReadRequest:
    """Restore ``n_tokens`` (a Match, a count, or None = longest prefix) into segments."""

    ns: str
    tokens: npt.ArrayLike
    layout: LayoutLike | None  # a Match's layout (None only for a match of nothing)
    segments: Sequence[Segment]
    n_tokens: int | Match | None = None
    keep: object = None
    checkpoint: bool = False  # n_tokens is a Match from lookup_checkpoint


_Job = TypeVar("_Job", WriteRequest, ReadRequest)
_Result = TypeVar("_Result", PutResult, Restore)


class StorageIO:
    """Writer and reader threads for one store (see the module docstring)."""

    def __init__(self, store: BlockStore, max_pending_writes: int = 4,
                 name: str = "mlxkv-storage") -> None:
        if max_pending_writes < 1:
            raise ValueError(f"max_pending_writes must be >= 1, got {max_pending_writes}")
        self.store = store
        self.max_pending_writes = max_pending_writes
        self._slots = threading.Semaphore(max_pending_writes)
        # (future, request) per request; None stops the thread
        self._write_queue: queue.SimpleQueue[tuple[Future[PutResult], WriteRequest] | None] = \
            queue.SimpleQueue()
        self._read_queue: queue.SimpleQueue[tuple[Future[Restore], ReadRequest] | None] = \
            queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._abort = threading.Event()
        self._pending = 0  # writes submitted and not settled
        self._pending_reads = 0  # reads submitted and not settled (queued or running)
        self._counts = {"written": 0, "failed": 0, "read": 0, "read_failed": 0, "cancelled": 0}
        self._writer = threading.Thread(target=self._run, args=(self._write_queue, self._write, True),
                                        name=f"{name}-writer", daemon=True)
        self._reader = threading.Thread(target=self._run, args=(self._read_queue, self._read, False),
                                        name=f"{name}-reader", daemon=True)
        self._writer.start()
        self._reader.start()

    # ------------------------------------------------------------------ submit
    def submit_write(self, request: WriteRequest, block: bool = True,
                     timeout: float | None = None) -> Future[PutResult]:
        """Queue a write; -> Future[PutResult]. Blocks while the queue is full unless
        ``block=False`` or ``timeout`` runs out (then the future fails WriteQueueFull)."""
        if not isinstance(request, WriteRequest):
            raise TypeError(f"submit_write takes a WriteRequest, got {type(request).__name__}")
        fut: Future[PutResult] = Future()
        self._check_open()
        if not self._slots.acquire(blocking=block, timeout=timeout if block else None):
            fut.set_exception(WriteQueueFull(
                f"{self.max_pending_writes} writes already pending; write not queued"))
            return fut
        with self._lock:
            if self._closed:
                self._slots.release()
                raise StorageClosed("StorageIO is closed")
            self._pending += 1
            self._write_queue.put((fut, request))
        return fut

    def submit_read(self, request: ReadRequest) -> Future[Restore]:
        """Queue a restore on the reader thread; -> Future[Restore]."""
        if not isinstance(request, ReadRequest):
            raise TypeError(f"submit_read takes a ReadRequest, got {type(request).__name__}")
        fut: Future[Restore] = Future()
        with self._lock:
            self._check_open()
            self._pending_reads += 1
            self._read_queue.put((fut, request))
        return fut

    @property
    def pending_writes(self) -> int:
        with self._lock:
            return self._pending

    @property
    def pending_reads(self) -> int:
        """Reads queued or running on the reader thread (its queue depth)."""
        with self._lock:
            return self._pending_reads

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {**self._counts, "pending": self._pending}

    # ------------------------------------------------------------------ threads
    def _write(self, request: WriteRequest) -> PutResult:
        if request.on_start is not None:
            request.on_start()
        if request.checkpoint:
            return self.store.put_checkpoint(
                request.ns, request.tokens, request.layout, request.segments,
                manifest=request.manifest, durable=request.durable)
        return self.store.put_blocks(
            request.ns, request.tokens, request.layout, request.segments, tail=request.tail,
            manifest=request.manifest, durable=request.durable, pace=request.pace)

    def _read(self, request: ReadRequest) -> Restore:
        if request.layout is None:
            raise TypeError("a read needs the layout of what it restores")
        if request.checkpoint:
            if not isinstance(request.n_tokens, Match):
                raise ValueError("a checkpoint read needs the Match from lookup_checkpoint")
            return self.store.get_checkpoint(request.ns, request.n_tokens, request.layout,
                                             request.segments)
        return self.store.get_blocks(request.ns, request.tokens, request.layout,
                                     request.segments, request.n_tokens)

    def _run(self, q: queue.SimpleQueue[tuple[Future[_Result], _Job] | None],
             fn: Callable[[_Job], _Result], is_writer: bool) -> None:
        while True:
            item = q.get()
            if item is None:
                return
            fut: Future[_Result] | None
            job: _Job | None
            fut, job = item
            item = None
            try:
                if self._abort.is_set():
                    if fut.set_running_or_notify_cancel():
                        fut.set_exception(StorageClosed("closed before this request ran"))
                    self._settled(is_writer, "cancelled")
                    continue
                if not fut.set_running_or_notify_cancel():
                    self._settled(is_writer, "cancelled")
                    continue
                try:
                    res = fn(job)
                except BaseException as exc:  # the future carries every failure
                    if not isinstance(exc, (OSError, CacheFolderError)):  # not a disk condition
                        log.exception("mlxkv storage: %s failed", "write" if is_writer else "read")
                    self._settled(is_writer, "failed" if is_writer else "read_failed")
                    job = None  # unpin before the caller is woken
                    fut.set_exception(exc)
                else:
                    self._settled(is_writer, "written" if is_writer else "read")
                    job = None
                    fut.set_result(res)
            finally:
                job = fut = None

    def _settled(self, is_writer: bool, what: str) -> None:
        with self._lock:
            self._counts[what] += 1
            if is_writer:
                self._pending -= 1
            else:
                self._pending_reads -= 1
        if is_writer:
            self._slots.release()

    def _check_open(self) -> None:
        if self._closed:
            raise StorageClosed("StorageIO is closed")

    # ------------------------------------------------------------------ shutdown
    def close(self, timeout: float | None = None) -> dict[str, int]:
        """Stop accepting work, finish queued writes (up to ``timeout`` seconds), stop the
        threads. Writes still queued at the deadline fail with StorageClosed.

        Returns {"written", "failed", "pending", "cancelled", "read", "read_failed"}:
        ``pending`` counts writes not finished when close returned (queued or running).
        """
        with self._lock:
            already = self._closed
            self._closed = True
        if not already:
            self._write_queue.put(None)
            self._read_queue.put(None)
        self._writer.join(timeout)
        if self._writer.is_alive():
            self._abort.set()  # the running write finishes; the queued ones fail fast
        self._reader.join(timeout if not self._writer.is_alive() else 0)
        if not self._writer.is_alive():
            self.store.close()  # its write helper thread; restarts if the store is reused
        with self._lock:
            report = {**self._counts, "pending": self._pending}
        if report["pending"]:
            log.warning("mlxkv storage: closed with %d writes not finished", report["pending"])
        return report

    def __enter__(self) -> StorageIO:  # noqa: PYI034
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
