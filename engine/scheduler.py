"""The engine thread's command loop for one loaded model: takes each command from its
:class:`~engine.commands.CommandSource` and serves it: a call runs, a request is prepared
(:class:`~engine.preparing.Preparer`) and starts in a batch of one that the requests after
it join (:class:`~engine.batching.Batching`); one whose speculation only the lone path runs
decodes alone (:class:`~engine.single.SingleStream`) until another request waits, then in
a batch. Builds those parts, which call only downwards:

    Scheduler -> Batching -> SingleStream -> Admission -> CommandQueue
         \\-----------> Preparer -> CacheUse
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from mlxkv.engine.admission import Admission
from mlxkv.engine.batching import Batching
from mlxkv.engine.commands import STOP, WAKE, Call, CommandQueue, CommandSource
from mlxkv.engine.loading import Runtime
from mlxkv.engine.lookups import LookupHistory
from mlxkv.engine.preparing import Preparer, TokenSource
from mlxkv.engine.requests import Counts, RequestHandle
from mlxkv.engine.settings import Settings
from mlxkv.engine.single import SingleStream
from mlxkv.engine.snapshot import Publisher


class Scheduler:
    """Serves the commands of one engine thread (engine thread only)."""

    def __init__(self, runtime: Runtime, settings: Settings, commands: CommandQueue,
                 counts: Counts, source: CommandSource, tokens: TokenSource,
                 load_wait: Callable[[float], float], max_batch: int, publisher: Publisher):
        self.runtime = runtime
        self.commands = commands
        self.counts = counts
        self.source = source
        self.publisher = publisher
        self.lookups = LookupHistory(settings.lookup_history)
        self.admission = Admission(commands, counts, max_batch, runtime.batchable, settings.spec)
        self.preparer = Preparer(runtime.loaded, runtime.cache, counts, tokens, self.lookups)
        self.single = SingleStream(runtime, settings, commands, counts, self.admission, tokens,
                                   load_wait, self.between)
        self.batching = Batching(runtime, settings, commands, counts, self.admission,
                                 self.preparer, self.single, load_wait, self.between)

    def between(self, started: bool = False) -> None:
        """Where the engine thread looks up from a generation (prefill layers and chunks,
        tokens, batch steps): quick calls, then the published figures when due, or at
        once when a request ``started`` (its first progress, or joining a batch)."""
        self.commands.run_quick()
        self.publisher.tick(started)

    def active(self) -> int:
        """Requests decoding now."""
        return self.batching.active_rows() or int(self.single.current is not None)

    def running(self) -> list[dict[str, Any]]:
        """The requests being served now and how far each is: ``prefill`` with its prompt
        tokens done (cached ones included; inside a chunk, the layer reached), or
        ``decode`` with the tokens generated."""
        single = self.single.current
        handles = self.batching.active_handles() or ([single] if single is not None else [])
        out = []
        for h in handles:
            p = h.progress
            row: dict[str, Any] = {"id": h.id, "prompt_tokens": p.total if p else None,
                                   "prefill_done": p.done if p else 0,
                                   "generated": len(h.tokens)}
            at = self.single.prefill_at if h is single else self.batching.prefill_at(h)
            if at is not None:
                row.update(prefill_done=at.done, chunk=at.chunk, layer=at.layer, layers=at.layers)
            row["phase"] = "prefill" if (p is None or p.done < p.total) and not h.tokens \
                else "decode"
            out.append(row)
        return out

    def run(self) -> None:
        """Serve commands until :data:`~engine.commands.STOP`."""
        commands, cache, publisher = self.commands, self.runtime.cache, self.publisher
        publisher.publish()
        while True:
            cmd = commands.next(self.source)
            if cmd is STOP:
                break
            if cmd is WAKE:
                commands.run_quick()
            else:
                publisher.busy = True  # callers read the published figures meanwhile
                try:
                    if isinstance(cmd, Call):
                        cmd.run()
                    elif isinstance(cmd, RequestHandle):
                        self.serve(cmd)
                finally:
                    publisher.busy = False
            if commands.waiting <= 0:
                cache.busy(False)
            if cmd is not WAKE:
                publisher.publish()

    def serve(self, handle: RequestHandle) -> None:
        """Answer one request: in a batch (of one until others join), or alone until
        another waits, then in a batch."""
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
        if self.batching.takes(job.handle.request):
            self.batching.run(job)
            return
        join = self.single.run(job)
        if join is not None:
            self.batching.run(job, join)

    def finish(self) -> None:
        """The loop ended: tell the source, answer what is left, close the cache."""
        self.source.stopped()
        self.commands.drain()
        self.runtime.cache.close(10.0)
