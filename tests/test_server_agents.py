"""`mlxkv serve` as agents use it, through the real `anthropic` and `openai` clients against a
real server on a loopback port, on tiny models: a request shaped as Claude Code sends it,
``system`` entries inside ``messages`` (rendered in place, or merged where the template
refuses them), the churn rules that let a new conversation reuse the last one's prompt, the
``count_tokens`` equal to the prefill,
``max_tokens`` clamped with a header, the requested model echoed, keep-alive pings while a
request waits, and honest cache usage on every route."""

from __future__ import annotations

import json
import threading
from typing import Any

import anthropic
import openai
import pytest
from common import T
from server_support import WEATHER_TOOL, LoopbackServer, prompt_size, system_first_model

from bench.server import http_client
from mlxkv.engine.engine import Engine
from mlxkv.engine.generate import SamplingParams
from mlxkv.server.chat_prompt import place_system_entries
from mlxkv.server.churn import normalise
from mlxkv.server.context import ServerConfig
from mlxkv.server.keepalive import PROGRESS_EVERY

httpx = http_client()
BLOCK = 16
STATIC = ("You are an agent working with the user toward their goals. Use the tools to read and "
          "change files; keep replies short. ") * 12
REMINDER = "<system-reminder>\nThe git status: clean.\n</system-reminder>"
ENVIRONMENT = "# Environment\n - Primary working directory: /tmp/project\n - Platform: linux"
BETAS = ["claude-code-20250219", "interleaved-thinking-2025-05-14", "context-management-2025-06-27"]
WEATHER = {"name": "get_weather", "description": WEATHER_TOOL["function"]["description"],
           "input_schema": WEATHER_TOOL["function"]["parameters"]}


def billing(suffix: str) -> str:
    return f"x-anthropic-billing-header: cc_version=2.1.332.{suffix}; cc_entrypoint=sdk-cli;"


def claude_code_body(prompt: str, suffix: str = "1c9", tools: bool = True) -> dict[str, Any]:
    """A Messages body as Claude Code 2.1 sends it (abridged): three system blocks, the
    first its billing line; the user's turn with reminders before the prompt; a system entry
    after it; tools, one deferred; and the fields it always sends."""
    body: dict[str, Any] = {
        "model": "claude-sonnet-4-6", "max_tokens": 32000,
        "system": [{"type": "text", "text": billing(suffix)},
                   {"type": "text", "text": "You are a Claude agent.", "cache_control": {"type": "ephemeral"}},
                   {"type": "text", "text": "\n" + STATIC, "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": REMINDER}, {"type": "text", "text": prompt}]},
            {"role": "system", "content": [{"type": "text", "text": ENVIRONMENT,
                                            "cache_control": {"type": "ephemeral"}}]}],
        "metadata": {"user_id": json.dumps({"device_id": "d", "session_id": "s"})},
        "thinking": {"type": "adaptive", "display": "omitted"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "cache_control": {"type": "ephemeral"},
    }
    if tools:
        body["tools"] = [WEATHER, {"name": "DeferredToolPlaceholder", "description": "never call",
                                   "input_schema": {"type": "object", "properties": {}}, "defer_loading": True}]
    return body


@pytest.fixture(scope="module")
def engine(tiny_qwen3):
    from mlxkv.engine.cache.prefix_cache import PrefixCache

    cache = PrefixCache(ram_bytes=64 << 20, cache_dir=None, block_tokens=BLOCK)
    with Engine(str(tiny_qwen3), prefix_cache=cache).start(timeout=T) as e:
        yield e


@pytest.fixture(scope="module")
def served(engine):
    config = ServerConfig(defaults=SamplingParams(max_tokens=4), max_tokens_limit=6)
    with LoopbackServer(engine, config) as srv:
        yield srv


def claude_of(srv: LoopbackServer, **kw: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.url, api_key="none", max_retries=0, timeout=T, **kw)


def post(srv: LoopbackServer, path: str, body: dict, headers: dict | None = None) -> Any:
    return httpx.post(srv.url + path, json=body, headers=headers or {}, timeout=T)


# ------------------------------------------------------------------ Claude Code's request
def test_a_claude_code_request_is_served_stream_and_not(served):
    claude = claude_of(served)
    body = claude_code_body("Say hello.")
    extra = {k: body[k] for k in ("context_management", "output_config", "cache_control", "thinking")}
    ask = dict(model=body["model"], max_tokens=body["max_tokens"], system=body["system"],
               messages=body["messages"], tools=body["tools"], metadata=body["metadata"],
               betas=BETAS, extra_body=extra, extra_query={"beta": "true"})  # as Claude Code sends it
    raw = claude.beta.messages.with_raw_response.create(**ask)
    assert raw.http_request.url.params.get("beta") == "true"
    assert raw.headers["x-mlxkv-max-tokens"] == "requested 32000, clamped to 6"
    m = raw.parse()
    assert m.model == "claude-sonnet-4-6" and m.stop_reason in ("max_tokens", "end_turn", "tool_use")
    counted = claude.beta.messages.count_tokens(**{k: v for k, v in ask.items() if k not in ("max_tokens", "metadata")})
    assert prompt_size(m.usage) == counted.input_tokens
    with claude.beta.messages.stream(**ask) as s:
        final = s.get_final_message()
    assert final.model == "claude-sonnet-4-6" and prompt_size(final.usage) == counted.input_tokens
    assert final.usage.cache_read_input_tokens == counted.input_tokens - 1  # the same prompt again


def test_a_system_entry_after_the_question_goes_in_front_of_it(served, engine):
    """Claude Code's environment entry, after the user's question, goes into the question's
    turn, in front of its text, even where the template renders system turns: the prompt
    ends on the user's words and the generation prompt."""
    claude = claude_of(served)
    body = claude_code_body("Say hello.", tools=False)
    counted = claude.messages.count_tokens(model="m", system=body["system"], messages=body["messages"]).input_tokens
    system = normalise(billing("1c9") + "You are a Claude agent.\n" + STATIC)
    expected = [{"role": "system", "content": system},
                {"role": "user", "content": ENVIRONMENT + "\n\n" + REMINDER + "Say hello."}]
    tokens = engine.encode_chat(expected, T)
    assert counted == len(tokens)
    prompt = engine.decode(tokens, T)
    assert prompt.endswith("Say hello.<|im_end|>\n<|im_start|>assistant\n"), prompt[-200:]


def test_system_entries_merge_into_the_adjacent_user_turn_where_the_template_refuses_them():
    with Engine(str(system_first_model())).start(timeout=T) as engine, \
            LoopbackServer(engine, ServerConfig(defaults=SamplingParams(max_tokens=2))) as srv:
        claude = claude_of(srv)
        messages = [{"role": "system", "content": "first"},
                    {"role": "user", "content": "question"},
                    {"role": "system", "content": [{"type": "text", "text": ENVIRONMENT}]},
                    {"role": "assistant", "content": "answer"},
                    {"role": "system", "content": "before the next"},
                    {"role": "user", "content": "again"}]
        counted = claude.messages.count_tokens(model="m", system="top", messages=messages).input_tokens
        merged = [{"role": "system", "content": "top\n\nfirst"},
                  {"role": "user", "content": ENVIRONMENT + "\n\nquestion"},
                  {"role": "assistant", "content": "answer"},
                  {"role": "user", "content": "before the next\n\nagain"}]
        assert counted == len(engine.encode_chat(merged, T))
        m = claude.messages.create(model="m", max_tokens=2, system="top", messages=messages)
        assert prompt_size(m.usage) == counted
        # the OpenAI route takes system messages anywhere too
        oai = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=T)
        r = oai.chat.completions.create(model="m", max_tokens=2, messages=[
            {"role": "user", "content": "question"}, {"role": "developer", "content": ENVIRONMENT}])
        assert r.usage.prompt_tokens == len(engine.encode_chat(
            [{"role": "user", "content": ENVIRONMENT + "\n\nquestion"}], T))
        # what the template still refuses (two user turns in a row) is a 400 that says so
        with pytest.raises(anthropic.BadRequestError, match="chat template refused the messages"):
            claude.messages.create(model="m", max_tokens=2, messages=[
                {"role": "user", "content": "x"}, {"role": "user", "content": "y"}])


def test_place_system_entries_rules():
    u, a, s = ({"role": r, "content": r[0]} for r in ("user", "assistant", "system"))
    # right after a user turn: in front of its text, whatever the template takes
    assert place_system_entries([s, u, s], True) == [s, {"role": "user", "content": "s\n\nu"}]
    assert place_system_entries([s, u, s, a, u], True) == [s, {"role": "user", "content": "s\n\nu"}, a, u]
    assert place_system_entries([s, u, a, s, u], True) == [s, u, a, s, u]  # the template takes them
    assert place_system_entries([s, s, u], False) == [{"role": "system", "content": "s\n\ns"}, u]
    assert place_system_entries([u, s, s, a], False) == [{"role": "user", "content": "s\n\ns\n\nu"}, a]
    assert place_system_entries([u, a, s, u], False) == [u, a, {"role": "user", "content": "s\n\nu"}]
    assert place_system_entries([u, a, s], False) == [u, a, {"role": "user", "content": "s"}]
    assert place_system_entries([s, u, a], False) == [s, u, a]


# ----------------------------------------------------------------------------- churn
def test_churn_rules_remove_the_billing_line_and_nothing_else():
    line = billing("4f2")
    assert normalise(line + "You are a Claude agent.") == "You are a Claude agent."
    assert normalise(line + "\nNext line") == "Next line"
    later = "x-anthropic-billing-header: cc_version=2.1.400.a0; cc_entrypoint=cli; cch=00000;"
    assert normalise(f"head\n{later}\ntail") == "head\ntail"
    for text in ("x-anthropic-billing-header is a header Claude Code sends", "cc_version=2; cc_entrypoint=cli;",
                 "no churn here"):
        assert normalise(text) == text


def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _conversation_pair(srv: LoopbackServer, engine: Engine, suffixes: tuple[str, str]) -> tuple[int, int]:
    """Two new conversations that differ in the billing line's suffix and the prompt: (the
    second's cached tokens, the longest common token prefix of the two prompts once the
    billing line is left out)."""
    claude = claude_of(srv)
    prompts = (f"Summarise README.md ({suffixes[0]}).", f"List the tests ({suffixes[1]}).")
    usages = []
    for prompt, suffix in zip(prompts, suffixes):
        body = claude_code_body(prompt, suffix)
        usages.append(claude.messages.create(model="m", max_tokens=1, system=body["system"],
                                             messages=body["messages"], tools=body["tools"]).usage)
    ideal = [engine.encode_chat(_normalised_prompt(p), T) for p in prompts]
    return usages[1].cache_read_input_tokens, _lcp(*ideal)


def _normalised_prompt(prompt: str) -> list[dict[str, Any]]:
    """The second conversation's prompt as the rules leave it, written out by hand: no
    billing line, the tool list in the default format (the tiny model's template has none),
    the environment entry in front of the user's text."""
    from mlxkv.server.tool_prompt import tools_text

    tools = [{"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                               "parameters": WEATHER["input_schema"]}}]
    return [{"role": "system", "content": "You are a Claude agent.\n" + STATIC + "\n\n" + tools_text(tools)},
            {"role": "user", "content": ENVIRONMENT + "\n\n" + REMINDER + prompt}]


def test_a_new_conversation_reuses_the_prompt_it_shares_with_the_last(served, engine):
    cached, ideal = _conversation_pair(served, engine, ("a1b", "c2d"))
    assert ideal > 200  # the system prompt and tools: hundreds of tokens in common
    assert ideal - BLOCK < cached <= ideal, (cached, ideal)


def test_without_the_churn_rules_a_new_conversation_misses_at_the_billing_line(engine):
    with LoopbackServer(engine, ServerConfig(defaults=SamplingParams(max_tokens=2), churn_rules=False)) as srv:
        cached, ideal = _conversation_pair(srv, engine, ("e3f", "0a9"))
    assert cached < 3 * BLOCK < ideal, (cached, ideal)


# ------------------------------------------------------------------- count_tokens = prefill
@pytest.mark.parametrize("tools", [False, True])
def test_count_tokens_is_the_prompt_the_engine_prefills(served, tools):
    claude = claude_of(served)
    body = claude_code_body("Count me.", tools=tools)
    ask = {k: body[k] for k in ("system", "messages") + (("tools",) if tools else ())}
    counted = claude.messages.count_tokens(model="m", **ask).input_tokens
    m = claude.messages.create(model="m", max_tokens=1, **ask)
    assert prompt_size(m.usage) == counted


# ------------------------------------------------------------------- max_tokens, model
def test_max_tokens_is_clamped_with_a_header_and_the_model_echoed_on_every_route(served):
    cases = [("/v1/messages", {"model": "claude-x", "max_tokens": 32000,
                               "messages": [{"role": "user", "content": "hi"}]}),
             ("/v1/chat/completions", {"model": "gpt-x", "max_completion_tokens": 32000,
                                       "messages": [{"role": "user", "content": "hi"}]}),
             ("/v1/completions", {"model": "text-x", "max_tokens": 32000, "prompt": "hi"})]
    for path, body in cases:
        for stream in (False, True):
            with httpx.stream("POST", served.url + path, json={**body, "stream": stream}, timeout=T) as r:
                assert r.status_code == 200 and r.headers["x-mlxkv-max-tokens"] == "requested 32000, clamped to 6"
                text = r.read().decode()
            assert f'"model":"{body["model"]}"' in text, (path, stream, text[:300])
        r = post(served, path, {**body, "max_tokens": 3, "max_completion_tokens": None})
        assert "x-mlxkv-max-tokens" not in r.headers


# ----------------------------------------------------------------------------- pings
class RecordingTransport(httpx.HTTPTransport):
    """An HTTP transport that keeps the bytes the server sends, for the test to read what
    came in the stream besides what the client made of it."""

    def __init__(self, marker: bytes):
        super().__init__()
        self.marker = marker
        self.received = b""

    @property
    def pings(self) -> int:
        return self.received.count(self.marker)

    def handle_request(self, request: Any) -> Any:
        response = super().handle_request(request)
        inner, recorder = response.stream, self

        class Recorded(httpx.SyncByteStream):
            def __iter__(self):
                for chunk in inner:
                    recorder.received += chunk
                    yield chunk

            def close(self) -> None:
                inner.close()
        response.stream = Recorded()
        return response


def _wait_for(predicate: Any, what: str) -> None:
    import time

    deadline = time.monotonic() + T
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_queued_stream_gets_pings_and_the_clients_still_parse_it(tiny_qwen3):
    """One decoding slot (max_batch 1): a second request waits in the queue while the first
    decodes; its stream starts anyway and sends pings until it is served. On the Messages
    route every 25th keep-alive in a row is an empty text delta (in a text block it opens),
    which Claude Code counts as progress where it stops counting pings."""
    with Engine(str(tiny_qwen3), max_batch=1).start(timeout=T) as engine, \
            LoopbackServer(engine, ServerConfig(ping_interval_s=0.05)) as srv:
        oai = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=T)
        reference = claude_of(srv).messages.create(model="m", max_tokens=5, messages=[
            {"role": "user", "content": "hello"}], extra_body={"temperature": 0}).content[0].text
        for route in ("anthropic", "openai"):
            blocker = oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "one"}],
                                                  max_tokens=20000, stream=True)
            next(iter(blocker))  # decoding: the next request waits
            if route == "anthropic":
                transport = RecordingTransport(b"event: ping")
                client: Any = claude_of(srv, http_client=httpx.Client(transport=transport))
            else:
                transport = RecordingTransport(b": ping")
                client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=T,
                                       http_client=httpx.Client(transport=transport))
            out: dict[str, Any] = {}

            def ask(client: Any = client, route: str = route, out: dict = out) -> None:
                if route == "anthropic":
                    with client.messages.stream(model="m", max_tokens=5, messages=[
                            {"role": "user", "content": "hello"}], extra_body={"temperature": 0}) as s:
                        events = list(s)
                        final = s.get_final_message()
                    out["text"] = final.content[0].text
                    # the stream started before the prompt was taken: message_start knew no
                    # usage yet, message_delta has it whole
                    start = next(e for e in events if e.type == "message_start").message.usage
                    out["usage"] = (prompt_size(start), prompt_size(final.usage))
                else:
                    chunks = client.chat.completions.create(
                        model="m", messages=[{"role": "user", "content": "hello"}], max_tokens=5, temperature=0,
                        stream=True, stream_options={"include_usage": True})
                    out["text"] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

            thread = threading.Thread(target=ask)
            thread.start()
            enough = PROGRESS_EVERY + 5 if route == "anthropic" else 3
            _wait_for(lambda transport=transport, n=enough: transport.pings >= n, f"{route}: too few pings")
            blocker.close()  # the slot frees; the waiting request is served
            thread.join(T)
            assert out.get("text") == reference, (route, out)
            if route == "openai":
                before = []
                for chunk in transport.received.decode().split("\n\n"):
                    if chunk.startswith("data: {") and any(c["delta"].get("content") for c in
                                                           json.loads(chunk[6:])["choices"]):
                        break
                    before.append(chunk)
                assert before.count(": ping") >= 3
                continue
            assert out["usage"][0] == 0 and out["usage"][1] > 0
            kinds = [json.loads(line[6:])["type"] for line in transport.received.decode().splitlines()
                     if line.startswith("data: ")]
            assert kinds[:PROGRESS_EVERY + 1] == ["message_start"] + ["ping"] * (PROGRESS_EVERY - 1) + [
                "content_block_start"]  # the 25th keep-alive opens the text block
            assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
            assert kinds.count("content_block_start") == 1  # the reply's text went into it


def test_a_long_prefill_streams_pings_before_the_first_token(tiny_qwen3):
    """Nothing queued: the prompt itself takes a while to prefill (thousands of tokens, in
    chunks of 256) and the stream pings meanwhile, after message_start."""
    with Engine(str(tiny_qwen3)).start(timeout=T) as engine, \
            LoopbackServer(engine, ServerConfig(ping_interval_s=0.005)) as srv:
        body = {"model": "m", "max_tokens": 2, "stream": True,
                "messages": [{"role": "user", "content": "import os, sys, json; " * 150}]}
        with httpx.stream("POST", srv.url + "/v1/messages", json=body, timeout=T) as r:
            events = [line.removeprefix("event: ") for line in r.iter_lines() if line.startswith("event: ")]
    assert events[0] == "message_start" and events[-1] == "message_stop"
    first_token = events.index("content_block_start")
    assert events[1:first_token].count("ping") >= 2, events[:first_token + 1]


# ------------------------------------------------------------------------ usage honesty
def test_usage_says_what_was_read_and_stored_on_every_route(served):
    claude = claude_of(served)
    ask = {"model": "m", "max_tokens": 2,
           "messages": [{"role": "user", "content": "Anthropic: are the counts honest?"}]}
    first = claude.messages.create(**ask).usage
    # what it did not read it stored (the start of the template may be cached already)
    assert first.input_tokens == 0 and first.cache_creation_input_tokens > prompt_size(first) // 2
    with claude.messages.stream(**ask) as s:
        events = list(s)
        final = s.get_final_message().usage
    start = next(e for e in events if e.type == "message_start").message.usage
    assert (start.cache_read_input_tokens, start.cache_creation_input_tokens) == (prompt_size(first) - 1, 1)
    assert (final.cache_read_input_tokens, final.cache_creation_input_tokens, final.input_tokens) == \
        (prompt_size(first) - 1, 1, 0)
    oai = openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=T)
    chat = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "Chat completions, counted?"}]}
    completion = {"model": "m", "max_tokens": 2, "prompt": "Plain completions count too"}
    for create, body in ((oai.chat.completions.create, chat), (oai.completions.create, completion)):
        cold = create(**body).usage
        assert cold.prompt_tokens_details.cached_tokens < cold.prompt_tokens // 2
        warm = create(**body).usage
        assert warm.prompt_tokens_details.cached_tokens == warm.prompt_tokens - 1
        streamed = [c for c in create(**body, stream=True, stream_options={"include_usage": True}) if c.usage]
        assert streamed[-1].usage.prompt_tokens_details.cached_tokens == warm.prompt_tokens - 1



# ------------------------------------------------------------------ cache diagnostics
def test_anthropic_cache_diagnostics_say_what_changed(served):
    """``diagnostics.previous_message_id`` (beta cache-diagnosis-2026-04-07): the reply's
    ``diagnostics.cache_miss_reason`` names what the request changed against the message it
    follows, with the input tokens that missed for it; null when it went on unchanged."""
    claude = claude_of(served)
    system = "You answer briefly. " * 20
    turn1 = [{"role": "user", "content": "First question about the weather in Paris?"}]
    first = claude.messages.create(model="m", max_tokens=4, system=system, messages=turn1)
    assert first.diagnostics is None  # only when asked (the SDK knows the field)

    def ask(**kw):
        body = dict(model="m", max_tokens=4, system=system, tools=[WEATHER],
                    messages=turn1 + [{"role": "assistant", "content": first.content[0].text or "ok"},
                                      {"role": "user", "content": "And tomorrow?"}])
        body.update(kw)
        previous = body.pop("previous", first.id)
        return claude.messages.create(**body, extra_body={"diagnostics": {"previous_message_id": previous}},
                                      extra_headers={"anthropic-beta": "cache-diagnosis-2026-04-07"})

    second = claude.messages.create(model="m", max_tokens=4, system=system, tools=[WEATHER], messages=turn1)
    same = ask(previous=second.id).model_dump()["diagnostics"]
    assert same == {"cache_miss_reason": None}
    changed = ask(previous=second.id, system="Another system prompt entirely. " * 20).model_dump()["diagnostics"]
    assert changed["cache_miss_reason"]["type"] == "system_changed"
    assert changed["cache_miss_reason"]["cache_missed_input_tokens"] > 0
    assert ask(previous=second.id, tools=[]).model_dump()["diagnostics"]["cache_miss_reason"]["type"] == "tools_changed"
    assert ask(previous=second.id, model="other").model_dump()["diagnostics"]["cache_miss_reason"]["type"] == \
        "model_changed"
    assert ask(previous="msg_unknown").model_dump()["diagnostics"]["cache_miss_reason"]["type"] == \
        "previous_message_not_found"
    # streamed: on message_start
    with claude.messages.stream(model="m", max_tokens=4, system="Changed. " * 20, tools=[WEATHER], messages=turn1,
                                extra_body={"diagnostics": {"previous_message_id": second.id}}) as s:
        start = next(e for e in s if e.type == "message_start")
        s.get_final_message()
    assert start.message.model_dump()["diagnostics"]["cache_miss_reason"]["type"] == "system_changed"
    with pytest.raises(anthropic.BadRequestError, match="diagnostics.previous_message_id"):
        claude.messages.create(model="m", max_tokens=4, messages=turn1, extra_body={"diagnostics": {}})


# ------------------------------------------------------------------ no max_tokens
def test_without_max_tokens_a_reply_runs_to_the_end_of_the_context(tiny_qwen3):
    """aider sends no max_tokens and expects the model's end of turn: `mlxkv serve` lets such
    a reply run to the end of the context (within --max-tokens-limit), not to a default 512;
    `--max-tokens N` sets a default instead."""
    from mlxkv.cli.common import sampling_params
    from mlxkv.engine.settings import Settings
    from mlxkv.server.run import config_from_settings

    settings = Settings.load({"model": str(tiny_qwen3), "context_tokens": 900, "prefix_cache": False}, env={})
    config = config_from_settings(settings, sampling_params(settings))
    assert config.open_ended
    capped = Settings.load({"model": str(tiny_qwen3), "max_tokens": 8}, env={})
    assert not config_from_settings(capped, sampling_params(capped)).open_ended
    with Engine.from_settings(settings).start(timeout=T) as engine, LoopbackServer(engine, config) as srv:
        oai = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=T)
        r = oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "Tell me a long story."}],
                                        temperature=0)
        used = r.usage.prompt_tokens + r.usage.completion_tokens
        assert r.usage.completion_tokens > 512 and (r.choices[0].finish_reason == "stop" or used == 900), r.usage
        text = oai.completions.create(model="m", prompt="Once upon a time", temperature=0)
        assert text.usage.completion_tokens > 512, text.usage
