"""Grammar-constrained decoding (``Request.grammar``, llguidance) on the real model through
the engine: sampled replies are valid against their JSON schema every time; a Lark grammar
with a tool-call wrapper gives exactly that shape; greedy output is the same with and
without speculation, and the grammar's forced tokens are drafted and accepted; batched
constrained rows are valid and answer as alone; a grammar that does not compile is a
clear error, before and after submitting. The constraint keeps its matcher in step when
asked about shorter outputs (the verifier's walk), and its mask is its allowed set."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from common import T, greedy

from mlxkv.engine.engine import Engine, EngineError, Request
from mlxkv.engine.generate import SamplingParams
from mlxkv.engine.settings import Settings
from mlxkv.engine.speculation.grammar import GrammarConstraint, check_grammar, json_grammar
from support.real_model import real_model_path
from tests.test_batch import held

REAL = real_model_path()
pytestmark = pytest.mark.skipif(REAL is None, reason="the real model is not fetched: run `make fixtures`")

# JSON written as json.dumps writes it: what is not the model's choice is forced.
WHITESPACE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 16},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7},
                   "units": {"enum": ["celsius", "fahrenheit"]},
                   "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2}},
    "required": ["city", "days", "units"],
    "additionalProperties": False,
    "x-guidance": WHITESPACE,
}
ASK = [{"role": "user", "content": "What is the weather in Paris for the next 3 days? Answer in JSON."}]


def weather_valid(value) -> bool:
    """``value`` satisfies WEATHER (checked by hand: jsonschema is not a dependency)."""
    if not isinstance(value, dict) or not {"city", "days", "units"} <= set(value) <= set(WEATHER["properties"]):
        return False
    tags = value.get("tags", [])
    return (isinstance(value["city"], str) and len(value["city"]) <= 16
            and type(value["days"]) is int and 1 <= value["days"] <= 7
            and value["units"] in ("celsius", "fahrenheit")
            and isinstance(tags, list) and len(tags) <= 2
            and all(isinstance(t, str) and len(t) <= 8 for t in tags))


@pytest.fixture(scope="module")
def engine():
    settings = Settings.load({"model": str(REAL), "prefix_cache": False, "max_batch": 4}, env={})
    with Engine.from_settings(settings).start(timeout=T) as e:
        yield e


@pytest.fixture(scope="module")
def tokenizer(engine):
    return engine.call(lambda: engine.loaded.tokenizer).result(T)


def test_sampled_replies_are_valid_against_the_schema_every_time(engine):
    grammar = json_grammar(WEATHER)
    for seed in range(4):
        params = SamplingParams(max_tokens=96, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, seed=seed)
        r = engine.submit(Request(messages=ASK, params=params, grammar=grammar,
                                  spec="off" if seed % 2 else None)).result(timeout=T)
        assert r.finish_detail == "eos", r.text
        assert weather_valid(json.loads(r.text)), r.text


def test_a_lark_tool_call_wrapper_gives_exactly_that_shape(engine):
    grammar = 'start: "<tool_call>\\n" %json ' + json.dumps(WEATHER) + ' "\\n</tool_call>"'
    r = engine.submit(Request(messages=ASK, params=greedy(max_tokens=96), grammar=grammar)).result(timeout=T)
    m = re.fullmatch(r"<tool_call>\n(.*)\n</tool_call>", r.text, re.S)
    assert m and r.finish_detail == "eos", r.text
    assert weather_valid(json.loads(m.group(1)))


def test_greedy_is_lossless_and_the_forced_tokens_are_drafted(engine):
    grammar = json_grammar(WEATHER)
    plain = engine.submit(Request(messages=ASK, params=greedy(max_tokens=96), grammar=grammar,
                                  spec="off")).result(timeout=T)
    spec = engine.submit(Request(messages=ASK, params=greedy(max_tokens=96), grammar=grammar)).result(timeout=T)
    assert spec.tokens == plain.tokens and weather_valid(json.loads(spec.text))
    figures = spec.stats.spec
    assert plain.stats.spec is None and figures["source"] == "constraint"
    # '{"city": "', '", "days": ', ... are proposed whole: far fewer forwards than tokens.
    assert figures["accepted"] >= len(spec.tokens) // 3
    assert figures["target_forwards"] < len(spec.tokens) * 2 // 3


def test_batched_constrained_rows_are_valid_and_answer_as_alone(engine):
    lark = 'start: "<tool_call>\\n" %json ' + json.dumps(WEATHER) + ' "\\n</tool_call>"'
    reqs = [Request(messages=ASK, params=greedy(max_tokens=96), grammar=json_grammar(WEATHER)),
            Request(messages=[{"role": "user", "content": "Name a colour."}], params=greedy(max_tokens=12)),
            Request(messages=ASK, params=greedy(max_tokens=96), grammar=lark)]
    with held(engine):
        handles = [engine.submit(r) for r in reqs]
    got = [h.result(timeout=T) for h in handles]
    assert all(r.stats.batched for r in got)
    # The constrained rows drafted their forced tokens inside the batch.
    assert all(got[i].stats.spec["source"] == "constraint" and got[i].stats.spec["accepted"] > 0 for i in (0, 2))
    assert weather_valid(json.loads(got[0].text))
    inner = re.fullmatch(r"<tool_call>\n(.*)\n</tool_call>", got[2].text, re.S)
    assert inner and weather_valid(json.loads(inner.group(1)))
    # The batch lives until its loop finds it empty: a request sent on the last row's final
    # event could still join it. sync() returns once the batch has ended.
    engine.sync(timeout=T)
    for req, r in zip(reqs, got):
        alone = engine.submit(Request(messages=req.messages, params=req.params, grammar=req.grammar,
                                      spec="off")).result(timeout=T)
        assert r.tokens == alone.tokens and not alone.stats.batched


def test_a_grammar_that_does_not_compile_is_a_clear_error(engine, tokenizer):
    with pytest.raises(ValueError, match=r"Unimplemented keys: \[\"not\"\]"):
        check_grammar(None, json_grammar({"not": {"type": "string"}}))
    with pytest.raises(ValueError, match="unknown name"):
        check_grammar(tokenizer, "start: value")
    check_grammar(None, json_grammar(WEATHER))
    check_grammar(tokenizer, json_grammar(WEATHER))
    with pytest.raises(ValueError, match="grammar must be a non-empty string"):
        Request(prompt="x", grammar=" ")
    with pytest.raises(ValueError, match="one of guided_choice, json_skeleton, grammar"):
        Request(prompt="x", grammar=json_grammar(WEATHER), guided_choice=("a",))
    bad = Request(prompt="x", params=greedy(max_tokens=4), grammar=json_grammar({"uniqueItems": True}))
    with pytest.raises(EngineError, match=r"grammar: .*Unimplemented keys: \[\"uniqueItems\"\]"):
        engine.submit(bad).result(timeout=T)


def test_the_matcher_follows_shorter_outputs_and_the_mask_is_the_allowed_set(tokenizer):
    value = {"city": "Paris", "days": 3, "units": "celsius"}
    tokens = list(tokenizer.encode(json.dumps(value), add_special_tokens=False))
    eos = min(tokenizer.eos_token_ids)
    walked = GrammarConstraint(tokenizer, json_grammar(WEATHER), vocab=49216)
    # Ask about every prefix out of order (forward, back, forward again), as verify windows do.
    order = list(range(len(tokens) + 1)) + [3, 1, len(tokens), 0, 5, len(tokens)]
    for n in order:
        fresh = GrammarConstraint(tokenizer, json_grammar(WEATHER))
        allowed = walked.allowed(tokens[:n])
        assert allowed == fresh.allowed(tokens[:n])
        assert (eos in allowed) == (n == len(tokens)) == walked.done(tokens[:n])
        row = np.array(walked.mask(tokens[:n], 49216))
        assert row.shape == (49216,) and np.flatnonzero(row == 0).tolist() == allowed
        assert np.all(row[49152:] == -np.inf)
    assert walked.forced(tokens) == [eos]
    assert walked.done(tokens + [5])  # off the grammar: nothing but the end
    # What is forced is allowed token after token, and some spans are several tokens long.
    longest = 0
    for n in range(len(tokens)):
        forced = walked.forced(tokens[:n])
        assert all(t in walked.allowed(tokens[:n] + forced[:j]) for j, t in enumerate(forced))
        longest = max(longest, len(forced))
    assert tokenizer.decode(walked.forced([])).startswith('{"') and longest >= 2
