"""The engine thread: one thread owns MLX (loads the model, runs every generation) and
serves commands from a queue; callers hold thread-safe :class:`RequestHandle` s.

    with Engine("path/or/hub-id").start() as engine:
        handle = engine.submit(Request(messages=[{"role": "user", "content": "hi"}]))
        for event in handle:          # ProgressEvent ..., TokenEvent ..., StatsEvent, FinishedEvent
            ...
        handle.cancel()               # from any thread
        engine.stats(); engine.cache_entries(); engine.subscribe(print)
        engine.prefetch(messages).result()   # warm a conversation's cached state into RAM

Everything a front end needs is a public method here, callable from any thread: each runs
on the engine thread, *between tokens* of a running generation or between requests, and
waits with a timeout (:class:`EngineError` when it passes). The prefix cache (see
``engine/cache/prefix_cache.py``) is looked up before the prefill and stored after; a
generation that fails after starting from a cached prefix is answered again without it.

A lone request decodes single-stream (``engine.generate.Generation``). When another
request is waiting while one runs, the running one moves, with its KV state, into a
:class:`engine.batch.Batch`, and the waiting ones join it between steps (up to
``max_batch`` rows; see ``engine/batching.py``); each row sends exactly the events it
would have sent alone. More than ``max_queue`` waiting requests make ``submit`` raise
:class:`QueueFull`.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from mlxkv.engine.batching import Batching
from mlxkv.engine.batching import Job as _Job
from mlxkv.engine.batching import Join as _Join
from mlxkv.engine.generate import Generation
from mlxkv.engine.logs import warn_once
from mlxkv.engine.requests import (  # noqa: F401  (re-exported: the engine's public names)
    CacheEvent,
    EngineError,
    EngineEvent,
    ErrorEvent,
    Event,
    FinishedEvent,
    LoadEvent,
    ProgressEvent,
    QueueFull,
    Request,
    RequestHandle,
    RequestRefused,
    Result,
    StatsEvent,
    TokenEvent,
    WaitTimeout,
    _blank,
)

log = logging.getLogger("mlxkv.engine")


class _Call:
    def __init__(self, fn: Callable[..., Any], args: tuple):
        self.fn, self.args, self.future = fn, args, Future()

    def run(self) -> None:
        if self.future.set_running_or_notify_cancel():
            try:
                self.future.set_result(self.fn(*self.args))
            except BaseException as e:
                self.future.set_exception(e)


class _Retry(Exception):
    """A generation from a cached prefix failed: compute the request again without it."""


_STOP = object()
_WAKE = object()  # a quick call is waiting in Engine._quick
_LOAD_STAGES = ("model", "prefix cache", "ready")
_live_engines: weakref.WeakSet[Engine] = weakref.WeakSet()


def _clear_streams() -> None:
    # mlx needs the streams a thread created destroyed before that thread (and the
    # interpreter) exits, or the process aborts at exit ("terminate called ...").
    try:
        import mlx.core as mx

        mx.clear_streams()
    except Exception:
        pass


@atexit.register
def _shutdown_live_engines() -> None:
    for engine in list(_live_engines):
        engine.shutdown(timeout=10.0)


class Engine(Batching):
    """Owns one model on one thread. ``prefix_cache`` is an object with ``lookup`` and
    ``store`` (see ``engine.cache.PrefixCache``), or a callable
    ``(loaded_model, namespace) -> object`` called on the engine thread once the model is
    loaded; None = no caching."""

    def __init__(self, model: str, *, dtype: str = "auto", full_hash: bool = False,
                 prefix_cache: Any = None, name: str = "mlxkv-engine", settings: Any = None,
                 max_batch: int = 8, max_queue: int = 64):
        if int(max_batch) < 1 or int(max_queue) < 1:
            raise ValueError(f"max_batch and max_queue must be at least 1, got {max_batch} "
                             f"and {max_queue}")
        self.max_batch, self.max_queue = int(max_batch), int(max_queue)
        self.model_spec = str(model)
        self.settings = settings  # speculation reads spec, draft_model, spec_* (None: defaults)
        self.spec_providers: dict[str, Any] = {}
        self.dtype = dtype
        self.full_hash = full_hash
        self._prefix_arg = prefix_cache
        self.prefix_cache: Any = None
        self._caching = False  # a real prefix cache (not NullPrefixCache) is in use
        self._queue: queue.Queue = queue.Queue()
        self._quick: collections.deque[_Call] = collections.deque()
        self._ready = threading.Event()
        self._stopping = threading.Event()
        # Held while checking _stopping and enqueueing, so nothing lands behind _STOP.
        self._submit_lock = threading.Lock()
        self._load_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._listeners: list[tuple[object, Callable[[EngineEvent], None]]] = []
        self._listeners_lock = threading.Lock()
        self.loaded: Any = None  # LoadedModel; touch its arrays only on the engine thread
        self.namespace: str = ""
        self.info: dict[str, Any] = {}
        self.load_s = 0.0
        self._load_t0 = self._load_t1 = 0.0
        self._serving: RequestHandle | None = None
        self._counts = {"requests": 0, "errors": 0, "refused": 0, "cancelled": 0,
                        "retries": 0, "batched": 0}
        self._waiting = 0  # requests submitted and not yet served (under _submit_lock)
        # Commands the engine thread took from _queue and has not handled yet (it looks
        # ahead for requests that may join a batch). Engine thread only.
        self._backlog: collections.deque = collections.deque()
        self._batch: Any = None  # the engine.batch.Batch decoding now
        self._batched_at: float | None = None  # when a batch last ended (time.monotonic())
        self._batchable = False  # the model's caches can be batched (set at load)
        self._is_busy = False  # what the prefix cache was last told (busy())

    @classmethod
    def from_settings(cls, settings: Any, prefix_cache: Any = None) -> Engine:
        """An engine for ``settings``; unless ``prefix_cache`` is given, the prefix cache is
        built from the settings on the engine thread (``PrefixCache.from_settings``). Under a
        distributed launch (mlx.launch) this rank's ``engine.distributed`` engine."""
        from mlxkv.engine.distributed import join, launched

        world = join(getattr(settings, "dist_timeout_s", 60.0)) if launched() else None
        if world is not None:
            from mlxkv.engine.distributed.engine import ShardedEngine

            return ShardedEngine.for_world(settings, world, prefix_cache)
        if prefix_cache is None and settings.prefix_cache:
            def prefix_cache(loaded: Any, namespace: str) -> Any:
                from mlxkv.engine.cache.prefix_cache import PrefixCache

                return PrefixCache.from_settings(settings)
        return cls(settings.model, dtype=settings.dtype, prefix_cache=prefix_cache,
                   full_hash=getattr(settings, "full_hash", False), settings=settings,
                   max_batch=getattr(settings, "max_batch", 8),
                   max_queue=getattr(settings, "max_queue", 64))

    # lifecycle
    def start(self, timeout: float | None = None, wait: bool = True) -> Engine:
        """Start the thread; with ``wait``, wait until the model is loaded (re-raising a
        load error). Without it, requests may be submitted at once: they are served as
        soon as the model is loaded, or fail with the load error."""
        self._thread.start()
        _live_engines.add(self)
        return self.wait_ready(timeout) if wait else self

    def wait_ready(self, timeout: float | None = None) -> Engine:
        """Wait for the model to be loaded; re-raise the load error if it failed."""
        if not self._ready.wait(timeout):
            raise EngineError(f"model {self.model_spec} did not load within {timeout} s")
        if self._load_error is not None:
            raise self._load_error
        return self

    def shutdown(self, timeout: float | None = 30.0, wait: bool = True) -> None:
        """Cancel what runs, finish queued requests as cancelled, close the cache, and
        (with ``wait``) join the engine thread."""
        if not self._thread.is_alive():
            return
        with self._submit_lock:
            if not self._stopping.is_set():
                self._stopping.set()
                self._queue.put(_STOP)
        if wait:
            self._thread.join(timeout)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # requests
    def submit(self, request: Request, callback: Callable[[Event], None] | None = None
               ) -> RequestHandle:
        """Queue a request; ``callback`` (optional) sees each event on the engine thread.
        Raises :class:`QueueFull` at once when ``max_queue`` requests already wait."""
        handle = RequestHandle(request, callback)
        with self._submit_lock:
            if self._load_error is not None:
                raise self._load_error
            if self._stopping.is_set() or not self._thread.is_alive():
                raise EngineError("engine is not running")
            if self._waiting >= self.max_queue:
                raise QueueFull(f"{self._waiting} requests are already waiting (the engine's "
                                f"max_queue is {self.max_queue}); try again later")
            self._waiting += 1
            self._queue.put(handle)
        return handle

    def call(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run ``fn(*args)`` on the engine thread (between requests); returns a Future.
        For tests and tools: front ends have a public method for what they need."""
        cmd = _Call(fn, args)
        with self._submit_lock:
            if self._stopping.is_set() or not self._thread.is_alive():
                cmd.future.set_exception(EngineError("engine is not running"))
            else:
                self._queue.put(cmd)
        return cmd.future

    def sync(self, timeout: float | None = 30.0) -> None:
        """Wait until everything queued before this call has been served."""
        self._wait(self.call(lambda: None), timeout, "sync")

    def _wait(self, future: Future, timeout: float | None, what: str) -> Any:
        try:
            return future.result(timeout)
        except FutureTimeout:  # the builtin TimeoutError only from Python 3.11 on
            future.cancel()
            raise EngineError(f"the engine did not answer ({what}) within {timeout} s") from None

    def _ask(self, what: str, fn: Callable[..., Any], *args: Any,
             timeout: float | None = 30.0) -> Any:
        """Run ``fn(*args)`` on the engine thread as soon as it is between two tokens (or
        two requests), and wait for its result."""
        if threading.current_thread() is self._thread:
            return fn(*args)
        cmd = _Call(fn, args)
        with self._submit_lock:
            if self._stopping.is_set() or not self._thread.is_alive():
                raise EngineError("engine is not running")
            self._quick.append(cmd)
            self._queue.put(_WAKE)
        return self._wait(cmd.future, timeout, what)

    def _queued_requests(self) -> int:
        # Requests only: the queue also holds wake-up markers of calls served between tokens.
        return self._waiting

    # what front ends need
    def stats(self, timeout: float | None = 30.0) -> dict[str, Any]:
        """The model, its load time, request counts, what is queued, the requests decoding
        now (``active``) and the cache's stats (``loading`` and no cache stats, without
        waiting, while the model loads)."""
        def collect(loading: bool = False) -> dict[str, Any]:
            batch = self._batch
            active = len(batch) if batch is not None else int(self._serving is not None)
            from mlxkv.engine.speculation.providers import spec_stats

            return {"model": dict(self.info), "load_s": self.load_s, **self._counts,
                    "loading": loading, "queued": self._queued_requests(),
                    "busy": active > 0, "active": active, "max_batch": self.max_batch,
                    "batching": self._batchable and self.max_batch > 1,
                    "namespace": self.namespace, "spec": spec_stats(self.spec_providers),
                    "cache": None if loading else self.prefix_cache.stats()}
        if self._thread.is_alive() and not self._ready.is_set():
            return collect(loading=True)
        return self._ask("stats", collect, timeout=timeout)

    def _facade(self, name: str, default: Any, *args: Any, timeout: float | None) -> Any:
        def run() -> Any:
            fn = getattr(self.prefix_cache, name, None)
            return default if fn is None else fn(*args)
        return self._ask(f"cache {name}", run, timeout=timeout)

    def cache_entries(self, ns: str | None = None, timeout: float | None = 30.0) -> list:
        """Cached states (``CacheEntryInfo``), of namespace ``ns`` or all."""
        return self._facade("entries", [], ns, timeout=timeout)

    def cache_entry(self, entry_id: str, timeout: float | None = 30.0) -> Any:
        """One entry's details (``CacheEntryDetail``) or None."""
        return self._facade("entry", None, entry_id, timeout=timeout)

    def cache_pin(self, entry_id: str, pinned: bool = True, timeout: float | None = 30.0
                  ) -> bool:
        return self._facade("pin", False, entry_id, pinned, timeout=timeout)

    def cache_evict(self, entry_id: str, timeout: float | None = 30.0) -> bool:
        """Drop an entry from RAM (kept on SSD)."""
        return self._facade("evict", False, entry_id, timeout=timeout)

    def cache_delete(self, entry_id: str, timeout: float | None = 30.0) -> bool:
        """Drop an entry from every tier."""
        return self._facade("delete", False, entry_id, timeout=timeout)

    def cache_verify(self, entry_id: str | None = None, timeout: float | None = 30.0) -> dict:
        """Read and check SSD blocks (of one entry, or all)."""
        empty = {"checked": 0, "ok": 0, "damaged": [], "manifests_damaged": 0}
        return self._facade("verify", empty, entry_id, timeout=timeout)

    def cache_flush(self, timeout: float | None = None) -> dict:
        """Persist every dirty state now (the flush itself is bounded by ``timeout``)."""
        wait = None if timeout is None else timeout + 30.0
        return self._facade("flush", {}, timeout, timeout=wait)

    def cache_gc(self, min_age_s: float = 0.0, timeout: float | None = 30.0) -> dict:
        """Remove the SSD blocks of this model's namespace that no saved state names
        (older than ``min_age_s``): ``{removed, bytes, live_keys, manifests_removed,
        unreadable_manifests}``; zeros without an SSD tier."""
        empty = {"removed": 0, "bytes": 0, "live_keys": 0, "manifests_removed": 0,
                 "unreadable_manifests": {}}
        return self._facade("gc", empty, self.namespace, float(min_age_s), timeout=timeout)

    def prefetch(self, messages: list[dict[str, Any]], session: str | None = None) -> Future:
        """Warm the cached state of the prompt ``messages`` would send next (chat template
        with the generation prompt) into RAM, restoring it from SSD, on the engine thread
        between requests (so a chat opened after a restart answers from RAM). The Future
        resolves to the tokens now warm in RAM (0 when nothing is cached or caching is
        off) or to the error that stopped it."""
        def run() -> int:
            fn = getattr(self.prefix_cache, "prefetch", None)
            if fn is None or not messages or all(_blank(m.get("content")) for m in messages):
                return 0
            from mlxkv.engine.models import chat_prompt_tokens

            tokens = chat_prompt_tokens(self.loaded.tokenizer, messages)
            return int(fn(tokens, self.namespace, session=session))
        return self.call(run)

    def open_session(self, session: str, timeout: float | None = 30.0) -> None:
        self._facade("open_session", None, session, timeout=timeout)

    def close_session(self, session: str, timeout: float | None = 30.0) -> None:
        self._facade("close_session", None, session, timeout=timeout)

    def encode(self, text: str, timeout: float | None = 30.0) -> list[int]:
        """Token ids of raw ``text``, as ``Request(prompt=text)`` would see them."""
        return self._ask("encode", self._encode_text, text, timeout=timeout)

    def encode_chat(self, messages: list[dict[str, str]], timeout: float | None = 30.0,
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of the prompt ``Request(messages=..., tools=...)`` sends the model."""
        from mlxkv.engine.models import chat_prompt_tokens

        return self._ask("encode_chat", lambda: chat_prompt_tokens(
            self.loaded.tokenizer, messages, tools=tools), timeout=timeout)

    def decode(self, tokens: list[int], timeout: float | None = 30.0) -> str:
        return self._ask("decode", lambda: self.loaded.tokenizer.decode(list(tokens)),
                         timeout=timeout)

    def subscribe(self, callback: Callable[[EngineEvent], None]) -> Callable[[], None]:
        """Call ``callback`` with every engine-wide event (:class:`CacheEvent`,
        :class:`LoadEvent`), from the engine or storage threads; returns the function
        that unsubscribes it."""
        token = object()
        with self._listeners_lock:
            self._listeners.append((token, callback))

        def unsubscribe() -> None:
            with self._listeners_lock:
                self._listeners[:] = [(t, c) for t, c in self._listeners if t is not token]
        return unsubscribe

    def _publish(self, event: EngineEvent) -> None:
        with self._listeners_lock:
            listeners = [c for _, c in self._listeners]
        for callback in listeners:
            try:
                callback(event)
            except Exception:  # a front end's bug must not break the engine or the cache
                log.exception("engine event listener failed")

    def _cache_event(self, data: dict) -> None:
        kind = str(data.get("type", "cache.event")).removeprefix("cache.")
        self._publish(CacheEvent(kind, {k: v for k, v in data.items() if k != "type"}))

    # engine thread
    def _load(self) -> None:
        from mlxkv.engine.blas import describe
        from mlxkv.engine.cache.prefix_cache import NullPrefixCache

        total = len(_LOAD_STAGES) - 1
        self._publish(LoadEvent(_LOAD_STAGES[0], 0, total))
        self.loaded, self.namespace = self._load_model()
        from mlxkv.engine.speculation.providers import bind_providers, load_providers

        self.spec_providers = load_providers(self.loaded, self.settings)
        self._publish(LoadEvent(_LOAD_STAGES[1], 1, total))
        arg = self._prefix_arg
        if arg is None:
            self.prefix_cache = NullPrefixCache()
        elif callable(arg) and not hasattr(arg, "lookup"):
            self.prefix_cache = arg(self.loaded, self.namespace)
        else:
            self.prefix_cache = arg
        self._caching = not isinstance(self.prefix_cache, NullPrefixCache)
        bind_model = getattr(self.prefix_cache, "bind_model", None)
        if bind_model is not None:  # restored states are checked against this model's caches
            bind_model(self.namespace, self.loaded.model)
        bind_providers(self.prefix_cache, self.namespace, self.spec_providers)
        if hasattr(self.prefix_cache, "on_event"):
            previous = self.prefix_cache.on_event

            def on_event(data: dict) -> None:
                if previous is not None:
                    previous(data)
                self._cache_event(data)
            self.prefix_cache.on_event = on_event
        self.load_s = time.perf_counter() - self._load_t0
        self.info = {
            "model": self.loaded.label, "spec": self.loaded.spec, "path": str(self.loaded.path),
            "fingerprint": self.loaded.fingerprint, "namespace": self.namespace,
            "weights_dtype": self.loaded.weights_dtype,
            "compute_dtype": self.loaded.compute_dtype, "blas": describe(),
            "model_type": self.loaded.config.get("model_type"),
            "context_tokens": self.loaded.context_tokens, "load_s": self.load_s,
            "speculation": sorted(self.spec_providers),
        }
        from mlx_lm.models.cache import make_prompt_cache

        from mlxkv.engine.batch import batchable_cache

        self._batchable = batchable_cache(make_prompt_cache(self.loaded.model))
        from mlxkv.engine.generate import head_view

        head_view(self.loaded.model)  # probed while loading, not inside the first request's TTFT
        self._publish(LoadEvent(_LOAD_STAGES[2], total, total))

    def _load_model(self) -> tuple[Any, str]:
        """The model and its prefix-cache namespace (a sharded engine loads its shard)."""
        from mlxkv.engine.cache.layout import kv_namespace
        from mlxkv.engine.models import load_model

        loaded = load_model(self.model_spec, self.dtype, self.full_hash)
        return loaded, kv_namespace(loaded.fingerprint, loaded.compute_dtype)

    def _next_command(self) -> Any:
        """Wait for the next command (a sharded engine keeps its peers informed meanwhile)."""
        return self._queue.get()

    def _stopped(self) -> None:
        """The command loop ended; a sharded engine tells its peers."""

    def _decoding(self, handle: RequestHandle, speculation: Any) -> Any:
        """The token source a generation uses (a sharded engine decodes in lock-step)."""
        return speculation

    def _run(self) -> None:
        self._load_t0 = time.perf_counter()
        try:
            self._load()
        except BaseException as e:  # reported to start()'s caller and queued requests
            self._load_error = e
            with self._submit_lock:
                self._stopping.set()
            self._drain(error=e)
            _clear_streams()
            self._ready.set()
            return
        finally:
            self._load_t1 = time.perf_counter()
        self._ready.set()
        try:
            while True:
                cmd = self._backlog.popleft() if self._backlog else self._next_command()
                if cmd is _STOP:
                    break
                if cmd is _WAKE:
                    self._run_quick()
                elif isinstance(cmd, _Call):
                    cmd.run()
                else:
                    self._serve(cmd)
                if self._waiting <= 0:
                    self._busy(False)
        finally:
            with self._submit_lock:
                self._stopping.set()
            self._stopped()
            self._drain()
            close = getattr(self.prefix_cache, "close", None)
            if close is not None:
                try:
                    close(10.0)
                except Exception:
                    log.exception("prefix cache close failed")
            _clear_streams()

    def _run_quick(self) -> None:
        while self._quick:
            self._quick.popleft().run()

    def _sweep_cancelled(self) -> None:
        """Answer the waiting requests cancelled before they started, wherever they are in
        line: they stop counting against ``max_queue`` at once (a client that went away)."""
        while True:
            try:
                self._backlog.append(self._queue.get_nowait())
            except queue.Empty:
                break
        if any(isinstance(c, RequestHandle) and c.cancelled for c in self._backlog):
            line = list(self._backlog)
            self._backlog.clear()
            for cmd in line:
                if isinstance(cmd, RequestHandle) and cmd.cancelled:
                    self._serve(cmd)  # answered "cancelled" at once
                else:
                    self._backlog.append(cmd)

    def _peek(self) -> Any:
        """The next command still to handle (None: nothing queued), left in the backlog;
        quick-call markers met on the way are served."""
        while True:
            if not self._backlog:
                try:
                    self._backlog.append(self._queue.get_nowait())
                except queue.Empty:
                    return None
            head = self._backlog[0]
            if head is not _WAKE:
                return head
            self._backlog.popleft()
            self._run_quick()

    def _drain(self, error: BaseException | None = None) -> None:
        """Answer everything still queued: cancelled (shutdown), or the load ``error``."""
        with self._submit_lock:  # nothing is enqueued any more: _stopping is set
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
                self._take(cmd)
                cmd._emit(ErrorEvent(str(error), error) if error is not None
                          else FinishedEvent("cancelled", "shutdown"))
            elif isinstance(cmd, _Call):
                cmd.future.set_exception(error if error is not None
                                         else EngineError("engine shut down"))

    def _encode_text(self, text: str) -> list[int]:
        # As mlx_lm.stream_generate: add special tokens unless the text starts with BOS.
        tok = self.loaded.tokenizer
        bos = getattr(tok, "bos_token", None)
        return list(tok.encode(text, add_special_tokens=bos is None or not text.startswith(bos)))

    def _prompt_tokens(self, req: Request) -> list[int]:
        from mlxkv.engine.models import chat_prompt_tokens

        if req.prompt_tokens is not None:
            tokens = [int(t) for t in req.prompt_tokens]
            vocab = self.loaded.config.get("vocab_size")
            bad = [t for t in tokens if t < 0 or (vocab and t >= vocab)]
            if bad:  # mlx would index out of range silently
                raise RequestRefused(f"token ids out of range [0, {vocab}): {bad[:5]}")
        elif req.messages is not None:
            if all(_blank(m.get("content")) for m in req.messages):
                raise RequestRefused("the prompt is empty")
            tokens = chat_prompt_tokens(self.loaded.tokenizer, req.messages, tools=req.tools)
        else:
            if not (req.prompt or "").strip():
                raise RequestRefused("the prompt is empty")
            tokens = self._encode_text(req.prompt)
        if not tokens:
            raise RequestRefused("the prompt is empty")
        return tokens

    def _fit_context(self, tokens: list[int], req: Request) -> tuple[list[int], int]:
        """The prompt to run and how many tokens may follow it within the model's context:
        a prompt that leaves no room is refused, or (``truncate``) cut to its last tokens."""
        context = self.loaded.context_tokens
        max_tokens = req.params.max_tokens
        if context is None:
            return tokens, max_tokens
        if len(tokens) >= context:
            keep = max(context - max_tokens, context // 2, 1)
            if not req.truncate:
                raise RequestRefused(
                    f"the prompt is {len(tokens)} tokens; the model's context is {context} "
                    f"tokens (use --truncate to keep the last {keep})")
            tokens = tokens[-keep:]
        return tokens, min(max_tokens, context - len(tokens))

    def _tier_split(self, cached: int) -> tuple[int, int]:
        """(RAM, SSD) shares of the ``cached`` tokens the last lookup served."""
        last = getattr(self.prefix_cache, "last", None) or {}
        if cached <= 0 or last.get("cached_tokens") != cached:
            return 0, 0
        return int(last.get("ram_tokens", 0)), int(last.get("ssd_tokens", 0))

    def _lookup(self, tokens: list[int], session: str | None) -> tuple[int, Any]:
        try:
            n, cache = self.prefix_cache.lookup(tokens, self.namespace, session=session)
        except Exception:
            log.exception("prefix cache lookup failed; computing the whole prompt")
            return 0, None
        if cache is None or n <= 0:
            return 0, None
        if n >= len(tokens):  # the seam promises n <= len - 1; never trust it blindly
            log.error("prefix cache returned %d cached tokens for a %d-token prompt", n,
                      len(tokens))
            return 0, None
        return n, cache

    def _release(self, cache: Any) -> None:
        # A request that borrowed a cache from lookup and will not store it gives it back.
        release = getattr(self.prefix_cache, "release", None)
        if cache is not None and release is not None:
            try:
                release(cache)
            except Exception:
                log.exception("prefix cache release failed")

    def _drop_cached(self, tokens: list[int], cache: Any, n_cached: int,
                     exc: BaseException) -> None:
        """A generation that started from ``n_cached`` cached tokens failed: drop every
        cached state that would seed this prompt again (or, without ``invalidate``, give
        the borrowed cache back as any failed request does)."""
        invalidate = getattr(self.prefix_cache, "invalidate", None)
        try:
            if invalidate is not None:
                invalidate(tokens, self.namespace)
            else:
                self._release(cache)
        except Exception:
            log.exception("prefix cache invalidate failed")
        first = (str(exc).splitlines() or [""])[0][:200]
        warn_once(log, f"retry:{type(exc).__name__}",
                   "a cached prompt prefix could not be used (%s: %s); it was dropped and the "
                   "prompt computed again without it", type(exc).__name__, first)

    def _take(self, handle: RequestHandle) -> None:
        """``handle`` stops waiting: it is served now (or answered)."""
        with self._submit_lock:
            self._waiting -= 1

    def _busy(self, active: bool) -> None:
        """Tell the prefix cache whether a request is being served (its writer yields to
        decoding meanwhile); only changes are told."""
        if active == self._is_busy:
            return
        self._is_busy = active
        busy = getattr(self.prefix_cache, "busy", None)
        if busy is not None:
            try:
                busy(active)
            except Exception:
                log.exception("prefix cache busy() failed")

    def _serve(self, handle: RequestHandle) -> None:
        self._take(handle)
        if handle.cancelled or self._stopping.is_set():
            self._counts["cancelled"] += 1
            handle._emit(FinishedEvent("cancelled", "shutdown" if self._stopping.is_set()
                                       else None))
            return
        start = time.perf_counter()
        self._counts["requests"] += 1
        self._serving = handle
        self._busy(True)
        try:
            self._serve_request(handle, start)
        finally:
            self._serving = None

    def _prepare(self, handle: RequestHandle, start: float) -> _Job | None:
        """Tokenize, fit the context and look up the prefix cache; None when the request
        was refused (its ErrorEvent is sent)."""
        req = handle.request
        try:
            tokens, max_tokens = self._fit_context(self._prompt_tokens(req), req)
        except Exception as e:
            self._counts["refused" if isinstance(e, RequestRefused) else "errors"] += 1
            handle._emit(ErrorEvent(str(e) if isinstance(e, RequestRefused)
                                    else f"{type(e).__name__}: {e}", e))
            return None
        params = req.params
        if max_tokens != params.max_tokens:
            params = dataclasses.replace(params, max_tokens=max_tokens)
        n_cached, cache = self._lookup(tokens, req.session)
        ram_tokens, ssd_tokens = self._tier_split(n_cached)
        return _Job(handle, start, tokens, params, n_cached, cache, ram_tokens, ssd_tokens)

    def _load_wait(self, submitted: float) -> float:
        """The part of a request's wait that the model load took."""
        if submitted >= self._load_t1:
            return 0.0
        return max(0.0, self._load_t1 - max(submitted, self._load_t0))

    def _serve_request(self, handle: RequestHandle, start: float) -> None:
        job = self._prepare(handle, start)
        if job is None:
            return
        req = handle.request
        tokens, params, n_cached, cache = job.tokens, job.params, job.n_cached, job.cache
        ram_tokens, ssd_tokens, max_tokens = job.ram_tokens, job.ssd_tokens, params.max_tokens
        sent: list[int] = []  # tokens of the TokenEvents already sent
        retried = False
        try:
            try:
                gen = self._generate(handle, tokens, params, cache, n_cached, sent, None)
            except _Retry as failed:
                self._counts["retries"] += 1
                retried = True
                self._drop_cached(tokens, cache, n_cached, failed.__cause__)
                cache = None
                gen = self._generate(handle, tokens, params, None, 0, [], sent)
        except _Join as join:  # another request waits: go on decoding together
            self._run_batch(job, join)
            return
        except Exception as e:
            log.debug("request %d failed", handle.id, exc_info=True)
            if not retried:
                self._release(cache)
            self._counts["errors"] += 1
            handle._emit(ErrorEvent(f"{type(e).__name__}: {e}", e))
            return
        self._answered(handle, req, gen, start, max_tokens, n_cached, ram_tokens, ssd_tokens,
                       retried)

    def _answered(self, handle: RequestHandle, req: Request, gen: Generation, start: float,
                  max_tokens: int, n_cached: int, ram_tokens: int, ssd_tokens: int,
                  retried: bool) -> None:
        """A single-stream generation ended: its StatsEvent and FinishedEvent, then the
        store of its state."""
        out = gen.outcome
        ttft = (gen.first_token_time - start) if gen.first_token_time else 0.0
        submitted = handle.submitted
        load_s = self._load_wait(submitted)
        handle._emit(StatsEvent(
            prompt_tokens=out.prompt_tokens, cached_tokens=out.cached_tokens,
            generated_tokens=len(out.tokens), ttft_s=ttft, prefill_tps=out.prefill_tps,
            decode_tps=out.decode_tps, queue_s=start - submitted, load_s=load_s,
            retried=retried,
            cached_ram_tokens=ram_tokens if out.cached_tokens == n_cached and not retried else 0,
            cached_ssd_tokens=ssd_tokens if out.cached_tokens == n_cached and not retried else 0,
            spec=out.spec))
        detail = out.stop_detail
        if out.finish_reason == "cancelled":
            self._counts["cancelled"] += 1
            if self._stopping.is_set():
                detail = "shutdown"
        elif out.finish_reason == "length" and max_tokens < req.params.max_tokens:
            detail = "context"  # stopped at the end of the model's context
        handle._emit(FinishedEvent(out.finish_reason, detail))
        # After the caller has its answer: hand the KV state to the prefix cache.
        if self._caching and out.tokens_in_cache:
            self._store_state(out.tokens_in_cache, gen.cache, req.session)

    def _store_state(self, tokens: list[int], cache: Any, session: str | None) -> None:
        """Hand the KV state of ``tokens`` to the prefix cache, once the request is answered;
        a failure is logged, never raised into the request."""
        try:
            import mlx.core as mx

            mx.eval([c.state for c in cache])
            self.prefix_cache.store(tokens, cache, self.namespace, session=session)
        except Exception:
            log.exception("prefix cache store failed")

    def _generate(self, handle: RequestHandle, tokens: list[int], params: Any, cache: Any,
                  n_cached: int, sent: list[int], replay: list[int] | None) -> Generation:
        """Run one generation, sending its events to ``handle``; ``sent`` collects the
        tokens sent. A failure with a cached prefix raises :class:`_Retry`. ``replay``: the
        tokens an earlier, failed attempt already sent, which are checked, not sent again."""

        gather = [replay is None]  # before its prefill, once: see Batching._gather

        def progress(done: int, total: int) -> None:
            handle._emit(ProgressEvent(done, total))
            self._run_quick()
            if gather[0]:
                gather[0] = False
                self._gather(handle)
            if done < total and replay is None and self._join_wanted(handle, gen, sent):
                raise _Join(gen, sent, started)

        from mlxkv.engine.speculation.providers import open_speculation

        req = handle.request
        speculation, constraint = open_speculation(
            self.spec_providers, self.loaded, params, mode=req.spec,
            settings_mode=getattr(self.settings, "spec", "auto"), guided_choice=req.guided_choice,
            json_skeleton=req.json_skeleton, max_tokens=getattr(self.settings, "spec_tokens", 12),
            prefix_cache=self.prefix_cache if self._caching else None, namespace=self.namespace,
            session=req.session)
        speculation = self._decoding(handle, speculation)
        started = time.perf_counter()
        gen = Generation(self.loaded.model, self.loaded.tokenizer, tokens, params,
                         cache=cache, n_cached=n_cached, on_progress=progress,
                         should_stop=lambda: handle.cancelled or self._stopping.is_set(),
                         logprobs=req.logprobs, speculation=speculation, constraint=constraint)
        skip = 0
        steps = iter(gen)
        try:
            for step in steps:
                if replay is not None and skip < len(replay) and step.token is not None:
                    if step.token != replay[skip]:
                        raise EngineError(
                            "computed again without the cache, the reply differs from the "
                            f"{len(replay)} tokens already sent; it cannot be continued")
                    skip += 1
                    continue
                handle._emit(TokenEvent(step.token, step.text, step.logprob, step.top_logprobs))
                if step.token is not None:
                    sent.append(step.token)
                self._run_quick()
                if (step.token is not None and replay is None
                        and self._join_wanted(handle, gen, sent)):
                    steps.close()  # ends its generate_step (and speculation) before the move
                    raise _Join(gen, sent, started)
        except Exception as e:
            if n_cached > 0 and not isinstance(e, EngineError):
                raise _Retry() from e
            raise
        return gen
