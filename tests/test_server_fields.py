"""Every request field the server reads, on every route, table-driven through a real server
on a loopback port: each valid value is accepted, each malformed one (a wrong type, NaN, an
infinite or huge number, a seed beyond 64 bits, a lone UTF-16 surrogate, a wrong type deep
inside a nested field) is refused with a 400 that names the field, and nothing is ever
answered 5xx."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from common import T
from server_support import LoopbackServer

from bench.server import http_client
from mlxkv.engine.engine import Engine
from mlxkv.engine.generate import SamplingParams
from mlxkv.server.context import ServerConfig

httpx = http_client()
NAN, INF = float("nan"), float("inf")
SURROGATE = "bad \ud800 text"
WEATHER = {"name": "get_weather", "description": "Weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}

MESSAGES = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
TOOL_TURNS = {"model": "m", "max_tokens": 2, "tools": [WEATHER], "messages": [
    {"role": "user", "content": "weather?"},
    {"role": "assistant", "content": [{"type": "text", "text": "let me see"},
                                      {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                       "input": {"city": "Paris"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "22 C"}]}]}
CHAT = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
CHAT_TOOLS = {"model": "m", "max_tokens": 2, "messages": [
    {"role": "user", "content": "weather?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "22 C"}],
    "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER["input_schema"]}}]}
COMPLETION = {"model": "m", "max_tokens": 2, "prompt": "def f():"}

# (field path, valid values, malformed values); a path is a tuple of keys and indexes
SAMPLING = [
    (("temperature",), [0, 0.7, 2], ["hot", NAN, INF, -1, 1e400, [1]]),
    (("top_p",), [0.5, 1], [NAN, 0, 2, "x"]),
    (("top_k",), [0, 5], [-1, 2.5, "5", 10**30]),
    (("max_tokens",), [1, 3, 10**9, 1e10], [0, -5, "2", NAN, INF, 2.5, {}]),
]
MESSAGES_FIELDS = SAMPLING + [
    (("model",), ["anything", None], [5, {}, SURROGATE]),
    (("messages",), [[{"role": "user", "content": "x"}]], ["hi", [], [5], [{"role": "wizard", "content": "x"}],
                                                          {"role": "user"}]),
    (("messages", 0, "content"), ["x", [{"type": "text", "text": "x"}]],
     [5, {"text": "x"}, [{"text": "x"}], [{"type": "text", "text": 5}], [{"type": "image", "source": {}}],
      [{"type": "document", "source": {}}], SURROGATE, [{"type": "text", "text": SURROGATE}]]),
    (("messages", 0, "content"), [[{"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}],
                                  [{"type": "text", "text": "x",
                                    "cache_control": {"type": "ephemeral", "ttl": "1h"}}]],
     [[{"type": "text", "text": "x", "cache_control": "yes"}],
      [{"type": "text", "text": "x", "cache_control": {"type": "forever"}}],
      [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral", "ttl": 5}}]]),
    (("system",), ["be brief", [{"type": "text", "text": "a"}, {"type": "text", "text": "b",
                                                               "cache_control": {"type": "ephemeral"}}]],
     [5, {"text": "x"}, [{"type": "image"}], [{"type": "text", "text": None}], SURROGATE]),
    (("stop_sequences",), [["\n"], []], [5, [5], [""], ["x"] * 17]),
    (("stream",), [False], ["yes", 1]),
    (("metadata",), [{"user_id": "u-1"}, {}], ["u-1", {"user_id": 5}]),
    (("thinking",), [{"type": "adaptive"}, {"type": "adaptive", "display": "omitted"},
                     {"type": "enabled", "budget_tokens": 1024}, {"type": "disabled"}],
     ["on", {"type": "deep"}, {"type": "enabled", "budget_tokens": "lots"}, {"type": "enabled", "budget_tokens": -1}]),
    (("context_management",), [{"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}, {}],
     ["clear", {"edits": "all"}, {"edits": [5]}]),
    (("output_config",), [{"effort": "high"}, {}, {"format": {"type": "json_schema", "schema": {"type": "object"}}}],
     ["high", {"effort": 5}, {"format": {"type": "xml"}}, {"format": {"type": "json_schema", "schema": {"not": {}}}}]),
    (("cache_control",), [{"type": "ephemeral"}, {"type": "ephemeral", "ttl": "5m"}],
     ["ephemeral", {"type": "ephemeral", "ttl": "1d"}]),
    (("service_tier",), ["auto"], [5]),
    (("tools",), [[WEATHER], [{**WEATHER, "defer_loading": True}],
                  [{**WEATHER, "cache_control": {"type": "ephemeral"}}], []],
     ["get_weather", [5], [{"description": "no name"}], [{**WEATHER, "input_schema": "object"}],
      [{**WEATHER, "defer_loading": "yes"}], [{"type": "web_search_20250305", "name": "web_search"}],
      [{**WEATHER, "description": 5}], [{**WEATHER, "name": SURROGATE}]]),
    (("tool_choice",), [{"type": "auto"}, {"type": "any"}, {"type": "none"}],
     ["auto", {"type": "sometimes"}, {"type": "tool"}, {"type": "tool", "name": "not_a_tool"}]),
    (("session_id",), ["s-1"], [5, "", "x" * 300]),
]
TOOL_TURN_FIELDS = [
    (("messages", 1, "content", 1, "input"), [{}, {"city": "Rome"}], ["Paris", [1], 5]),
    (("messages", 1, "content", 1, "name"), ["other"], [5, "", None]),
    (("messages", 1, "content", 1, "id"), ["toolu_x"], [5, {}]),
    (("messages", 2, "content", 0, "tool_use_id"), ["toolu_1"], [5, None]),
    (("messages", 2, "content", 0, "content"), ["ok", [{"type": "text", "text": "ok"}], None],
     [5, [{"type": "image", "source": {}}], [{"type": "text", "text": 5}]]),
    (("messages", 0, "content"), ["weather?"], [[{"type": "tool_use", "id": "t", "name": "x", "input": {}}]]),
    (("messages", 1, "content", 1, "type"), ["tool_use"], ["tool_result", "server_tool_use"]),
]
COUNT_FIELDS = [f for f in MESSAGES_FIELDS if f[0][0] not in ("max_tokens", "stream", "temperature", "top_p",
                                                              "top_k", "stop_sequences", "session_id")]
OPENAI_COMMON = SAMPLING + [
    (("min_p",), [0.1], [-0.1, 2, "x", NAN]),
    (("seed",), [0, 7, 2**64 - 1], [-1, 2**64, 10**30, "7", 1.5]),
    (("stop",), ["\n", ["\n", "x"]], [5, [5], [""], ["x"] * 17]),
    (("n",), [1], [2, "1", 0]),
    (("stream",), [False], ["yes", 1]),
    (("stream_options",), [{"include_usage": True}], ["yes", {"include_usage": "yes"}]),
    (("model",), ["anything", None], [5, SURROGATE]),
    (("spec",), ["off", "auto"], ["fast", 5]),
    (("guided_choice",), [["yes", "no"]], ["yes", [], [""], [5]]),
    (("session_id",), ["s-1"], [5, ""]),
]
CHAT_FIELDS = OPENAI_COMMON + [
    (("max_completion_tokens",), [2], [0, "2", NAN]),
    (("messages",), [[{"role": "developer", "content": "x"}, {"role": "user", "content": "y"}],
                     [{"role": "user", "content": [{"type": "text", "text": "x"}]}]],
     ["hi", [], [5], [{"role": "wizard", "content": "x"}]]),
    (("messages", 0, "content"), ["x", [{"type": "text", "text": "x"}]],
     [5, {"x": 1}, [{"type": "image_url", "image_url": {"url": "x"}}], [5], SURROGATE]),
    (("logprobs",), [True, False], ["yes", 1]),
    (("top_logprobs",), [], [0, 3]),  # without logprobs: true
    (("tools",), [[{"type": "function", "function": {"name": "f"}}]],
     ["f", [5], [{"type": "function"}], [{"type": "retrieval", "function": {"name": "f"}}],
      [{"type": "function", "function": {"name": 5}}]]),
    (("tool_choice",), ["auto", "none"], [5, "sometimes", "required",  # without tools: nothing to call
                                          {"type": "function", "function": {"name": "f"}}]),
    (("response_format",), [{"type": "text"}, {"type": "json_object"},
                            {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object"}}}],
     ["json", {"type": "xml"}, {"type": "json_schema"}, {"type": "json_schema", "json_schema": {"schema": 5}},
      {"type": "json_schema", "json_schema": {"name": "s", "schema": {"if": {}, "then": {}}}}]),
    (("reasoning_effort",), ["none", "low", "high"], ["extreme", 5]),
    (("chat_template_kwargs",), [{"enable_thinking": False}, {}], ["x", {"not a name": 1}]),
]
CHAT_TOOL_FIELDS = [
    (("messages", 1, "tool_calls"), [[{"id": "c1", "type": "function", "function": {"name": "g", "arguments": "{}"}}]],
     ["call", [5], [{"function": {"name": 5}}], [{"function": {"name": "g", "arguments": "not json"}}],
      [{"function": {"name": "g", "arguments": 5}}], [{"function": {"name": "g", "arguments": "[1, 2]"}}]]),
    (("messages", 2, "tool_call_id"), ["c1"], [5, {}]),
    (("messages", 2, "content"), ["22 C"], [5, SURROGATE]),
]
COMPLETION_FIELDS = OPENAI_COMMON + [
    (("prompt",), ["x", ["x"], [1, 2, 3]], [5, {}, [], [1, "x"], ["a", "b"], SURROGATE, [-1], [10**12]]),
    (("logprobs",), [0, 2], [-1, 21, "2", True]),
    (("echo",), [False], [True, "yes"]),
    (("suffix",), [None], ["tail", 5]),
]
ROUTES = [
    ("/v1/messages", MESSAGES, MESSAGES_FIELDS),
    ("/v1/messages", TOOL_TURNS, TOOL_TURN_FIELDS),
    ("/v1/messages/count_tokens", {k: v for k, v in MESSAGES.items() if k != "max_tokens"}, COUNT_FIELDS),
    ("/v1/chat/completions", CHAT, CHAT_FIELDS),
    ("/v1/chat/completions", CHAT_TOOLS, CHAT_TOOL_FIELDS),
    ("/v1/chat/completions", {**CHAT, "logprobs": True}, [(("top_logprobs",), [0, 3], [-1, 21, "3", NAN])]),
    ("/v1/completions", COMPLETION, COMPLETION_FIELDS),
]


@pytest.fixture(scope="module")
def served(tiny_qwen3):
    from mlxkv.engine.cache.prefix_cache import PrefixCache

    cache = PrefixCache(ram_bytes=64 << 20, cache_dir=None, block_tokens=16)
    engine = Engine(str(tiny_qwen3), prefix_cache=cache).start(timeout=T)
    try:
        with LoopbackServer(engine, ServerConfig(defaults=SamplingParams(max_tokens=2),
                                                 max_tokens_limit=4)) as srv:
            yield srv
    finally:
        engine.shutdown()


def with_value(base: dict, path: tuple, value: Any) -> dict:
    body = copy.deepcopy(base)
    holder = body
    for key in path[:-1]:
        holder = holder[key]
    holder[path[-1]] = value
    return body


def post(url: str, body: dict) -> Any:
    # json.dumps spells NaN and infinities as the bare words Python's json reads back;
    # a lone surrogate as its \\ud800 escape
    return httpx.post(url, content=json.dumps(body), headers={"content-type": "application/json"}, timeout=T)


def field_name(path: tuple) -> str:
    out = ""
    for key in path:
        out += f"[{key}]" if isinstance(key, int) else (f".{key}" if out else key)
    return out


@pytest.mark.parametrize("route,base,fields", ROUTES, ids=[f"{r}:{i}" for i, (r, _, _) in enumerate(ROUTES)])
def test_every_field_valid_or_a_400_that_names_it(served, route, base, fields):
    url = served.url + route
    assert post(url, base).status_code == 200
    failures = []
    for path, good, bad in fields:
        name = field_name(path)
        for value in good:
            r = post(url, with_value(base, path, value))
            if r.status_code != 200:
                failures.append(f"{name}={value!r}: {r.status_code} {r.text[:200]}")
        for value in bad:
            r = post(url, with_value(base, path, value))
            is_json = r.headers.get("content-type", "").startswith("application/json")
            error = r.json().get("error", {}) if is_json else {}
            # a block's type is wrong: the block is named
            said = name.removesuffix(".type") if path[-1] == "type" else name
            named = said in (error.get("param") or "") or said in (error.get("message") or "")
            if r.status_code != 400 or not named:
                failures.append(f"{name}={value!r}: {r.status_code} {r.text[:200]}")
    assert not failures, "\n".join(failures)
    assert post(url, base).status_code == 200  # and the server goes on


def test_a_lone_surrogate_anywhere_is_a_400_that_says_where(served):
    body = with_value(TOOL_TURNS, ("messages", 1, "content", 1, "input", "city"), "\udc00")
    r = post(served.url + "/v1/messages", body)
    assert r.status_code == 400, r.text
    assert "messages[1].content[1].input.city" in r.json()["error"]["message"]
    r = post(served.url + "/v1/chat/completions", {**CHAT, "metadata": {"\ud800key": 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "metadata.\\ud800key"
    # a pair of surrogates is one character, and fine
    assert post(served.url + "/v1/chat/completions", with_value(CHAT, ("messages", 0, "content"),
                                                                "\ud83d\ude00")).status_code == 200


def test_numbers_json_has_not_utf_16_and_syntax_errors_are_400s_that_say_where():
    """Python's parser takes NaN, Infinity, 1e999 and UTF-16 bodies; JSON has none of them,
    and a reply could not write such a number back. A syntax error names the field whose
    value it is in."""
    from mlxkv.server.errors import ApiError
    from mlxkv.server.fields import parse_body

    def refused(raw: bytes) -> ApiError:
        with pytest.raises(ApiError) as e:
            parse_body(raw)
        assert e.value.status == 400
        return e.value

    e = refused(b'{"tools": [{"parameters": {"maximum": 1e999}}]}')
    assert e.param == "tools[0].parameters.maximum" and "1e999 is not a number JSON has" in e.message
    assert refused(b'{"temperature": NaN}').param == "temperature"
    assert refused(b'{"a": {"b": -Infinity}}').param == "a.b"
    e = refused(b'{"model": "m", "max_tokens": 0x10, "stream": true}')
    assert e.param == "max_tokens" and "not valid JSON (in max_tokens)" in e.message
    # the path of the value it is in, past strings holding the structure's own characters
    e = refused(b'{"messages": [{"role": "user", "content": "a, {b]\\" x"}, 00]}')
    assert e.param == "messages[1]" and "(in messages[1])" in e.message
    assert "not UTF-8" in refused(json.dumps({"model": "m"}).encode("utf-16")).message
    assert parse_body(b'{"top_p": 1e308, "x": [0.5]}') == {"top_p": 1e308, "x": [0.5]}  # finite: kept
