"""What every route shares: the engine, the server's settings and bounds, and the helpers
that read a request body and turn engine events into reply pieces."""

from __future__ import annotations

import contextvars
import copy
import dataclasses
import functools
import json
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any

from mlxkv.engine.generate import SamplingParams
from mlxkv.engine.requests import Event, StatsEvent, TokenEvent
from mlxkv.server.bridge import Gate
from mlxkv.server.chat_prompt import TemplateProbe
from mlxkv.server.diagnostics import MessageLog
from mlxkv.server.errors import ApiError
from mlxkv.server.fields import Limits, get_str, parse_body
from mlxkv.server.response_store import ResponseStore
from mlxkv.server.tenants import Keys, cache_scope, scoped_name

if TYPE_CHECKING:
    from mlxkv.engine.api import EngineAPI
    from mlxkv.engine.pool import Lease, ModelPool


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """The server's own settings (``mlxkv serve`` fills them from engine.settings)."""

    api_key: str | None = None
    keys: Keys | None = None  # several keys (--api-key-file); None: api_key alone, if set
    cors_origins: tuple[str, ...] = ()
    max_body_bytes: int = 8 * 1024**2
    max_requests: int = 64
    max_tokens_limit: int | None = None
    defaults: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    model_id: str | None = None  # what /v1/models lists (default: the engine's model label)
    responses_store_bytes: int = 64 * 1024**2  # earlier /v1/responses kept (previous_response_id)
    churn_rules: bool = True  # server.churn's rules on system text
    # seconds without a byte after which a stream sends a keep-alive (Anthropic ``ping``
    # event, SSE comment on the OpenAI routes): clients give up on a silent stream
    ping_interval_s: float = 10.0
    # a request that names no max_tokens: True, its reply may run to the end of the context
    # (within max_tokens_limit), as OpenAI's do; False, ``defaults.max_tokens`` (what
    # ``mlxkv serve --max-tokens N`` sets)
    open_ended: bool = False

    @functools.cached_property
    def accepted(self) -> Keys:
        """The keys requests must carry (none: every request is let in)."""
        return self.keys if self.keys is not None else Keys.single(self.api_key)


def short_model_id(label: str) -> str:
    """What ``/v1/models`` lists for a model: a GGUF file or a folder by its name (not its
    whole local path), a hub id as it is, the demo model as ``demo``."""
    if label.startswith("demo model"):
        return "demo"
    if label.startswith(("/", "~", ".")) or "\\" in label:
        name = label.rstrip("/\\").replace("\\", "/").rsplit("/", 1)[-1]
        return name.removesuffix(".gguf") or label
    return label


class Served:
    """One model as the routes see it: its engine, the id replies name it by, the limits
    of its context, what its chat template renders, and token texts for log-probabilities
    (a tokenizer of our own: the engine's lives on the engine thread; loading one costs a
    second, once, and only if log-probabilities are asked for)."""

    def __init__(self, engine: EngineAPI, model_id: str, config: ServerConfig):
        self.engine = engine
        self.model_id = model_id
        info = engine.info
        self.limits = Limits(config.max_tokens_limit, info.get("context_tokens"), config.open_ended)
        self.template = TemplateProbe(engine)
        self._tokenizer: Any = None
        self._tok_lock = threading.Lock()
        self._token_texts: dict[int, str] = {}

    def load_tokenizer(self) -> None:
        with self._tok_lock:
            if self._tokenizer is None:
                from transformers import AutoTokenizer

                path = self.engine.info.get("path") or self.engine.model_spec
                self._tokenizer = AutoTokenizer.from_pretrained(str(path))

    def token_text(self, token: int) -> str:
        text = self._token_texts.get(token)
        if text is None:
            if self._tokenizer is None:
                self.load_tokenizer()
            text = self._tokenizer.decode([token])
            if len(self._token_texts) < 1 << 20:
                self._token_texts[token] = text
        return text


# The lease the current HTTP request holds on its model (released when the route returns;
# a request's EventStream holds it on its own until the reply ends).
current_lease: contextvars.ContextVar[Lease | None] = contextvars.ContextVar("mlxkv_current_lease", default=None)


class Context:
    """What every route shares (the models, the server's settings and bounds, the stores of
    earlier replies) and, once :meth:`for_model` bound it to a request's model, that
    model's parts (:class:`Served`): ``engine``, ``model_id``, ``limits``, ``template``,
    ``token_text``. Unbound, those are the default model's. ``models`` is an
    ``engine.pool.ModelPool``, or one started engine (served under every name)."""

    def __init__(self, models: EngineAPI | ModelPool, config: ServerConfig):
        from mlxkv.engine.pool import ModelPool

        self.config = config
        self.gate = Gate(config.max_requests)
        if isinstance(models, ModelPool):
            self.pool = models
        else:
            name = config.model_id or short_model_id(str(models.info.get("model") or models.model_spec))
            self.pool = ModelPool.of_engine(models, name)
        self.created = int(time.time())
        self.responses = ResponseStore(config.responses_store_bytes)
        self.messages = MessageLog()  # Messages replies, for cache diagnostics
        self._served: dict[int, Served] = {}  # by id(engine): a reloaded model is served anew
        self._served_lock = threading.Lock()
        self.lease: Lease | None = None
        self._bound: Served | None = None

    def served(self, engine: EngineAPI, name: str) -> Served:
        with self._served_lock:
            served = self._served.get(id(engine))
            if served is None or served.engine is not engine:
                model_id = self.config.model_id if len(self.pool.entries) == 1 and self.config.model_id else name
                served = self._served[id(engine)] = Served(engine, model_id, self.config)
            return served

    def _current(self) -> Served:
        if self._bound is not None:
            return self._bound
        entry = self.pool.resolve(None)
        engine: EngineAPI | None = self.pool.engine(None)
        if engine is None:
            from mlxkv.engine.requests import EngineError

            raise EngineError(f"model {entry.name} is not loaded")
        return self.served(engine, entry.name)

    @property
    def engine(self) -> EngineAPI:
        return self._current().engine

    @property
    def model_id(self) -> str:
        if self._bound is None and self.pool.engine(None) is None:
            return self.pool.resolve(None).name
        return self._current().model_id

    @property
    def limits(self) -> Limits:
        return self._current().limits

    @property
    def template(self) -> TemplateProbe:
        return self._current().template

    def load_tokenizer(self) -> None:
        self._current().load_tokenizer()

    def token_text(self, token: int) -> str:
        return self._current().token_text(token)

    async def for_model(self, body: dict) -> Context:
        """This context bound to the model the request's ``model`` names (loading it, or
        waiting for its load, first): a 404 naming the models when none answers to it."""
        from starlette.concurrency import run_in_threadpool

        from mlxkv.engine.pool import UnknownModel

        name = get_str(body, "model")
        try:
            lease = await run_in_threadpool(self.pool.lease, name)
        except UnknownModel as e:
            raise ApiError(404, str(e), "model", "model_not_found") from None
        except Exception as e:  # its load failed: say why (the next request tries again)
            raise ApiError(503, f"model {name or self.pool.default!r} could not be loaded: {e}", "model") from None
        held = current_lease.get()
        if held is not None:  # one lease per request
            held.release()
        current_lease.set(lease)
        bound = copy.copy(self)
        bound.lease, bound._bound = lease, self.served(lease.engine, lease.entry.name)
        return bound


async def read_json(request: Any, limit: int) -> dict[str, Any]:
    """The body as a JSON object, read no further than ``limit`` bytes (413 beyond)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            if int(declared) > limit:
                raise ApiError(413, f"the request body is {int(declared)} bytes; the limit is {limit}")
        except ValueError:
            raise ApiError(400, "content-length is not a number") from None
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"the request body is over the limit of {limit} bytes")
        chunks.append(chunk)
    return parse_body(b"".join(chunks))


def model_name(body: dict, ctx: Context) -> str:
    """The model a reply names: the one the client asked for (a client may check that the
    reply names what it sent, also when an alias or the default model answered it), else
    the served one."""
    return get_str(body, "model") or ctx.model_id


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def session_of(request: Any, body: dict) -> str | None:
    """The conversation a request belongs to, if the client says (header or field): the
    prefix cache keeps a session's states together. It caches by prefix either way."""
    value = request.headers.get("x-session-id") or body.get("session_id")
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > 256:
        raise ApiError(400, "session_id must be a string of 1 to 256 characters", "session_id")
    return scoped_name(value, cache_scope(request, body))


def text_of(content: Any, where: str) -> str:
    """Message content as text: a string, or a list of text parts (other parts: 400)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if isinstance(part, str):
                out.append(part)
            elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                out.append(part["text"])
            elif isinstance(part, dict):
                raise ApiError(400, f"{where}: content parts of type {part.get('type')!r} are not "
                                    "supported (text only)", where)
            else:
                raise ApiError(400, f"{where}: content parts must be objects", where)
        return "".join(out)
    raise ApiError(400, f"{where}: content must be a string or an array of parts", where)


def _stats(events: list[Event]) -> StatsEvent | None:
    return next((e for e in reversed(events) if isinstance(e, StatsEvent)), None)


def stored_count(events: list[Event]) -> int:
    """The prompt tokens a finished request stored into the prefix cache."""
    stats = _stats(events)
    return stats.stored_tokens if stats is not None else 0


def usage_counts(events: list[Event]) -> tuple[int, int, int]:
    """(prompt, cached, generated) tokens of a finished request."""
    stats = _stats(events)
    generated = sum(1 for e in events if isinstance(e, TokenEvent) and e.token is not None)
    if stats is None:
        return 0, 0, generated
    return stats.prompt_tokens, stats.cached_tokens, stats.generated_tokens


def timings(events: list[Event]) -> dict[str, Any] | None:
    """The engine's own figures for a request (an extension field clients ignore): where its
    time went, and which cache tier its cached tokens came from."""
    stats = _stats(events)
    if stats is None:
        return None
    out: dict[str, Any] = {"queue_s": round(stats.queue_s, 6), "ttft_s": round(stats.ttft_s, 6),
           "prefill_tps": round(stats.prefill_tps, 3), "decode_tps": round(stats.decode_tps, 3),
           "cached_ram_tokens": stats.cached_ram_tokens, "cached_ssd_tokens": stats.cached_ssd_tokens,
           "batched": stats.batched}
    if stats.spec:
        out["spec"] = stats.spec
    return out


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), default=str)
