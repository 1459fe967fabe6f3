"""The engine thread: one thread owns MLX (loads the model, runs every generation) and
serves commands from a queue; callers hold thread-safe :class:`RequestHandle` s.

    with Engine("path/or/hub-id").start() as engine:
        handle = engine.submit(Request(messages=[{"role": "user", "content": "hi"}]))
        for event in handle:          # TokenEvent ..., StatsEvent, FinishedEvent
            ...
        handle.cancel()               # from any thread

Prefix cache seam: see ``engine/prefix_cache.py`` (lookup before prefill, store after).
"""

from __future__ import annotations

import atexit
import itertools
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from engine.generate import Generation, SamplingParams

log = logging.getLogger("mlxkv.engine")


# ----------------------------------------------------------------------------- events
@dataclass(frozen=True)
class TokenEvent:
    token: int | None  # None: a final flush of held-back text
    text: str


@dataclass(frozen=True)
class StatsEvent:
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    ttft_s: float  # submit -> first token (includes queueing and prefill)
    prefill_tps: float  # uncached prompt tokens per second of prefill
    decode_tps: float  # tokens after the first per second
    queue_s: float = 0.0


@dataclass(frozen=True)
class FinishedEvent:
    reason: str  # "stop", "length", "cancelled"
    detail: str | None = None  # "eos", the matched stop string, "shutdown"


@dataclass(frozen=True)
class ErrorEvent:
    message: str
    exception: BaseException | None = None


Event = TokenEvent | StatsEvent | FinishedEvent | ErrorEvent


class EngineError(RuntimeError):
    """A request failed, or the engine could not start."""


# ---------------------------------------------------------------------------- requests
@dataclass
class Request:
    """Exactly one of ``messages`` (chat template applied), ``prompt`` (raw text) or
    ``prompt_tokens``. ``session`` groups requests of one conversation for the cache."""

    messages: list[dict[str, str]] | None = None
    prompt: str | None = None
    prompt_tokens: list[int] | None = None
    params: SamplingParams = field(default_factory=SamplingParams)
    session: str | None = None

    def __post_init__(self) -> None:
        given = [x is not None for x in (self.messages, self.prompt, self.prompt_tokens)]
        if sum(given) != 1:
            raise ValueError("a request needs exactly one of messages, prompt, prompt_tokens")


@dataclass
class Result:
    text: str
    tokens: list[int]
    finish_reason: str
    finish_detail: str | None
    stats: StatsEvent | None


class RequestHandle:
    """Thread-safe view of one request: iterate its events (once), or ``result()``."""

    _ids = itertools.count(1)

    def __init__(self, request: Request, callback: Callable[[Event], None] | None = None):
        self.id = next(self._ids)
        self.request = request
        self.submitted = time.perf_counter()
        self._events: queue.Queue = queue.Queue()
        self._cancel = threading.Event()
        self.done = threading.Event()  # set when the final event has been emitted
        self._callback = callback
        self.tokens: list[int] = []
        self._text: list[str] = []
        self.stats: StatsEvent | None = None
        self.finished: FinishedEvent | None = None
        self.error: ErrorEvent | None = None

    # engine side
    def _emit(self, event: Event) -> None:
        if self._callback is not None:
            try:
                self._callback(event)
            except Exception:  # a front end's bug must not kill the engine thread
                log.exception("event callback failed")
        self._events.put(event)
        if isinstance(event, (FinishedEvent, ErrorEvent)):
            self.done.set()

    # caller side
    def cancel(self) -> None:
        """Ask the engine to stop this request (between tokens); safe from any thread."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def _record(self, event: Event) -> None:
        if isinstance(event, TokenEvent):
            if event.token is not None:
                self.tokens.append(event.token)
            self._text.append(event.text)
        elif isinstance(event, StatsEvent):
            self.stats = event
        elif isinstance(event, FinishedEvent):
            self.finished = event
        elif isinstance(event, ErrorEvent):
            self.error = event

    def events(self, timeout: float | None = None) -> Iterator[Event]:
        """Events until (and including) FinishedEvent or ErrorEvent. ``timeout`` bounds
        the wait for each event (queue.Empty is raised when it passes)."""
        while self.finished is None and self.error is None:
            event = self._events.get(timeout=timeout)
            self._record(event)
            yield event

    def __iter__(self) -> Iterator[Event]:
        return self.events()

    def result(self, timeout: float | None = None) -> Result:
        """Wait for the end; raise :class:`EngineError` if the request failed."""
        for _ in self.events(timeout):
            pass
        if self.error is not None:
            raise EngineError(self.error.message) from self.error.exception
        assert self.finished is not None
        return Result("".join(self._text), list(self.tokens), self.finished.reason,
                      self.finished.detail, self.stats)

    def text(self, timeout: float | None = None) -> str:
        return self.result(timeout).text


# ------------------------------------------------------------------------------ engine
class _Call:
    def __init__(self, fn: Callable[..., Any], args: tuple):
        self.fn, self.args, self.future = fn, args, Future()


_STOP = object()
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


class Engine:
    """Owns one model on one thread. ``prefix_cache`` is an object with ``lookup`` and
    ``store`` (see ENGINE_SEAM), or a callable ``(loaded_model, namespace) -> object``
    called on the engine thread once the model is loaded; None = no caching."""

    def __init__(self, model: str, *, dtype: str = "auto", full_hash: bool = False,
                 prefix_cache: Any = None, name: str = "mlxkv-engine"):
        self.model_spec = str(model)
        self.dtype = dtype
        self.full_hash = full_hash
        self._prefix_arg = prefix_cache
        self.prefix_cache: Any = None
        self._caching = False  # a real prefix cache (not NullPrefixCache) is in use
        self._queue: queue.Queue = queue.Queue()
        self._ready = threading.Event()
        self._stopping = threading.Event()
        # Held while checking _stopping and enqueueing, so nothing lands behind _STOP.
        self._submit_lock = threading.Lock()
        self._load_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.loaded: Any = None  # LoadedModel; touch its arrays only on the engine thread
        self.namespace: str = ""
        self.info: dict[str, Any] = {}

    @classmethod
    def from_settings(cls, settings: Any, prefix_cache: Any = None) -> Engine:
        """An engine for ``settings``; unless ``prefix_cache`` is given, the prefix cache is
        built from the settings on the engine thread (``PrefixCache.from_settings``)."""
        if prefix_cache is None and settings.prefix_cache:
            def prefix_cache(loaded: Any, namespace: str) -> Any:
                from engine.cache.prefix_cache import PrefixCache

                return PrefixCache.from_settings(settings)
        return cls(settings.model, dtype=settings.dtype, prefix_cache=prefix_cache,
                   full_hash=getattr(settings, "full_hash", False))

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

    # commands
    def submit(self, request: Request, callback: Callable[[Event], None] | None = None
               ) -> RequestHandle:
        """Queue a request; ``callback`` (optional) sees each event on the engine thread."""
        handle = RequestHandle(request, callback)
        with self._submit_lock:
            if self._load_error is not None:
                raise self._load_error
            if self._stopping.is_set() or not self._thread.is_alive():
                raise EngineError("engine is not running")
            self._queue.put(handle)
        return handle

    def call(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run ``fn(*args)`` on the engine thread (between requests); returns a Future."""
        cmd = _Call(fn, args)
        with self._submit_lock:
            if self._stopping.is_set() or not self._thread.is_alive():
                cmd.future.set_exception(EngineError("engine is not running"))
            else:
                self._queue.put(cmd)
        return cmd.future

    def sync(self, timeout: float | None = None) -> None:
        """Wait until everything queued before this call has been served."""
        self.call(lambda: None).result(timeout)

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        from engine.models import chat_prompt_tokens

        return self.call(lambda: chat_prompt_tokens(self.loaded.tokenizer, messages)).result()

    # engine thread
    def _run(self) -> None:
        try:
            from engine.blas import describe
            from engine.cache.prefix_cache import NullPrefixCache
            from engine.models import load_model

            self.loaded = load_model(self.model_spec, self.dtype, self.full_hash)
            self.namespace = f"{self.loaded.fingerprint}-{self.loaded.compute_dtype}-kv"
            arg = self._prefix_arg
            if arg is None:
                self.prefix_cache = NullPrefixCache()
            elif callable(arg) and not hasattr(arg, "lookup"):
                self.prefix_cache = arg(self.loaded, self.namespace)
            else:
                self.prefix_cache = arg
            self._caching = not isinstance(self.prefix_cache, NullPrefixCache)
            self.info = {
                "model": self.loaded.spec, "path": str(self.loaded.path),
                "fingerprint": self.loaded.fingerprint, "namespace": self.namespace,
                "weights_dtype": self.loaded.weights_dtype,
                "compute_dtype": self.loaded.compute_dtype, "blas": describe(),
                "model_type": self.loaded.config.get("model_type"),
            }
        except BaseException as e:  # reported to start()'s caller and queued requests
            self._load_error = e
            with self._submit_lock:
                self._stopping.set()
            self._drain(error=e)
            _clear_streams()
            self._ready.set()
            return
        self._ready.set()
        try:
            while True:
                cmd = self._queue.get()
                if cmd is _STOP:
                    break
                if isinstance(cmd, _Call):
                    if cmd.future.set_running_or_notify_cancel():
                        try:
                            cmd.future.set_result(cmd.fn(*cmd.args))
                        except BaseException as e:
                            cmd.future.set_exception(e)
                else:
                    self._serve(cmd)
        finally:
            self._drain()
            close = getattr(self.prefix_cache, "close", None)
            if close is not None:
                try:
                    close(10.0)
                except Exception:
                    log.exception("prefix cache close failed")
            _clear_streams()

    def _drain(self, error: BaseException | None = None) -> None:
        """Answer everything still queued: cancelled (shutdown), or the load ``error``."""
        while True:
            try:
                cmd = self._queue.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, RequestHandle):
                cmd._emit(ErrorEvent(str(error), error) if error is not None
                          else FinishedEvent("cancelled", "shutdown"))
            elif isinstance(cmd, _Call):
                cmd.future.set_exception(error if error is not None
                                         else EngineError("engine shut down"))

    def _prompt_tokens(self, req: Request) -> list[int]:
        from engine.models import chat_prompt_tokens

        tok = self.loaded.tokenizer
        if req.prompt_tokens is not None:
            tokens = [int(t) for t in req.prompt_tokens]
            vocab = self.loaded.config.get("vocab_size")
            bad = [t for t in tokens if t < 0 or (vocab and t >= vocab)]
            if bad:  # mlx would index out of range silently
                raise ValueError(f"token ids out of range [0, {vocab}): {bad[:5]}")
            return tokens
        if req.messages is not None:
            return chat_prompt_tokens(tok, req.messages)
        # As mlx_lm.stream_generate: add special tokens unless the text starts with BOS.
        bos = getattr(tok, "bos_token", None)
        return list(tok.encode(req.prompt, add_special_tokens=bos is None
                               or not req.prompt.startswith(bos)))

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

    def _serve(self, handle: RequestHandle) -> None:
        if handle.cancelled or self._stopping.is_set():
            handle._emit(FinishedEvent("cancelled", "shutdown" if self._stopping.is_set()
                                       else None))
            return
        start = time.perf_counter()
        req = handle.request
        cache = None
        try:
            tokens = self._prompt_tokens(req)
            if not tokens:
                raise ValueError("the prompt is empty")
            n_cached, cache = self._lookup(tokens, req.session)
            gen = Generation(self.loaded.model, self.loaded.tokenizer, tokens, req.params,
                             cache=cache, n_cached=n_cached,
                             should_stop=lambda: handle.cancelled or self._stopping.is_set())
            for step in gen:
                handle._emit(TokenEvent(step.token, step.text))
            out = gen.outcome
            ttft = (gen.first_token_time - handle.submitted) if gen.first_token_time else 0.0
            handle._emit(StatsEvent(
                prompt_tokens=out.prompt_tokens, cached_tokens=out.cached_tokens,
                generated_tokens=len(out.tokens), ttft_s=ttft, prefill_tps=out.prefill_tps,
                decode_tps=out.decode_tps, queue_s=start - handle.submitted))
            detail = out.stop_detail
            if out.finish_reason == "cancelled" and self._stopping.is_set():
                detail = "shutdown"
            handle._emit(FinishedEvent(out.finish_reason, detail))
        except Exception as e:
            log.debug("request %d failed", handle.id, exc_info=True)
            self._release(cache)
            handle._emit(ErrorEvent(f"{type(e).__name__}: {e}", e))
            return
        # After the caller has its answer: hand the KV state to the prefix cache.
        if self._caching and out.tokens_in_cache:
            try:
                import mlx.core as mx

                mx.eval([c.state for c in gen.cache])
                self.prefix_cache.store(out.tokens_in_cache, gen.cache, self.namespace,
                                        session=req.session)
            except Exception:
                log.exception("prefix cache store failed")
