"""MTP speculation through the real engine is lossless: greedy output with ``spec="mtp"``
is token for token plain decoding, over 50 prompts, on two tiny Qwen3.5-style (hybrid:
Gated DeltaNet + full attention) checkpoints with MTP weights:

- random MTP weights, untied LM head: drafts are almost never accepted (every round is a
  rejection and a rollback of the target's recurrent layers);
- a constructed "copy" MTP on a tied target that mostly repeats its last token: most
  drafts are accepted, some partially (accepted drafts, bonus tokens, partial rollbacks).

The prefix cache is on: a prompt asked again finds the MTP state stored by the first
request (the hybrid target itself restores only at exact positions: it recomputes), every
fifth prompt is continued like a conversation turn (the target starts from its cached
state, the MTP from its own), and a conversation's MTP state comes back from RAM and, in a
new engine, from the SSD tier."""

from __future__ import annotations

import pytest

from mlxkv.engine.cache.prefix_cache import PrefixCache
from mlxkv.engine.engine import Engine
from mlxkv.engine.generate import SamplingParams
from mlxkv.engine.requests import Request
from support.modelgen import mtp_model, stdlib_corpus

TIMEOUT = 120


def _prompts(tokenizer, count: int = 50) -> list[list[int]]:
    corpus = "".join(stdlib_corpus(300_000))
    out = []
    for i in range(count):
        start = (i * 7919) % (len(corpus) - 400)
        out.append(list(tokenizer.encode(corpus[start:start + 20 + (i % 5) * 30])))
    return out


def _run(engine: Engine, tokens: list[int], spec: str, max_tokens: int, session: str | None = None):
    req = Request(prompt_tokens=tokens, params=SamplingParams(temperature=0.0, max_tokens=max_tokens),
                  spec=spec, session=session)
    return engine.submit(req).result(timeout=TIMEOUT)


@pytest.mark.parametrize("variant,max_tokens", [
    ({}, 4),
    ({"mtp_init": "copy", "tie_word_embeddings": True, "scale": 0.05}, 8),
], ids=["random-mtp", "copy-mtp"])
def test_greedy_mtp_equals_plain_decoding_over_50_prompts(variant, max_tokens):
    path = mtp_model(**variant)
    cache = PrefixCache(ram_bytes=64 << 20, cache_dir=None, block_tokens=16)
    with Engine(str(path), prefix_cache=cache).start(timeout=TIMEOUT) as engine:
        assert "mtp" in engine.info["speculation"]
        prompts = _prompts(engine.loaded.tokenizer)
        totals = {"drafted": 0, "accepted": 0, "target_hits": 0}

        def check(prompt: list[int], mtp_first: bool, where: str) -> list[int]:
            # Alternate which one runs first: the second finds the first's stored state.
            order = ("mtp", "off") if mtp_first else ("off", "mtp")
            got = {spec: _run(engine, prompt, spec, max_tokens) for spec in order}
            assert got["mtp"].tokens == got["off"].tokens, where
            stats = got["mtp"].stats.spec
            assert stats is not None and stats["source"] == "mtp"
            assert got["off"].stats.spec is None
            totals["drafted"] += stats["drafted"]
            totals["accepted"] += stats["accepted"]
            totals["target_hits"] += got["mtp"].stats.cached_tokens > 0
            return got["off"].tokens

        for i, tokens in enumerate(prompts):
            answer = check(tokens, i % 2 == 1, f"prompt {i}")
            if i % 5 == 0:  # the next turn of that conversation
                check(tokens + answer + prompts[(i + 1) % len(prompts)][:8], i % 2 == 0, f"prompt {i} turn 2")
    drafted, accepted = totals["drafted"], totals["accepted"]
    assert drafted > 0 and totals["target_hits"] >= 5
    if variant:
        assert accepted > drafted // 2  # the copy MTP is right most of the time ...
        assert accepted < drafted  # ... but not always: partial rounds happen too


def test_mtp_state_comes_back_with_the_conversation():
    """Turn 2 of a session restores the MTP KV stored after turn 1 and stays lossless."""
    path = mtp_model(mtp_init="copy", tie_word_embeddings=True, scale=0.05)
    cache = PrefixCache(ram_bytes=64 << 20, cache_dir=None, block_tokens=16)
    with Engine(str(path), prefix_cache=cache).start(timeout=TIMEOUT) as engine:
        tok = engine.loaded.tokenizer
        turn1 = list(tok.encode("class Conversation:\n    def turn(self):\n"))
        first = _run(engine, turn1, "mtp", 12, session="s")
        turn2 = turn1 + first.tokens + list(tok.encode("\n    def again(self):\n"))
        second = _run(engine, turn2, "mtp", 12, session="s")
        assert second.stats.spec["restored_draft_tokens"] > len(turn1)
        plain = _run(engine, turn2, "off", 12)
        assert second.tokens == plain.tokens


def test_sampled_mtp_requests_run_through_rejection_sampling():
    """With temperature the MTP samples its drafts and hands q to the verifier (the
    distribution test of rejection sampling itself is the verifier's)."""
    path = mtp_model(mtp_init="copy", tie_word_embeddings=True, scale=0.05)
    with Engine(str(path)).start(timeout=TIMEOUT) as engine:
        tokens = list(engine.loaded.tokenizer.encode("def sample(self):\n"))
        # seeded, so the draws are the same every run: unseeded, a request whose first draws
        # end the text (a random model over 512 tokens) drafts nothing
        req = Request(prompt_tokens=tokens, params=SamplingParams(temperature=0.7, max_tokens=24, seed=11),
                      spec="mtp")
        result = engine.submit(req).result(timeout=TIMEOUT)
        assert len(result.tokens) == 24
        assert result.stats.spec["source"] == "mtp" and result.stats.spec["drafted"] > 0


def test_mtp_state_comes_back_from_the_ssd_tier_after_a_restart(tmp_path):
    """The MTP KV is stored like any block state: a new engine over the same cache folder
    (nothing in RAM) restores it for the conversation's next turn, losslessly."""
    path = mtp_model(mtp_init="copy", tie_word_embeddings=True, scale=0.05)

    def engine() -> Engine:
        cache = PrefixCache(ram_bytes=64 << 20, cache_dir=str(tmp_path), block_tokens=16)
        return Engine(str(path), prefix_cache=cache).start(timeout=TIMEOUT)

    with engine() as first_engine:
        tok = first_engine.loaded.tokenizer
        turn1 = list(tok.encode("class Restart:\n    def turn(self):\n        return 1\n"))
        first = _run(first_engine, turn1, "mtp", 12, session="s")
        first_engine.cache_flush(timeout=TIMEOUT)
    turn2 = turn1 + first.tokens + list(tok.encode("\n    def again(self):\n"))
    with engine() as second_engine:
        second = _run(second_engine, turn2, "mtp", 12, session="s")
        assert second.stats.cached_ssd_tokens > 0
        assert second.stats.spec["restored_draft_tokens"] >= 16
        assert second.tokens == _run(second_engine, turn2, "off", 12).tokens


@pytest.mark.parametrize("variant", [
    {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32},
    {"arch": "qwen3_next"},
], ids=["qwen3_5_moe", "qwen3_next"])
def test_greedy_mtp_on_moe_checkpoints_equals_plain_decoding(variant):
    """Qwen3.5-MoE (experts fused) and Qwen3-Next (one tensor per expert) checkpoints."""
    with Engine(str(mtp_model(**variant))).start(timeout=TIMEOUT) as engine:
        assert "mtp" in engine.info["speculation"]
        for tokens in _prompts(engine.loaded.tokenizer, 10):
            assert _run(engine, tokens, "mtp", 6).tokens == _run(engine, tokens, "off", 6).tokens
