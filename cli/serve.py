"""``mlxkv serve``: the OpenAI- and Anthropic-compatible HTTP server (``server/``)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from cli.common import sampling_params, start_engine


def cmd_serve(args: argparse.Namespace, settings: Any) -> int:
    from server.run import config_from_settings, serve, warn_if_open

    warn_if_open(settings.host, settings.api_key)
    config = config_from_settings(settings, sampling_params(settings))
    engine = start_engine(settings)
    label = engine.info.get("model", settings.model)

    def ready(url: str) -> None:
        key = ", API key required" if config.api_key else ""
        print(f"mlxkv serve: {label} on {url} (OpenAI {url}/v1, Anthropic {url}/v1/messages{key}); "
              "Ctrl-C stops", file=sys.stderr, flush=True)

    report = serve(engine, config, settings.host, settings.port, on_ready=ready)
    if report.get("durable") or report.get("pending") or report.get("failed"):
        print(f"mlxkv serve: prefix cache flushed ({report.get('durable', 0)} states on disk, "
              f"{report.get('pending', 0)} pending, {report.get('failed', 0)} failed)",
              file=sys.stderr, flush=True)
    return 0
