"""Several models behind one `mlxkv serve`: the demo model and the real model (SmolLM2-135M's
GGUF) in one ``ModelPool``, through the real OpenAI and Anthropic clients on a loopback port;
loading on demand, the memory budget's LRU unload, pinning, idle unloads, and a reloaded
model's conversations restored from the SSD tier. Few requests, short replies."""

from __future__ import annotations

import re
import time

import anthropic
import openai
import pytest
from common import T
from server_support import LoopbackServer

from bench.server import http_client
from mlxkv.engine.generate import SamplingParams
from mlxkv.engine.pool import (
    ModelEntry,
    ModelPool,
    UnknownModel,
    check_entries,
    entries_from_config,
    entry_name,
    parse_cli_model,
)
from mlxkv.engine.settings import DEMO_MODEL, Settings, SettingsError
from mlxkv.server.context import ServerConfig
from support.real_model import real_model_path

REAL = real_model_path()
needs_real = pytest.mark.skipif(REAL is None, reason="the real model is not fetched: run `make fixtures`")
httpx = http_client()
CONFIG = ServerConfig(defaults=SamplingParams(max_tokens=6))
QUESTION = "What is the capital of France? Answer in one word, then explain at length why it is so."


def settings(tmp_path, **changes):
    return Settings.defaults(cache_dir=str(tmp_path / "cache"), ram_cache_bytes=64 << 20, block_tokens=16,
                             spec="off", **changes)


def entries(pin_demo=False):
    return [ModelEntry("demo", str(DEMO_MODEL), pin=pin_demo),
            ModelEntry("smol", str(REAL), aliases=("claude-*haiku*",))]


def ask(oai, model, content=QUESTION):
    return oai.chat.completions.create(model=model, messages=[{"role": "user", "content": content}],
                                       temperature=0, max_tokens=6)


def states(pool):
    return {m["name"]: m["state"] for m in pool.describe()}


# ------------------------------------------------------------------ names and config
def test_names_from_the_command_line_and_the_config_file(tmp_path):
    assert parse_cli_model("demo") == ModelEntry("demo", str(DEMO_MODEL))
    assert parse_cli_model("coder=ollama:qwen3:4b") == ModelEntry("coder", "ollama:qwen3:4b")
    assert parse_cli_model("mlx-community/Qwen3-4B-4bit").name == "mlx-community/Qwen3-4B-4bit"
    assert entry_name("/models/SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct.Q4_1"
    assert entry_name("ollama:qwen3:4b") == "ollama:qwen3:4b"
    got = entries_from_config([{"name": "small", "path": "demo", "aliases": ["haiku"], "pin": True,
                                "context_tokens": 4096, "draft_model": "/d"}])
    assert got == [ModelEntry("small", str(DEMO_MODEL), ("haiku",), True,
                              {"context_tokens": 4096, "draft_model": "/d"})]
    for bad, words in (([{"name": "x"}], "path"), ([{"path": "demo", "port": 1}], "unknown key(s) port"),
                       ([{"path": "demo", "pin": "yes"}], "pin"), ([{"path": "demo", "context_tokens": -1}],
                                                                  "models[0].context_tokens"), ("demo", "list")):
        with pytest.raises(SettingsError, match=re.escape(words)):
            entries_from_config(bad)
    with pytest.raises(SettingsError, match="given twice"):
        check_entries([ModelEntry("a", "x"), ModelEntry("b", "y", ("a",))], None)
    with pytest.raises(SettingsError, match="--default-model 'c' is not one of the models"):
        check_entries([ModelEntry("a", "x"), ModelEntry("b", "y")], "c")
    path = tmp_path / "config.toml"
    path.write_text('default_model = "small"\nmodels_memory_bytes = "2GiB"\n'
                    '[[models]]\nname = "small"\npath = "demo"\npin = true\n')
    s = Settings.load({}, env={}, config_path=path)
    assert (s.default_model, s.models_memory_bytes, s.models[0]["name"]) == ("small", 2 << 30, "small")
    path.write_text('[[models]]\nname = "small"\n')
    with pytest.raises(SettingsError, match="path"):
        Settings.load({}, env={}, config_path=path)


def test_one_model_answers_every_name_several_answer_theirs(tmp_path):
    one = ModelPool([ModelEntry("demo", str(DEMO_MODEL))], settings(tmp_path))
    assert one.resolve("gpt-4o").name == "demo" and one.resolve(None).name == "demo"
    two = ModelPool(entries(), settings(tmp_path))
    assert two.resolve("claude-haiku-4-5-20251001").name == "smol"  # an alias pattern
    assert two.resolve("").name == "demo"  # no name: the default, the first
    with pytest.raises(UnknownModel, match="the models are: demo, smol"):
        two.resolve("gpt-4o")
    anyone = ModelPool(entries(), settings(tmp_path), default="smol")
    assert anyone.resolve("gpt-4o").name == "smol"


# ------------------------------------------------------------------ two models served
@needs_real
def test_two_models_through_both_clients_interleaved_by_name(tmp_path):
    pool = ModelPool(entries(), settings(tmp_path))
    try:
        with LoopbackServer(pool, CONFIG) as srv:
            oai = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=T)
            claude = anthropic.Anthropic(base_url=srv.url, api_key="none", max_retries=0, timeout=T)
            listed = {m.id: m for m in oai.models.list().data}
            assert set(listed) == {"demo", "smol"} and not any(m.loaded for m in listed.values())
            assert listed["smol"].context_length == 8192  # from the GGUF header, before any load
            demo1 = ask(oai, "demo")
            assert states(pool) == {"demo": "ready", "smol": "unloaded"}  # loaded on demand
            smol1 = ask(oai, "smol")
            haiku = claude.messages.create(model="claude-haiku-4-5", max_tokens=6, extra_body={"temperature": 0},
                                           messages=[{"role": "user", "content": QUESTION}])
            demo2 = ask(oai, "demo")
            smol2 = ask(oai, "smol")
            # each name its own model: greedy, the same reply every time, and the two differ
            assert demo1.model == "demo" and haiku.model == "claude-haiku-4-5"
            assert demo1.choices[0].message.content == demo2.choices[0].message.content
            assert smol1.choices[0].message.content == smol2.choices[0].message.content
            assert smol1.choices[0].message.content != demo1.choices[0].message.content
            # the alias reached smol: its reply, its cache (the same prompt as smol1's)
            assert haiku.content[0].text == smol1.choices[0].message.content
            assert haiku.usage.cache_read_input_tokens > 0
            # the repeats came from each model's own cache
            assert demo2.usage.prompt_tokens_details.cached_tokens > 0
            assert smol2.usage.prompt_tokens_details.cached_tokens > 0
            with pytest.raises(openai.NotFoundError, match="the models are: demo, smol"):
                ask(oai, "gpt-4o")
            with pytest.raises(anthropic.NotFoundError, match="not served here"):
                claude.messages.create(model="gpt-4o", max_tokens=4, messages=[{"role": "user", "content": "x"}])
            stats = httpx.get(srv.url + "/stats", timeout=T).json()
            models = {m["name"]: m for m in stats["models"]}
            assert all(m["state"] == "ready" and m["leases"] == 0 and m["loads"] == 1 for m in models.values())
            assert models["smol"]["bytes_parts"]["weights"] > models["demo"]["bytes_parts"]["weights"] > 0
            smol_stats = httpx.get(srv.url + "/stats", params={"model": "smol"}, timeout=T).json()
            assert smol_stats["engine"]["model"]["model"] == str(REAL)
            assert httpx.get(srv.url + "/stats", params={"model": "nope"}, timeout=T).status_code == 404
    finally:
        pool.close()


@needs_real
def test_the_budget_unloads_the_least_recently_used_and_a_reload_restores_from_ssd(tmp_path):
    pool = ModelPool(entries(), settings(tmp_path))
    try:
        with LoopbackServer(pool, CONFIG) as srv:
            oai = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=T)
            first = ask(oai, "demo")
            ask(oai, "smol")
            sizes = {m["name"]: m["bytes"] for m in pool.describe()}
            pool.memory_bytes = max(sizes.values()) + min(sizes.values()) // 2  # fits one, not both
            assert pool.unload("smol", "test")
            ask(oai, "smol")  # demo, the least recently used, makes room
            assert states(pool) == {"demo": "unloaded", "smol": "ready"}
            again = ask(oai, "demo")  # smol goes; demo comes back with its conversation from the SSD tier
            assert states(pool) == {"demo": "ready", "smol": "unloaded"}
            assert again.choices[0].message.content == first.choices[0].message.content
            assert again.usage.prompt_tokens_details.cached_tokens > 0
            events = [(e["event"], e["model"]) for e in pool.events]
            assert ("unload", "demo") in events and events[-1] == ("load", "demo")
            assert all(e.get("flushed") is not None for e in pool.events if e["event"] == "unload")
    finally:
        pool.close()


@needs_real
def test_a_pinned_model_is_never_unloaded(tmp_path, caplog):
    pool = ModelPool(entries(pin_demo=True), settings(tmp_path), memory_bytes=1)  # fits nothing
    try:
        with pool.lease("demo"):
            pass
        with pool.lease("smol"):
            pass
        assert states(pool) == {"demo": "ready", "smol": "ready"}
        assert "loaded over the budget" in caplog.text
        assert not pool.unload("smol") or states(pool)["demo"] == "ready"
        with pool.lease("smol"):  # loaded again; demo stays
            assert states(pool)["demo"] == "ready"
    finally:
        pool.close()


def test_an_idle_model_is_unloaded_and_a_lease_holds_it(tmp_path):
    pool = ModelPool([ModelEntry("demo", str(DEMO_MODEL)), ModelEntry("again", str(DEMO_MODEL))],
                     settings(tmp_path), idle_s=0.3)
    try:
        lease = pool.lease("demo")
        time.sleep(1.0)
        assert states(pool)["demo"] == "ready"  # leased: not idle
        lease.release()
        deadline = time.monotonic() + T
        while states(pool)["demo"] != "unloaded" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert states(pool)["demo"] == "unloaded"
        assert [e["event"] for e in pool.events] == ["load", "unload"] and "idle" in pool.events[-1]["why"]
        with pool.lease("demo") as again:  # loaded again on demand
            assert again.engine.is_alive()
    finally:
        pool.close()


def test_a_model_that_fails_to_load_is_a_503_and_the_others_serve(tmp_path):
    pool = ModelPool([ModelEntry("demo", str(DEMO_MODEL)), ModelEntry("broken", str(tmp_path / "missing"))],
                     settings(tmp_path))
    try:
        with LoopbackServer(pool, CONFIG) as srv:
            oai = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=T)
            with pytest.raises(openai.InternalServerError, match="could not be loaded") as e:
                ask(oai, "broken")
            assert e.value.status_code == 503
            assert ask(oai, "demo").choices[0].message.content is not None
            assert states(pool) == {"demo": "ready", "broken": "failed"}
    finally:
        pool.close()


def test_serve_takes_several_models_on_the_command_line(tiny_qwen3, tmp_path):
    from bench.server import Served

    srv = Served("mlxkv", DEMO_MODEL, tmp_path, extra=("--model", f"qwen={tiny_qwen3}", "--model-idle-s", "600",
                                                       "--max-tokens", "4")).start(timeout=T)
    try:
        models = httpx.get(srv.url + "/v1/models", timeout=T).json()["data"]
        assert [(m["id"], m["loaded"]) for m in models] == [("demo", True), ("qwen", False)]
        body = {"model": "qwen", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}
        r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=T)
        assert r.status_code == 200 and r.json()["model"] == "qwen"
        r = httpx.post(srv.url + "/v1/chat/completions", json={**body, "model": "nope"}, timeout=T)
        assert r.status_code == 404 and "demo, qwen" in r.json()["error"]["message"]
    finally:
        srv.stop(timeout=T)
    assert srv.returncode == 0
    log = (tmp_path / "mlxkv.log").read_text()
    assert "2 models: demo (default), qwen" in log and "prefix cache flushed" in log and "Traceback" not in log
