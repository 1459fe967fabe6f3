"""`mlxkv serve` through the real `openai` and `anthropic` clients, against a real server on
a loopback port (uvicorn in a thread) in front of a real engine on a tiny random model."""

from __future__ import annotations

import json
import threading

import anthropic
import openai
import pytest
from common import T
from server_support import LoopbackServer, prompt_size

from bench.server import http_client
from mlxkv.engine.engine import Engine
from mlxkv.engine.generate import SamplingParams
from mlxkv.server.context import ServerConfig

httpx = http_client()
KEY = "test-key-123"
BODY_LIMIT = 256 * 1024


@pytest.fixture(scope="module")
def served(tiny_qwen3, tmp_path_factory):
    from mlxkv.engine.cache.prefix_cache import PrefixCache

    cache = PrefixCache(ram_bytes=64 << 20, cache_dir=str(tmp_path_factory.mktemp("cache")),
                        block_tokens=16)
    engine = Engine(str(tiny_qwen3), prefix_cache=cache).start(timeout=T)
    config = ServerConfig(api_key=KEY, max_body_bytes=BODY_LIMIT, max_requests=64,
                          defaults=SamplingParams(max_tokens=16))
    try:
        with LoopbackServer(engine, config) as srv:
            yield srv
    finally:
        engine.shutdown()


@pytest.fixture
def oai(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key=KEY, max_retries=0, timeout=T)


@pytest.fixture
def claude(served):
    return anthropic.Anthropic(base_url=served.url, api_key=KEY, max_retries=0, timeout=T)


def chat(oai, content, **kw):
    return oai.chat.completions.create(model="any", messages=[{"role": "user", "content": content}],
                                       temperature=0, **kw)


def test_models_and_health(served, oai):
    assert [m.id for m in oai.models.list().data] == [served.ctx.model_id]
    assert httpx.get(served.url + "/health", timeout=T).json()["status"] == "ok"  # no key needed


def test_chat_stream_and_not_give_the_same_greedy_reply_with_usage(oai):
    r = chat(oai, "def main(): return", max_tokens=12)
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens > 0
    assert r.usage.prompt_tokens_details.cached_tokens is not None
    assert r.model_extra["timings"]["ttft_s"] > 0  # the engine's own figures, an extension
    chunks = list(chat(oai, "def main(): return", max_tokens=12, stream=True,
                       stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == 12
    # the same prompt again: all but its last token comes from the prefix cache
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1


def test_completions_stream_and_not(oai):
    r = oai.completions.create(model="any", prompt="import os\nimport", max_tokens=8, temperature=0)
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 8
    assert r.usage.prompt_tokens_details.cached_tokens is not None
    text = "".join(c.choices[0].text for c in oai.completions.create(
        model="any", prompt="import os\nimport", max_tokens=8, temperature=0, stream=True) if c.choices)
    assert text == r.choices[0].text


def test_messages_stream_and_not(claude):
    m = claude.messages.create(model="any", max_tokens=10, system="Be brief.",
                               messages=[{"role": "user", "content": "def main(): return"}])
    assert m.role == "assistant" and m.stop_reason == "max_tokens" and m.usage.output_tokens == 10
    assert m.content[0].type == "text"
    with claude.messages.stream(model="any", max_tokens=10, system="Be brief.",
                                messages=[{"role": "user", "content": "def main(): return"}]) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == m.content[0].text and final.stop_reason == "max_tokens"
    # the repeated prompt is read from the cache, and the counts add up to the prompt
    assert final.usage.cache_read_input_tokens > 0
    assert prompt_size(final.usage) == prompt_size(m.usage)


def test_count_tokens_is_the_prompt_a_messages_request_sends(claude, served):
    body = dict(model="any", system="Be brief.",
                messages=[{"role": "user", "content": "count these tokens, please"}])
    counted = claude.messages.count_tokens(**body).input_tokens
    m = claude.messages.create(max_tokens=2, **body)
    assert counted == prompt_size(m.usage) > 0
    r = httpx.post(served.url + "/v1/messages/count_tokens", headers={"x-api-key": KEY},
                   json={"model": "any", "messages": []}, timeout=T)
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert "messages" in r.json()["error"]["message"]


def test_cached_tokens_grow_across_turns(oai):
    messages = [{"role": "system", "content": "You answer questions about Python code. " * 8}]
    cached = []
    for turn in range(3):
        messages.append({"role": "user", "content": f"turn {turn}: what does os.path.join do?"})
        r = oai.chat.completions.create(model="any", messages=messages, max_tokens=6, temperature=0,
                                        extra_headers={"x-session-id": "conv-1"})
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
    assert cached[0] < cached[1] < cached[2], cached


def test_stop_strings(oai, claude):
    full = oai.completions.create(model="any", prompt="class A:\n    def", max_tokens=16,
                                  temperature=0).choices[0].text
    stop = full[3:6]
    expected = full[:full.index(stop)]
    r = oai.completions.create(model="any", prompt="class A:\n    def", max_tokens=16, temperature=0,
                               stop=[stop])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (expected, "stop")
    ask = {"model": "any", "max_tokens": 16, "messages": [{"role": "user", "content": "class A:"}]}
    full = claude.messages.create(**ask).content[0].text
    stop = full[3:6]
    m = claude.messages.create(**ask, stop_sequences=[stop])
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", stop)
    assert "".join(b.text for b in m.content) == full[:full.index(stop)]


def test_a_client_that_goes_away_mid_stream_cancels_its_request(served, oai):
    gate = served.ctx.gate
    before = gate.cancelled
    body = {"model": "any", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 20000,
            "temperature": 0, "stream": True}
    with httpx.Client(timeout=T) as client:
        with client.stream("POST", served.url + "/v1/chat/completions", json=body,
                           headers={"authorization": f"Bearer {KEY}"}) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: ") for line in got)
        # the connection is closed here, long before 20000 tokens
    assert gate.wait_idle(T)
    assert gate.cancelled == before + 1
    reason, generated = gate.recent[-1]
    assert reason == "cancelled" and generated < 20000
    assert chat(oai, "still there?", max_tokens=3).choices[0].finish_reason == "length"


def test_bad_input_gets_json_4xx_in_each_api_shape_and_the_server_goes_on(served, oai, claude):
    url = served.url
    auth = {"authorization": f"Bearer {KEY}"}
    cases = [
        ("/v1/chat/completions", b"{not json", 400, None),
        ("/v1/chat/completions", json.dumps([1, 2]).encode(), 400, None),
        ("/v1/chat/completions", json.dumps({"messages": "hi"}).encode(), 400, "messages"),
        ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x"}],
                                             "max_tokens": "5"}).encode(), 400, "max_tokens"),
        ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x"}],
                                             "temperature": "hot"}).encode(), 400, "temperature"),
        ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x"}],
                                             "n": 2}).encode(), 400, "n"),
        ("/v1/chat/completions", json.dumps({"messages": [{"role": "wizard", "content": "x"}]}).encode(),
         400, "messages[0].role"),
        ("/v1/completions", json.dumps({"prompt": {"a": 1}}).encode(), 400, "prompt"),
        ("/v1/completions", json.dumps({"prompt": "x", "stream": "yes"}).encode(), 400, "stream"),
    ]
    for path, raw, status, param in cases:
        r = httpx.post(url + path, content=raw, headers=auth, timeout=T)
        assert r.status_code == status, (path, raw, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["message"], r.text
        assert err["param"] == param, (raw, err)
    # Anthropic route: its own error shape
    r = httpx.post(url + "/v1/messages", content=b'{"messages": 5, "max_tokens": 5}', headers=auth, timeout=T)
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError, match="max_tokens is required"):
        httpx_claude = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0)
        httpx_claude.post("/v1/messages", body={"model": "x", "messages": [{"role": "user", "content": "x"}]},
                          cast_to=object)
    # through the clients
    with pytest.raises(openai.BadRequestError, match="must be an integer"):
        chat(oai, "x", max_tokens="many")
    with pytest.raises(openai.BadRequestError, match="n must be 1"):
        chat(oai, "x", n=3)
    with pytest.raises(openai.APIStatusError) as big:
        chat(oai, "x" * (BODY_LIMIT + 10))
    assert big.value.status_code == 413 and "limit" in big.value.message
    # a body far over the limit, declared or chunked: the client reads the 413, it does not
    # meet a connection closed under its upload
    huge = b"x" * (40 * BODY_LIMIT)
    r = httpx.post(url + "/v1/chat/completions", content=huge, headers={**auth, "content-type": "application/json"},
                   timeout=T)
    assert r.status_code == 413 and f"{len(huge)} bytes" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/chat/completions", content=iter([huge[:BODY_LIMIT]] * 40), headers=auth, timeout=T)
    assert r.status_code == 413 and "over the limit" in r.json()["error"]["message"]
    # unknown route, wrong method: JSON too
    r = httpx.get(url + "/v1/nothing", headers=auth, timeout=T)
    assert r.status_code == 404 and r.json()["error"]["message"]
    r = httpx.get(url + "/v1/chat/completions", headers=auth, timeout=T)
    assert r.status_code == 405 and r.json()["error"]["message"]
    assert chat(oai, "still serving?", max_tokens=2).usage.completion_tokens == 2


def test_a_prompt_longer_than_the_context_is_refused_with_the_engines_message(tmp_path):
    from support.modelgen import tiny_model

    with Engine(str(tiny_model("qwen3", max_position_embeddings=64))).start(timeout=T) as engine, \
            LoopbackServer(engine, ServerConfig()) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=T)
        with pytest.raises(openai.BadRequestError, match="the model's context is 64 tokens"):
            chat(client, "import os " * 80, max_tokens=4)
        # more than the server allows is clamped, and the reply says so
        raw = client.chat.completions.with_raw_response.create(
            model="asked-for", messages=[{"role": "user", "content": "x"}], max_tokens=65, temperature=0)
        assert raw.headers["x-mlxkv-max-tokens"] == "requested 65, clamped to 64"
        assert raw.parse().model == "asked-for" and raw.parse().choices[0].finish_reason == "length"
        claude = anthropic.Anthropic(base_url=srv.url, api_key="none", max_retries=0, timeout=T)
        with pytest.raises(anthropic.BadRequestError, match="context is 64 tokens"):
            claude.messages.create(model="x", max_tokens=4, messages=[{"role": "user", "content": "os " * 80}])
        assert chat(client, "hi", max_tokens=2).usage.completion_tokens == 2


def test_a_bad_or_missing_api_key_is_refused(served, oai):
    for client in (openai.OpenAI(base_url=served.url + "/v1", api_key="wrong", max_retries=0),):
        with pytest.raises(openai.AuthenticationError, match="invalid API key"):
            client.models.list()
    bad = anthropic.Anthropic(base_url=served.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model="x", max_tokens=2, messages=[{"role": "user", "content": "x"}])
    assert e.value.body["error"]["type"] == "authentication_error"
    r = httpx.post(served.url + "/v1/completions", json={"prompt": "x"}, timeout=T)
    assert r.status_code == 401 and "API key is required" in r.json()["error"]["message"]
    # x-api-key works on every route, as Bearer does
    r = httpx.get(served.url + "/v1/models", headers={"x-api-key": KEY}, timeout=T)
    assert r.status_code == 200
    assert chat(oai, "ok", max_tokens=1).usage.completion_tokens == 1


def test_stats_and_flush(served):
    auth = {"authorization": f"Bearer {KEY}"}
    s = httpx.get(served.url + "/stats", headers=auth, timeout=T).json()
    assert s["engine"]["requests"] > 0 and s["cache"]["enabled"] and "server" in s
    r = httpx.post(served.url + "/admin/cache/flush", headers=auth, timeout=T)
    assert r.status_code == 200 and r.json()["durable"] > 0 and r.json()["pending"] == 0


def test_flush_without_an_ssd_tier_is_503(tiny_qwen3):
    with Engine(str(tiny_qwen3)).start(timeout=T) as engine, LoopbackServer(engine, ServerConfig()) as srv:
        r = httpx.post(srv.url + "/admin/cache/flush", timeout=T)
        assert r.status_code == 503 and "not durable" in r.json()["error"]["message"]


def test_a_full_server_answers_429_and_serves_again(tiny_qwen3):
    with Engine(str(tiny_qwen3)).start(timeout=T) as engine, \
            LoopbackServer(engine, ServerConfig(max_requests=1)) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=T)
        stream = chat(client, "hello", max_tokens=20000, stream=True)
        next(iter(stream))  # the first request is in flight
        with pytest.raises(openai.RateLimitError) as e:
            chat(client, "me too", max_tokens=2)
        assert e.value.body["type"] == "rate_limit_error"
        stream.close()
        assert srv.ctx.gate.wait_idle(T)
        assert chat(client, "now", max_tokens=2).usage.completion_tokens == 2


def test_a_full_engine_queue_answers_429(tiny_qwen3):
    # the engine decodes one row and lets one request wait: a third is refused at once
    with Engine(str(tiny_qwen3), max_batch=1, max_queue=1).start(timeout=T) as engine, \
            LoopbackServer(engine, ServerConfig(max_requests=64)) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=T)
        decoding = chat(client, "one", max_tokens=20000, stream=True)
        next(iter(decoding))
        waiting: list = []
        thread = threading.Thread(target=lambda: waiting.append(chat(client, "two", max_tokens=2)))
        thread.start()
        assert srv.ctx.gate.wait_in_flight(2, T)
        with pytest.raises(openai.RateLimitError, match="queue is full"):
            chat(client, "three", max_tokens=2)
        decoding.close()
        thread.join(T)
        assert waiting[0].usage.completion_tokens == 2


def test_concurrent_greedy_replies_equal_each_served_alone(oai):
    prompts = [f"def f{i}(x): return x" + " +" * i for i in range(4)]
    alone = [chat(oai, p, max_tokens=10).choices[0].message.content for p in prompts]
    together: list = [None] * len(prompts)
    barrier = threading.Barrier(len(prompts))

    def run(i: int) -> None:
        barrier.wait(T)
        together[i] = chat(oai, prompts[i], max_tokens=10).choices[0].message.content
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(T)
    assert together == alone


def test_logprobs_chat_and_completions(oai):
    r = chat(oai, "import sys", max_tokens=6, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 6
    assert "".join(e.token for e in content) == r.choices[0].message.content
    for e in content:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0.0
        assert e.top_logprobs[0].token == e.token  # greedy: the chosen token is the likeliest
        assert abs(e.top_logprobs[0].logprob - e.logprob) < 1e-4
        assert bytes(e.bytes).decode() == e.token
    c = oai.completions.create(model="any", prompt="import sys", max_tokens=5, temperature=0, logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == c.choices[0].text and all(len(t) <= 2 for t in lp.top_logprobs)
    streamed = list(chat(oai, "import sys", max_tokens=6, logprobs=True, top_logprobs=1, stream=True))
    tokens = [e.token for c in streamed if c.choices and c.choices[0].logprobs
              for e in c.choices[0].logprobs.content]
    assert "".join(tokens) == r.choices[0].message.content


def test_cors_is_off_unless_asked_for(served):
    origin = {"origin": "http://app.example", "authorization": f"Bearer {KEY}"}
    r = httpx.get(served.url + "/v1/models", headers=origin, timeout=T)
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    config = ServerConfig(cors_origins=("http://app.example",))
    with LoopbackServer(served.engine, config) as srv:
        r = httpx.options(srv.url + "/v1/chat/completions", timeout=T, headers={
            "origin": "http://app.example", "access-control-request-method": "POST",
            "access-control-request-headers": "authorization, content-type"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example"
        r = httpx.options(srv.url + "/v1/chat/completions", timeout=T, headers={
            "origin": "http://evil.example", "access-control-request-method": "POST"})
        assert "access-control-allow-origin" not in r.headers


def test_guided_choice_and_spec_fields(oai):
    choices = ["the quick brown fox jumps over the lazy dog", "no"]
    reply = chat(oai, "Pick one.", max_tokens=40, extra_body={"guided_choice": choices})
    assert reply.choices[0].message.content in choices
    done = oai.completions.create(model="any", prompt="Answer:", max_tokens=40, temperature=0,
                                  extra_body={"guided_choice": choices, "spec": "off"})
    assert done.choices[0].text in choices
    for bad in ({"guided_choice": []}, {"guided_choice": "no"}, {"guided_choice": [""]},
                {"spec": "fast"}):
        with pytest.raises(openai.BadRequestError) as e:
            chat(oai, "Pick one.", max_tokens=4, extra_body=bad)
        assert e.value.status_code == 400 and next(iter(bad)) in str(e.value)
