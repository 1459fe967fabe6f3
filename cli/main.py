"""``mlxkv`` (TUI if there is one, else chat), ``mlxkv chat``, ``mlxkv generate``,
``mlxkv config``, ``mlxkv cache ...``, ``mlxkv models``, ``mlxkv --version``.

Start-up is kept light on purpose (``mlxkv generate``'s process start -> first token is
benchmarked against mlx-lm's CLI): argparse first, then the OpenBLAS preload (before mlx is
imported: :mod:`mlxkv.engine.blas`), and mlx/mlx-lm only when a model is needed. Textual is never imported here
unless the TUI runs.

Nothing reaches the user as a traceback: a failure is one ``mlxkv: error: ...`` line and
exit status 1 (2 for a command line that cannot be run as given); warnings go through the
one logging handler of :mod:`cli.logs`. ``MLXKV_DEBUG=1`` shows tracebacks.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from mlxkv.cli.parser import JSON_COMMANDS, build_parser

if TYPE_CHECKING:
    from mlxkv.engine.settings import Settings


def main(argv: Sequence[str] | None = None) -> int:
    # Start-up allocates hundreds of thousands of long-lived objects (mlx-lm, transformers);
    # cyclic GC passes over them are wasted work. Re-enabled once the model is loaded.
    gc.disable()
    try:
        return _main(argv)
    finally:
        gc.enable()


def _early_env(argv: Sequence[str]) -> None:
    """--blas and --config must be known before the BLAS preload, which runs before the
    parser is built (building it already imports part of the engine)."""
    names = {"--blas": "MLXKV_BLAS", "--config": "MLXKV_CONFIG"}
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if flag in names:
            if not eq and i + 1 < len(argv):
                value = argv[i + 1]
            if value:
                os.environ[names[flag]] = value


def _settings(args: argparse.Namespace) -> Settings:
    from mlxkv.cli.common import UsageError
    from mlxkv.engine.pool import parse_cli_model
    from mlxkv.engine.settings import FIELD_BY_NAME, Settings

    flags = {k: v for k, v in vars(args).items() if k in FIELD_BY_NAME}
    given = getattr(args, "model_list", None) or []
    if len(given) > 1 and args.command != "serve":
        raise UsageError(f"--model is given {len(given)} times; only `mlxkv serve` serves several")
    if given:  # demo, NAME=SPEC: the model's spec
        flags["model"] = parse_cli_model(given[0]).spec
    return Settings.load(flags, config_path=getattr(args, "config", None))


def _debug() -> bool:
    return os.environ.get("MLXKV_DEBUG", "") not in ("", "0")


def _main(argv: Sequence[str] | None) -> int:
    from mlxkv.cli import logs
    from mlxkv.cli.common import UsageError, fail
    from mlxkv.cli.terminal import Terminated, watch_signals

    argv = list(sys.argv[1:] if argv is None else argv)
    if threading.current_thread() is threading.main_thread():
        watch_signals()
    logs.install()
    _early_env(argv)
    from mlxkv.engine.blas import preload

    preload()  # before anything imports mlx.core: the parser's settings table comes next
    args = build_parser().parse_args(argv)
    if getattr(args, "json", False) and args.command not in JSON_COMMANDS:
        return fail(f"--json applies to {', '.join(JSON_COMMANDS)}, not to "
                    f"{args.command or 'the chat'}", 2)
    try:
        return _dispatch(args)
    except UsageError as e:
        return fail(str(e), 2)
    except KeyboardInterrupt:
        return 130
    except Terminated:
        return 143
    except Exception as e:
        if _debug():
            raise
        return fail(_describe(e))


def _describe(e: BaseException) -> str:
    """One line for an exception: our errors carry clear messages; an OSError is named by
    what failed and on which path; anything else is a bug, said as such."""
    from mlxkv.engine.engine import EngineError
    from mlxkv.engine.models import ModelNotFoundError
    from mlxkv.engine.settings import SettingsError
    from mlxkv.storage import CacheFolderError

    if isinstance(e, (SettingsError, ModelNotFoundError, EngineError, ValueError, CacheFolderError)):
        return str(e)
    if isinstance(e, OSError):
        where = f": {e.filename}" if e.filename else ""
        return f"{e.strerror or e}{where}"
    return f"unexpected {type(e).__name__}: {e} (MLXKV_DEBUG=1 shows where)"




def _warn_if_reference_blas() -> None:
    """On Linux's CPU without a system OpenBLAS, mlx's float32 matmuls use the reference
    BLAS it bundles: prompts read 25-60x slower. Say so once, and how to fix it."""
    import logging

    from mlxkv.engine.blas import blas_info
    from mlxkv.engine.logs import warn_once

    info = blas_info()
    if info["active"] or not sys.platform.startswith("linux") or str(info["reason"]).startswith("disabled"):
        return
    import mlx.core as mx

    if mx.default_device() == mx.cpu:
        warn_once(logging.getLogger("mlxkv.blas"), "reference",
                  "%s: the CPU's float32 matmuls run on mlx's reference BLAS, 25-60x slower "
                  "than OpenBLAS (MLXKV_BLAS=off silences this)", info["reason"])


def _dispatch(args: argparse.Namespace) -> int:
    settings = _settings(args)
    if args.command == "config":
        return cmd_config(args, settings)
    if args.command == "cache":
        from mlxkv.cli.cache import run_cache_command

        return run_cache_command(args, settings)
    if args.command == "models":
        from mlxkv.cli.models import cmd_models

        return cmd_models(args, settings)
    if args.command in (None, "chat", "generate", "serve"):
        from mlxkv.engine.distributed.launch import run_rank

        _warn_if_reference_blas()

        code = run_rank(args.command, settings)  # under mlx.launch: every rank but 0 follows
        if code is not None:
            return code
    if args.command == "generate":
        from mlxkv.cli.generate import cmd_generate

        return cmd_generate(args, settings)
    if args.command == "serve":
        from mlxkv.cli.serve import cmd_serve

        return cmd_serve(args, settings)
    if args.command is None:
        return _run_tui(settings)
    from mlxkv.cli.chat import cmd_chat

    return cmd_chat(settings)


def cmd_config(args: argparse.Namespace, settings: Settings) -> int:
    from mlxkv.engine.blas import blas_info, describe
    from mlxkv.engine.models import model_label

    rows = [(n, "(set)" if n == "api_key" and v else v, s) for n, v, s in settings.describe()]
    # the model as users know it (a one-file binary unpacks the demo model to a temporary
    # folder: its raw path means nothing to them)
    labels = {n: model_label(v) for n, v, _ in rows if n == "model" and v}
    if getattr(args, "json", False):
        print(json.dumps({"settings": {n: {"value": v, "source": s,
                                           **({"label": labels[n]} if n in labels else {})}
                                       for n, v, s in rows},
                          "config_file": str(settings.config_path), "blas": blas_info()},
                         default=str))
        return 0
    width = max(len(n) for n, _, _ in rows)
    for name, value, source in rows:
        label = labels.get(name)
        shown = value if label is None or label == str(value) else f"{label}  [{value}]"
        print(f"{name:<{width}}  {shown!s:<40}  ({source})")
    exists = "" if settings.config_path.exists() else " (not present)"
    print(f"{'config file':<{width}}  {settings.config_path}{exists}")
    print(f"{'BLAS in use':<{width}}  {describe()}")
    return 0


def _run_tui(settings: Settings) -> int:
    """Run the Textual app (``mlxkv.tui.app.run(settings)``). Without a terminal on both
    ends (``mlxkv < questions.txt``, output to a pipe) there is nothing to draw on: the line
    chat answers instead."""
    from mlxkv.cli.common import isatty

    if not (isatty(sys.stdin) and isatty(sys.stdout)):
        from mlxkv.cli.chat import cmd_chat

        return cmd_chat(settings)
    from mlxkv.tui import app

    return int(app.run(settings) or 0)
