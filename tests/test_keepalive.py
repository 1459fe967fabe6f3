"""Keep-alives on a server-sent-event stream (server.keepalive): pings while the reply is
silent, chunks in order, and a stream closed by a client that went away leaves nothing
behind (a long soak logged "Task exception was never retrieved" for each such stream)."""

from __future__ import annotations

import asyncio
import gc

from mlxkv.server.keepalive import SSE_COMMENT, comment, keep_alive


async def _chunks(delays: list[float], end_after: float = 0.0):
    for i, d in enumerate(delays):
        await asyncio.sleep(d)
        yield f"chunk {i}"
    await asyncio.sleep(end_after)


def test_pings_fill_the_silences_and_chunks_keep_their_order():
    async def main() -> list[str]:
        return [c async for c in keep_alive(_chunks([0.0, 0.12, 0.0]), 0.05, comment)]

    out = asyncio.run(main())
    assert [c for c in out if c != SSE_COMMENT] == ["chunk 0", "chunk 1", "chunk 2"]
    assert out[0] == "chunk 0" and out[1] == SSE_COMMENT and 1 <= out.count(SSE_COMMENT) <= 3


def test_a_stream_closed_after_its_source_ended_leaves_no_unretrieved_exception():
    async def main() -> list[str]:
        seen: list[str] = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: seen.append(ctx["message"]))
        stream = keep_alive(_chunks([], end_after=0.05), 0.01, comment)
        assert await stream.__anext__() == SSE_COMMENT  # a ping while the source is silent
        await asyncio.sleep(0.15)  # the source ends while the client has not asked for more
        await stream.aclose()  # the client went away
        gc.collect()
        await asyncio.sleep(0)
        return seen

    assert asyncio.run(main()) == []
