"""mlxkv command line: ``mlxkv`` (TUI, else chat), ``mlxkv chat``, ``mlxkv generate``,
``mlxkv config``, ``mlxkv --version``.

Start-up is kept light on purpose (``mlxkv generate``'s process start -> first token is
benchmarked against mlx-lm's CLI): argparse first, then ``engine`` (which loads OpenBLAS
before mlx), and mlx/mlx-lm only when a model is needed. Textual is never imported here
unless the TUI runs.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import select
import signal
import sys
import threading
import uuid
from collections.abc import Sequence
from typing import Any, NoReturn

__version__ = "0.1.0"
PROG = "mlxkv"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One clear line instead of argparse's usage block.
        self.exit(2, f"{PROG}: error: {message} (see `{self.prog} --help`)\n")


def _common_flags() -> argparse.ArgumentParser:
    """Settings flags, accepted before or after the sub-command. SUPPRESS keeps unset
    flags out of the namespace so the environment and config file can fill them."""
    p = _Parser(add_help=False)
    S = argparse.SUPPRESS
    p.add_argument("--model", default=S, help="model folder or hub id (default: demo model)")
    p.add_argument("--draft-model", default=S, help="draft model folder or hub id")
    p.add_argument("--cache-dir", default=S, help="prefix cache folder")
    p.add_argument("--config", default=S, help="TOML config file")
    p.add_argument("--dtype", default=S, choices=["auto", "float32", "bfloat16", "float16",
                                                   "native"], help="compute dtype policy")
    p.add_argument("--temp", dest="temperature", type=float, default=S,
                   help="sampling temperature (0 = greedy)")
    p.add_argument("--top-p", type=float, default=S)
    p.add_argument("--top-k", type=int, default=S)
    p.add_argument("--min-p", type=float, default=S)
    p.add_argument("--repetition-penalty", type=float, default=S)
    p.add_argument("--seed", type=int, default=S)
    p.add_argument("--max-tokens", type=int, default=S)
    p.add_argument("--prefill-step-size", type=int, default=S)
    p.add_argument("--block-tokens", type=int, default=S)
    p.add_argument("--ram-cache-bytes", default=S, help="RAM tier size, e.g. 2GiB")
    p.add_argument("--system-prompt", default=S)
    p.add_argument("--blas", default=S, help="auto, off, or a BLAS library path (Linux)")
    p.add_argument("--full-hash", action="store_true", default=S,
                   help="fingerprint model weights by content instead of size + mtime")
    p.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   default=S, help="do not reuse cached prompt state")
    return p


def build_parser() -> argparse.ArgumentParser:
    common = _common_flags()
    parser = _Parser(prog=PROG, parents=[common],
                     description="Local LLM engine on MLX with a tiered prefix cache.")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("chat", parents=[common], help="plain terminal chat")
    gen = sub.add_parser("generate", parents=[common], help="generate one reply and exit")
    gen.add_argument("--prompt", "-p", required=True, help="user message ('-' reads stdin)")
    gen.add_argument("--json", action="store_true", help="print one JSON object at the end")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--raw", action="store_true", help="no chat template: prompt as is")
    cfg = sub.add_parser("config", parents=[common], help="print the effective settings")
    cfg.add_argument("--json", action="store_true")
    from cli.cache import add_cache_parser  # `mlxkv cache ...` (cli/cache.py)

    add_cache_parser(sub)
    return parser


def _fail(message: str, code: int = 1) -> int:
    sys.stderr.write(f"{PROG}: error: {message}\n")
    return code


def _settings(args: argparse.Namespace) -> Any:
    from engine.settings import FIELD_BY_NAME, Settings

    flags = {k: v for k, v in vars(args).items() if k in FIELD_BY_NAME}
    return Settings.load(flags, config_path=getattr(args, "config", None))


def _params(settings: Any, stop: Sequence[str] = ()) -> Any:
    from engine.generate import SamplingParams

    return SamplingParams(
        max_tokens=settings.max_tokens, temperature=settings.temperature,
        top_p=settings.top_p, top_k=settings.top_k, min_p=settings.min_p,
        repetition_penalty=settings.repetition_penalty, seed=settings.seed,
        stop=tuple(stop), prefill_step_size=settings.prefill_step_size)


def _start_engine(settings: Any, wait: bool = True) -> Any:
    from engine.engine import Engine

    engine = Engine.from_settings(settings).start(wait=wait)
    if wait:
        _after_startup()
    return engine


def _after_startup() -> None:
    gc.freeze()  # what start-up built lives for the whole process: keep GC off it
    gc.enable()


def stats_line(stats: Any, reason: str | None) -> str:
    if stats is None:
        return f"[{reason}]"
    return (f"[prompt {stats.prompt_tokens} tok, cached {stats.cached_tokens}, "
            f"TTFT {stats.ttft_s:.2f} s, prefill {stats.prefill_tps:.0f} tok/s, "
            f"{stats.generated_tokens} tok at {stats.decode_tps:.1f} tok/s, {reason}]")


def _printer(out: Any) -> Any:
    """An event callback that writes token text as it is generated. It runs on the engine
    thread, so a token reaches the terminal without a hop to the main thread."""
    from engine.engine import TokenEvent

    def on_event(event: Any) -> None:
        if isinstance(event, TokenEvent) and event.text:
            out.write(event.text)
            out.flush()

    return on_event


def _wait(handle: Any) -> Any:
    """Wait for a request's result; Ctrl-C cancels it (the engine then finishes it)."""
    while True:
        try:
            return handle.result()
        except KeyboardInterrupt:
            handle.cancel()


def cmd_generate(args: argparse.Namespace, settings: Any) -> int:
    from engine.engine import Request

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if args.raw:
        request = Request(prompt=prompt, params=_params(settings, args.stop))
    else:
        messages = ([{"role": "system", "content": settings.system_prompt}]
                    if settings.system_prompt else [])
        messages.append({"role": "user", "content": prompt})
        request = Request(messages=messages, params=_params(settings, args.stop))
    # Queue the request while the model loads: it runs the moment the model is ready.
    engine = _start_engine(settings, wait=False)
    try:
        printer = None if args.json else _printer(sys.stdout)
        started = []

        def on_event(event: Any) -> None:
            if not started:  # the model is loaded and running: GC back on
                started.append(True)
                _after_startup()
            if printer is not None:
                printer(event)

        handle = engine.submit(request, callback=on_event)
        result = _wait(handle)
        if args.json:
            stats = result.stats.__dict__ if result.stats else None
            print(json.dumps({"text": result.text, "tokens": result.tokens,
                              "finish_reason": result.finish_reason,
                              "finish_detail": result.finish_detail, "stats": stats,
                              "model": engine.info}))
        else:
            sys.stdout.write("\n")
            sys.stderr.write(stats_line(result.stats, result.finish_reason) + "\n")
        return 130 if result.finish_reason == "cancelled" else 0
    finally:
        engine.shutdown()


_wakeup_fd: int | None = None  # read end of the signal wakeup pipe (main thread only)


def _input(prompt: str) -> str:
    """input(prompt), but a signal that lands between the prompt and the read still takes
    effect at once: input() is one C call, so a handler tripped there would otherwise wait
    for the next line (SIGTERM at the prompt did nothing). Waits for stdin or a signal."""
    if _wakeup_fd is None:
        return input(prompt)
    sys.stdout.write(prompt)
    sys.stdout.flush()
    select.select([sys.stdin, _wakeup_fd], [], [])  # the handler runs as this returns
    try:
        while os.read(_wakeup_fd, 512):
            pass
    except BlockingIOError:
        pass
    return input()


def cmd_chat(settings: Any) -> int:
    from engine.engine import EngineError, Request

    engine = _start_engine(settings)
    info = engine.info
    print(f"mlxkv chat: {info['model']} ({info['compute_dtype']}, {info['blas']})")
    print("/quit or Ctrl-D to leave; Ctrl-C stops a reply.")
    session = uuid.uuid4().hex
    messages: list[dict[str, str]] = (
        [{"role": "system", "content": settings.system_prompt}] if settings.system_prompt
        else [])
    try:
        while True:
            try:
                line = _input("> ")
            except EOFError:
                print()
                return 0
            except KeyboardInterrupt:
                print()
                continue
            if line.strip() in ("/quit", "/exit", "/q"):
                return 0
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line})
            handle = engine.submit(Request(messages=list(messages), params=_params(settings),
                                           session=session), callback=_printer(sys.stdout))
            try:
                result = _wait(handle)
            except EngineError as e:
                messages.pop()
                _fail(str(e))
                print()  # end the line of whatever reply text was printed
                continue
            print()
            print(stats_line(result.stats, result.finish_reason))
            messages.append({"role": "assistant", "content": result.text})
    finally:
        engine.shutdown()


def cmd_config(args: argparse.Namespace, settings: Any) -> int:
    from engine.blas import blas_info, describe

    rows = settings.describe()
    if args.json:
        print(json.dumps({"settings": {n: {"value": v, "source": s} for n, v, s in rows},
                          "config_file": str(settings.config_path), "blas": blas_info()},
                         default=str))
        return 0
    width = max(len(n) for n, _, _ in rows)
    for name, value, source in rows:
        print(f"{name:<{width}}  {value!s:<40}  ({source})")
    exists = "" if settings.config_path.exists() else " (not present)"
    print(f"{'config file':<{width}}  {settings.config_path}{exists}")
    print(f"{'BLAS in use':<{width}}  {describe()}")
    return 0


def _run_tui(settings: Any) -> int | None:
    """Run the Textual app if the tui package has one (``tui.app.run(settings)``)."""
    import importlib.util

    if importlib.util.find_spec("tui") is None or importlib.util.find_spec("tui.app") is None:
        return None
    from tui import app

    run = getattr(app, "run", None)
    return None if run is None else int(run(settings) or 0)


def main(argv: Sequence[str] | None = None) -> int:
    # Start-up allocates hundreds of thousands of long-lived objects (mlx-lm, transformers);
    # cyclic GC passes over them are wasted work. Re-enabled once the model is loaded.
    gc.disable()
    try:
        return _main(argv)
    finally:
        gc.enable()


def _early_env(argv: Sequence[str]) -> None:
    """--blas and --config must be known before anything imports `engine` (which loads
    the BLAS before mlx), and building the parser already imports part of it."""
    names = {"--blas": "MLXKV_BLAS", "--config": "MLXKV_CONFIG"}
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if flag in names:
            if not eq and i + 1 < len(argv):
                value = argv[i + 1]
            if value:
                os.environ[names[flag]] = value


class Terminated(BaseException):
    """SIGTERM: unwind like Ctrl-D (engine shutdown, prefix-cache flush), then exit 143.
    A BaseException so that the REPL's Ctrl-C handling (cancel the reply) does not catch it."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise Terminated


def _watch_signals() -> None:
    """Route signals to a wakeup pipe as well, so that _input can wait on them."""
    global _wakeup_fd
    if _wakeup_fd is None:
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        _wakeup_fd = r


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)
        _watch_signals()
    _early_env(argv)
    args = build_parser().parse_args(argv)
    from engine.engine import EngineError
    from engine.models import ModelNotFoundError
    from engine.settings import SettingsError

    try:
        settings = _settings(args)
        if args.command == "config":
            return cmd_config(args, settings)
        if args.command == "cache":
            from cli.cache import run_cache_command

            return run_cache_command(args)
        if args.command == "generate":
            return cmd_generate(args, settings)
        if args.command is None:
            code = _run_tui(settings)
            if code is not None:
                return code
        return cmd_chat(settings)
    except (SettingsError, ModelNotFoundError, EngineError, ValueError) as e:
        return _fail(str(e))
    except KeyboardInterrupt:
        return 130
    except Terminated:
        return 143


if __name__ == "__main__":
    sys.exit(main())
