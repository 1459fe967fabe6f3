"""Run the app on uvicorn in front of a started engine, and stop gracefully: on SIGINT or
SIGTERM uvicorn stops accepting, lets the replies in flight finish (up to
``drain_timeout_s``; after that they are cancelled), then the prefix cache is flushed to
the SSD tier and the engine shut down."""

from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from mlxkv.server.context import ServerConfig
from mlxkv.server.tenants import Keys

if TYPE_CHECKING:
    import uvicorn

    from mlxkv.engine.api import EngineAPI
    from mlxkv.engine.pool import ModelPool
    from mlxkv.engine.sampling import SamplingParams
    from mlxkv.engine.settings import Settings

log = logging.getLogger("mlxkv.server")


def config_from_settings(settings: Settings, defaults: SamplingParams) -> ServerConfig:
    origins = tuple(o.strip() for o in (settings.cors_origins or "").split(",") if o.strip())
    if settings.api_key and settings.api_key_file:
        raise ValueError("give --api-key or --api-key-file, not both")
    keys = Keys.from_file(settings.api_key_file) if settings.api_key_file else None
    return ServerConfig(api_key=settings.api_key or None, keys=keys, cors_origins=origins,
                        max_body_bytes=settings.max_body_bytes, max_requests=settings.max_requests,
                        max_tokens_limit=settings.max_tokens_limit, defaults=defaults,
                        responses_store_bytes=settings.responses_store_bytes,
                        churn_rules=settings.churn_rules,
                        open_ended=settings.sources.get("max_tokens", "default") == "default")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def warn_if_open(host: str, keys: Keys | str | None) -> None:
    if not is_loopback(host) and not keys:
        log.warning("serving on %s without --api-key or --api-key-file: anyone who can reach this "
                    "address can use the model, and learn from its cache's speed what others sent",
                    host)


def build_server(engine: EngineAPI | ModelPool, config: ServerConfig, host: str, port: int,
                 drain_timeout_s: int = 60) -> uvicorn.Server:
    import uvicorn

    from mlxkv.server.app import create_app

    app = create_app(engine, config)
    uv = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                        lifespan="off", timeout_graceful_shutdown=drain_timeout_s,
                        server_header=False, date_header=True)
    return uvicorn.Server(uv)


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads: a port in use fails at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family)


def serve(engine: EngineAPI | ModelPool, config: ServerConfig, sock: socket.socket,
          on_ready: Callable[[str], None] | None = None, flush_timeout_s: float = 60.0
          ) -> Mapping[str, object]:
    """Serve ``engine`` (one started engine, or an ``engine.pool.ModelPool``) on ``sock``
    until SIGINT/SIGTERM (or ``server.should_exit``); then drain, flush the cache (every
    loaded model's) and return the flush report. The engines are shut down on the way out."""
    host, port = sock.getsockname()[:2]
    server = build_server(engine, config, host, port)
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
    report: Mapping[str, object] = {}
    try:
        if on_ready is not None:
            on_ready(url)
        try:
            server.run(sockets=[sock])
        except BaseException:
            # uvicorn raises the signal that stopped it again once it has drained; that
            # stop was asked for and has been done
            if not server.should_exit:
                raise
    finally:
        from mlxkv.engine.pool import ModelPool

        if isinstance(engine, ModelPool):  # each loaded model flushed, then stopped
            reports = engine.close()
            report = {k: sum(r[k] for r in reports.values() if r is not None) for k in ("durable", "pending", "failed")}
        else:
            try:
                report = engine.cache_flush(timeout=flush_timeout_s)
            except Exception as e:  # the engine may already be down: say so, lose nothing else
                log.warning("the prefix cache could not be flushed on shutdown: %s", e)
            engine.shutdown()
        sock.close()
    return report
