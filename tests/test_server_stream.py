"""When a streamed reply starts: once the engine has taken the prompt (its first progress
event), so that the response's headers and opening chunk go out while the prompt is
prefilled and the first token travels alone; a refused prompt still gets its 4xx before
any byte. Real engine on a tiny model, the server's own event bridge."""

from __future__ import annotations

import asyncio

from common import T

from mlxkv.engine.engine import Engine, ErrorEvent, FinishedEvent, ProgressEvent, Request, TokenEvent
from mlxkv.engine.generate import SamplingParams
from mlxkv.server.bridge import EventStream, Gate, first_event


async def _idle_receive() -> dict:
    await asyncio.sleep(3600)  # the client never goes away here
    return {"type": "http.disconnect"}


async def _first_and_rest(engine: Engine, req: Request, accepted: bool) -> list:
    stream = EventStream(engine, req, Gate(8), asyncio.get_running_loop())
    first = await asyncio.wait_for(first_event(stream, _idle_receive, accepted=accepted), T)
    events = [first]
    while not isinstance(events[-1], (FinishedEvent, ErrorEvent)):
        events.append(await asyncio.wait_for(stream.next(), T))
    return events


def test_a_stream_starts_at_the_first_progress_and_a_refusal_still_comes_first(tiny_qwen3):
    from support.modelgen import tiny_model

    prompt = list(range(3, 40))
    req = Request(prompt_tokens=prompt, params=SamplingParams(max_tokens=4, temperature=0.0))
    with Engine(str(tiny_qwen3)).start(timeout=T) as engine:
        events = asyncio.run(_first_and_rest(engine, req, accepted=True))
        assert isinstance(events[0], ProgressEvent) and events[0].total == len(prompt)
        assert sum(isinstance(e, TokenEvent) and e.token is not None for e in events) == 4
        assert isinstance(events[-1], FinishedEvent)
        # without it (replies that are not streamed), the first event is the first token
        events = asyncio.run(_first_and_rest(engine, req, accepted=False))
        assert isinstance(events[0], TokenEvent)
    with Engine(str(tiny_model("qwen3", max_position_embeddings=64))).start(timeout=T) as engine:
        too_long = Request(prompt_tokens=list(range(3, 100)), params=SamplingParams(max_tokens=4))
        events = asyncio.run(_first_and_rest(engine, too_long, accepted=True))
        assert isinstance(events[0], ErrorEvent) and "context is 64 tokens" in events[0].message
