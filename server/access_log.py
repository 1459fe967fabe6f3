"""One line per request on stderr, as ``mlxkv serve`` prints them (``--quiet``: none): the
route, the status, the time it took and, for a generation, its prompt / cached / generated
tokens, time to first token, decode speed and what the cache lookup found. No prompt or reply
text and no key is ever written: counts only."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlxkv.server.bridge import EventStream

log = logging.getLogger("mlxkv.access")
STREAM_KEY = "mlxkv.stream"  # where a generation route leaves its EventStream in the scope
KEY_SCOPE = "mlxkv.key"  # where the key check leaves the request's Key (server.tenants)


def install(stream: Any = None) -> None:
    """Send the access lines to ``stream`` (stderr), apart from the other mlxkv logs (those
    print each condition once; every request has its own line)."""
    for h in list(log.handlers):
        log.removeHandler(h)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(logging.Formatter("mlxkv: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


def line(method: str, path: str, status: int, seconds: float, stream: EventStream | None,
         key: str | None = None) -> str:
    """``key``: the name of the request's API key (from the key file), never the key."""
    parts = [method, path, str(status), f"{seconds:.2f}s"] + ([f"key={key}"] if key else [])
    handle = stream.handle if stream is not None else None
    stats = handle.stats if handle is not None else None
    if stats is not None:
        tiers = [f"{t} {n}" for t, n in (("ram", stats.cached_ram_tokens), ("ssd", stats.cached_ssd_tokens)) if n]
        cached = f"{stats.cached_tokens}" + (f" ({', '.join(tiers)})" if tiers else "")
        parts += [f"prompt={stats.prompt_tokens}", f"cached={cached}", f"generated={stats.generated_tokens}",
                  f"ttft={stats.ttft_s:.2f}s", f"{stats.decode_tps:.1f}tok/s"]
    report = handle.cache_report if handle is not None else None
    if report is not None:
        parts.append(f"cache={report.outcome}")
    return " ".join(parts)


class AccessLog:
    """ASGI middleware: logs each HTTP request once its response has been sent (a stream's
    line comes when the stream ends)."""

    def __init__(self, app: Callable[..., Awaitable[None]]):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not log.isEnabledFor(logging.INFO):
            await self.app(scope, receive, send)
            return
        started, status = time.perf_counter(), 0

        async def sending(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            key = scope.get(KEY_SCOPE)
            log.info(line(scope.get("method", "?"), scope.get("path", "?"), status or 499,
                          time.perf_counter() - started, scope.get(STREAM_KEY),
                          key.name if key is not None else None))
