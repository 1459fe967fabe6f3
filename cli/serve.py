"""``mlxkv serve``: the OpenAI- and Anthropic-compatible HTTP server (``server/``)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from mlxkv.cli.common import fail, sampling_params, start_engine


def cmd_serve(args: argparse.Namespace, settings: Any) -> int:
    from mlxkv.server.run import bind, config_from_settings, serve, warn_if_open

    if not settings.quiet:
        from mlxkv.server import access_log

        access_log.install()
    warn_if_open(settings.host, settings.api_key)
    config = config_from_settings(settings, sampling_params(settings))
    try:  # before the model loads: a port in use fails at once
        sock = bind(settings.host, settings.port)
    except OSError as e:
        return fail(f"cannot listen on {settings.host}:{settings.port}: {e.strerror or e}")
    try:
        engine = start_engine(settings)
    except BaseException:
        sock.close()
        raise
    label = engine.info.get("model", settings.model)

    def ready(url: str) -> None:
        key = ", API key required" if config.api_key else ""
        print(f"mlxkv serve: {label} on {url} (OpenAI {url}/v1, Anthropic {url}/v1/messages{key}); "
              "Ctrl-C stops", file=sys.stderr, flush=True)

    report = serve(engine, config, sock, on_ready=ready)
    if report.get("durable") or report.get("pending") or report.get("failed"):
        print(f"mlxkv serve: prefix cache flushed ({report.get('durable', 0)} states on disk, "
              f"{report.get('pending', 0)} pending, {report.get('failed', 0)} failed)",
              file=sys.stderr, flush=True)
    return 0
