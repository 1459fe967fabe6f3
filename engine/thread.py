"""The engine thread's lifecycle, in one place: start it, know when its model is loaded (or
why it failed), stop it and join it.

:class:`EngineThread` runs three steps the engine hands it: ``load`` (the model and the
prefix cache), ``serve`` (the command loop, until :data:`engine.commands.STOP`) and
``finish`` (answer what is left, close the cache). Whatever happens, the thread closes
its command queue, waits for the mlx work it queued and destroys the MLX streams it
created before it ends (:func:`finish_streams` says why both matter at exit). Engines still
running when the interpreter exits are stopped and joined first (``atexit``).
"""

from __future__ import annotations

import atexit
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from mlxkv.engine.commands import CommandQueue
from mlxkv.engine.requests import EngineError

_live: weakref.WeakSet[EngineThread] = weakref.WeakSet()


def finish_streams() -> None:
    """Wait for the mlx work this thread queued, then destroy the MLX streams it created;
    the engine thread calls it last.

    mlx-lm's decoding loop queues the next step (``mx.async_eval``) before it hands out a
    token, so a generation that ends (max tokens, a stop string, a cancel) leaves a
    forward pass computing on mlx's stream thread, which outlives this one
    (``clear_streams`` only drops this thread's encoders). Left running, that pass is
    inside OpenBLAS when the process exits, and OpenBLAS's exit handler
    (``gotoblas_quit`` -> ``blas_thread_shutdown_``) cannot stop a worker in a call: the
    worker ends its job by marking itself idle over the stop request, sleeps, and the
    handler's ``pthread_join`` waits forever; or, the worker done first, the handler
    unmaps the buffers the running kernel uses (a segmentation fault at exit). The streams
    must be destroyed before the thread (and the interpreter) exits, or the process aborts
    at exit ("terminate called ...")."""
    try:
        import mlx.core as mx
    except Exception:
        return
    streams: list[Any] = [None]  # None: this thread's default stream
    generate = sys.modules.get("mlx_lm.generate")
    if generate is not None:  # not imported: nothing ran on it (asking would create it)
        streams.append(generate.generation_stream)
    for stream in streams:
        try:
            mx.synchronize(stream)
        except Exception:  # a failed computation was reported where it was evaluated
            pass
    try:
        mx.clear_streams()
    except Exception:
        pass


@atexit.register
def _stop_live_threads() -> None:
    for thread in list(_live):
        thread.stop(timeout=10.0)


class EngineThread:
    """The one thread that owns MLX for an engine (see the module docstring)."""

    def __init__(self, name: str, commands: CommandQueue, *, load: Callable[[], None],
                 serve: Callable[[], None], finish: Callable[[], None]):
        self.name = name
        self.commands = commands
        self._load, self._serve, self._finish = load, serve, finish
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._ready = threading.Event()
        self.load_error: BaseException | None = None
        self.load_started = self.load_ended = 0.0

    def start(self) -> None:
        """Start the thread (once); commands are accepted from now on."""
        self.commands.open()
        self._thread.start()
        _live.add(self)

    def stop(self, timeout: float | None = 30.0, wait: bool = True) -> None:
        """Let the loop end after what is queued now (``STOP`` behind it) and, with
        ``wait``, join the thread (at most ``timeout`` s)."""
        if not self._thread.is_alive():
            return
        self.commands.close(wake=True)
        if wait:
            self.join(timeout)

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def is_current(self) -> bool:
        """Whether the caller runs on this thread."""
        return threading.current_thread() is self._thread

    def loading(self) -> bool:
        """Started, and the load has not ended yet."""
        return self._thread.is_alive() and not self._ready.is_set()

    def wait_ready(self, timeout: float | None, what: str) -> None:
        """Wait for the load to end; re-raise its error if it failed."""
        if not self._ready.wait(timeout):
            raise EngineError(f"{what} did not load within {timeout} s")
        if self.load_error is not None:
            raise self.load_error

    def load_wait(self, submitted: float) -> float:
        """The part of the wait of a request submitted at ``submitted`` that the load took."""
        if submitted >= self.load_ended:
            return 0.0
        return max(0.0, self.load_ended - max(submitted, self.load_started))

    def _main(self) -> None:
        self.load_started = time.perf_counter()
        try:
            self._load()
        except BaseException as e:  # reported to start()'s caller and to queued requests
            self.load_error = e
            self.commands.close(error=e)
            self.commands.drain(error=e)
            finish_streams()
            self._ready.set()
            return
        finally:
            self.load_ended = time.perf_counter()
        self._ready.set()
        try:
            self._serve()
        finally:
            self.commands.close()
            self._finish()
            finish_streams()
