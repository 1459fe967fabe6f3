"""The Anthropic client against `mlxkv serve` on the real model (SmolLM2-135M-Instruct, its
GGUF file; ChatML without tool support): Claude Code's request shape streamed and not, with
system entries and cache_control, its tools in the default format, and a conversation whose
cache reads grow turn by turn. Few requests, short replies: each prefill costs CPU."""

from __future__ import annotations

import anthropic
import pytest
from common import T
from server_support import LoopbackServer, prompt_size

from mlxkv.engine.engine import Engine
from mlxkv.engine.generate import SamplingParams
from mlxkv.server.context import ServerConfig
from support.real_model import real_model_path

REAL = real_model_path()
pytestmark = pytest.mark.skipif(REAL is None, reason="the real model is not fetched: run `make fixtures`")
SYSTEM = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.332.1c9; cc_entrypoint=sdk-cli;"},
          {"type": "text", "text": "You are a helpful assistant. Answer in one short sentence.",
           "cache_control": {"type": "ephemeral"}}]
ENVIRONMENT = {"role": "system", "content": [{"type": "text", "text": "Today's date is 2026-12-02.",
                                              "cache_control": {"type": "ephemeral"}}]}
TOOLS = [{"name": "get_weather", "description": "Current weather of a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
         {"name": "Hidden", "description": "loaded later", "input_schema": {"type": "object"}, "defer_loading": True}]


@pytest.fixture(scope="module")
def claude():
    from mlxkv.engine.cache.prefix_cache import PrefixCache

    cache = PrefixCache(ram_bytes=256 << 20, cache_dir=None, block_tokens=16)
    with Engine(str(REAL), prefix_cache=cache).start(timeout=T) as engine, \
            LoopbackServer(engine, ServerConfig(defaults=SamplingParams(max_tokens=8))) as srv:
        yield anthropic.Anthropic(base_url=srv.url, api_key="none", max_retries=0, timeout=T)


def test_system_entries_and_cache_control_stream_and_not(claude):
    ask = dict(model="claude-sonnet-4-6", max_tokens=32000, system=SYSTEM, cache_control={"type": "ephemeral"},
               messages=[{"role": "user", "content": "What is the capital of France?"}, ENVIRONMENT],
               extra_body={"temperature": 0, "thinking": {"type": "adaptive"}})
    counted = claude.messages.count_tokens(**{k: v for k, v in ask.items() if k != "max_tokens"}).input_tokens
    raw = claude.messages.with_raw_response.create(**ask)
    assert raw.headers["x-mlxkv-max-tokens"] == "requested 32000, clamped to 8192"
    m = raw.parse()
    assert m.model == "claude-sonnet-4-6" and prompt_size(m.usage) == counted
    assert m.content[0].type == "text" and m.content[0].text.strip()
    with claude.messages.stream(**ask) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    # greedy: the same reply; the repeated prompt read from the cache
    assert streamed == m.content[0].text and final.usage.cache_read_input_tokens == counted - 1


def test_tools_in_the_default_format(claude):
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    with_tools = claude.messages.count_tokens(model="m", tools=TOOLS, messages=question).input_tokens
    without = claude.messages.count_tokens(model="m", messages=question).input_tokens
    assert with_tools > without + 50  # the tool list is in the prompt (the deferred one is not)
    m = claude.messages.create(model="m", max_tokens=40, tools=TOOLS, messages=question,
                               extra_body={"temperature": 0})
    assert prompt_size(m.usage) == with_tools and m.stop_reason in ("tool_use", "end_turn", "max_tokens")
    for block in m.content:  # a call the model wrote comes back as a tool_use block, never as tag text
        assert block.type == "tool_use" or "<tool_call>" not in block.text


def test_a_conversation_reads_more_from_the_cache_each_turn(claude):
    messages: list[dict] = []
    reads, sizes = [], []
    for question in ("Name a fruit.", "Name a colour.", "Name an animal."):
        messages.append({"role": "user", "content": question})
        m = claude.messages.create(model="m", max_tokens=8, system=SYSTEM, messages=messages,
                                   extra_body={"temperature": 0})
        reads.append(m.usage.cache_read_input_tokens)
        sizes.append(prompt_size(m.usage))
        messages.append({"role": "assistant", "content": m.content[0].text or "."})
    assert reads[0] < reads[1] < reads[2], reads
    # each turn reads at least the whole of the previous prompt, less one block
    assert reads[1] > sizes[0] - 16 and reads[2] > sizes[1] - 16, (reads, sizes)
