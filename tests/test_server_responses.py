"""``POST /v1/responses`` through the `openai` SDK's ``responses.create`` and
``responses.stream``, against a real server on a loopback port in front of a real engine:
a tiny random model for the protocol, tiny models trained to call a tool (one whose chat
template renders tools, one whose template has no tool format and gets the server's default
one) for function calls and their round trip, and every malformed value of a documented
field answered 400 naming the field."""

from __future__ import annotations

import asyncio
import json
import threading

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
    tool_model,
)

from bench.server import http_client
from mlxkv.engine.engine import Engine
from mlxkv.engine.generate import SamplingParams
from mlxkv.server.chat_prompt import TemplateCaps, build_prompt
from mlxkv.server.context import ServerConfig
from mlxkv.server.response_store import ResponseStore
from mlxkv.server.responses_items import parse_input, parse_tools, to_messages
from mlxkv.server.tool_prompt import call_line

httpx = http_client()
FN = WEATHER_TOOL["function"]
TOOL = {"type": "function", "name": FN["name"], "description": FN["description"],
        "parameters": FN["parameters"], "strict": False}
# what Codex CLI sends beside its function tools
CODEX_EXTRAS = [
    {"type": "namespace", "name": "agents", "description": "Sub-agents", "tools": [
        {"type": "function", "name": "spawn", "description": "Start one", "strict": False,
         "parameters": {"type": "object", "properties": {"task": {"type": "string"}}}}]},
    {"type": "web_search", "external_web_access": False},
]


def _cache():
    from mlxkv.engine.cache.prefix_cache import PrefixCache

    return PrefixCache(ram_bytes=64 << 20, cache_dir=None, block_tokens=16)


@pytest.fixture(scope="module")
def served(tiny_qwen3):
    config = ServerConfig(defaults=SamplingParams(max_tokens=16, temperature=0.0), max_tokens_limit=256,
                          responses_store_bytes=1 << 20)
    with Engine(str(tiny_qwen3), prefix_cache=_cache()).start(timeout=T) as engine, \
            LoopbackServer(engine, config) as srv:
        yield srv


@pytest.fixture
def oai(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=T)


def _events(stream) -> list:
    return [e for e in stream]


def test_create_and_stream_give_the_same_reply_and_usage(oai):
    ask = dict(model="codex-local", input="def main(): return", max_output_tokens=12,
               temperature=0, instructions="Write Python.")
    r = oai.responses.create(**ask)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "codex-local"
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.instructions == "Write Python." and r.max_output_tokens == 12
    (msg,) = r.output
    assert msg.type == "message" and msg.role == "assistant" and msg.content[0].type == "output_text"
    assert r.usage.output_tokens == 12 and r.usage.input_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    with oai.responses.stream(**ask) as s:
        events = _events(s)
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == r.output_text == events[-2].item.content[0].text
    final = events[-1].response
    assert final.status == "incomplete" and final.output_text == r.output_text
    # the same prompt again: all of it but its last token comes from the prefix cache
    usage = final.usage
    assert usage.input_tokens == r.usage.input_tokens
    assert usage.input_tokens_details.cached_tokens == usage.input_tokens - 1


def test_input_items_previous_response_and_the_store(oai, served):
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "import os"}]},
             {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "opaque"}]
    r1 = oai.responses.create(model="m", input=items, max_output_tokens=4, temperature=0,
                              metadata={"job": "a"}, prompt_cache_key="conv-1")
    assert r1.metadata == {"job": "a"} and r1.store is True
    r2 = oai.responses.create(model="m", previous_response_id=r1.id, max_output_tokens=4, temperature=0,
                              input=[{"role": "user", "content": "and sys?"}])
    assert r2.previous_response_id == r1.id
    # the whole first exchange is a prefix of the second prompt: its tokens come from the cache
    assert r2.usage.input_tokens_details.cached_tokens >= r1.usage.input_tokens
    # the same conversation sent whole is the same prompt
    whole = items + [o.model_dump(exclude_none=True) for o in r1.output] + \
        [{"role": "user", "content": "and sys?"}]
    r3 = oai.responses.create(model="m", input=whole, max_output_tokens=4, temperature=0)
    assert r3.usage.input_tokens == r2.usage.input_tokens and r3.output_text == r2.output_text
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model="m", previous_response_id="resp_nope", input="x", max_output_tokens=2)
    assert e.value.body["param"] == "previous_response_id" and "not known" in e.value.body["message"]
    unstored = oai.responses.create(model="m", input="x", max_output_tokens=2, store=False)
    with pytest.raises(openai.BadRequestError, match="not stored"):
        oai.responses.create(model="m", previous_response_id=unstored.id, input="y", max_output_tokens=2)
    assert served.ctx.responses.get(r2.id) is not None


def test_the_store_is_bounded_by_bytes_and_forgets_the_least_recently_used():
    store = ResponseStore(max_bytes=400)
    item = [{"type": "message", "role": "user", "content": "x" * 60}]
    for i in range(3):
        assert store.put(f"r{i}", item)
    assert store.get("r0") is not None  # r0 used: r1 is now the oldest
    assert store.put("r3", item) and store.put("r4", item)
    assert store.get("r1") is None and store.get("r0") is not None and store.bytes <= 400
    assert not store.put("huge", [{"content": "y" * 400}]) and store.get("huge") is None
    assert ResponseStore(0).put("r", item) is False


def test_max_output_tokens_above_the_limit_is_clamped_and_said(served):
    body = {"model": "m", "input": "hi", "max_output_tokens": 10**12, "temperature": 0}
    r = httpx.post(served.url + "/v1/responses", json=body, timeout=T)
    assert r.status_code == 200, r.text
    assert r.json()["max_output_tokens"] == 256
    assert r.headers["x-mlxkv-max-tokens"] == f"requested {10**12}, clamped to 256"
    with httpx.stream("POST", served.url + "/v1/responses", json={**body, "stream": True}, timeout=T) as s:
        assert s.status_code == 200 and s.headers["x-mlxkv-max-tokens"].endswith("clamped to 256")
        s.read()


def test_what_codex_sends_is_accepted(oai, served):
    """Codex CLI's body: developer messages and no instructions, namespace and built-in tools,
    reasoning and include, prompt_cache_key, store false, client_metadata; earlier turns'
    function calls and their outputs."""
    history = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "You are Codex."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "list files"}]},
        {"type": "reasoning", "summary": [], "content": None, "encrypted_content": None},
        {"type": "function_call", "name": "spawn", "namespace": "agents", "arguments": '{"task": "ls"}',
         "call_id": "call_1"},
        {"type": "function_call_output", "call_id": "call_1",
         "output": [{"type": "input_text", "text": "a.py b.py"}]},
    ]
    with oai.responses.stream(
            model="gpt-5.1-codex", input=history, tools=[TOOL, *CODEX_EXTRAS], tool_choice="auto",
            parallel_tool_calls=True, reasoning={"effort": "medium", "summary": "auto"}, store=False,
            include=["reasoning.encrypted_content"], prompt_cache_key="0199-session",
            text={"verbosity": "low"}, max_output_tokens=6, temperature=0,
            extra_body={"client_metadata": {"x-codex-window-id": "w"}}) as s:
        events = _events(s)
    final = events[-1].response
    assert final.model == "gpt-5.1-codex" and final.store is False
    assert [t.type for t in final.tools] == ["function", "namespace", "web_search"]
    assert final.reasoning.effort == "medium" and final.text.verbosity == "low"
    assert final.prompt_cache_key == "0199-session"
    assert final.usage.input_tokens > 0 and events[-1].type == "response.incomplete"


def test_a_quiet_stream_repeats_in_progress_and_the_sdk_takes_it(served):
    """While the engine is busy (here: held on its own thread), the stream sends
    response.in_progress every quiet interval; the SDK's stream state accepts the repeats."""
    from openai import omit
    from openai._models import construct_type
    from openai.lib.streaming.responses._responses import ResponseStreamState
    from openai.types.responses import ResponseStreamEvent

    from mlxkv.engine.requests import ProgressEvent
    from mlxkv.server.bridge import EventStream
    from mlxkv.server.responses_api import Answer, _stream, engine_request, read_ask

    async def run() -> list[dict]:
        ctx = served.ctx
        ask = read_ask({"input": "hello", "max_output_tokens": 3, "temperature": 0, "stream": True}, ctx)
        req = await engine_request(ask, ctx, None)
        held, release = threading.Event(), threading.Event()
        engine_busy = served.engine.call(lambda: (held.set(), release.wait(T)))
        assert await asyncio.to_thread(held.wait, T)
        es = EventStream(served.engine, req, ctx.gate, asyncio.get_running_loop())
        out, beats = [], 0
        async for chunk in _stream(Answer(ask, ctx), es, ProgressEvent(0, 0), ctx, quiet_s=0.05):
            event = json.loads(chunk.split("data: ", 1)[1])
            out.append(event)
            beats += event["type"] == "response.in_progress"
            if beats == 3:
                release.set()  # the engine goes on once the stream has repeated itself
        await asyncio.to_thread(engine_busy.result, T)
        return out

    events = asyncio.run(run())
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["response.created"] + ["response.in_progress"] * 3
    assert kinds[-1] == "response.incomplete" and "response.output_item.added" in kinds
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    for e in events:
        state.handle_event(construct_type(type_=ResponseStreamEvent, value=e))


BAD_FIELDS = [
    ("input", 5), ("input[0]", [5]), ("input", {"a": 1}),
    ("input[0].role", [{"role": "wizard", "content": "x"}]),
    ("input[0].content", [{"role": "user", "content": 3}]),
    ("input[0].content[0].type", [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]),
    ("input[0].content[0].text", [{"role": "user", "content": [{"type": "input_text", "text": 1}]}]),
    ("input[0].type", [{"type": "item_reference", "id": "x"}]),
    ("input[0].call_id", [{"type": "function_call", "name": "f", "arguments": "{}"}]),
    ("input[0].arguments", [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{no"}]),
    ("input[0].name", [{"type": "function_call", "call_id": "c", "name": 7, "arguments": "{}"}]),
    ("input[0].output", [{"type": "function_call_output", "call_id": "c", "output": 7}]),
    ("instructions", 5), ("model", 5),
    ("tools", "all"), ("tools[0]", [3]), ("tools[0].type", [{"type": "teleport"}]),
    ("tools[0].name", [{"type": "function"}]), ("tools[0].parameters", [{"type": "function", "name": "f",
                                                                         "parameters": "x"}]),
    ("tools[0].strict", [{"type": "function", "name": "f", "strict": "yes"}]),
    ("tools[0].tools", [{"type": "namespace", "name": "n", "tools": 3}]),
    ("tool_choice", "sometimes"), ("tool_choice", 3),
    ("parallel_tool_calls", "yes"), ("stream", "yes"), ("store", 1),
    ("max_output_tokens", 0), ("max_output_tokens", "many"), ("max_output_tokens", 1.5),
    ("max_output_tokens", float("inf")),
    ("temperature", "hot"), ("temperature", -1), ("temperature", 1e300), ("temperature", float("nan")),
    ("temperature", 10**400), ("top_p", -(10**400)), ("max_output_tokens", -(10**400)),
    ("top_p", 2), ("top_p", 0), ("top_p", []),
    ("seed", 2**64), ("seed", -1), ("seed", 10**40),
    ("metadata", "x"), ("metadata", {"a": 1}),
    ("prompt_cache_key", 5), ("include", "x"), ("include", [1]),
    ("reasoning", "high"), ("reasoning.effort", {"effort": 3}),
    ("text", "plain"), ("text.format", {"format": {"type": "xml"}}),
    ("text.format.schema", {"format": {"type": "json_schema", "name": "s"}}),
    ("text.format.schema", {"format": {"type": "json_schema", "name": "s", "schema": {"not": {}}}}),
    ("reasoning.effort", {"effort": "extreme"}),
    ("text.verbosity", {"verbosity": 2}),
    ("truncation", "sometimes"), ("user", 5), ("service_tier", 5),
    ("previous_response_id", 5), ("background", True), ("conversation", "conv_1"),
    ("top_logprobs", 99), ("max_tool_calls", 0), ("client_metadata", "x"),
]


def test_every_malformed_documented_field_is_a_400_naming_it(served, oai):
    base = {"model": "m", "input": "hi", "max_output_tokens": 2}
    for param, value in BAD_FIELDS:
        field = param.split(".")[0].split("[")[0]
        raw = json.dumps({**base, field: value}, allow_nan=True)
        r = httpx.post(served.url + "/v1/responses", content=raw, timeout=T,
                       headers={"content-type": "application/json"})
        assert r.status_code == 400, (param, value, r.status_code, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == param, (param, value, err)
    # a lone UTF-16 surrogate is valid JSON and not text: 400, wherever it is
    for where, body in (("input", '"\\ud800"'), ("input[0].content[0].text",
                                                 '[{"role": "user", "content": [{"type": "input_text", '
                                                 '"text": "a\\udfff"}]}]'),
                        ("metadata.k", '"x", "metadata": {"k": "\\ud83d"}')):
        raw = '{"model": "m", "max_output_tokens": 2, "input": ' + body + "}"
        r = httpx.post(served.url + "/v1/responses", content=raw, timeout=T,
                       headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == where, (where, r.text)
    r = httpx.post(served.url + "/v1/responses", content=b'{"input": "x"', timeout=T)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(served.url + "/v1/responses", json={"model": "m"}, timeout=T)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    # the server goes on
    assert oai.responses.create(model="m", input="still there?", max_output_tokens=2).usage.output_tokens == 2


def test_a_prompt_longer_than_the_context_is_a_400(tmp_path):
    from support.modelgen import tiny_model

    with Engine(str(tiny_model("qwen3", max_position_embeddings=64))).start(timeout=T) as engine, \
            LoopbackServer(engine, ServerConfig()) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=T)
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError, match="context is 64 tokens"):
                r = client.responses.create(model="m", input="import os " * 80, stream=stream)
                list(r) if stream else None
        # without max_output_tokens a reply may fill the context
        r = client.responses.create(model="m", input="hi", temperature=0)
        assert r.usage.input_tokens + r.usage.output_tokens <= 64 and r.usage.output_tokens > 16


# --------------------------------------------------------------------- function calls
@pytest.fixture(scope="module", params=["template", "default"])
def tool_served(request):
    """A model that answers the weather question with a call: through its template's tool
    format, or through the server's default one (its template has none)."""
    folder = tool_model() if request.param == "template" else default_format_tool_model()
    with Engine(str(folder), prefix_cache=_cache()).start(timeout=T) as engine, \
            LoopbackServer(engine, ServerConfig()) as srv:
        yield srv


def test_function_call_round_trip(tool_served):
    oai = openai.OpenAI(base_url=tool_served.url + "/v1", api_key="none", max_retries=0, timeout=T)
    ask = dict(model="m", tools=[TOOL], max_output_tokens=60, temperature=0)
    r = oai.responses.create(input=QUESTION, **ask)
    assert r.status == "completed"
    (call,) = r.output  # no empty message before the call
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert json.loads(call.arguments) == CALL_ARGS and call.status == "completed"
    items = [{"role": "user", "content": QUESTION}, call.model_dump(exclude_none=True),
             {"type": "function_call_output", "call_id": call.call_id, "output": TOOL_RESULT}]
    with oai.responses.stream(input=items, **ask) as s:
        events = _events(s)
        final = s.get_final_response()
    assert final.output_text == FINAL_ANSWER and final.status == "completed"
    assert [o.type for o in final.output] == ["message"]
    # the second turn continues the first one's cached prompt
    assert final.usage.input_tokens_details.cached_tokens > 0
    assert "response.output_item.added" in [e.type for e in events]
    # streamed, the call is one function_call item with its argument events
    with oai.responses.stream(input=QUESTION, **ask) as s:
        events = _events(s)
        final = s.get_final_response()
    kinds = [e.type for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    assert events[2].item.type == "function_call" and events[2].item.arguments == ""
    assert json.loads(events[4].arguments) == CALL_ARGS and events[4].name == "get_weather"
    (done,) = final.output
    assert (done.name, json.loads(done.arguments), done.call_id) == ("get_weather", CALL_ARGS,
                                                                      events[5].item.call_id)
    # tool_choice none: no tools offered, nothing parsed
    r = oai.responses.create(input=QUESTION, tool_choice="none", **ask)
    assert all(o.type == "message" for o in r.output)


def test_the_default_tool_format_is_written_only_for_templates_without_one():
    items = parse_input([
        {"role": "developer", "content": "Be exact."},
        {"role": "user", "content": QUESTION},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "spawn", "namespace": "agents", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": TOOL_RESULT},
        {"type": "function_call_output", "call_id": "c2", "output": "ok"},
    ])
    tools = parse_tools([TOOL, *CODEX_EXTRAS])
    assert [t["function"]["name"] for t in tools.chat] == ["get_weather", "agents.spawn"]
    assert tools.chat[0] == WEATHER_TOOL  # what a template's own tool format is given
    assert tools.namespaced == {"agents.spawn": ("agents", "spawn")}
    messages = to_messages(items, "Instructions.")
    assert messages[0] == {"role": "system", "content": "Instructions.\n\nBe exact."}
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "tool"]
    assert [c["function"]["name"] for c in messages[2]["tool_calls"]] == ["get_weather", "agents.spawn"]
    assert messages[3]["name"] == "get_weather" and messages[2]["tool_calls"][0]["function"]["arguments"] == CALL_ARGS
    # a template without tools gets the server's default format, as on every chat route
    inline = build_prompt(messages, tools.chat, TemplateCaps(tools=False, system_turns=True)).messages
    assert [m["role"] for m in inline] == ["system", "user", "assistant", "user"]
    assert inline[0]["content"].startswith("Instructions.\n\nBe exact.\n\n# Tools")
    assert "## get_weather" in inline[0]["content"] and "## agents.spawn" in inline[0]["content"]
    assert inline[2]["content"] == (call_line("get_weather", CALL_ARGS) + "\n" + call_line("agents.spawn", {}))
    assert inline[3]["content"] == (f"<tool_response>\n{TOOL_RESULT}\n</tool_response>\n"
                                    "<tool_response>\nok\n</tool_response>")
    assert all("tool_calls" not in m for m in inline)
