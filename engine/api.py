"""What a front end (the TUI, the HTTP server, the CLI) may call on an engine, typed.

:class:`EngineAPI` is the whole surface: requests, the figures of :meth:`~EngineAPI.stats`,
the prefix cache's views and upkeep, tokenizing, engine-wide events and the lifecycle.
:class:`CacheViews` is the part the cache inspector needs; an object standing between a
front end and its engine (the TUI's bridge) offers that part alone. Every front end holds
its engine as one of these, never as ``engine.engine.Engine``, so the engine may change
inside as long as this holds; a check at the end of ``engine/engine.py`` has mypy hold
:class:`~engine.engine.Engine` to it.

The figures are the engine's dictionaries as they are at run time, described by
TypedDicts: the keys front ends read are named here (the cache reports more than
:class:`CacheStats` names).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol, TypedDict

# The cache's reports are the cache's own types, named here for the front ends.
from mlxkv.engine.cache.durability import FlushReport as FlushReport
from mlxkv.engine.cache.info import VerifyReport as VerifyReport

if TYPE_CHECKING:
    from mlxkv.engine.cache.info import CacheEntryDetail, CacheEntryInfo
    from mlxkv.engine.requests import EngineEvent, Event, Request, RequestHandle


class ModelInfo(TypedDict, total=False):
    """``EngineAPI.info``: the loaded model (empty until it is loaded); a model source may
    add its own keys (a shard's ``shard``)."""

    model: str  # its label
    spec: str
    path: str
    fingerprint: str
    namespace: str
    weights_dtype: str
    compute_dtype: str
    blas: str
    model_type: str | None
    context_tokens: int | None
    load_s: float
    speculation: list[str]
    shard: Any  # a sharded engine's part of the model, as the launch describes it


class DurabilityFigures(TypedDict, total=False):
    """``CacheStats["durability"]``: writes to the SSD tier by state."""

    durable: int
    pending: int
    failed: int
    missing: int


class QueueFigures(TypedDict, total=False):
    """``CacheStats["queues"]``: the SSD writer's and the storage's queues."""

    waiting: int
    inflight: int
    storage_pending_writes: int
    storage_pending_reads: int


class NamespaceBytes(TypedDict, total=False):
    """``CacheStats["namespaces"]`` by store namespace: what each tier holds of it."""

    ram_bytes: int
    ssd_bytes: int


class CacheStats(TypedDict, total=False):
    """``EngineStats["cache"]``: the prefix cache's figures (``{"enabled": False}`` when
    caching is off). Counters are totals since the engine started."""

    enabled: bool
    block_tokens: int
    prompt_tokens: int
    cached_tokens: int
    hit_fraction: float
    ram_hits: int
    ssd_hits: int
    misses: int
    ram_bytes: int
    ram_max_bytes: int
    ram_entries: int
    ram_blocks: int
    dedup_ratio: float
    restore_ms: float
    restore_bytes: int
    ssd: bool
    ssd_bytes: int
    ssd_max_bytes: int | None
    ssd_blocks: int
    ssd_disabled_reason: str | None
    sessions: int
    pinned: int
    retained: int
    queues: QueueFigures
    durability: DurabilityFigures
    namespaces: dict[str, NamespaceBytes]


class RunningRequest(TypedDict, total=False):
    """``EngineStats["running"]``: one request being served and how far it is."""

    id: int
    prompt_tokens: int | None
    prefill_done: int
    generated: int
    chunk: int
    layer: int
    layers: int
    phase: str  # "prefill" or "decode"


class LookupRow(TypedDict, total=False):
    """``EngineStats["lookups"]``: one request's cache lookup (``engine.lookups.LookupReport``)."""

    request: int
    at: float
    prompt_tokens: int
    matched: int
    tier: str | None
    outcome: str
    diverged_at: int | None
    entry: str | None
    entry_label: str | None
    entry_tokens: int
    entry_tier: str | None
    before: str
    prompt_after: str
    entry_after: str


class MemoryFigures(TypedDict):
    """``EngineStats["memory"]``: MLX's allocator, process-wide."""

    mlx_active_bytes: int
    mlx_cache_bytes: int
    mlx_peak_bytes: int


class DistributedInfo(TypedDict):
    """Under a distributed launch: this rank, the group, and the last request's cached
    prefix per rank (``cached_by_rank``, ...)."""

    world: int
    rank: int
    shard: Any  # the shard's description, as the launch gives it
    last_request: dict[str, Any] | None


class _EngineFigures(TypedDict):
    model: ModelInfo
    load_s: float
    requests: int
    errors: int
    refused: int
    cancelled: int
    retries: int
    batched: int
    loading: bool
    queued: int
    busy: bool
    active: int
    max_batch: int
    batching: bool
    namespace: str
    spec: dict[str, dict[str, Any]]  # per draft source: its figures (JSON)
    running: list[RunningRequest]
    lookups: list[LookupRow]
    step_budget: dict[str, float | int | None] | None
    memory: MemoryFigures
    compiled: dict[str, dict[str, int]]
    cache: CacheStats | None  # None while the model loads
    as_of: float  # unix time the figures were taken
    age_s: float


class EngineStats(_EngineFigures, total=False):
    """:meth:`EngineAPI.stats`: the model, request counts, what is queued and running,
    the last cache lookups, the cache's figures, and when they were taken."""

    distributed: DistributedInfo  # under a distributed launch


class GCReport(TypedDict):
    """:meth:`CacheViews.cache_gc`: SSD blocks no saved state names, removed."""

    removed: int
    bytes: int
    live_keys: int
    manifests_removed: int
    unreadable_manifests: dict[str, str]  # path -> why it cannot be read


class CacheSwitch(Protocol):
    """What a front end reads of an engine's prefix cache: whether it stores at all."""

    @property
    def enabled(self) -> bool: ...


class CacheViews(Protocol):
    """The figures and the prefix cache's views and upkeep. Each call blocks (up to
    ``timeout`` seconds) while the engine thread answers: call from a worker thread."""

    def stats(self, timeout: float | None = ...) -> EngineStats: ...

    def cache_entries(self, ns: str | None = ..., timeout: float | None = ...) -> list[CacheEntryInfo]: ...

    def cache_entry(self, entry_id: str, timeout: float | None = ...) -> CacheEntryDetail | None: ...

    def cache_pin(self, entry_id: str, pinned: bool = ..., timeout: float | None = ...) -> bool: ...

    def cache_evict(self, entry_id: str, timeout: float | None = ...) -> bool: ...

    def cache_delete(self, entry_id: str, timeout: float | None = ...) -> bool: ...

    def cache_verify(self, entry_id: str | None = ..., timeout: float | None = ...) -> VerifyReport: ...

    def cache_flush(self, timeout: float | None = ...) -> FlushReport: ...

    def cache_gc(self, min_age_s: float = ..., timeout: float | None = ...) -> GCReport: ...

    def decode(self, tokens: list[int], timeout: float | None = ...) -> str: ...

    def subscribe(self, callback: Callable[[EngineEvent], None]) -> Callable[[], None]:
        """Engine-wide events (cache, load) from the engine's threads; returns the
        function that unsubscribes."""
        ...


class EngineAPI(CacheViews, Protocol):
    """Everything a front end may call on an engine (``engine.engine.Engine`` and the
    sharded engine of a distributed launch are ones)."""

    @property
    def model_spec(self) -> str: ...

    @property
    def info(self) -> ModelInfo: ...

    @property
    def prefix_cache(self) -> CacheSwitch | None: ...

    # lifecycle
    def start(self, timeout: float | None = ..., wait: bool = ...) -> EngineAPI: ...

    def wait_ready(self, timeout: float | None = ...) -> EngineAPI: ...

    def shutdown(self, timeout: float | None = ..., wait: bool = ...) -> None: ...

    def is_alive(self) -> bool: ...

    # requests
    def submit(self, request: Request, callback: Callable[[Event], None] | None = ...) -> RequestHandle: ...

    def snapshot(self) -> EngineStats | None:
        """The figures the engine thread published last, without asking it (None before
        the model is loaded)."""
        ...

    def distributed_info(self) -> DistributedInfo | None:
        """This rank and its group under a distributed launch; None in one process."""
        ...

    # conversations' cached state
    def prefetch(self, messages: list[dict[str, Any]], session: str | None = ...) -> Future[int]: ...

    def open_session(self, session: str, timeout: float | None = ...) -> None: ...

    def close_session(self, session: str, timeout: float | None = ...) -> None: ...

    # the tokenizer and the chat template
    def encode(self, text: str, timeout: float | None = ...) -> list[int]: ...

    def encode_chat(self, messages: list[dict[str, str]], timeout: float | None = ...,
                    tools: list[dict[str, Any]] | None = ...,
                    template_kwargs: dict[str, Any] | None = ...) -> list[int]: ...

    def chat_template(self, markers: Sequence[str] = ..., timeout: float | None = ...
                      ) -> tuple[str | None, list[str], str | None]: ...

