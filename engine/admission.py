"""Which waiting requests may decode together, and when: the line of waiting requests as
continuous batching sees it (engine thread only).

A request starts in a batch of one, and the waiting ones join it between steps
(:meth:`next_row`), up to ``max_batch`` rows. A request served alone (its speculation runs
only there) decodes single-stream; while it runs, the engine looks, between tokens and
prefill chunks, at the next command in line (:meth:`wanted`); when that is a request that
may be batched, the running one moves into a batch and the waiting ones join it. A call, a shutdown or a
request that must be served alone (seeded sampling) is not overtaken.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from mlxkv.engine.commands import CommandQueue
from mlxkv.engine.requests import Counts, FinishedEvent, Request, RequestHandle

if TYPE_CHECKING:
    from mlxkv.engine.generate import Generation

# How long a request that starts alone waits for others sent with it (see Admission.gather),
# and for how long after requests last decoded together the engine expects such bursts.
GATHER_S = 0.01
GATHER_RECENT_S = 60.0


def guided(req: Request) -> bool:
    """Whether ``req`` carries something its speculation proposes from (a choice list, a
    grammar, a JSON skeleton)."""
    return bool(req.json_skeleton or req.guided_choice or req.grammar)


def row_batchable(req: Request, spec: str = "auto") -> bool:
    """Whether ``req`` may decode in a batch (``spec``: the engine's speculation mode). A
    seeded sampled request may when it decodes plainly (its sampler's key sequence is its
    own, alone or batched); one that speculates (a mode asked for, or a constraint that
    proposes under ``auto``) draws a verify's positions from MLX's global key, which only a
    request served alone keeps to itself."""
    p = req.params
    if p.seed is None or p.temperature == 0:
        return True
    mode = req.spec or spec
    return mode == "off" or (mode == "auto" and not guided(req))


class Admission:
    """The waiting line's side of batching for one loaded model."""

    def __init__(self, commands: CommandQueue, counts: Counts, max_batch: int,
                 batchable: bool, spec: str = "auto"):
        self.commands = commands
        self.spec = spec  # the engine's speculation mode (a request may name its own)
        self.counts = counts
        self.max_batch = max_batch
        self.enabled = batchable and max_batch > 1  # the model's caches can be batched
        self.batching = False  # a batch decodes now
        self.batched_at: float | None = None  # when a batch last ended (time.monotonic())

    def answer_cancelled(self, handle: RequestHandle) -> None:
        """A request cancelled before it started (already taken from the line) ends now."""
        self.counts.cancelled += 1
        handle.emit(FinishedEvent("cancelled", "shutdown" if self.commands.is_closed()
                                  else None))

    def sweep_cancelled(self) -> None:
        """Answer the waiting requests cancelled before they started, wherever they are in
        line: they stop counting against ``max_queue`` at once (a client that went away)."""
        for handle in self.commands.take_cancelled():
            self.answer_cancelled(handle)

    def recently_batched(self) -> bool:
        """Whether requests decoded together within the last ``GATHER_RECENT_S``."""
        last = self.batched_at
        return self.batching or (last is not None and time.monotonic() - last < GATHER_RECENT_S)

    def gather(self, handle: RequestHandle) -> None:
        """A batchable request that starts while nothing else waits gives the requests sent
        with it (clients that send at once) up to ``GATHER_S`` to arrive before its prefill:
        they then prefill together in one batch, as mlx_lm.server's do, instead of this one
        alone and the others after its first token (its prefill is one pass: nothing to join
        between). It waits that long once, on the queue, not in a sleep, and only while
        requests have decoded together within ``GATHER_RECENT_S``: a lone user (the chat, one
        agent) never waits; a server that sees concurrent clients does."""
        if (self.commands.waiting > 0 or self.commands.has_backlog() or not self.enabled
                or not self.recently_batched() or handle.cancelled
                or not row_batchable(handle.request, self.spec)):
            return
        self.commands.look_ahead(GATHER_S)

    def wanted(self, handle: RequestHandle, gen: Generation, sent: list[int]) -> bool:
        """Should the single-stream request ``handle`` move into a batch now: another
        request that may decode with it is next in line, and its state can move."""
        if self.commands.waiting > 0:
            self.sweep_cancelled()
        if (self.commands.waiting <= 0 or not self.enabled or handle.cancelled
                or self.commands.is_closed() or not row_batchable(handle.request, self.spec)):
            return False
        head = self.commands.peek()
        if not (isinstance(head, RequestHandle) and not head.cancelled
                and row_batchable(head.request, self.spec)):
            return False
        from mlxkv.engine.batch import movable

        return gen.cache is not None and movable(gen.cache, len(gen.prompt_tokens) + len(sent), gen)

    def next_row(self) -> RequestHandle | None:
        """The request next in line, taken from it, when it may join a batch now (cancelled
        ones on the way are answered); None when the line's head must wait, or the engine
        is stopping."""
        while not self.commands.is_closed():
            head = self.commands.peek()
            if not isinstance(head, RequestHandle):
                return None
            if head.cancelled:
                self.commands.pop()
                self.commands.take(head)
                self.answer_cancelled(head)
                continue
            if not row_batchable(head.request, self.spec):
                return None
            self.commands.pop()
            self.commands.take(head)
            return head
        return None
