"""``mlxkv serve``: the OpenAI- and Anthropic-compatible HTTP server (``server/``)."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from mlxkv.cli.common import UsageError, after_startup, fail, sampling_params, start_engine

if TYPE_CHECKING:
    from mlxkv.engine.api import EngineAPI
    from mlxkv.engine.pool import ModelEntry, ModelPool
    from mlxkv.engine.settings import Settings


def cmd_serve(args: argparse.Namespace, settings: Settings) -> int:
    from mlxkv.server.run import bind, config_from_settings, serve, warn_if_open

    if not settings.quiet:
        from mlxkv.server import access_log

        access_log.install()
    config = config_from_settings(settings, sampling_params(settings))
    warn_if_open(settings.host, config.accepted)
    try:  # before the model loads: a port in use fails at once
        sock = bind(settings.host, settings.port)
    except OSError as e:
        return fail(f"cannot listen on {settings.host}:{settings.port}: {e.strerror or e}")
    entries = served_entries(args, settings)
    try:
        models, label = start_models(entries, settings)
    except BaseException:
        sock.close()
        raise

    def ready(url: str) -> None:
        n = len(config.accepted)
        key = "" if not n else ", API key required" if n == 1 else f", {n} API keys, each its own cache"
        print(f"mlxkv serve: {label} on {url} (OpenAI {url}/v1, Anthropic {url}/v1/messages{key}); "
              "Ctrl-C stops", file=sys.stderr, flush=True)

    report = serve(models, config, sock, on_ready=ready)
    if report.get("durable") or report.get("pending") or report.get("failed"):
        print(f"mlxkv serve: prefix cache flushed ({report.get('durable', 0)} states on disk, "
              f"{report.get('pending', 0)} pending, {report.get('failed', 0)} failed)",
              file=sys.stderr, flush=True)
    return 0


def served_entries(args: argparse.Namespace, settings: Settings) -> list[ModelEntry]:
    """The models to serve: every ``--model`` given (in order), else the config file's
    ``[[models]]``, else the one model of the settings."""
    from mlxkv.engine.pool import ModelEntry, entries_from_tables, entry_name, parse_cli_model

    given = getattr(args, "model_list", None) or []
    if given:
        return [parse_cli_model(v) for v in given]
    if settings.models:
        return entries_from_tables(settings.models)
    return [ModelEntry(entry_name(settings.model), settings.model)]


def start_models(entries: list[ModelEntry], settings: Settings) -> tuple[EngineAPI | ModelPool, str]:
    """One model: its engine, started (under mlx.launch too). Several: a ``ModelPool`` with
    the default model loaded (a broken default fails here, the others when first asked
    for); what the ready line names."""
    from mlxkv.engine.pool import ModelPool, check_entries

    if len(entries) == 1 and not entries[0].settings and not entries[0].aliases:
        engine = start_engine(settings.replace(model=entries[0].spec))
        return engine, engine.info.get("model", entries[0].spec)
    from mlxkv.engine.distributed import launched

    if launched():
        raise UsageError("under mlx.launch, serve one model (the ranks share it)")
    check_entries(entries, settings.default_model)
    pool = ModelPool(entries, settings, memory_bytes=settings.models_memory_bytes,
                     idle_s=settings.model_idle_s, default=settings.default_model)
    try:
        pool.lease(None).release()
    except BaseException:
        pool.close()
        raise
    after_startup()
    names = ", ".join(e.name + (" (default)" if e.name == pool.default else "") for e in entries)
    return pool, f"{len(entries)} models: {names}"
