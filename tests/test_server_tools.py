"""Tool calls through the server, for real: a tiny model trained to answer the weather
question with a ``<tool_call>`` (see server_support.tool_model) is asked through the
`openai` and `anthropic` clients; the call is parsed back, answered, and the model's reply to
the result comes back as text. A second model learned the same replies from the server's
default tool format (its template renders no tools): the tools reach it as text in the
system prompt, and its calls come back all the same."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest
from common import T
from server_support import (
    CALL_ARGS,
    FINAL_ANSWER,
    QUESTION,
    TOOL_RESULT,
    WEATHER_TOOL,
    LoopbackServer,
    default_format_tool_model,
    prompt_size,
    tool_model,
)

from mlxkv.engine.engine import Engine
from mlxkv.server.context import ServerConfig
from mlxkv.server.formats import DEFAULT_SYNTAX, split_reply
from mlxkv.server.formats.stream import ReplyParser


def serving(model: Any) -> Iterator[LoopbackServer]:
    from mlxkv.engine.cache.prefix_cache import PrefixCache

    cache = PrefixCache(ram_bytes=64 << 20, cache_dir=None, block_tokens=16)
    with Engine(str(model), prefix_cache=cache).start(timeout=T) as engine, \
            LoopbackServer(engine, ServerConfig()) as srv:
        yield srv


@pytest.fixture(scope="module")
def served():
    yield from serving(tool_model())


@pytest.fixture
def oai(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=T)


def test_openai_tool_call_round_trip(oai):
    messages = [{"role": "user", "content": QUESTION}]
    r = oai.chat.completions.create(model="m", messages=messages, tools=[WEATHER_TOOL], max_tokens=60,
                                    temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    assert json.loads(call.function.arguments) == CALL_ARGS
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": TOOL_RESULT}]
    r2 = oai.chat.completions.create(model="m", messages=messages, tools=[WEATHER_TOOL], max_tokens=60,
                                     temperature=0)
    assert (r2.choices[0].message.content, r2.choices[0].finish_reason) == (FINAL_ANSWER, "stop")
    assert not r2.choices[0].message.tool_calls
    # the second turn continues the first one's cached prompt
    assert r2.usage.prompt_tokens_details.cached_tokens > 0


def test_openai_streamed_tool_call(oai):
    chunks = list(oai.chat.completions.create(
        model="m", messages=[{"role": "user", "content": QUESTION}], tools=[WEATHER_TOOL],
        max_tokens=60, temperature=0, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == CALL_ARGS
    assert "".join(d.content or "" for d in deltas) == ""  # no tag text leaks as content
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_without_tools_the_text_is_left_alone(oai):
    # tool_choice "none": the template gets no tools, and nothing is parsed out of the reply
    r = oai.chat.completions.create(model="m", messages=[{"role": "user", "content": QUESTION}],
                                    tools=[WEATHER_TOOL], tool_choice="none", max_tokens=60, temperature=0)
    assert r.choices[0].finish_reason != "tool_calls" and not r.choices[0].message.tool_calls


def test_anthropic_tool_use_round_trip(served):
    claude = anthropic.Anthropic(base_url=served.url, api_key="none", max_retries=0, timeout=T)
    fn = WEATHER_TOOL["function"]
    tools = [{"name": fn["name"], "description": fn["description"], "input_schema": fn["parameters"]}]
    messages = [{"role": "user", "content": QUESTION}]
    m = claude.messages.create(model="m", max_tokens=60, tools=tools, messages=messages)
    assert m.stop_reason == "tool_use"
    # counted as sent: the tools are in the prompt the template renders
    counted = claude.messages.count_tokens(model="m", tools=tools, messages=messages).input_tokens
    assert counted == prompt_size(m.usage)
    assert claude.messages.count_tokens(model="m", messages=messages).input_tokens < counted
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert (use.name, use.input) == ("get_weather", CALL_ARGS) and use.id.startswith("toolu_")
    messages += [{"role": "assistant", "content": [b.model_dump() for b in m.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                               "content": TOOL_RESULT}]}]
    with claude.messages.stream(model="m", max_tokens=60, tools=tools, messages=messages) as s:
        final = s.get_final_message()
    assert final.stop_reason == "end_turn" and final.content[0].text == FINAL_ANSWER
    assert final.usage.cache_read_input_tokens > 0
    # streamed tool_use blocks come back whole
    with claude.messages.stream(model="m", max_tokens=60, tools=tools,
                                messages=[{"role": "user", "content": QUESTION}]) as s:
        streamed = s.get_final_message()
    assert streamed.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [("get_weather", CALL_ARGS)]


# The same round trips with a model whose template renders no tools: the server's default
# tool format (tool list in the system prompt, calls and results as text).
WEATHER = {"name": "get_weather", "description": WEATHER_TOOL["function"]["description"],
           "input_schema": WEATHER_TOOL["function"]["parameters"]}


@pytest.fixture(scope="module")
def tool_served():
    yield from serving(default_format_tool_model())


def test_tools_a_template_cannot_render_go_in_the_default_format_and_calls_come_back(tool_served):
    claude = anthropic.Anthropic(base_url=tool_served.url, api_key="none", max_retries=0, timeout=T)
    messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
    counted = claude.messages.count_tokens(model="m", tools=[WEATHER], messages=messages).input_tokens
    assert claude.messages.count_tokens(model="m", messages=messages).input_tokens < counted - 50
    m = claude.messages.create(model="m", max_tokens=60, tools=[WEATHER], messages=messages)
    assert m.stop_reason == "tool_use" and prompt_size(m.usage) == counted
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert (use.name, use.input) == ("get_weather", CALL_ARGS)
    messages += [{"role": "assistant", "content": [b.model_dump() for b in m.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": TOOL_RESULT}]}]
    with claude.messages.stream(model="m", max_tokens=60, tools=[WEATHER], messages=messages) as s:
        final = s.get_final_message()
    assert (final.stop_reason, final.content[0].text) == ("end_turn", FINAL_ANSWER)
    assert final.usage.cache_read_input_tokens > 0
    # the OpenAI route: the same prompt, the same calls
    oai = openai.OpenAI(base_url=tool_served.url + "/v1", api_key="none", max_retries=0, timeout=T)
    chunks = list(oai.chat.completions.create(model="m", messages=[{"role": "user", "content": QUESTION}],
                                              tools=[WEATHER_TOOL], max_tokens=60, temperature=0, stream=True))
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_weather", CALL_ARGS)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_parser_holds_back_a_partial_tag_and_gives_back_a_bad_one():
    p = ReplyParser(DEFAULT_SYNTAX, None)
    out = []
    for piece in ["Hi <to", "ol_c", "all>{\"name\": \"f\", \"argu", "ments\": {\"a\": 1}}</tool_call> bye <"]:
        out += p.feed(piece)
    out += p.finish()
    assert [k for k, _ in out] == ["text", "call", "text", "text"]
    assert out[0][1] == "Hi " and out[1][1].name == "f" and out[1][1].arguments == {"a": 1}
    assert "".join(x for k, x in out if k == "text") == "Hi bye <"  # the space after a call is dropped
    text, _, calls = split_reply(ReplyParser(DEFAULT_SYNTAX, None),
                                 "a <tool_call>not json</tool_call> b <tool_call>{\"name\"")
    assert calls == [] and text == "a <tool_call>not json</tool_call> b <tool_call>{\"name\""
