"""The engine: one thread owns MLX (loads the model, runs every generation) and serves
commands from a queue; callers hold thread-safe :class:`RequestHandle` s.

    with Engine("path/or/hub-id").start() as engine:
        handle = engine.submit(Request(messages=[{"role": "user", "content": "hi"}]))
        for event in handle:          # ProgressEvent ..., TokenEvent ..., StatsEvent, FinishedEvent
            ...
        handle.cancel()               # from any thread
        engine.stats(); engine.cache_entries(); engine.subscribe(print)
        engine.prefetch(messages).result()   # warm a conversation's cached state into RAM

Every public method runs on the engine thread, between tokens or between requests, and
waits with a timeout (:class:`EngineError` when it passes); front ends call them through
:class:`~engine.api.EngineAPI`. :class:`Engine` is a facade over parts with one job each,
drawn in ``docs/architecture.md``: lifecycle (``engine.thread``), commands, loading, and on
the engine thread the scheduler, preparation, the single stream, batching and the cache's use.
More than ``max_queue`` waiting requests make ``submit`` raise :class:`QueueFull`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, TypeVar, cast

from mlxkv.engine.cache.client import CacheArg, CacheClient
from mlxkv.engine.commands import CommandQueue, CommandSource, QueueSource, wait
from mlxkv.engine.listeners import Listeners
from mlxkv.engine.loading import LocalModel, ModelSource, Runtime
from mlxkv.engine.preparing import LocalTokens, TokenSource
from mlxkv.engine.requests import (  # noqa: F401  (re-exported: the engine's public names)
    CacheEvent,
    Counts,
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
    blank,
)
from mlxkv.engine.settings import Settings
from mlxkv.engine.snapshot import Publisher
from mlxkv.engine.thread import EngineThread

if TYPE_CHECKING:
    from mlxkv.engine.api import (
        DistributedInfo,
        EngineAPI,
        EngineStats,
        FlushReport,
        GCReport,
        ModelInfo,
        VerifyReport,
    )
    from mlxkv.engine.cache.info import CacheEntryDetail, CacheEntryInfo
    from mlxkv.engine.models import LoadedModel
    from mlxkv.engine.scheduler import Scheduler
    from mlxkv.engine.speculation.base import ProposalProvider

T = TypeVar("T")


@dataclasses.dataclass
class EngineSources:
    """What an engine runs on, each behind a declared interface: the model's source, the
    source of the engine thread's commands and the source of a generation's tokens. The
    defaults are one process; a sharded engine plugs in its own."""

    model: ModelSource | None = None  # None: the whole model, in this process
    commands: CommandSource = dataclasses.field(default_factory=QueueSource)
    tokens: TokenSource = dataclasses.field(default_factory=LocalTokens)



def _mlx_memory() -> dict[str, int]:
    """MLX's allocator, process-wide: arrays alive, buffers kept for reuse, the peak."""
    import mlx.core as mx

    return {"mlx_active_bytes": int(mx.get_active_memory()), "mlx_cache_bytes": int(mx.get_cache_memory()),
            "mlx_peak_bytes": int(mx.get_peak_memory())}

class Engine:
    """Owns one model on one thread. ``prefix_cache`` is a :class:`CacheClient` (see
    ``engine.cache.PrefixCache``), or a callable ``(loaded_model, namespace) -> cache``
    called on the engine thread once the model is loaded; None = no caching. ``settings``
    (default: :meth:`Settings.defaults`) holds every other choice; ``dtype``,
    ``full_hash``, ``max_batch`` and ``max_queue``, when given, override it."""

    def __init__(self, model: str, *, dtype: str | None = None, full_hash: bool | None = None,
                 prefix_cache: CacheArg = None, name: str = "mlxkv-engine",
                 settings: Settings | None = None, max_batch: int | None = None,
                 max_queue: int | None = None, sources: EngineSources | None = None):
        if (max_batch is not None and int(max_batch) < 1) or (
                max_queue is not None and int(max_queue) < 1):
            raise ValueError(f"max_batch and max_queue must be at least 1, got {max_batch} "
                             f"and {max_queue}")
        settings = settings if settings is not None else Settings.defaults()
        given = {"model": str(model), "dtype": dtype, "full_hash": full_hash,
                 "max_batch": max_batch, "max_queue": max_queue}
        current = settings.as_dict()
        changed = {k: v for k, v in given.items() if v is not None and v != current[k]}
        self.settings = settings.replace(**changed) if changed else settings
        self.model_spec = self.settings.model
        self.max_batch, self.max_queue = self.settings.max_batch, self.settings.max_queue
        self.sources = sources if sources is not None else EngineSources()
        self._model = self.sources.model or LocalModel(self.model_spec, self.settings.dtype,
                                                     self.settings.full_hash,
                                                     self.settings.dequantize)
        self._prefix_arg = prefix_cache
        self._counts = Counts()
        self._listeners = Listeners()
        # the figures the engine thread publishes, for callers that must not wait for it
        self._publisher = Publisher(self._figures, self._listing)
        self._listeners.subscribe(self._publisher.on_event)
        self._commands = CommandQueue(self.max_queue)
        self._thread = EngineThread(name, self._commands, load=self._load,
                                    serve=lambda: self.scheduler.run(),
                                    finish=lambda: self.scheduler.finish())
        self.runtime: Runtime | None = None  # set on the engine thread once loaded
        self._scheduler: Scheduler | None = None

    @classmethod
    def from_settings(cls, settings: Settings, prefix_cache: CacheArg = None) -> Engine:
        """An engine for ``settings`` in this process; unless ``prefix_cache`` is given,
        the prefix cache is built from the settings on the engine thread
        (``PrefixCache.from_settings``). Under mlx.launch,
        ``engine.distributed.launch.engine_for`` gives this rank's engine."""
        if prefix_cache is None and settings.prefix_cache:
            def prefix_cache(loaded: LoadedModel, namespace: str) -> CacheClient:
                from mlxkv.engine.cache.prefix_cache import PrefixCache

                return PrefixCache.from_settings(settings)
        return cls(settings.model, prefix_cache=prefix_cache, settings=settings)

    # what the engine thread loaded (empty until then)
    @property
    def scheduler(self) -> Scheduler:
        """The engine thread's parts (touch them on the engine thread only)."""
        if self._scheduler is None:
            raise EngineError(f"model {self.model_spec} is not loaded")
        return self._scheduler

    @property
    def loaded(self) -> LoadedModel | None:
        """The loaded model; touch its arrays only on the engine thread."""
        return self.runtime.loaded if self.runtime is not None else None

    @property
    def namespace(self) -> str:
        return self.runtime.namespace if self.runtime is not None else ""

    @property
    def info(self) -> ModelInfo:
        return cast("ModelInfo", self.runtime.info if self.runtime is not None else {})

    @property
    def load_s(self) -> float:
        return self.runtime.load_s if self.runtime is not None else 0.0

    @property
    def spec_providers(self) -> dict[str, ProposalProvider]:
        return self.runtime.providers if self.runtime is not None else {}

    @property
    def prefix_cache(self) -> CacheClient | None:
        return self.runtime.cache.client if self.runtime is not None else None

    # lifecycle
    def start(self, timeout: float | None = None, wait: bool = True) -> Engine:
        """Start the thread; with ``wait``, wait until the model is loaded (re-raising a
        load error). Without it, requests may be submitted at once: they are served as
        soon as the model is loaded, or fail with the load error."""
        self._thread.start()
        return self.wait_ready(timeout) if wait else self

    def wait_ready(self, timeout: float | None = None) -> Engine:
        """Wait for the model to be loaded; re-raise the load error if it failed."""
        self._thread.wait_ready(timeout, f"model {self.model_spec}")
        return self

    def shutdown(self, timeout: float | None = 30.0, wait: bool = True) -> None:
        """Cancel what runs, finish queued requests as cancelled, close the cache, and
        (with ``wait``) join the engine thread."""
        self._thread.stop(timeout, wait)

    def is_alive(self) -> bool:
        """Whether the engine thread runs."""
        return self._thread.is_alive()

    def join(self, timeout: float | None = None) -> None:
        """Wait for the engine thread to end."""
        self._thread.join(timeout)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # requests and calls
    def submit(self, request: Request, callback: Callable[[Event], None] | None = None
               ) -> RequestHandle:
        """Queue a request; ``callback`` (optional) sees each event on the engine thread.
        Raises :class:`QueueFull` at once when ``max_queue`` requests already wait."""
        handle = RequestHandle(request, callback)
        self._commands.submit(handle)
        return handle

    def call(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run ``fn(*args)`` on the engine thread (between requests); returns a Future.
        For tests and tools: front ends have a public method for what they need."""
        return self._commands.call(fn, *args)

    def sync(self, timeout: float | None = 30.0) -> None:
        """Wait until everything queued before this call has been served."""
        wait(self.call(lambda: None), timeout, "sync")

    def _ask(self, what: str, fn: Callable[..., T], *args: Any,
             timeout: float | None = 30.0) -> T:
        """Run ``fn(*args)`` on the engine thread as soon as it is between two tokens (or
        two requests), and wait for its result."""
        if self._thread.is_current():
            return fn(*args)
        return wait(self._commands.quick(fn, *args), timeout, what)

    # what front ends need
    def stats(self, timeout: float | None = 30.0) -> EngineStats:
        """The model, its load time, request counts, what is queued, the requests being
        served (``active``; ``running``: how far each is), the cache's stats, the last
        lookups (``lookups``: what each request found in the cache, and why no more), and
        ``as_of`` / ``age_s``: when they were taken. While the engine thread is busy they
        are what it published last (at most about half a second old while it works), so
        this never waits for a prefill; the request counts are always as of now (a request
        whose answer a caller has is counted). ``loading`` and no cache stats while the
        model loads."""
        if self._thread.loading():
            return cast("EngineStats", {**self._figures(loading=True), "as_of": time.time(), "age_s": 0.0})
        figures = self._publisher.stats(
            lambda: self._ask("stats", self._publisher.publish_now, timeout=timeout))
        return cast("EngineStats", {**figures, **self._counts.as_dict()})

    def snapshot(self) -> EngineStats | None:
        """What the engine thread published last (the figures of :meth:`stats`, with
        ``as_of``), without asking it anything; None before the model is loaded."""
        snap = self._publisher.latest
        return None if snap is None else cast("EngineStats", snap.answer())

    def _figures(self, loading: bool = False) -> dict[str, Any]:
        from mlxkv.engine.speculation.providers import spec_stats
        from mlxkv.engine.traced import trace_figures

        sched, rt = self._scheduler, self.runtime
        active = sched.active() if sched is not None else 0
        return {"model": dict(self.info), "load_s": self.load_s, **self._counts.as_dict(),
                "loading": loading, "queued": self._commands.waiting,
                "busy": active > 0, "active": active, "max_batch": self.max_batch,
                "batching": rt is not None and rt.batchable and self.max_batch > 1,
                "namespace": self.namespace, "spec": spec_stats(self.spec_providers),
                "running": sched.running() if sched is not None else [],
                "lookups": sched.lookups.as_dicts() if sched is not None else [],
                "step_budget": sched.batching.budget.figures() if sched is not None else None,
                "memory": _mlx_memory(), "compiled": trace_figures(),
                "cache": None if loading or rt is None else rt.cache.client.stats()}

    def _listing(self) -> list[CacheEntryInfo]:
        return self.scheduler.runtime.cache.client.entries(None)

    def _cache(self, what: str, fn: Callable[[CacheClient], T], timeout: float | None) -> T:
        return self._ask(f"cache {what}", lambda: fn(self.scheduler.runtime.cache.client),
                         timeout=timeout)

    def cache_entries(self, namespace: str | None = None, timeout: float | None = 30.0
                      ) -> list[CacheEntryInfo]:
        """Cached states (``CacheEntryInfo``), of model namespace ``namespace`` or all. All of them,
        while the engine thread is busy, are the listing it published last (made again
        whenever the cache changed, at most about once a second), so this never waits for
        a prefill."""
        if namespace is not None:
            return self._cache("entries", lambda c: c.entries(namespace), timeout)
        return self._publisher.entries(
            lambda: self._ask("cache entries", self._publisher.list_now, timeout=timeout))

    def cache_entry(self, entry_id: str, timeout: float | None = 30.0
                    ) -> CacheEntryDetail | None:
        """One entry's details (``CacheEntryDetail``) or None."""
        return self._cache("entry", lambda c: c.entry(entry_id), timeout)

    def cache_pin(self, entry_id: str, pinned: bool = True, timeout: float | None = 30.0
                  ) -> bool:
        return self._cache("pin", lambda c: c.pin(entry_id, pinned), timeout)

    def cache_evict(self, entry_id: str, timeout: float | None = 30.0) -> bool:
        """Drop an entry from RAM (kept on SSD)."""
        return self._cache("evict", lambda c: c.evict(entry_id), timeout)

    def cache_delete(self, entry_id: str, timeout: float | None = 30.0) -> bool:
        """Drop an entry from every tier."""
        return self._cache("delete", lambda c: c.delete(entry_id), timeout)

    def cache_verify(self, entry_id: str | None = None, timeout: float | None = 30.0) -> VerifyReport:
        """Read and check SSD blocks (of one entry, or all)."""
        return self._cache("verify", lambda c: c.verify(entry_id), timeout)

    def cache_flush(self, timeout: float | None = None) -> FlushReport:
        """Persist every dirty state now (the flush itself is bounded by ``timeout``)."""
        wait_s = None if timeout is None else timeout + 30.0
        return self._cache("flush", lambda c: c.flush(timeout), wait_s)

    def cache_gc(self, min_age_s: float = 0.0, timeout: float | None = 30.0) -> GCReport:
        """Remove the SSD blocks of this model's namespace that no saved state names
        (older than ``min_age_s``): ``{removed, bytes, live_keys, manifests_removed,
        unreadable_manifests}``; zeros without an SSD tier."""
        return cast("GCReport", self._cache("gc", lambda c: c.gc(self.namespace, float(min_age_s)), timeout))

    def prefetch(self, messages: list[dict[str, Any]], session: str | None = None) -> Future:
        """Warm the cached state of the prompt ``messages`` would send next (chat template
        with the generation prompt) into RAM, restoring it from SSD, on the engine thread
        between requests (so a chat opened after a restart answers from RAM). The Future
        resolves to the tokens now warm in RAM (0 when nothing is cached or caching is
        off) or to the error that stopped it."""
        def run() -> int:
            cache = self.scheduler.runtime.cache
            if not cache.enabled or not messages or all(blank(m.get("content")) for m in messages):
                return 0
            tokens = self.scheduler.preparer.chat_tokens(messages)
            return int(cache.client.prefetch(tokens, self.namespace, session=session))
        return self.call(run)

    def open_session(self, session: str, timeout: float | None = 30.0) -> None:
        self._cache("open_session", lambda c: c.open_session(session), timeout)

    def close_session(self, session: str, timeout: float | None = 30.0) -> None:
        self._cache("close_session", lambda c: c.close_session(session), timeout)

    def encode(self, text: str, timeout: float | None = 30.0) -> list[int]:
        """Token ids of raw ``text``, as ``Request(prompt=text)`` would see them."""
        return self._ask("encode", lambda: self.scheduler.preparer.encode_text(text),
                         timeout=timeout)

    def encode_chat(self, messages: list[dict[str, str]], timeout: float | None = 30.0,
                    tools: list[dict[str, Any]] | None = None,
                    template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Token ids of the prompt ``Request(messages=..., tools=...)`` sends the model."""
        return self._ask("encode_chat", lambda: self.scheduler.preparer.chat_tokens(
            messages, tools, template_kwargs), timeout=timeout)

    def chat_template(self, markers: Sequence[str] = (), timeout: float | None = 30.0
                      ) -> tuple[str | None, list[str], str | None]:
        """The model's chat template (None: it has none), which of ``markers`` are single
        tokens of its vocabulary, and the tool parser its tokenizer config names (mlx-lm's
        ``tool_parser_type``, or None): what a front end needs to tell its reply format."""
        def read() -> tuple[str | None, list[str], str | None]:
            tokenizer = self.scheduler.runtime.loaded.tokenizer
            template = getattr(tokenizer, "chat_template", None)
            vocab = tokenizer.get_vocab()
            named = (getattr(tokenizer, "init_kwargs", None) or {}).get("tool_parser_type")
            return (template if isinstance(template, str) else None, [m for m in markers if m in vocab],
                    named if isinstance(named, str) else None)
        return self._ask("chat_template", read, timeout=timeout)

    def decode(self, tokens: list[int], timeout: float | None = 30.0) -> str:
        return self._ask("decode", lambda: self.scheduler.runtime.loaded.tokenizer.decode(
            list(tokens)), timeout=timeout)

    def distributed_info(self) -> DistributedInfo | None:
        """This rank and its group under a distributed launch (a sharded engine); None here:
        one process holds the whole model."""
        return None

    def subscribe(self, callback: Callable[[EngineEvent], None]) -> Callable[[], None]:
        """Call ``callback`` with every engine-wide event (:class:`CacheEvent`,
        :class:`LoadEvent`), from the engine or storage threads; returns the function
        that unsubscribes it."""
        return self._listeners.subscribe(callback)

    # the engine thread
    def _load(self) -> None:
        from mlxkv.engine.loading import load_runtime, ready_event
        from mlxkv.engine.scheduler import Scheduler

        runtime = load_runtime(self._model, self.settings, self._prefix_arg,
                               self._listeners.publish, self._listeners.cache_event)
        self._scheduler = Scheduler(runtime, self.settings, self._commands, self._counts,
                                    self.sources.commands, self.sources.tokens,
                                    self._thread.load_wait, self.max_batch, self._publisher)
        self.runtime = runtime
        self._listeners.publish(ready_event())


if TYPE_CHECKING:
    def _offers_the_engine_api(engine: Engine) -> EngineAPI:
        """Never called: mypy checks that :class:`Engine` offers all the front ends may call."""
        return engine
