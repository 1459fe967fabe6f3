"""The ASGI app: routes, the API key check, CORS, and errors as JSON in each API's shape.

    GET  /health                 liveness (no key needed)
    GET  /v1/models              the models served (loaded or not)
    POST /v1/chat/completions    OpenAI chat (JSON or SSE)
    POST /v1/completions         OpenAI text completion (JSON or SSE)
    POST /v1/responses           OpenAI Responses (JSON or SSE; what Codex CLI speaks)
    POST /v1/messages            Anthropic Messages (JSON or SSE)
    POST /v1/messages/count_tokens  the input tokens of a Messages body
    GET  /stats                  engine, cache and speculation figures, and the server's own
    POST /admin/cache/flush      persist the prefix cache now: 200 with the report, 503 when
                                 the cache is not durable (no SSD tier, or writes left)

Request bodies are never logged. A handler's bug is answered 500 with a JSON error and
logged as one line (``MLXKV_DEBUG=1`` logs the traceback).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mlxkv.engine.pool import UnknownModel
from mlxkv.server import anthropic_api, openai_api, responses_api, tenants
from mlxkv.server.access_log import STREAM_KEY, AccessLog
from mlxkv.server.bridge import cache_header, current_stream
from mlxkv.server.context import Context, ServerConfig, current_lease, dumps
from mlxkv.server.errors import ApiError, anthropic_body, openai_body

if TYPE_CHECKING:
    from mlxkv.engine.api import CacheStats, EngineAPI, EngineStats, FlushReport
    from mlxkv.engine.pool import ModelPool

log = logging.getLogger("mlxkv.server")
_FLUSH_TOTALS: tuple[Literal["durable", "pending", "failed"], ...] = ("durable", "pending", "failed")
Handler = Callable[[HttpRequest, Context], Awaitable[Response]]


def _anthropic(path: str) -> bool:
    return path.startswith("/v1/messages")


def _error(err: ApiError, path: str) -> JSONResponse:
    body = anthropic_body(err) if _anthropic(path) else openai_body(err)
    headers = {"retry-after": "1"} if err.status == 429 else None
    if err.status == 401 and not _anthropic(path):
        headers = {"www-authenticate": "Bearer"}
    return JSONResponse(body, status_code=err.status, headers=headers)


def _route(ctx: Context, handler: Handler, open_route: bool = False,
           admin: bool = False) -> Callable[[HttpRequest], Awaitable[Response]]:
    """``handler`` behind the key check (``open_route``: none; ``admin``: an admin key's
    routes, which show or act on every tenant's cache)."""
    async def endpoint(http: HttpRequest) -> Response:
        try:
            if not open_route:
                tenants.check(http, ctx.config.accepted, admin=admin)
            current_stream.set(None)
            current_lease.set(None)
            response = await handler(http, ctx)
            http.scope[STREAM_KEY] = current_stream.get()  # for the access log
            header = cache_header(current_stream.get())
            if header is not None:  # a generation route: what its cache lookup found
                response.headers["x-mlxkv-cache"] = header
            return response
        except ApiError as e:
            return _error(e, http.url.path)
        except Exception as e:  # a bug of ours: the client gets JSON, the log one line
            if os.environ.get("MLXKV_DEBUG", "") not in ("", "0"):
                log.exception("%s %s failed", http.method, http.url.path)
            else:
                log.error("%s %s failed: %s: %s", http.method, http.url.path, type(e).__name__, e)
            return _error(ApiError(500, f"internal error ({type(e).__name__})"), http.url.path)
        finally:
            lease = current_lease.get()
            if lease is not None:  # the request's stream holds its own while it runs
                current_lease.set(None)
                lease.release()
    return endpoint


async def health(http: HttpRequest, ctx: Context) -> Response:
    """Liveness: answered at once, also during a long prefill (the engine's figures are
    the ones it published last, never asked for)."""
    out: dict[str, Any] = {"status": "ok", "model": ctx.model_id}
    engine: EngineAPI | None = ctx.pool.engine(None)
    snap = engine.snapshot() if engine is not None else None
    if snap is not None:
        out.update(busy=snap.get("busy"), queued=snap.get("queued"), as_of=snap.get("as_of"),
                   age_s=snap.get("age_s"))
    if len(ctx.pool.entries) > 1:
        out["models"] = {m["name"]: m["state"] for m in ctx.pool.describe()}
    return JSONResponse(out)


async def models(http: HttpRequest, ctx: Context) -> Response:
    """The models served, by the short ids requests name them with (and their aliases),
    whether each is loaded, and its context (known once it was loaded)."""
    data = []
    for m in ctx.pool.describe():
        engine: EngineAPI | None = ctx.pool.engine(m["name"]) if m["loaded"] else None
        info = engine.info if engine is not None else {}
        model_id = ctx.model_id if len(ctx.pool.entries) == 1 else m["name"]
        data.append({"id": model_id, "object": "model", "created": ctx.created, "owned_by": "mlxkv",
                     "context_length": info.get("context_tokens", ctx.pool.context_of(m["name"])),
                     "loaded": m["loaded"], "aliases": m["aliases"], "pinned": m["pinned"]})
    return JSONResponse({"object": "list", "data": data})


async def stats(http: HttpRequest, ctx: Context) -> Response:
    """Engine, cache and speculation figures (while the engine is busy: as it published
    them last, ``as_of`` says when), the last requests' cache lookups (``lookups``: what
    each matched and where its prompt parted from the closest cached state), and the
    server's own counts: of the default model, or of the model ``?model=NAME`` names.
    ``models``: every model served, loaded or not, its memory and its load's progress."""
    name = http.query_params.get("model")
    try:
        engine: EngineAPI | None = ctx.pool.engine(name)
    except UnknownModel as e:
        raise ApiError(404, str(e), "model", "model_not_found") from None
    figures: EngineStats | dict[str, Any] = await run_in_threadpool(engine.stats) if engine is not None else {}
    for m in ctx.pool.loaded():
        await run_in_threadpool(ctx.pool.refresh, m[0].name)
    gate = ctx.gate
    return Response(dumps({
        "engine": {k: v for k, v in figures.items() if k not in ("cache", "spec", "lookups")},
        "cache": figures.get("cache"), "spec": figures.get("spec"),
        "lookups": figures.get("lookups", []),
        "models": ctx.pool.describe(), "models_memory_bytes": ctx.pool.memory_bytes,
        "model_events": list(ctx.pool.events),
        "server": {"in_flight": gate.in_flight, "limit": gate.limit, "served": gate.served,
                   "rejected": gate.rejected, "cancelled": gate.cancelled}}), media_type="application/json")


async def flush(http: HttpRequest, ctx: Context) -> Response:
    """Persist every loaded model's prefix cache: 200 with the report (by model when there
    are several), 503 when a cache is not durable or a write is left."""
    reports: dict[str, FlushReport] = {}
    with ctx.pool.each_loaded() as leases:
        for lease in leases:
            engine: EngineAPI = lease.engine
            figures = await run_in_threadpool(engine.stats)
            cache: CacheStats = figures.get("cache") or {}
            if not cache.get("enabled") or not cache.get("ssd"):
                raise ApiError(503, "the prefix cache is not durable here (no SSD tier: "
                                    f"{cache.get('ssd_disabled_reason') or 'turned off'})")
            reports[lease.entry.name] = await run_in_threadpool(engine.cache_flush, 60.0)
    report: Mapping[str, object]
    if len(ctx.pool.entries) == 1:
        report = next(iter(reports.values()), {})
    else:
        report = {"models": reports, **{k: sum(int(r.get(k) or 0) for r in reports.values())
                                        for k in _FLUSH_TOTALS}}
    if report.get("pending") or report.get("failed"):
        return JSONResponse(report, status_code=503)
    return JSONResponse(report)


def create_app(served: EngineAPI | ModelPool, config: ServerConfig | None = None) -> Starlette:
    """The app for a started engine (its model loaded), or for an ``engine.pool.ModelPool``."""
    ctx = Context(served, config or ServerConfig())
    routes = [
        Route("/health", _route(ctx, health, open_route=True), methods=["GET"]),
        Route("/v1/models", _route(ctx, models), methods=["GET"]),
        Route("/v1/chat/completions", _route(ctx, openai_api.chat_completions), methods=["POST"]),
        Route("/v1/completions", _route(ctx, openai_api.completions), methods=["POST"]),
        Route("/v1/responses", _route(ctx, responses_api.responses), methods=["POST"]),
        Route("/v1/messages", _route(ctx, anthropic_api.messages), methods=["POST"]),
        Route("/v1/messages/count_tokens", _route(ctx, anthropic_api.count_tokens), methods=["POST"]),
        Route("/stats", _route(ctx, stats, admin=True), methods=["GET"]),
        Route("/admin/cache/flush", _route(ctx, flush, admin=True), methods=["POST"]),
    ]
    middleware = [Middleware(AccessLog)]
    if ctx.config.cors_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(ctx.config.cors_origins),
                                     allow_methods=["GET", "POST", "OPTIONS"],
                                     allow_headers=["authorization", "content-type", "x-api-key",
                                                    "anthropic-version", "x-session-id"],
                                     expose_headers=["x-mlxkv-cache"]))

    async def http_error(http: HttpRequest, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return _error(ApiError(exc.status_code, f"{http.method} {http.url.path}: {exc.detail}"),
                      http.url.path)

    app = Starlette(routes=routes, middleware=middleware, exception_handlers={HTTPException: http_error})
    app.state.ctx = ctx
    return app
