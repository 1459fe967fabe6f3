"""Cache scopes on the real engine (a tiny random-weight qwen3, a real cache folder): the
states of one scope are found by its requests only, and a scoped request's output teaches
no speculation source that drafts for others, nor does it draft from theirs."""

from __future__ import annotations

import pytest
from common import T

from mlxkv.engine.cache.info import scope_base, scoped_namespace
from mlxkv.engine.engine import Engine, Request
from mlxkv.engine.generate import SamplingParams
from mlxkv.engine.settings import Settings
from support.modelgen import tiny_model

PROMPT = [{"role": "user", "content": "A conversation long enough to fill several cache blocks: " + "word " * 80}]


@pytest.fixture
def engine(tmp_path):
    settings = Settings.load({"model": str(tiny_model("qwen3")), "cache_dir": str(tmp_path / "cache"),
                              "block_tokens": 16, "ram_cache_bytes": 256 << 20, "spec": "suffix"}, env={})
    eng = Engine.from_settings(settings).start(timeout=T)
    yield eng
    eng.shutdown(timeout=T)


def ask(engine: Engine, scope: str | None, max_tokens: int = 6):
    handle = engine.submit(Request(messages=PROMPT, params=SamplingParams(max_tokens=max_tokens, temperature=0),
                                   cache_scope=scope))
    result = handle.result(timeout=T)
    engine.sync(T)  # the state is stored after the answer
    return handle.stats, result


def test_a_scope_finds_its_own_states_only(engine):
    first, _ = ask(engine, "alice")
    assert first.cached_tokens == 0
    again, _ = ask(engine, "alice")
    assert again.cached_tokens > 64
    for other in ("bob", None):
        stats, _ = ask(engine, other)
        assert stats.cached_tokens == 0  # neither another scope nor the model's own namespace
    spaces = {e.ns for e in engine.cache_entries()}
    own = engine.namespace
    assert spaces == {own, scoped_namespace(own, "alice"), scoped_namespace(own, "bob")}
    assert {scope_base(ns) for ns in spaces} == {own}


def test_a_scoped_output_teaches_no_shared_source(engine):
    suffix = engine.spec_providers["suffix"]
    before = suffix.learned_tokens
    ask(engine, "alice")
    assert suffix.learned_tokens == before  # alice's reply is not drafted for anyone else
    ask(engine, None)
    assert suffix.learned_tokens > before  # an unscoped reply is, as before


def test_a_scope_must_be_a_non_empty_string():
    with pytest.raises(ValueError, match="cache_scope"):
        Request(messages=PROMPT, cache_scope="")
    assert scoped_namespace("m", None) == "m" and scope_base(scoped_namespace("m", "x")) == "m"
