"""The prefix cache as an agent sees it through `mlxkv serve`: the ``x-mlxkv-cache`` header
of every generation route and ``/stats``'s ``lookups`` say what matched and where a prompt
parted from the closest cached state; Anthropic ``cache_control`` and OpenAI
``prompt_cache_key`` become retention hints (malformed ones a 400 naming the field);
``/stats`` and ``/health`` answer during a long prefill. Real server on loopback, real
engine, real clients."""

from __future__ import annotations

import random
import threading
import time

import pytest
import test_server
from common import T
from server_support import LoopbackServer

from bench.server import http_client
from mlxkv.engine.engine import Engine
from mlxkv.engine.generate import SamplingParams
from mlxkv.engine.settings import Settings
from mlxkv.server.context import ServerConfig
from support.modelgen import tiny_model

httpx = http_client()
HEADER = "x-mlxkv-cache"
KEY = test_server.KEY
AUTH = {"x-api-key": KEY}
oai, claude = test_server.oai, test_server.claude  # the clients, of this module's ``served``
# a volatile first line that the churn rules do not know (they remove Claude Code's own)
SYSTEM = ("Workspace build {v}; entrypoint=cli;\n"
          "You are a careful assistant who answers questions about files in the project. "
          "Read the files before answering, and say which ones you read.")


def fields(header: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in header.split("; "))


@pytest.fixture(scope="module")
def served(tiny_qwen3):
    from mlxkv.engine.cache.prefix_cache import PrefixCache

    cache = PrefixCache(ram_bytes=64 << 20, cache_dir=None, block_tokens=16)
    engine = Engine(str(tiny_qwen3), prefix_cache=cache).start(timeout=T)
    config = ServerConfig(api_key=KEY, defaults=SamplingParams(max_tokens=4, temperature=0.0))
    try:
        with LoopbackServer(engine, config) as srv:
            yield srv
    finally:
        engine.shutdown()


def test_every_generation_route_says_what_its_lookup_matched(oai, claude):
    msgs = [{"role": "system", "content": SYSTEM.format(v="2.1.1")},
            {"role": "user", "content": "which files define the server?"}]
    r = oai.chat.completions.with_raw_response.create(model="m", messages=msgs, max_tokens=2)
    first = fields(r.headers[HEADER])
    assert first["outcome"] in ("cold", "diverged", "extends")
    total = int(first["matched"].split("/")[1])
    # the same conversation again: all but its last token cached, from RAM
    r = oai.chat.completions.with_raw_response.create(model="m", messages=msgs, max_tokens=2)
    again = fields(r.headers[HEADER])
    assert again == {"matched": f"{total - 1}/{total}", "tier": "ram", "outcome": "hit"}
    # a new conversation whose system prompt differs in the version only
    other = [{"role": "system", "content": SYSTEM.format(v="2.1.7")}, msgs[1]]
    with oai.chat.completions.with_streaming_response.create(
            model="m", messages=other, max_tokens=2, stream=True) as s:
        parted = fields(s.headers[HEADER])
        list(s.iter_lines())
    assert parted["outcome"] == "diverged" and parted["matched"].startswith(parted["diverged_at"] + "/")
    assert len(parted["entry"]) == 16 and parted["entry"].isascii()
    # completions and Messages, streamed and not, carry it too
    r = oai.completions.with_raw_response.create(model="m", prompt="the server reads", max_tokens=2)
    assert fields(r.headers[HEADER])["matched"].endswith("/" + str(r.parse().usage.prompt_tokens))
    m = claude.messages.with_raw_response.create(model="m", max_tokens=2, messages=[
        {"role": "user", "content": "which files define the server?"}])
    assert "matched=" in m.headers[HEADER]
    with claude.messages.with_streaming_response.create(model="m", max_tokens=2, stream=True,
                                                        messages=[{"role": "user", "content": "hi"}]) as s:
        assert "outcome=" in s.headers[HEADER]


def test_stats_shows_where_each_prompt_parted_from_the_cache(served, oai):
    msgs = [{"role": "system", "content": SYSTEM.format(v="3.0.41")},
            {"role": "user", "content": "list the tests"}]
    oai.chat.completions.create(model="m", messages=msgs, max_tokens=2)
    other = [{"role": "system", "content": SYSTEM.format(v="3.0.52")}, msgs[1]]
    r = oai.chat.completions.with_raw_response.create(model="m", messages=other, max_tokens=2)
    header = fields(r.headers[HEADER])
    lookups = httpx.get(served.url + "/stats", headers=AUTH, timeout=T).json()["lookups"]
    last = lookups[-1]
    assert last["outcome"] == "diverged" and str(last["diverged_at"]) == header["diverged_at"]
    assert last["entry"] == header["entry"] and last["entry_label"] == header["entry"][:12]
    # the excerpts on both sides of the point where they part: the same text before it,
    # then this prompt's version against the cached one's
    assert "build 3.0" in last["before"]
    assert "52" in last["prompt_after"][:4] and "41" in last["entry_after"][:4]
    assert last["prompt_after"] != last["entry_after"]
    assert max(len(last[k]) for k in ("before", "prompt_after", "entry_after")) <= 40


def test_cache_control_and_prompt_cache_key_keep_the_state(served, oai, claude):
    claude.messages.create(model="m", max_tokens=2, system=[
        {"type": "text", "text": "You answer in one word.",
         "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
        messages=[{"role": "user", "content": "colour of the sky at noon?"}])
    oai.chat.completions.create(model="m", max_tokens=2, prompt_cache_key="project-7",
                                messages=[{"role": "user", "content": "a short poem"}])
    kept = sorted(round(e.retained_s, -2) for e in served.engine.cache_entries(timeout=T)
                  if e.retained_s > 0)
    assert kept == [300.0, 3600.0]


@pytest.mark.parametrize("body, field", [
    ({"cache_control": {"type": "ephemeral", "ttl": "2h"}}, "cache_control.ttl"),
    ({"system": [{"type": "text", "text": "x", "cache_control": {"type": "persistent"}}]},
     "system[0].cache_control.type"),
    ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "x", "cache_control": "yes"}]}]}, "messages[0].content[0].cache_control"),
])
def test_a_malformed_cache_control_is_a_400_naming_it(served, body, field):
    full = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], **body}
    r = httpx.post(served.url + "/v1/messages", json=full, headers=AUTH, timeout=T)
    assert r.status_code == 400 and field in r.json()["error"]["message"]


@pytest.mark.parametrize("extra, field", [({"prompt_cache_key": 7}, "prompt_cache_key"),
                                          ({"prompt_cache_retention": "forever"},
                                           "prompt_cache_retention")])
def test_a_malformed_prompt_cache_key_is_a_400_naming_it(served, extra, field):
    body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], **extra}
    r = httpx.post(served.url + "/v1/chat/completions", json=body, headers=AUTH,
                   timeout=T)
    assert r.status_code == 400 and r.json()["error"]["param"] == field


# ------------------------------------------------------------------- during a prefill
# A 2,048-token pass of seconds (4.3 s here): the prompt's first token comes from that
# pass, so the request is in its prefill only while the pass runs.
SLOW = dict(hidden_size=192, intermediate_size=768, num_hidden_layers=6)


def test_stats_and_health_answer_during_a_long_prefill(tmp_path):
    settings = Settings.defaults(model=str(tiny_model("qwen3", **SLOW)), spec="off",
                                 cache_dir=str(tmp_path / "cache"), prefill_step_size=4096)
    rng = random.Random(8)
    prompt = [rng.randrange(3, 500) for _ in range(2048)]  # one chunk
    with Engine.from_settings(settings).start(timeout=T) as engine, \
            LoopbackServer(engine, ServerConfig()) as srv:
        started, ended = threading.Event(), threading.Event()
        body = {"model": "m", "prompt": prompt, "max_tokens": 1, "stream": True}

        def stream() -> None:
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=T) as r:
                started.set()  # the headers: the engine took the prompt, its prefill runs
                list(r.iter_lines())
            ended.set()
        t = threading.Thread(target=stream)
        t.start()
        assert started.wait(T)
        running, answered = [], 0
        deadline = time.monotonic() + 10
        while not running and time.monotonic() < deadline:
            s = httpx.get(srv.url + "/stats", timeout=5).json()  # well under a chunk's time
            running, answered = s["engine"]["running"], answered + 1
        health = httpx.get(srv.url + "/health", timeout=5).json()
        assert not ended.is_set(), "the prefill ended first: use a longer prompt"
        assert running[0]["phase"] == "prefill" and running[0]["prompt_tokens"] == len(prompt)
        assert s["engine"]["busy"] and s["engine"]["age_s"] >= 0 and s["server"]["in_flight"] == 1
        assert health["status"] == "ok" and health["busy"] is True and "as_of" in health
        t.join(T)
        assert ended.is_set()
