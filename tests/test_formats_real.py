"""Every model family's tool calls and reasoning through `mlxkv serve`, for real: the real
GGUF model with each family's real chat template swapped in (``--chat-template``), its reply
forced to the family's own call text (``guided_choice``), asked through the real OpenAI and
Anthropic SDKs on chat completions, Messages and Responses, streamed and not. The call comes
back structured on every route; a thinking family's reasoning comes back apart."""

from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import openai
import pytest
from common import T
from server_support import LoopbackServer

from mlxkv.engine.engine import Engine
from mlxkv.engine.settings import Settings
from mlxkv.server.context import ServerConfig
from support.formats import ARGS, FAMILIES, REASONING, WEATHER_TOOL, Family
from support.real_model import real_model_path

REAL = real_model_path()
pytestmark = pytest.mark.skipif(REAL is None, reason="the real model is not fetched: run `make fixtures`")
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
CLAUDE_TOOL = {"name": "get_weather", "description": WEATHER_TOOL["function"]["description"],
               "input_schema": WEATHER_TOOL["function"]["parameters"]}
RESPONSES_TOOL = {"type": "function", "name": "get_weather", **{k: v for k, v in WEATHER_TOOL["function"].items()
                                                                 if k != "name"}}


class Clients:
    def __init__(self, srv: LoopbackServer, family: Family, engine: Engine):
        self.family, self.engine = family, engine
        self.oai = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=T)
        self.claude = anthropic.Anthropic(base_url=srv.url, api_key="none", max_retries=0, timeout=T)


@pytest.fixture(scope="module", params=FAMILIES, ids=lambda f: f.name)
def served(request) -> Iterator[Clients]:
    from mlxkv.engine.cache.prefix_cache import PrefixCache

    family = request.param
    settings = Settings.defaults().replace(chat_template=str(family.template_path), model=str(REAL))
    cache = PrefixCache(ram_bytes=256 << 20, cache_dir=None, block_tokens=16)
    with Engine(str(REAL), settings=settings, prefix_cache=cache).start(timeout=T) as engine, \
            LoopbackServer(engine, ServerConfig(open_ended=True)) as srv:
        yield Clients(srv, family, engine)


def forced(text: str) -> dict:
    return {"guided_choice": [text], "temperature": 0}


def test_the_call_comes_back_structured_on_every_route(served):
    fam = served.family
    # OpenAI chat completions, whole and streamed
    r = served.oai.chat.completions.create(model="m", messages=QUESTION, tools=[WEATHER_TOOL],
                                           extra_body=forced(fam.call))
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", ARGS)
    assert not choice.message.content
    chunks = list(served.oai.chat.completions.create(model="m", messages=QUESTION, tools=[WEATHER_TOOL],
                                                     stream=True, extra_body=forced(fam.call)))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(d.function.name, json.loads(d.function.arguments)) for d in deltas] == [("get_weather", ARGS)]
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip()
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # Anthropic Messages
    m = served.claude.messages.create(model="m", max_tokens=256, messages=QUESTION, tools=[CLAUDE_TOOL],
                                      extra_body=forced(fam.call))
    assert m.stop_reason == "tool_use" and [(b.type, b.name, b.input) for b in m.content] == [
        ("tool_use", "get_weather", ARGS)]
    with served.claude.messages.stream(model="m", max_tokens=256, messages=QUESTION, tools=[CLAUDE_TOOL],
                                       extra_body=forced(fam.call)) as s:
        final = s.get_final_message()
    assert final.stop_reason == "tool_use" and [(b.type, b.input) for b in final.content] == [("tool_use", ARGS)]
    # Responses
    resp = served.oai.responses.create(model="m", input="What is the weather in Paris?", tools=[RESPONSES_TOOL],
                                       extra_body=forced(fam.call))
    calls = [(i.type, i.name, json.loads(i.arguments)) for i in resp.output if i.type == "function_call"]
    assert calls == [("function_call", "get_weather", ARGS)] and len(resp.output) == 1, resp.output
    events = list(served.oai.responses.create(model="m", input="What is the weather in Paris?",
                                              tools=[RESPONSES_TOOL], stream=True, extra_body=forced(fam.call)))
    done = events[-1].response
    assert [(i.type, i.name) for i in done.output] == [("function_call", "get_weather")]


def test_reasoning_comes_back_apart_on_every_route(served):
    fam = served.family
    if fam.thinking is None:
        pytest.skip(f"{fam.name} writes no reasoning")
    r = served.oai.chat.completions.create(model="m", messages=QUESTION, extra_body=forced(fam.thinking))
    msg = r.choices[0].message
    assert (msg.content, msg.model_extra["reasoning_content"], msg.model_extra["reasoning"]) == (
        "Sunny.", REASONING, REASONING)
    chunks = list(served.oai.chat.completions.create(model="m", messages=QUESTION, stream=True,
                                                     extra_body=forced(fam.thinking)))
    assert "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                   for c in chunks if c.choices) == REASONING
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Sunny."
    m = served.claude.messages.create(model="m", max_tokens=256, messages=QUESTION, extra_body=forced(fam.thinking))
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in m.content] == [
        ("thinking", REASONING), ("text", "Sunny.")]
    with served.claude.messages.stream(model="m", max_tokens=256, messages=QUESTION,
                                       extra_body=forced(fam.thinking)) as s:
        kinds = [e.delta.type for e in s if e.type == "content_block_delta"]
        final = s.get_final_message()
    assert "thinking_delta" in kinds and [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == REASONING
    resp = served.oai.responses.create(model="m", input="What is the weather in Paris?",
                                       extra_body=forced(fam.thinking))
    assert [i.type for i in resp.output] == ["reasoning", "message"]
    assert resp.output[0].content[0].text == REASONING and resp.output_text == "Sunny."


def test_a_tool_loop_stays_in_the_cache(served):
    """Three turns of call, result, call: each turn's prompt reads the one before it from the
    cache, the call the model wrote included as far as the template renders it back."""
    fam = served.family
    messages = list(QUESTION)
    cached = []
    for turn in range(3):
        r = served.oai.chat.completions.create(model="m", messages=messages, tools=[WEATHER_TOOL],
                                               extra_body=forced(fam.call))
        cached.append((r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens))
        (call,) = r.choices[0].message.tool_calls
        messages += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": f"Sunny, {20 + turn} C"}]
    # each turn reads at least the previous turn's prompt but its last few tokens back
    for (prev, _), (_, hit) in zip(cached, cached[1:]):
        assert hit >= prev - 16, cached


STRICT = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}}, "required": ["city"],
          "additionalProperties": False}


def test_a_forced_tool_choice_is_a_call_on_every_route(served):
    """tool_choice required / named (OpenAI, Responses), any / tool (Anthropic): the reply is
    held to calls of an allowed tool in the family's own syntax, with arguments valid against
    its schema, sampled at temperature 1."""
    import jsonschema

    tool = {"type": "function", "function": {**WEATHER_TOOL["function"], "parameters": STRICT}}
    r = served.oai.chat.completions.create(model="m", messages=QUESTION, tools=[tool], tool_choice="required",
                                           max_tokens=400, temperature=1.0, seed=7)
    assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
    for call in r.choices[0].message.tool_calls:
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), STRICT)
    m = served.claude.messages.create(model="m", max_tokens=400, messages=QUESTION,
                                      tools=[{**CLAUDE_TOOL, "input_schema": STRICT}],
                                      tool_choice={"type": "tool", "name": "get_weather"},
                                      extra_body={"temperature": 1.0, "seed": 8})
    assert m.stop_reason == "tool_use" and {b.type for b in m.content} == {"tool_use"}
    for block in m.content:
        jsonschema.validate(block.input, STRICT)
    resp = served.oai.responses.create(model="m", input="What is the weather in Paris?",
                                       tools=[{**RESPONSES_TOOL, "parameters": STRICT}], tool_choice="required",
                                       max_output_tokens=400, temperature=1.0, extra_body={"seed": 9})
    assert {i.type for i in resp.output} == {"function_call"} and resp.output[0].name == "get_weather"


def test_reasoning_sent_back_keeps_a_thinking_tool_loop_in_the_cache(served):
    """A thinking model's tool loop: the client sends each turn's reasoning back with its
    call (``reasoning_content``), and a template that reads it (MiniMax-M2's) renders the turn
    as the model wrote it, so the next turn reads all of it from the cache."""
    fam = served.family
    if fam.name != "minimax_m2":
        pytest.skip("one template that keeps earlier reasoning is enough")
    messages = [{"role": "user", "content": "What is the weather in Paris this week?"}]
    usages = []
    for _turn in range(2):
        r = served.oai.chat.completions.create(model="m", messages=messages, tools=[WEATHER_TOOL],
                                               extra_body=forced(fam.reasoned_call))
        msg = r.choices[0].message
        assert msg.model_extra["reasoning_content"] == REASONING and msg.tool_calls
        usages.append(r.usage)
        messages += [{"role": "assistant", "content": None, "reasoning_content": REASONING,
                      "tool_calls": [msg.tool_calls[0].model_dump()]},
                     {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "Sunny"}]
    first, second = usages
    assert second.prompt_tokens_details.cached_tokens >= first.prompt_tokens + first.completion_tokens - 4, usages
