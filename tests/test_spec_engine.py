"""Speculation through the engine and the CLI: the per-request figures in StatsEvent.spec,
log-probabilities in TokenEvents, guided_choice with and without speculation, the draft
model's KV stored with the conversation and restored from the SSD tier by a new engine
(no draft prefill, same output as a cold run), and `mlxkv generate --json` / the trace."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from common import T

from mlxkv.engine.engine import Engine, Request, TokenEvent
from mlxkv.engine.generate import SamplingParams
from mlxkv.engine.settings import Settings
from support.modelgen import tiny_model

ROOT = Path(__file__).resolve().parent.parent


def settings(tmp_path: Path, **values) -> Settings:
    base = {"model": str(tiny_model("llama")), "cache_dir": str(tmp_path / "cache"), "block_tokens": 16,
            "ram_cache_bytes": 256 << 20}
    return Settings.load({**base, **values}, env={})


def run(engine: Engine, request: Request):
    handle = engine.submit(request)
    events = list(handle.events(timeout=T))
    return handle.result(timeout=T), events


CONVERSATION = [{"role": "user", "content": "def area(r):\n    return 3.14 * r * r\n" * 3}]


def test_stats_logprobs_and_guided_choice(tmp_path):
    with Engine.from_settings(settings(tmp_path, spec="ngram", prefix_cache=False)).start(timeout=T) as engine:
        params = SamplingParams(max_tokens=24)
        spec, events = run(engine, Request(messages=CONVERSATION, params=params, logprobs=2))
        plain, plain_events = run(engine, Request(messages=CONVERSATION, params=params, logprobs=2, spec="off"))
        assert spec.tokens == plain.tokens
        assert spec.stats.spec["source"] == "ngram" and spec.stats.spec["target_forwards"] > 0
        assert plain.stats.spec is None
        got = [(e.token, e.logprob, [t for t, _ in e.top_logprobs]) for e in events
               if isinstance(e, TokenEvent) and e.token is not None]
        want = [(e.token, e.logprob, [t for t, _ in e.top_logprobs]) for e in plain_events
                if isinstance(e, TokenEvent) and e.token is not None]
        assert [g[0] for g in got] == [w[0] for w in want] and [g[2] for g in got] == [w[2] for w in want]
        assert all(abs(g[1] - w[1]) < 1e-4 and g[1] <= 0 for g, w in zip(got, want))
        assert all(e.logprob is None for e in plain_events if isinstance(e, TokenEvent) and e.token is None)
        choices = ("the quick brown fox jumps over the lazy dog", "no", "maybe later")
        guided, _ = run(engine, Request(prompt="Answer:", params=SamplingParams(max_tokens=64),
                                        guided_choice=choices))
        unguided_spec, _ = run(engine, Request(prompt="Answer:", params=SamplingParams(max_tokens=64),
                                               guided_choice=choices, spec="off"))
        assert guided.text in choices and guided.text == unguided_spec.text
        assert guided.stats.spec["source"] == "constraint"
        figures = engine.stats()["spec"]
        assert figures["ngram"]["requests"] == 1 and figures["constraint"]["requests"] == 1
        if guided.text == choices[0]:
            assert guided.stats.spec["target_forwards"] < len(guided.tokens)


def test_draft_state_comes_back_from_ssd_in_a_new_engine(tmp_path):
    draft = str(tiny_model("qwen3"))
    s = settings(tmp_path, draft_model=draft, spec="draft")
    params = SamplingParams(max_tokens=16)
    with Engine.from_settings(s).start(timeout=T) as engine:
        first, _ = run(engine, Request(messages=CONVERSATION, params=params, session="c1"))
        assert first.stats.spec["source"] == "draft" and first.stats.spec["restored_draft_tokens"] == 0
        engine.cache_flush(timeout=T)
        # The draft's state is listed as such beside its conversation (the inspector shows it).
        kinds = sorted(e.kind for e in engine.cache_entries())
        assert kinds == ["conversation", "draft"]
    turn2 = CONVERSATION + [{"role": "assistant", "content": first.text},
                            {"role": "user", "content": "and the perimeter?"}]
    with Engine.from_settings(s).start(timeout=T) as engine:  # nothing in RAM: SSD only
        second, _ = run(engine, Request(messages=turn2, params=params, session="c1"))
    with Engine.from_settings(settings(tmp_path / "cold", prefix_cache=False, spec="off")).start(timeout=T) as cold:
        want, _ = run(cold, Request(messages=turn2, params=params))
    assert second.tokens == want.tokens
    assert second.stats.cached_ssd_tokens > 0
    assert second.stats.spec["restored_draft_tokens"] >= 16  # the draft was not prefilled again


def test_generate_json_reports_spec_and_trace_prints_rounds(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "XDG_CONFIG_HOME": str(tmp_path / "cfg"), "MLXKV_SPEC_TRACE": "1"}
    env.pop("MLXKV_CONFIG", None)
    r = subprocess.run([sys.executable, "-m", "mlxkv", "generate", "--json", "-p", "a b c a b c a b",
                        "--model", str(tiny_model("llama")), "--spec", "ngram", "--max-tokens", "12",
                        "--no-ssd-cache"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=T)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["spec"]["source"] == "ngram" and out["stats"]["spec"] == out["spec"]
    assert {"drafted", "accepted", "acceptance_by_position", "tokens_per_forward", "draft_s", "verify_s",
            "other_s"} <= set(out["spec"])
    assert "mlxkv spec batch: " in r.stderr  # a lone request is a batch of one


def test_bad_spec_values_are_refused(tmp_path):
    with pytest.raises(ValueError, match="spec must be one of"):
        Request(prompt="x", spec="sometimes")
    with pytest.raises(ValueError, match="spec"):
        settings(tmp_path, spec="always")


def test_a_json_skeleton_drafts_through_the_engine_and_never_changes_the_output(tmp_path):
    with Engine.from_settings(settings(tmp_path, prefix_cache=False)).start(timeout=T) as engine:
        params = SamplingParams(max_tokens=32)
        plain, _ = run(engine, Request(prompt="Person:", params=params, spec="off"))
        # A random model does not write JSON: open the skeleton with the text it writes
        # first, so the rest of the opening part is drafted after its first token.
        first = engine.decode(plain.tokens[:1])
        skeleton = (first + '"name": "', '", "age": ', "}")
        drafted, _ = run(engine, Request(prompt="Person:", params=params, json_skeleton=skeleton))
        assert drafted.tokens == plain.tokens
        assert drafted.stats.spec["source"] == "constraint" and drafted.stats.spec["drafted"] > 0
    with pytest.raises(ValueError, match="json_skeleton"):
        Request(prompt="x", json_skeleton=("",))
    with pytest.raises(ValueError, match="not both"):
        Request(prompt="x", json_skeleton=("{",), guided_choice=("a",))
