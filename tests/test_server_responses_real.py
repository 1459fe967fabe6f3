"""``POST /v1/responses`` on the real model (SmolLM2-135M-Instruct, GGUF) through the `openai`
SDK: short answers streamed and not, and a conversation resent whole each turn, as Codex
CLI sends it, whose cached tokens grow turn by turn. Its chat template has no tool format:
tools reach it in the server's default one."""

from __future__ import annotations

import openai
import pytest
from common import T
from server_support import LoopbackServer

from mlxkv.engine.engine import Engine
from mlxkv.server.context import ServerConfig
from support.real_model import real_model_path

REAL = real_model_path()
pytestmark = pytest.mark.skipif(REAL is None, reason="the real model is not fetched: run `make fixtures`")
SHELL = {"type": "function", "name": "shell", "description": "Run a shell command and return its output",
         "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                        "required": ["command"]}}


@pytest.fixture(scope="module")
def oai():
    from mlxkv.engine.cache.prefix_cache import PrefixCache

    cache = PrefixCache(ram_bytes=256 << 20, cache_dir=None, block_tokens=16)
    with Engine(str(REAL), prefix_cache=cache).start(timeout=T) as engine, \
            LoopbackServer(engine, ServerConfig()) as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=T)


def test_short_answers_streamed_and_not(oai):
    ask = dict(model="smollm2", instructions="Answer in one short sentence.", temperature=0,
               max_output_tokens=32)
    r = oai.responses.create(input="What is the capital of France?", **ask)
    assert "Paris" in r.output_text and r.model == "smollm2" and r.status == "completed"
    with oai.responses.stream(input="What is the capital of France?", **ask) as s:
        deltas = [e.delta for e in s if e.type == "response.output_text.delta"]
        final = s.get_final_response()
    assert "".join(deltas) == r.output_text == final.output_text
    # items instead of a string, no instructions (the template's own system prompt)
    r = oai.responses.create(model="smollm2", temperature=0, max_output_tokens=32, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "What is 2+2?"}]}])
    assert "4" in r.output_text


def test_a_conversation_resent_whole_reuses_the_cache_each_turn(oai):
    """Each turn sends the whole history again (developer prompt, tools, earlier turns):
    the cached part grows with it, and every earlier turn's prompt is a cached prefix."""
    items = [{"type": "message", "role": "developer",
              "content": [{"type": "input_text", "text": "You are a helpful coding assistant."}]}]
    cached, prompts = [], []
    for question in ("What is Python?", "Name one Python web framework.", "What does pip do?"):
        items.append({"type": "message", "role": "user", "content": [{"type": "input_text", "text": question}]})
        with oai.responses.stream(model="smollm2", input=items, tools=[SHELL], temperature=0,
                                  max_output_tokens=24, store=False, prompt_cache_key="conv") as s:
            events = [e for e in s]
        final = events[-1].response
        assert final.output_text and final.usage.output_tokens > 0
        cached.append(final.usage.input_tokens_details.cached_tokens)
        prompts.append(final.usage.input_tokens)
        items += [o.model_dump(exclude_none=True) for o in final.output]
    assert cached[0] < cached[1] < cached[2], cached
    assert cached[1] >= prompts[0] and cached[2] >= prompts[1], (cached, prompts)
