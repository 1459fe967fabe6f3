"""Keep-alive bytes on a server-sent-event stream while nothing else is sent.

A reply can be silent for minutes before its first token: queued behind other requests, or
prefilling a long prompt on a slow machine. Clients give up on a silent stream (Claude Code
aborts one after 300 s without an event and sends the request again), so every ``interval``
seconds without a chunk, :func:`keep_alive` sends one that clients skip: an Anthropic
``ping`` event, or an SSE comment line on the OpenAI routes.

Some clients count only so many keep-alives in a row as a live stream: Claude Code 2.1
takes at most 30 consecutive ``ping`` events as progress, after which its 300 s idle timer
runs again. The keep-alive chunk is therefore asked of the route for each keep-alive in a
row (``ping(n)``, n from 1), so that the Messages route can send an event clients count
instead of every :data:`PROGRESS_EVERY`-th ping (see ``anthropic_api``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable

ANTHROPIC_PING = 'event: ping\ndata: {"type":"ping"}\n\n'
SSE_COMMENT = ": ping\n\n"
# keep-alives in a row after which a route sends one that counts as progress (below
# Claude Code's 30)
PROGRESS_EVERY = 25


def comment(n: int) -> str:
    """The OpenAI routes' keep-alive: an SSE comment line, whatever the count."""
    return SSE_COMMENT


async def keep_alive(chunks: AsyncGenerator[str, None], interval: float | None,
                     ping: Callable[[int], str]) -> AsyncIterator[str]:
    """``chunks`` as they come, with ``ping(n)`` between them whenever ``interval`` seconds
    pass without one (n: keep-alives in a row so far, from 1; None or 0: no keep-alives).
    ``ping`` runs while ``chunks`` waits for its next event, never in the middle of writing
    one. Closing this closes ``chunks``."""
    pending: asyncio.Future | None = None
    in_a_row = 0
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(chunks.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=interval or None)
            if not done:
                in_a_row += 1
                yield ping(in_a_row)
                continue
            try:
                chunk = pending.result()
            except StopAsyncIteration:
                return
            pending, in_a_row = None, 0
            yield chunk
    finally:
        # A client that goes away while a ping is out leaves ``pending`` running, or ended
        # (the reply finished, or failed) with nobody to read it: cancel it, and read it
        # either way, so that asyncio has no exception to report as never retrieved.
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await pending
        await chunks.aclose()
