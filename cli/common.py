"""What ``generate`` and ``chat`` share: sampling parameters from the settings, engine
start-up, waiting for a reply, the token printer, the stats line and prefill progress."""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol, TextIO

from mlxkv.cli.parser import PROG

if TYPE_CHECKING:
    from mlxkv.engine.api import EngineAPI
    from mlxkv.engine.requests import Event, RequestHandle, Result, StatsEvent
    from mlxkv.engine.sampling import SamplingParams
    from mlxkv.engine.settings import Settings


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def fail(message: str, code: int = 1) -> int:
    """Print one ``mlxkv: error:`` line; returns ``code`` for the caller to exit with."""
    sys.stderr.write(f"{PROG}: error: {message}\n")
    return code


class UsageError(ValueError):
    """The command line asks for something that cannot be done (exit status 2)."""


def sampling_params(settings: Settings, stop: Sequence[str] = ()) -> SamplingParams:
    from mlxkv.engine.generate import SamplingParams

    return SamplingParams(
        max_tokens=settings.max_tokens, temperature=settings.temperature,
        top_p=settings.top_p, top_k=settings.top_k, min_p=settings.min_p,
        repetition_penalty=settings.repetition_penalty, seed=settings.seed,
        stop=tuple(stop), prefill_step_size=settings.prefill_step_size)


def start_engine(settings: Settings, wait: bool = True) -> EngineAPI:
    from mlxkv.engine.distributed.launch import engine_for

    engine: EngineAPI = engine_for(settings).start(wait=wait)
    if wait:
        after_startup()
    return engine


def after_startup() -> None:
    gc.freeze()  # what start-up built lives for the whole process: keep GC off it
    gc.enable()


def wait_result(handle: RequestHandle) -> Result:
    """Wait for a request's result; Ctrl-C cancels it (the engine then finishes it), and
    a second Ctrl-C leaves at once (a request queued while the model loads is not looked
    at before the load ends)."""
    while True:
        try:
            return handle.result()
        except KeyboardInterrupt:
            if handle.cancelled:
                raise
            handle.cancel()


def stats_line(stats: StatsEvent | None, reason: str | None) -> str:
    """``[prompt .., cached .., load .. s, TTFT .. s, ...]``: TTFT counts from the start of
    serving the request (lookup + prefill); a model load before it is shown apart."""
    if stats is None:
        return f"[{reason}]"
    load_s = stats.load_s or 0.0
    load = f"model load {load_s:.2f} s, " if load_s > 0 else ""
    spec = stats.spec
    speculated = ""
    if spec:
        speculated = (f"{spec['source']} {spec['accepted']}/{spec['drafted']} drafts accepted, "
                      f"{spec['tokens_per_forward']:.2f} tok/forward, ")
    return (f"[prompt {stats.prompt_tokens} tok, cached {stats.cached_tokens}, {load}"
            f"TTFT {stats.ttft_s:.2f} s, prefill {stats.prefill_tps:.0f} tok/s, "
            f"{stats.generated_tokens} tok at {stats.decode_tps:.1f} tok/s, {speculated}{reason}]")


class Progress:
    """``prefill 4096/10000 tokens`` on one rewritten line of a terminal's stderr while a
    long prompt is computed. Shown only when stderr is a terminal and more than one prefill
    chunk (``step`` tokens) is left to compute when the prefill starts."""

    def __init__(self, step: int, stream: TextIO | None = None) -> None:
        self.step = step
        self.stream = stream or sys.stderr
        self.enabled = isatty(self.stream)
        self.shown = False
        self._long: bool | None = None  # decided at the first report

    def update(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        if self._long is None:
            self._long = total - done > self.step
        if not self._long or done >= total:
            self.clear()
            return
        self.stream.write(f"\r{PROG}: prefill {done}/{total} tokens")
        self.stream.flush()
        self.shown = True

    def clear(self) -> None:
        if self.shown:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self.shown = False


def isatty(stream: TextIO) -> bool:
    """Whether ``stream`` is a terminal (False for a closed or stand-in stream)."""
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class Writable(Protocol):
    """Where token text goes: a stream, or a stand-in that drops it."""

    def write(self, text: str, /) -> int: ...

    def flush(self) -> None: ...


def printer(out: Writable, progress: Progress | None = None) -> Callable[[Event], None]:
    """An event callback that writes token text as it is generated. It runs on the engine
    thread, so a token reaches the terminal without a hop to the main thread."""
    from mlxkv.engine import engine as eng


    def on_event(event: Event) -> None:
        if isinstance(event, eng.TokenEvent):
            if progress is not None:
                progress.clear()
            if event.text:
                out.write(event.text)
                out.flush()
        elif isinstance(event, eng.ProgressEvent):
            if progress is not None:
                progress.update(event.done, event.total)
        elif progress is not None and isinstance(event, (eng.FinishedEvent, eng.ErrorEvent)):
            progress.clear()

    return on_event
