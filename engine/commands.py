"""The engine thread's command queue: what callers hand the engine thread, and the order in
which the engine thread takes it.

Callers (any thread) put requests (:class:`RequestHandle`), calls (:class:`Call`, run
between requests) and quick calls (run between two tokens; a :data:`WAKE` marker in the
queue says one waits). The engine thread takes them one by one, through a
:class:`CommandSource` (the plain one waits on the queue; a sharded engine's keeps its
peers informed meanwhile), and may look ahead: commands it took to look at and has not
handled yet wait in the backlog, in order. :data:`STOP` ends the engine thread's loop.

Closing the queue (shutdown, a failed load, the end of the loop) is checked under the
same lock as every put, so nothing lands behind :data:`STOP`.
"""

from __future__ import annotations

import collections
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Protocol, TypeVar

from mlxkv.engine.requests import EngineError, ErrorEvent, FinishedEvent, QueueFull, RequestHandle

T = TypeVar("T")

STOP = object()  # the command loop ends
WAKE = object()  # a quick call is waiting


class Call:
    """``fn(*args)`` to run on the engine thread; its result (or error) goes to ``future``."""

    def __init__(self, fn: Callable[..., Any], args: tuple):
        self.fn, self.args = fn, args
        self.future: Future[Any] = Future()

    def run(self) -> None:
        if self.future.set_running_or_notify_cancel():
            try:
                self.future.set_result(self.fn(*self.args))
            except BaseException as e:
                self.future.set_exception(e)


Command = RequestHandle | Call | object  # object: STOP or WAKE


class CommandSource(Protocol):
    """Where the engine thread's loop takes its next command from."""

    def next_command(self, commands: CommandQueue) -> Command:
        """Wait for the next command (:data:`STOP` ends the loop)."""

    def stopped(self) -> None:
        """The command loop ended."""


class QueueSource:
    """The plain source: the queue itself."""

    def next_command(self, commands: CommandQueue) -> Command:
        return commands.get()

    def stopped(self) -> None:
        return None


def wait(future: Future[T], timeout: float | None, what: str) -> T:
    """The result of ``future``; :class:`EngineError` when ``timeout`` passes first."""
    try:
        return future.result(timeout)
    except FutureTimeout:  # the builtin TimeoutError only from Python 3.11 on
        future.cancel()
        raise EngineError(f"the engine did not answer ({what}) within {timeout} s") from None


class CommandQueue:
    """The queue, the quick calls, the look-ahead backlog and the count of waiting
    requests (at most ``max_queue``). ``put``-side methods are thread-safe; the others
    are the engine thread's."""

    def __init__(self, max_queue: int):
        self.max_queue = max_queue
        self._queue: queue.Queue[Command] = queue.Queue()
        self._quick: collections.deque[Call] = collections.deque()
        self._backlog: collections.deque[Command] = collections.deque()
        self._lock = threading.Lock()
        self._open = False
        self._closed = threading.Event()
        self._error: BaseException | None = None  # what submit raises once the load failed
        self._waiting = 0  # requests submitted and not yet served

    # any thread
    def open(self) -> None:
        """Accept commands (the engine thread is about to start)."""
        with self._lock:
            self._open = True

    def close(self, error: BaseException | None = None, wake: bool = False) -> bool:
        """Accept nothing more (``submit`` raises ``error`` when given); with ``wake``, put
        :data:`STOP` behind what is queued. False when it was closed already."""
        with self._lock:
            if self._closed.is_set():
                return False
            self._closed.set()
            if error is not None:
                self._error = error
            if wake:
                self._queue.put(STOP)
            return True

    def is_closed(self) -> bool:
        return self._closed.is_set()

    @property
    def waiting(self) -> int:
        """Requests submitted and not yet served."""
        return self._waiting

    def _refusal(self) -> EngineError | None:
        if self._closed.is_set() or not self._open:
            return EngineError("engine is not running")
        return None

    def submit(self, handle: RequestHandle) -> None:
        """Queue a request; :class:`QueueFull` when ``max_queue`` already wait."""
        with self._lock:
            if self._error is not None:
                raise self._error
            refused = self._refusal()
            if refused is not None:
                raise refused
            if self._waiting >= self.max_queue:
                raise QueueFull(f"{self._waiting} requests are already waiting (the engine's "
                                f"max_queue is {self.max_queue}); try again later")
            self._waiting += 1
            self._queue.put(handle)

    def call(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Queue ``fn(*args)`` to run between requests (a closed queue fails the Future)."""
        cmd = Call(fn, args)
        with self._lock:
            refused = self._refusal()
            if refused is not None:
                cmd.future.set_exception(refused)
            else:
                self._queue.put(cmd)
        return cmd.future

    def quick(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Queue ``fn(*args)`` to run as soon as the engine thread is between two tokens
        (or two requests); raises :class:`EngineError` when closed."""
        cmd = Call(fn, args)
        with self._lock:
            refused = self._refusal()
            if refused is not None:
                raise refused
            self._quick.append(cmd)
            self._queue.put(WAKE)
        return cmd.future

    # the engine thread
    def get(self, timeout: float | None = None) -> Command:
        """Wait for the next queued command (``queue.Empty`` after ``timeout``)."""
        return self._queue.get(timeout=timeout)

    def next(self, source: CommandSource) -> Command:
        """The next command to handle: the backlog's first, else the source's."""
        return self._backlog.popleft() if self._backlog else source.next_command(self)

    def take(self, handle: RequestHandle) -> None:
        """``handle`` stops waiting: it is served now (or answered)."""
        with self._lock:
            self._waiting -= 1

    def run_quick(self) -> None:
        while self._quick:
            self._quick.popleft().run()

    def peek(self) -> Command | None:
        """The next command still to handle (None: nothing queued), left in the backlog;
        quick-call markers met on the way are served."""
        while True:
            if not self._backlog:
                try:
                    self._backlog.append(self._queue.get_nowait())
                except queue.Empty:
                    return None
            head = self._backlog[0]
            if head is not WAKE:
                return head
            self._backlog.popleft()
            self.run_quick()

    def pop(self) -> Command:
        """Remove the backlog's first command (the one :meth:`peek` returned)."""
        return self._backlog.popleft()

    def has_backlog(self) -> bool:
        return bool(self._backlog)

    def look_ahead(self, timeout: float) -> None:
        """Wait up to ``timeout`` for a command, kept in the backlog."""
        try:
            self._backlog.append(self._queue.get(timeout=timeout))
        except queue.Empty:
            pass

    def take_cancelled(self) -> list[RequestHandle]:
        """Remove the waiting requests cancelled before they started, wherever they are
        in line (each is taken: it stops counting against ``max_queue``)."""
        while True:
            try:
                self._backlog.append(self._queue.get_nowait())
            except queue.Empty:
                break
        cancelled = [c for c in self._backlog if isinstance(c, RequestHandle) and c.cancelled]
        if cancelled:
            kept = [c for c in self._backlog
                    if not (isinstance(c, RequestHandle) and c.cancelled)]
            self._backlog.clear()
            self._backlog.extend(kept)
            for handle in cancelled:
                self.take(handle)
        return cancelled

    def drain(self, error: BaseException | None = None) -> None:
        """Answer everything still queued: cancelled (shutdown), or ``error`` (a failed
        load). Called once the queue is closed, so nothing is enqueued any more."""
        with self._lock:
            pending = list(self._quick) + list(self._backlog)
            self._quick.clear()
            self._backlog.clear()
            while True:
                try:
                    pending.append(self._queue.get_nowait())
                except queue.Empty:
                    break
        for cmd in pending:
            if isinstance(cmd, RequestHandle):
                self.take(cmd)
                cmd.emit(ErrorEvent(str(error), error) if error is not None
                          else FinishedEvent("cancelled", "shutdown"))
            elif isinstance(cmd, Call):
                cmd.future.set_exception(error if error is not None
                                         else EngineError("engine shut down"))
