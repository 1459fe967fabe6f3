"""``mlxkv generate``: one reply, streamed to stdout (or one JSON object with ``--json``),
with a stats line on stderr."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import TYPE_CHECKING, Any

from mlxkv.cli.common import (
    Progress,
    UsageError,
    after_startup,
    printer,
    sampling_params,
    start_engine,
    stats_line,
    wait_result,
)

if TYPE_CHECKING:
    from mlxkv.engine.requests import Event, Request
    from mlxkv.engine.settings import Settings


def read_prompt(args: argparse.Namespace) -> str:
    """The prompt text; an empty or whitespace-only one is refused before a model loads."""
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt.strip():
        where = "stdin" if args.prompt == "-" else "--prompt"
        raise UsageError(f"the prompt is empty (nothing but whitespace from {where})")
    return prompt


def build_request(args: argparse.Namespace, settings: Settings, prompt: str) -> Request:
    from mlxkv.engine.engine import Request

    extra: dict[str, Any] = {}
    if args.truncate:
        extra["truncate"] = True
    params = sampling_params(settings, args.stop)
    if args.raw:
        return Request(prompt=prompt, params=params, **extra)
    messages = ([{"role": "system", "content": settings.system_prompt}]
                if settings.system_prompt else [])
    messages.append({"role": "user", "content": prompt})
    return Request(messages=messages, params=params, **extra)


def cmd_generate(args: argparse.Namespace, settings: Settings) -> int:
    request = build_request(args, settings, read_prompt(args))
    # Queue the request while the model loads: it runs the moment the model is ready.
    engine = start_engine(settings, wait=False)
    try:
        want_json = getattr(args, "json", False)
        progress = Progress(settings.prefill_step_size)
        show = printer(sys.stdout if not want_json else _Discard(), progress)
        started: list[bool] = []

        def on_event(event: Event) -> None:
            if not started:  # the model is loaded and running: GC back on
                started.append(True)
                after_startup()
            show(event)

        handle = engine.submit(request, callback=on_event)
        result = wait_result(handle)
        if want_json:
            stats = dataclasses.asdict(result.stats) if result.stats else None
            distributed = engine.distributed_info()  # under mlx.launch: the ranks and their cached prefixes
            print(json.dumps({"text": result.text, "tokens": result.tokens,
                              "finish_reason": result.finish_reason,
                              "finish_detail": result.finish_detail, "stats": stats,
                              "spec": stats.get("spec") if stats else None,
                              "model": engine.info,
                              **({"distributed": distributed} if distributed is not None else {})}))
        else:
            sys.stdout.write("\n")
            sys.stderr.write(stats_line(result.stats, result.finish_reason) + "\n")
        return 130 if result.finish_reason == "cancelled" else 0
    finally:
        engine.shutdown()


class _Discard:
    """A stream that drops what is written (``--json`` prints the text once, at the end)."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        return None
