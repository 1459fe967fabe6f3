"""The engine thread's events, carried to the event loop, and the server's bound on requests
in flight.

The engine calls a handle's callback on its own thread; the callback only schedules a
``put_nowait`` on the loop (never blocks, never waits on the loop), so a slow or gone client
can never stall decoding. A client that goes away cancels its request: the engine stops it
before its next step.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import threading
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, overload

from starlette.responses import StreamingResponse

from mlxkv.engine.requests import (
    EngineError,
    ErrorEvent,
    Event,
    FinishedEvent,
    ProgressEvent,
    QueueFull,
    Request,
    RequestRefused,
    TokenEvent,
)
from mlxkv.server.errors import ApiError

if TYPE_CHECKING:
    from mlxkv.engine.api import EngineAPI
    from mlxkv.engine.pool import Lease


class Gate:
    """Counts requests in flight (submitted and not yet finished on the engine thread):
    beyond ``limit`` a request is answered 429 at once instead of waiting unboundedly."""

    def __init__(self, limit: int):
        self.limit = limit
        self._lock = threading.Condition()
        self.in_flight = 0
        self.rejected = 0
        self.served = 0
        self.cancelled = 0
        # (finish reason, tokens generated) of the last requests that ended
        self.recent: collections.deque[tuple[str, int]] = collections.deque(maxlen=64)

    def enter(self) -> None:
        with self._lock:
            if self.in_flight >= self.limit:
                self.rejected += 1
                raise ApiError(429, f"the server is busy ({self.in_flight} requests in flight, "
                                    f"the limit is {self.limit}); retry later")
            self.in_flight += 1
            self._lock.notify_all()

    def refused(self) -> None:
        with self._lock:
            self.rejected += 1

    def leave(self, reason: str = "error", generated: int = 0) -> None:
        with self._lock:
            self.in_flight -= 1
            self.served += 1
            self.cancelled += reason == "cancelled"
            self.recent.append((reason, generated))
            self._lock.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is in flight (False if ``timeout`` passed first)."""
        return self.wait_in_flight(0, timeout)

    def wait_in_flight(self, n: int, timeout: float) -> bool:
        """Wait until exactly ``n`` requests are in flight (False if ``timeout`` passed)."""
        with self._lock:
            return self._lock.wait_for(lambda: self.in_flight == n, timeout)


# The request an HTTP handler submitted, for what the app adds to every generation
# route's response (the x-mlxkv-cache header): each HTTP request runs in a task of its
# own, so this is the handler's own request, and no route has to hand it over.
current_stream: contextvars.ContextVar[EventStream | None] = contextvars.ContextVar(
    "mlxkv_current_stream", default=None)


def cache_header(stream: EventStream | None) -> str | None:
    """The ``x-mlxkv-cache`` header of ``stream``'s request: what its cache lookup
    matched and, when it matched less than the prompt, where the prompt parted from the
    closest cached state (``engine.lookups.LookupReport.header``); None before the lookup."""
    report = None if stream is None else stream.handle.cache_report
    return None if report is None else report.header()


class EventStream:
    """One submitted request: its events, in order, on the event loop."""

    def __init__(self, engine: EngineAPI, request: Request, gate: Gate,
                 loop: asyncio.AbstractEventLoop, lease: Lease | None = None):
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self._loop = loop
        self._gate = gate
        self._left = False
        self._generated = 0
        self.first_progress: ProgressEvent | None = None  # prompt tokens and cached tokens, before the prefill
        gate.enter()
        # the model stays loaded until the request ends (engine.pool.Lease)
        self._lease = lease
        if lease is not None:
            lease.hold()
        try:
            self.handle = engine.submit(request, callback=self._on_event)
        except Exception as e:
            self._leave()
            if isinstance(e, QueueFull):  # the engine's own bound on waiting requests
                gate.refused()
                raise ApiError(429, f"the engine's queue is full ({e}); retry later") from None
            if isinstance(e, EngineError):
                raise ApiError(503, f"the engine is not serving: {e}") from None
            raise
        current_stream.set(self)

    def _leave(self, reason: str = "error") -> None:
        if not self._left:
            self._left = True
            self._gate.leave(reason, self._generated)
            if self._lease is not None:
                self._lease.release()

    def _on_event(self, event: Event) -> None:  # engine thread
        if isinstance(event, TokenEvent) and event.token is not None:
            self._generated += 1
        elif isinstance(event, (FinishedEvent, ErrorEvent)):
            self._leave(event.reason if isinstance(event, FinishedEvent) else "error")
        try:
            self._loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def cancel(self) -> None:
        self.handle.cancel()

    async def next(self) -> Event:
        return await self.queue.get()

    async def events(self) -> AsyncIterator[Event]:
        """Events up to and including the final FinishedEvent or ErrorEvent; a consumer that
        stops early (client gone, task cancelled) cancels the request."""
        try:
            while True:
                event = await self.queue.get()
                yield event
                if isinstance(event, (FinishedEvent, ErrorEvent)):
                    return
        finally:
            self.cancel()  # no-op once finished


class SseResponse(StreamingResponse):
    """Server-sent events of one request; however the response ends (sent whole, client
    gone before or during the stream, task cancelled), the request is cancelled with it
    (a no-op once it has finished)."""

    def __init__(self, content: Any, stream: EventStream, headers: dict[str, str] | None = None):
        super().__init__(content, media_type="text/event-stream",
                         headers={"cache-control": "no-cache", "x-accel-buffering": "no",
                                  **(headers or {})})
        self._stream = stream

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._stream.cancel()


async def wait_disconnect(receive: Any) -> None:
    """Returns when the client has gone (the request body has been read already)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class _Gone:
    """What waiting for an event gives when the client went away first."""


_GONE = _Gone()


class Waiting:
    """:func:`first_event`'s answer when the engine has not taken the prompt in time (it
    is queued behind other requests): a stream starts anyway, to keep its client."""


WAITING = Waiting()


@overload
async def _next_unless_gone(stream: EventStream, gone: asyncio.Future) -> Event | _Gone: ...
@overload
async def _next_unless_gone(stream: EventStream, gone: asyncio.Future,
                            timeout: float | None) -> Event | Waiting | _Gone: ...
async def _next_unless_gone(stream: EventStream, gone: asyncio.Future,
                            timeout: float | None = None) -> Event | Waiting | _Gone:
    """The stream's next event, or ``_GONE`` (the request cancelled) when ``gone`` (the
    client's disconnect) comes first, or :data:`WAITING` when ``timeout`` passes first."""
    get = asyncio.ensure_future(stream.next())
    done, _ = await asyncio.wait({get, gone}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    if not done:
        get.cancel()  # an event it took stays queued (asyncio.Queue.get gives it back)
        return WAITING
    if get not in done:
        get.cancel()
        stream.cancel()
        return _GONE
    return get.result()


async def first_event(stream: EventStream, receive: Any, accepted: bool = False,
                      wait_s: float | None = None) -> Event | Waiting | None:
    """The request's first event that is not progress, or None when the client went away
    first (the request is then cancelled). With ``accepted``, its first progress event
    (the engine has taken the prompt: a refusal comes before any progress), so that a
    stream's reply starts while the prompt is prefilled and its first token goes out alone.
    With ``wait_s``: :data:`WAITING` when nothing came within that many seconds (the
    stream then starts, and a refusal comes inside it)."""
    loop = asyncio.get_running_loop()
    deadline = None if wait_s is None else loop.time() + wait_s
    gone = asyncio.ensure_future(wait_disconnect(receive))
    try:
        while True:
            left = None if deadline is None else max(0.0, deadline - loop.time())
            event = await _next_unless_gone(stream, gone, left)
            if isinstance(event, _Gone):
                return None
            if isinstance(event, Waiting):
                return event
            if not isinstance(event, ProgressEvent):
                return event
            if stream.first_progress is None:
                stream.first_progress = event
            if accepted:
                return event
    finally:
        gone.cancel()


def error_status(event: ErrorEvent, param: str | None = None) -> ApiError:
    """A request that failed before its first token: 400 when the engine refused the input
    (prompt longer than the context, empty: ``param`` names the field that held it) or the
    model's chat template refused the messages (an order of roles it does not take), 500
    otherwise."""
    from jinja2 import TemplateError

    if isinstance(event.exception, (RequestRefused, ValueError)):
        return ApiError(400, event.message, param)
    if isinstance(event.exception, TemplateError):
        return ApiError(400, f"the model's chat template refused the messages: {event.exception}",
                        "messages")
    return ApiError(500, f"the request failed: {event.message}")


async def collect(stream: EventStream, receive: Any) -> list[Event] | None:
    """Every event of a request that is not streamed, or None when the client went away
    before the end (the request is then cancelled)."""
    gone = asyncio.ensure_future(wait_disconnect(receive))
    events: list[Event] = []
    try:
        while True:
            event = await _next_unless_gone(stream, gone)
            if isinstance(event, _Gone):
                return None
            events.append(event)
            if isinstance(event, (FinishedEvent, ErrorEvent)):
                return events
    finally:
        gone.cancel()


async def all_events(stream: EventStream, first: Event | Waiting, receive: Any) -> list[Event] | None:
    """``first`` (already taken) and every later event of a request that is not streamed,
    or None when the client went away before the end (the request is then cancelled).
    :data:`WAITING` took no event: the events are all still to come."""
    if isinstance(first, Waiting):
        return await collect(stream, receive)
    if isinstance(first, (FinishedEvent, ErrorEvent)):
        return [first]
    rest = await collect(stream, receive)
    return None if rest is None else [first, *rest]


def ending(events: list[Event]) -> FinishedEvent | ErrorEvent:
    """The event that ended a request (the last of what :func:`collect` and
    :func:`all_events` answer)."""
    last = events[-1]
    if not isinstance(last, (FinishedEvent, ErrorEvent)):
        raise RuntimeError(f"a request's events end with a {type(last).__name__}")
    return last
