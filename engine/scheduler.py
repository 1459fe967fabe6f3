"""The engine thread's command loop for one loaded model: takes each command from its
:class:`~engine.commands.CommandSource` and serves it: a call runs, a request is prepared
(:class:`~engine.preparing.Preparer`) and decodes alone
(:class:`~engine.single.SingleStream`) until another request waits, then in a batch
(:class:`~engine.batching.Batching`). Builds those parts, which call only downwards:

    Scheduler -> Batching -> SingleStream -> Admission -> CommandQueue
         \\-----------> Preparer -> CacheUse
"""

from __future__ import annotations

import time
from collections.abc import Callable

from mlxkv.engine.admission import Admission
from mlxkv.engine.batching import Batching
from mlxkv.engine.commands import STOP, WAKE, Call, CommandQueue, CommandSource
from mlxkv.engine.loading import Runtime
from mlxkv.engine.preparing import Preparer, TokenSource
from mlxkv.engine.requests import Counts, RequestHandle
from mlxkv.engine.settings import Settings
from mlxkv.engine.single import SingleStream


class Scheduler:
    """Serves the commands of one engine thread (engine thread only)."""

    def __init__(self, runtime: Runtime, settings: Settings, commands: CommandQueue,
                 counts: Counts, source: CommandSource, tokens: TokenSource,
                 load_wait: Callable[[float], float], max_batch: int):
        self.runtime = runtime
        self.commands = commands
        self.counts = counts
        self.source = source
        self.admission = Admission(commands, counts, max_batch, runtime.batchable)
        self.preparer = Preparer(runtime.loaded, runtime.cache, counts, tokens)
        self.single = SingleStream(runtime, settings, commands, counts, self.admission, tokens,
                                   load_wait)
        self.batching = Batching(runtime, settings, commands, counts, self.admission,
                                 self.preparer, self.single, load_wait)

    def active(self) -> int:
        """Requests decoding now."""
        return self.batching.active_rows() or int(self.single.current is not None)

    def run(self) -> None:
        """Serve commands until :data:`~engine.commands.STOP`."""
        commands, cache = self.commands, self.runtime.cache
        while True:
            cmd = commands.next(self.source)
            if cmd is STOP:
                break
            if cmd is WAKE:
                commands.run_quick()
            elif isinstance(cmd, Call):
                cmd.run()
            elif isinstance(cmd, RequestHandle):
                self.serve(cmd)
            if commands.waiting <= 0:
                cache.busy(False)

    def serve(self, handle: RequestHandle) -> None:
        """Answer one request: alone, or (once another waits) in a batch."""
        self.commands.take(handle)
        if handle.cancelled or self.commands.is_closed():
            self.admission.answer_cancelled(handle)
            return
        start = time.perf_counter()
        self.counts.requests += 1
        self.runtime.cache.busy(True)
        job = self.preparer.prepare(handle, start)
        if job is None:
            return
        join = self.single.run(job)
        if join is not None:
            self.batching.run(job, join)

    def finish(self) -> None:
        """The loop ended: tell the source, answer what is left, close the cache."""
        self.source.stopped()
        self.commands.drain()
        self.runtime.cache.close(10.0)
