"""The only place the TUI touches the engine.

:class:`EngineBridge` builds and starts the engine on a background thread (importing the
engine, and so mlx, there: the UI takes keys while the model loads), subscribes to its
engine-wide events and turns them into Textual messages (:mod:`tui.messages`) posted with
``post_message``, which is thread-safe. Cache events are only counted here; the app drains
the counts on a timer (:meth:`EngineBridge.take_cache_changes`), so a burst of stores is one
refresh. Each reply has a :class:`ReplyStream`: its callback runs on the engine thread and
buffers token text, posting one :class:`~tui.messages.ReplyTokens` per burst that the UI
drains, so a fast model never floods the message queue.

Every other engine call (``stats``, ``cache_*``, ``decode``, ``prefetch``...) blocks: call
them from a thread worker, never from the UI thread. Warnings on the ``mlxkv`` loggers
(the cache folder falling back to RAM-only, a disk that fills up) become
:class:`~tui.messages.EngineWarning` messages, once per condition.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from textual.message import Message

from mlxkv.tui.messages import (
    EngineFailed,
    EngineLoading,
    EngineReady,
    EngineWarning,
    ReplyFinished,
    ReplyProgress,
    ReplyStats,
    ReplyTokens,
)

if TYPE_CHECKING:
    from mlxkv.engine.api import EngineAPI, EngineStats, FlushReport, GCReport, ModelInfo, VerifyReport
    from mlxkv.engine.cache.info import CacheEntryDetail, CacheEntryInfo
    from mlxkv.engine.requests import EngineEvent, Event, RequestHandle
    from mlxkv.engine.settings import Settings

log = logging.getLogger("mlxkv.tui")
Post = Callable[[Message], object]  # an app's or a screen's post_message
# a chat reply asked for: its messages, sampling parameters (``SamplingParams``' fields), session
Ask = tuple[list[dict[str, str]], dict[str, Any], "str | None"]


class NotReady(RuntimeError):
    """The engine is not running (still loading, failed to load, or switching models)."""


def describe_error(e: BaseException) -> str:
    """One line for an exception: the project's errors carry clear messages."""
    if isinstance(e, OSError) and not str(e).strip():
        return f"{e.strerror or type(e).__name__}: {e.filename}"
    if isinstance(e, (ValueError, OSError, RuntimeError)) and str(e).strip():
        return str(e)
    return f"unexpected {type(e).__name__}: {e}"


class WarningRelay(logging.Handler):
    """Posts each distinct WARNING of the ``mlxkv`` loggers once (keyed like the CLI's
    handler: a message logged with arguments by its template)."""

    def __init__(self, post: Post) -> None:
        super().__init__(logging.WARNING)
        self.post = post
        self._seen: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage().strip()
            key = record.msg if record.args and isinstance(record.msg, str) else message
            with self._lock:
                if (record.name, key) in self._seen:
                    return
                self._seen.add((record.name, key))
            self.post(EngineWarning(message))
        except Exception:  # a warning must never break the thread that logs it
            pass


def with_sources(stats: dict[str, Any], lookup: dict | None) -> dict[str, Any]:
    """``stats`` with where its cached tokens came from (``cached_ram_tokens``,
    ``cached_ssd_tokens``, ``restore_ms``) taken from the cache's lookup event, unless the
    engine reported them itself."""
    if not lookup or stats.get("retried"):
        return stats
    out = dict(stats)
    if "cached_ram_tokens" not in out:
        cached = int(out.get("cached_tokens") or 0)
        tier = str(lookup.get("tier") or "")
        out["cached_ram_tokens"] = cached if tier == "ram" else 0
        out["cached_ssd_tokens"] = cached if tier == "ssd" else 0
    if lookup.get("restore_ms") and out.get("cached_ssd_tokens"):
        out["restore_ms"] = lookup["restore_ms"]
    return out


class ReplyStream:
    """One reply in flight. :meth:`on_event` runs on the engine thread; the UI calls
    :meth:`drain` when a :class:`ReplyTokens` arrives and gets all text since the last
    drain, with the time the oldest of it was produced (for token-to-screen latency)."""

    _ids = iter(range(1, 1 << 62))

    def __init__(self, post: Post, take_lookup: Callable[[], dict | None] = lambda: None) -> None:
        self.rid = next(self._ids)
        self.post = post
        self._take_lookup = take_lookup
        self.lookup: dict | None = None  # the cache lookup of this reply's prompt
        self._started = False
        self.handle: RequestHandle | None = None
        self._lock = threading.Lock()
        self._parts: list[str] = []
        self._oldest: float | None = None
        self._posted = False
        self.text_parts: list[str] = []  # the whole reply so far
        self.stats: dict[str, Any] | None = None
        self.done = threading.Event()
        self._cancel_requested = False

    def on_event(self, event: Event | _Failed) -> None:
        if isinstance(event, _Failed):
            self.done.set()
            self.post(ReplyFinished(self.rid, "error", None, event.message, event.refused))
            return
        from mlxkv.engine.requests import ErrorEvent, FinishedEvent, ProgressEvent, StatsEvent, TokenEvent

        if not self._started and isinstance(event, (ProgressEvent, TokenEvent)):
            # The engine looks the prompt up right before its prefill starts: the lookup
            # the cache reported last is this reply's.
            self._started = True
            self.lookup = self._take_lookup()
        if isinstance(event, TokenEvent):
            if not event.text:
                return
            with self._lock:
                self._parts.append(event.text)
                self.text_parts.append(event.text)
                if self._oldest is None:
                    self._oldest = time.perf_counter()
                if self._posted:
                    return
                self._posted = True
            self.post(ReplyTokens(self.rid))
        elif isinstance(event, ProgressEvent):
            self.post(ReplyProgress(self.rid, event.done, event.total))
        elif isinstance(event, StatsEvent):
            stats = with_sources(dataclasses.asdict(event), self.lookup)
            self.stats = stats
            self.post(ReplyStats(self.rid, stats))
        elif isinstance(event, FinishedEvent):
            self.done.set()
            self.post(ReplyFinished(self.rid, event.reason, event.detail))
        elif isinstance(event, ErrorEvent):
            self.done.set()
            exc = event.exception
            refused = type(exc).__name__ == "RequestRefused"
            self.post(ReplyFinished(self.rid, "error", None, event.message, refused))

    def drain(self) -> tuple[str, float | None]:
        with self._lock:
            text, oldest = "".join(self._parts), self._oldest
            self._parts.clear()
            self._oldest = None
            self._posted = False
        return text, oldest

    @property
    def text(self) -> str:
        with self._lock:
            return "".join(self.text_parts)

    def cancel(self) -> None:
        self._cancel_requested = True
        if self.handle is not None:
            self.handle.cancel()


class EngineBridge:
    """Owns the engine for the app: start, switch models, submit replies, blocking calls.
    It offers the engine's cache views (``engine.api.CacheViews``) to the inspector: each
    waits for the engine of the moment to be loaded.

    ``post`` delivers messages to the app (``app.post_message``); replies post to the
    target given to :meth:`submit`."""

    def __init__(self, settings: Settings, post: Post) -> None:
        self.settings = settings
        self.post = post
        self.engine: EngineAPI | None = None
        self.info: ModelInfo = {}
        self.error: str | None = None
        self.ready = threading.Event()  # set when loaded, or when loading failed
        self.model_spec: str = str(settings.model)
        self._lock = threading.Lock()
        self._pending: list[tuple[Ask, ReplyStream]] = []  # submitted before the engine exists
        self._unsubscribe: Callable[[], None] | None = None
        self._cache_kinds: collections.Counter[str] = collections.Counter()
        self._listeners: list[Callable[[EngineEvent], None]] = []
        self._last_lookup: dict | None = None  # the cache's last lookup (engine thread)
        self._starter: threading.Thread | None = None
        self._relay = WarningRelay(post)
        self._closed = False
        self.load_started = 0.0
        self.loaded_at: float | None = None

    # lifecycle ------------------------------------------------------------------------
    def start(self, model: str | None = None) -> threading.Thread:
        """Start (or switch to) ``model`` in the background; returns the starter thread.
        The app hears :class:`EngineLoading`, then :class:`EngineReady` or
        :class:`EngineFailed`."""
        logging.getLogger("mlxkv").addHandler(self._relay)
        with self._lock:
            previous, self.engine = self.engine, None
            self.ready.clear()
            self.error = None
            self.info = {}
            if model is not None:
                self.model_spec = str(model)
        thread = threading.Thread(target=self._start, args=(previous, self.model_spec),
                                  name="mlxkv-tui-start", daemon=True)
        self._starter = thread
        thread.start()
        return thread

    def _start(self, previous: EngineAPI | None, spec: str) -> None:
        self.load_started = time.perf_counter()
        try:
            self._stop_engine(previous)
            self.post(EngineLoading("starting", 0, 3))
            from mlxkv.engine import blas
            from mlxkv.engine.engine import Engine

            blas.leave_a_core()  # keys and tokens reach the screen while a reply decodes
            settings = self.settings
            if spec != str(settings.model):
                settings = settings.replace(model=spec)
            engine: EngineAPI = Engine.from_settings(settings)
            self._unsubscribe = engine.subscribe(self._on_engine_event)
            engine.start(wait=False)
            with self._lock:
                self.engine = engine
                pending, self._pending = self._pending, []
            for request, stream in pending:
                self._submit_now(engine, request, stream)
            engine.wait_ready()
        except BaseException as e:  # reported to the user as a notification, not a traceback
            log.debug("engine start failed", exc_info=True)
            message = describe_error(e)
            with self._lock:
                self.error = message
                pending, self._pending = self._pending, []
            for _, stream in pending:
                stream.on_event(_Failed(message))
            self.ready.set()
            self.post(EngineFailed(message))
            return
        self.info = engine.info.copy()
        self.loaded_at = time.perf_counter()
        # What start-up and the load built (mlx-lm, the tokenizer, the model, the app) lives
        # as long as the engine, yet each full collection walked all of it: ~100 ms with every
        # thread held, the UI's included, every few replies. Frozen, the collector passes over
        # it; stopping the engine hands it back.
        gc.freeze()
        gc.enable()  # the command line starts with it off (start-up is faster without)
        self.ready.set()
        self.post(EngineReady(self.info.copy()))

    def _stop_engine(self, engine: EngineAPI | None) -> None:
        if engine is None:
            return
        gc.unfreeze()  # what the engine leaves can be collected again
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        engine.shutdown(timeout=30.0)

    def shutdown(self) -> None:
        """Stop the engine (its cache is flushed and closed); blocks: call off the UI thread."""
        self._closed = True
        logging.getLogger("mlxkv").removeHandler(self._relay)
        starter = self._starter
        if starter is not None and starter is not threading.current_thread():
            starter.join(60.0)
        with self._lock:
            engine, self.engine = self.engine, None
        self._stop_engine(engine)

    # events ---------------------------------------------------------------------------
    def subscribe(self, callback: Callable[[EngineEvent], None]) -> Callable[[], None]:
        """Call ``callback`` with every engine-wide event (``CacheEvent``, ``LoadEvent``) of
        this engine and of any it switches to, from engine or storage threads; returns the
        function that unsubscribes it."""
        with self._lock:
            self._listeners.append(callback)

        def unsubscribe() -> None:
            with self._lock:
                if callback in self._listeners:
                    self._listeners.remove(callback)
        return unsubscribe

    def _on_engine_event(self, event: EngineEvent) -> None:
        with self._lock:
            listeners = list(self._listeners)
        for callback in listeners:
            try:
                callback(event)
            except Exception:  # a screen's bug must not break the engine or the cache
                log.exception("TUI event listener failed")
        from mlxkv.engine.requests import CacheEvent, LoadEvent

        if isinstance(event, LoadEvent):
            self.post(EngineLoading(event.stage, 1 + event.done, 1 + event.total))
        elif isinstance(event, CacheEvent):
            with self._lock:
                self._cache_kinds[event.kind] += 1
                if event.kind == "lookup":
                    self._last_lookup = dict(event.data)
            if event.kind == "warning":
                message = str(event.data.get("message") or event.data)
                self._relay.emit(logging.LogRecord("mlxkv.cache", logging.WARNING, "", 0,
                                                   message, None, None))

    def _take_lookup(self) -> dict | None:
        with self._lock:
            lookup, self._last_lookup = self._last_lookup, None
        return lookup

    def take_cache_changes(self) -> dict[str, int]:
        """Cache event counts by kind since the last call (empty: nothing changed)."""
        with self._lock:
            kinds = dict(self._cache_kinds)
            self._cache_kinds.clear()
        return kinds

    # replies --------------------------------------------------------------------------
    def submit(self, messages: list[dict[str, str]], params: dict[str, Any], session: str | None,
               post: Post) -> ReplyStream:
        """Queue a chat reply; its messages go to ``post`` (the chat screen's). Served once
        the model is loaded when it is still loading. Never blocks."""
        stream = ReplyStream(post, self._take_lookup)
        request: Ask = (messages, params, session)
        with self._lock:
            engine, error = self.engine, self.error
            if engine is None and error is None:
                self._pending.append((request, stream))
                return stream
        if engine is None:
            stream.on_event(_Failed(error or "the engine is not running"))
            return stream
        self._submit_now(engine, request, stream)
        return stream

    def _submit_now(self, engine: EngineAPI, request: Ask, stream: ReplyStream) -> None:
        from mlxkv.engine.generate import SamplingParams
        from mlxkv.engine.requests import Request

        messages, params, session = request
        try:
            sampling = SamplingParams(**params)
            stream.handle = engine.submit(Request(messages=messages, params=sampling, session=session),
                                          stream.on_event)
            if stream._cancel_requested:
                stream.handle.cancel()
        except Exception as e:  # a refused request (empty prompt, engine stopped) is an answer
            stream.on_event(_Failed(describe_error(e), refused=isinstance(e, ValueError)))

    # blocking engine calls (thread workers only) ---------------------------------------
    def running(self, timeout: float | None = 60.0) -> EngineAPI:
        """The engine once loaded; :class:`NotReady` when it failed or did not load in time."""
        if not self.ready.wait(timeout):
            raise NotReady(f"the model {self.model_spec} is still loading")
        engine = self.engine
        if engine is None or self.error is not None:
            raise NotReady(self.error or "the engine is not running")
        return engine

    # The caller's timeout reaches the engine (verifying everything may take minutes; a
    # listing should give up in seconds).
    def stats(self, timeout: float | None = 30.0) -> EngineStats:
        return self.running().stats(timeout=timeout)

    def cache_entries(self, ns: str | None = None, timeout: float | None = 30.0) -> list[CacheEntryInfo]:
        return self.running().cache_entries(ns, timeout=timeout)

    def cache_entry(self, entry_id: str, timeout: float | None = 30.0) -> CacheEntryDetail | None:
        return self.running().cache_entry(entry_id, timeout=timeout)

    def cache_pin(self, entry_id: str, pinned: bool = True, timeout: float | None = 30.0) -> bool:
        return self.running().cache_pin(entry_id, pinned, timeout=timeout)

    def cache_evict(self, entry_id: str, timeout: float | None = 30.0) -> bool:
        return self.running().cache_evict(entry_id, timeout=timeout)

    def cache_delete(self, entry_id: str, timeout: float | None = 30.0) -> bool:
        return self.running().cache_delete(entry_id, timeout=timeout)

    def cache_verify(self, entry_id: str | None = None, timeout: float | None = 30.0) -> VerifyReport:
        return self.running().cache_verify(entry_id, timeout=timeout)

    def cache_flush(self, timeout: float | None = None) -> FlushReport:
        return self.running().cache_flush(timeout)

    def cache_gc(self, min_age_s: float = 0.0, timeout: float | None = 30.0) -> GCReport:
        return self.running().cache_gc(min_age_s, timeout=timeout)

    def decode(self, tokens: list[int], timeout: float | None = 30.0) -> str:
        return self.running().decode(tokens, timeout=timeout)

    def open_session(self, session: str) -> None:
        self.running().open_session(session)

    def close_session(self, session: str) -> None:
        engine = self.engine
        if engine is not None and self.ready.is_set() and self.error is None:
            engine.close_session(session)

    def prefetch(self, messages: list[dict[str, str]], session: str | None) -> int:
        """Warm a conversation's cached state into RAM (``engine.prefetch``): the tokens now
        warm."""
        return int(self.running().prefetch(messages, session=session).result(60.0) or 0)


@dataclasses.dataclass(frozen=True)
class _Failed:
    """Stands in for an ErrorEvent when a reply fails before the engine has it."""

    message: str
    refused: bool = False

