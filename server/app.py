"""The ASGI app: routes, the API key check, CORS, and errors as JSON in each API's shape.

    GET  /health                 liveness (no key needed)
    GET  /v1/models              the one model served
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

import hmac
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mlxkv.server import anthropic_api, openai_api, responses_api
from mlxkv.server.access_log import STREAM_KEY, AccessLog
from mlxkv.server.bridge import cache_header, current_stream
from mlxkv.server.context import Context, ServerConfig, dumps
from mlxkv.server.errors import ApiError, anthropic_body, openai_body

log = logging.getLogger("mlxkv.server")
Handler = Callable[[HttpRequest, Context], Awaitable[Response]]


def _anthropic(path: str) -> bool:
    return path.startswith("/v1/messages")


def _error(err: ApiError, path: str) -> JSONResponse:
    body = anthropic_body(err) if _anthropic(path) else openai_body(err)
    headers = {"retry-after": "1"} if err.status == 429 else None
    if err.status == 401 and not _anthropic(path):
        headers = {"www-authenticate": "Bearer"}
    return JSONResponse(body, status_code=err.status, headers=headers)


def _check_key(http: HttpRequest, key: str | None) -> None:
    if key is None:
        return
    given = http.headers.get("x-api-key")
    auth = http.headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        given = auth[7:].strip()
    if given is None or not hmac.compare_digest(given.encode(), key.encode()):
        raise ApiError(401, "invalid API key" if given else
                       "an API key is required (Authorization: Bearer KEY, or x-api-key: KEY)")


def _route(ctx: Context, handler: Handler, open_route: bool = False) -> Callable[[HttpRequest], Awaitable[Response]]:
    async def endpoint(http: HttpRequest) -> Response:
        try:
            if not open_route:
                _check_key(http, ctx.config.api_key)
            current_stream.set(None)
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
    return endpoint


async def health(http: HttpRequest, ctx: Context) -> Response:
    """Liveness: answered at once, also during a long prefill (the engine's figures are
    the ones it published last, never asked for)."""
    out: dict[str, Any] = {"status": "ok", "model": ctx.model_id}
    snap = ctx.engine.snapshot()
    if snap is not None:
        out.update(busy=snap.get("busy"), queued=snap.get("queued"), as_of=snap.get("as_of"),
                   age_s=snap.get("age_s"))
    return JSONResponse(out)


async def models(http: HttpRequest, ctx: Context) -> Response:
    """The model served, under a short id (any name a request gives is served and echoed)."""
    info = getattr(ctx.engine, "info", {}) or {}
    return JSONResponse({"object": "list", "data": [
        {"id": ctx.model_id, "object": "model", "created": ctx.created, "owned_by": "mlxkv",
         "context_length": info.get("context_tokens")}]})


async def stats(http: HttpRequest, ctx: Context) -> Response:
    """Engine, cache and speculation figures (while the engine is busy: as it published
    them last, ``as_of`` says when), the last requests' cache lookups (``lookups``: what
    each matched and where its prompt parted from the closest cached state), and the
    server's own counts."""
    figures: dict[str, Any] = await run_in_threadpool(ctx.engine.stats)
    gate = ctx.gate
    return Response(dumps({
        "engine": {k: v for k, v in figures.items() if k not in ("cache", "spec", "lookups")},
        "cache": figures.get("cache"), "spec": figures.get("spec"),
        "lookups": figures.get("lookups", []),
        "server": {"in_flight": gate.in_flight, "limit": gate.limit, "served": gate.served,
                   "rejected": gate.rejected, "cancelled": gate.cancelled}}), media_type="application/json")


async def flush(http: HttpRequest, ctx: Context) -> Response:
    figures = await run_in_threadpool(ctx.engine.stats)
    cache = figures.get("cache") or {}
    if not cache.get("enabled") or not cache.get("ssd"):
        raise ApiError(503, "the prefix cache is not durable here (no SSD tier: "
                            f"{cache.get('ssd_disabled_reason') or 'turned off'})")
    report = await run_in_threadpool(ctx.engine.cache_flush, 60.0)
    if report.get("pending") or report.get("failed"):
        return JSONResponse(report, status_code=503)
    return JSONResponse(report)


def create_app(engine: Any, config: ServerConfig | None = None) -> Starlette:
    """The app for a started ``engine`` (its model loaded)."""
    ctx = Context(engine, config or ServerConfig())
    routes = [
        Route("/health", _route(ctx, health, open_route=True), methods=["GET"]),
        Route("/v1/models", _route(ctx, models), methods=["GET"]),
        Route("/v1/chat/completions", _route(ctx, openai_api.chat_completions), methods=["POST"]),
        Route("/v1/completions", _route(ctx, openai_api.completions), methods=["POST"]),
        Route("/v1/responses", _route(ctx, responses_api.responses), methods=["POST"]),
        Route("/v1/messages", _route(ctx, anthropic_api.messages), methods=["POST"]),
        Route("/v1/messages/count_tokens", _route(ctx, anthropic_api.count_tokens), methods=["POST"]),
        Route("/stats", _route(ctx, stats), methods=["GET"]),
        Route("/admin/cache/flush", _route(ctx, flush), methods=["POST"]),
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
