"""Speculative decoding is lossless: greedy output through the verifier equals plain
decoding token for token, for every source (prompt lookup, draft model, constraints), on
dense, hybrid (linear attention + attention) and sliding-window models; the stream ends
as plain decoding does (EOS, stop strings, max tokens) and leaves the cache holding
exactly the tokens it reports."""

from __future__ import annotations

import random

import pytest

from mlxkv.engine.generate import Generation, SamplingParams, cache_length
from mlxkv.engine.models import load_model
from mlxkv.engine.speculation.base import TargetView
from mlxkv.engine.speculation.constraints import ConstraintProvider, GuidedChoice, JsonSkeleton
from mlxkv.engine.speculation.draft import DraftMismatch, DraftModelProvider
from mlxkv.engine.speculation.ngram import NgramIndex, NgramProvider, NgramRowGroup
from mlxkv.engine.speculation.providers import Speculation
from support.modelgen import init_model, tiny_model

QWEN3_NEXT = {"model_type": "qwen3_next", "hidden_size": 64, "num_hidden_layers": 2,
              "intermediate_size": 128, "num_attention_heads": 4, "linear_num_value_heads": 2,
              "linear_num_key_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
              "linear_conv_kernel_dim": 4, "num_experts": 4, "num_experts_per_tok": 2,
              "decoder_sparse_step": 1, "shared_expert_intermediate_size": 64,
              "mlp_only_layers": [0, 1], "moe_intermediate_size": 64, "rms_norm_eps": 1e-6,
              "num_key_value_heads": 2, "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
              "max_position_embeddings": 4096, "head_dim": 16, "full_attention_interval": 2}
GEMMA3 = {"model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": 2,
          "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 16,
          "sliding_window_pattern": 2, "max_position_embeddings": 4096}
N_PROMPTS = 50


@pytest.fixture(scope="module")
def dense():
    return load_model(str(tiny_model("llama")))


@pytest.fixture(scope="module")
def draft(dense):
    """A different random model with the same tokenizer (many rejections)."""
    return DraftModelProvider(load_model(str(tiny_model("qwen3"))), dense)


@pytest.fixture(scope="module")
def self_draft(dense):
    """The target as its own draft: greedy drafts are always right (long accepted runs)."""
    return DraftModelProvider(dense, dense)


def _model(dense, config: dict):
    vocab = dense.model.args.vocab_size
    return init_model({**config, "vocab_size": vocab}, seed=4)


def prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Token prompts with repeats (so prompt lookup finds matches) of varied lengths."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        base = [rng.randrange(3, vocab) for _ in range(rng.randrange(3, 12))]
        out.append((base * rng.randrange(1, 4) + [rng.randrange(3, vocab) for _ in range(i % 5)])[:40])
    return out


def plain(model, tok, prompt, params, **kw) -> Generation:
    gen = Generation(model, tok, prompt, params, **kw)
    list(gen)
    return gen


def speculative(model, tok, prompt, params, provider, constraint=None, spec_tokens=6) -> Generation:
    spec = Speculation(provider, TargetView(model, tok), params, mode="ngram", constraint=constraint,
                       max_tokens=spec_tokens)
    gen = Generation(model, tok, prompt, params, speculation=spec, constraint=constraint)
    list(gen)
    return gen


def check_same(model, tok, providers: dict, params, prompt_list) -> dict:
    """Every prompt through plain decoding once, then through each source: same tokens, same
    text, same ending, and a cache that holds exactly the tokens reported. Returns
    (drafted, accepted) per source."""
    totals = {name: [0, 0] for name in providers}
    for i, prompt in enumerate(prompt_list):
        want = plain(model, tok, prompt, params)
        for name, provider in providers.items():
            if isinstance(provider, list):  # alternate between providers of one kind
                provider = provider[i % len(provider)]
            got = speculative(model, tok, prompt, params, provider)
            assert got.outcome.tokens == want.outcome.tokens, (name, prompt)
            assert got.outcome.finish_reason == want.outcome.finish_reason
            assert got.outcome.text == want.outcome.text
            length = cache_length(got.cache)
            assert length is None or length == len(got.outcome.tokens_in_cache)
            totals[name][0] += got.outcome.spec["drafted"]
            totals[name][1] += got.outcome.spec["accepted"]
    return totals


GREEDY = SamplingParams(max_tokens=24)


def test_lossless_dense(dense, draft, self_draft):
    totals = check_same(dense.model, dense.tokenizer, {"ngram": NgramProvider(1, 3), "draft": [draft, self_draft]},
                        GREEDY, prompts(N_PROMPTS, dense.model.args.vocab_size))
    (nd, na), (dd, da) = totals["ngram"], totals["draft"]
    assert na > 50 and nd > na  # it speculated, and was sometimes wrong
    assert da > 300 and dd > da  # long accepted runs (self draft) and rejections (other draft)


def test_lossless_hybrid(dense, draft, self_draft):
    # Linear-attention layers cannot be trimmed: they roll back by snapshot and replay.
    hybrid = _model(dense, QWEN3_NEXT)
    totals = check_same(hybrid, dense.tokenizer, {"ngram": NgramProvider(1, 3), "draft": draft},
                        SamplingParams(max_tokens=20), prompts(N_PROMPTS, dense.model.args.vocab_size, seed=3))
    (nd, na), (dd, da) = totals["ngram"], totals["draft"]
    assert 0 < na < nd and da < dd


def test_lossless_with_repetition_penalty(dense, self_draft):
    # The penalty sees, at each window position, the history that position would have had.
    params = SamplingParams(max_tokens=24, repetition_penalty=1.3)
    totals = check_same(dense.model, dense.tokenizer, {"ngram": NgramProvider(1, 3), "draft": self_draft}, params,
                        prompts(12, dense.model.args.vocab_size, seed=1))
    assert 0 < totals["draft"][1] < totals["draft"][0]


def test_sliding_window_lossless(dense):
    # Before the window fills, rounds are trimmed; once a round could wrap it, plain steps.
    model = _model(dense, GEMMA3)
    tok = dense.tokenizer
    short = [p[:8] for p in prompts(10, dense.model.args.vocab_size, seed=4)]
    totals = check_same(model, tok, {"ngram": NgramProvider(1, 3)}, SamplingParams(max_tokens=30), short)
    assert totals["ngram"][0] > 0


def test_guided_choice_lossless_and_one_of_the_choices(dense):
    tok = dense.tokenizer
    rng = random.Random(5)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "return value", "class Foo", "import os"]
    ps = prompts(N_PROMPTS, dense.model.args.vocab_size, seed=5)
    forwards = 0
    for prompt in ps:
        choices = rng.sample(words, 3)
        choices[0] = choices[0] + " " + " ".join(rng.sample(words, 4))  # one long choice
        constraint = GuidedChoice(tok, choices)
        params = SamplingParams(max_tokens=64)
        want = plain(dense.model, tok, prompt, params, constraint=constraint)
        got = speculative(dense.model, tok, prompt, params, ConstraintProvider(),
                          constraint=GuidedChoice(tok, choices), spec_tokens=64)
        assert got.outcome.tokens == want.outcome.tokens
        assert got.outcome.text in choices and got.outcome.stop_detail == "eos"
        forwards += got.outcome.spec["target_forwards"]
    assert forwards <= 3 * len(ps)  # a choice costs a few forwards, not one per token


def test_stop_strings_eos_and_max_tokens_as_plain(dense, self_draft):
    tok = dense.tokenizer
    prompt = prompts(1, dense.model.args.vocab_size, seed=6)[0]
    base = plain(dense.model, tok, prompt, SamplingParams(max_tokens=40)).outcome
    stop = base.text[len(base.text) // 2: len(base.text) // 2 + 3]
    for params in (SamplingParams(max_tokens=40, stop=(stop,)), SamplingParams(max_tokens=7),
                   SamplingParams(max_tokens=1)):
        want = plain(dense.model, tok, prompt, params)
        got = speculative(dense.model, tok, prompt, params, self_draft)
        assert (got.outcome.tokens, got.outcome.text, got.outcome.finish_reason, got.outcome.stop_detail) == (
            want.outcome.tokens, want.outcome.text, want.outcome.finish_reason, want.outcome.stop_detail)
        assert got.outcome.tokens_in_cache[: len(prompt)] == prompt


def test_prompt_cache_reuse_and_logprobs(dense, self_draft):
    # Continuing from a cached prefix gives the same output, and the log-probabilities of
    # speculated tokens are those plain decoding reports.
    tok = dense.tokenizer
    prompt = prompts(40, dense.model.args.vocab_size, seed=7)[39] * 2
    params = SamplingParams(max_tokens=16)
    want = Generation(dense.model, tok, prompt, params, logprobs=3)
    want_steps = [s for s in want if s.token is not None]
    first = Generation(dense.model, tok, prompt[:10], SamplingParams(max_tokens=1))
    list(first)
    cache = first.cache
    for c in cache:
        c.trim(c.offset - 10)
    spec = Speculation(self_draft, TargetView(dense.model, tok), params, max_tokens=6)
    got = Generation(dense.model, tok, prompt, params, cache=cache, n_cached=10, speculation=spec, logprobs=3)
    got_steps = [s for s in got if s.token is not None]
    assert [s.token for s in got_steps] == [s.token for s in want_steps]
    for a, b in zip(got_steps, want_steps):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]
    assert got.outcome.cached_tokens == 10 and got.outcome.spec["accepted"] > 0


def test_ngram_index_is_incremental_and_longest_first():
    idx = NgramIndex(1, 3)
    idx.extend([1, 2, 3, 4, 9, 2, 3, 5, 7])
    assert idx.lookup(2, 3) == [3, 5, 7]  # the latest occurrence of [2]
    idx2 = NgramIndex(1, 3)
    idx2.extend([1, 2, 3, 4, 9, 8, 2, 3, 5, 1, 2])
    assert idx2.lookup(3, 2) == [4, 9]  # trailing [1, 2, 3] matched before [2, 3]
    assert NgramIndex(2, 3).lookup(1, 4) == []
    with pytest.raises(ValueError):
        NgramIndex(3, 2)


def test_ngram_row_group_proposes_ragged_rows():
    provider = NgramProvider(1, 2)
    rows = [provider.open(None, GREEDY) for _ in range(3)]
    rows[0].prefill([1, 2, 3, 1, 2, 3])
    rows[1].prefill([5, 6, 7])
    rows[2].prefill([4, 4, 4, 4])
    group = NgramRowGroup()
    group.append(rows)
    # a match that runs into the end continues its cycle
    assert group.propose([1, 9, 4], 4) == [[2, 3, 1, 2], [], [4, 4, 4, 4]]
    group.commit([[1, 2], [9], [4]])
    group.consume([[7, 7], [], [1]], [2, 0, 1])  # tokens the rows did not propose
    group.filter_rows([2, 0])
    assert group.propose([4, 3], 2) == [[1, 4], [1, 2]]


def test_draft_with_another_vocabulary_is_refused(dense):
    other = load_model(str(tiny_model("qwen3", vocab_size=300)))
    with pytest.raises(DraftMismatch, match="does not share the model's tokenizer"):
        DraftModelProvider(other, dense)


def test_json_skeleton_proposes_literal_parts(dense):
    tok = dense.tokenizer
    sk = JsonSkeleton(tok, ['{"name": "', '", "age": ', "}"])
    first = tok.encode('{"name": "', add_special_tokens=False)
    assert sk.forced([]) == first
    out = first + tok.encode('Ada"', add_special_tokens=False)
    rest = sk.forced(out)
    assert rest and tok.decode(out + rest).endswith('", "age": ')
    assert sk.allowed(out) is None


def test_draft_row_group_matches_single_rows(dense, self_draft):
    # Rows of a group propose what each source alone proposes; a row consumes a new turn
    # it did not propose and proposes from it without a prefill; constraints force rows.
    from mlxkv.engine.speculation.constraints import RowConstraints
    from mlxkv.engine.speculation.rows import SourceRowGroup

    tok = dense.tokenizer
    ps = prompts(2, dense.model.args.vocab_size, seed=8)
    rows = []
    for p in ps:
        row = self_draft.open(TargetView(dense.model, tok), GREEDY)
        row.prefill(p)
        rows.append(row)
    alone = []
    for p in ps:
        src = self_draft.open(TargetView(dense.model, tok), GREEDY)
        src.prefill(p)
        got = src.propose(p[-1], 3)  # a draft model's tokens come unevaluated (lazy)
        alone.append(got.lazy.tolist() if got.lazy is not None else got.tokens)
    group = SourceRowGroup()
    group.append(rows)
    assert group.propose([p[-1] for p in ps], 3) == alone
    group.commit([[ps[0][-1]], [ps[1][-1]]])
    group.consume([[5, 6, 7], []], [3, 0])
    fresh = self_draft.open(TargetView(dense.model, tok), GREEDY)
    fresh.prefill(ps[0] + [ps[0][-1], 5, 6, 7])
    got = fresh.propose(9, 2)
    assert group.propose([9, 9], 2)[0] == (got.lazy.tolist() if got.lazy is not None else got.tokens)
    forced = RowConstraints([GuidedChoice(tok, ["alpha beta"]), GuidedChoice(tok, ["gamma", "delta"])])
    group = SourceRowGroup(forced)
    group.append([NgramProvider(1, 2).open(None, GREEDY) for _ in range(2)])
    want = tok.encode("alpha beta", add_special_tokens=False)
    assert group.propose([1, 1], 8)[0] == want + sorted(tok.eos_token_ids)[:1]
    group.commit([want[:1], []])
    assert forced.allowed(0, []) == [want[1]] and not forced.done(0)


def test_drafts_after_an_end_of_sequence_token_are_not_counted(dense, self_draft):
    # The target as its own draft drafts past the reply's end; those drafts could never be
    # emitted, so they are not counted as drafted or accepted (nor seen by the policy): a
    # reply's last round does not read as a run of drafts.
    tok = dense.tokenizer
    prompt = prompts(3, dense.model.args.vocab_size, seed=11)[2]
    params = SamplingParams(max_tokens=24)
    free = plain(dense.model, tok, prompt, params).outcome.tokens
    # An end token that lands inside a window of 4 drafts (window positions 1-4, 6-9, ...).
    at = next(p for p in (2, 3, 7, 8, 12, 13) if free.index(free[p]) == p)
    saved = set(tok.eos_token_ids)
    tok.eos_token_ids = saved | {free[at]}
    try:
        want = plain(dense.model, tok, prompt, params).outcome
        spec = Speculation(self_draft, TargetView(dense.model, tok), params, mode="draft", max_tokens=4,
                           timed=False)
        got = Generation(dense.model, tok, prompt, params, speculation=spec)
        list(got)
    finally:
        tok.eos_token_ids = saved
    assert got.outcome.tokens == want.tokens == free[:at] and got.outcome.stop_detail == "eos"
    stats = got.outcome.spec
    assert stats["accepted"] == stats["drafted"] <= at  # every counted draft is a token of the reply
    assert sum(stats["acceptance_by_position"]) == len(stats["acceptance_by_position"])
