"""The prefill of plain decoding and of the speculative verifier (``engine.generate.prefill``):
the prompt's last token goes in with the last chunk, whose last position gives the first
token (no pass of its own); a model whose logits are not its head on the hidden state keeps
mlx-lm's separate pass; and the streaming detokenizer releases bytes that can no longer
become valid UTF-8 at once."""

from __future__ import annotations

import functools
import random
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from common import T
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from mlxkv.engine.engine import Engine, Request
from mlxkv.engine.generate import Generation, SamplingParams, head_view, probe_model, stream_detokenizer
from mlxkv.engine.settings import Settings
from mlxkv.engine.speculation.base import TargetView
from support.modelgen import tiny_model

PROMPT = list(range(3, 13))  # 10 tokens


@pytest.fixture(scope="module")
def qwen3():
    return load(str(tiny_model("qwen3")))


def passes(monkeypatch: pytest.MonkeyPatch, model) -> list[int]:
    """Tokens of each pass through ``model``'s decoder stack, as they happen."""
    seen: list[int] = []
    cls = type(model.model)
    call = cls.__call__

    @functools.wraps(call)  # the stack's signature stays readable (the probe reads it)
    def counted(self, inputs, *args, **kwargs):
        seen.append(int(inputs.shape[1]))
        return call(self, inputs, *args, **kwargs)

    monkeypatch.setattr(cls, "__call__", counted)
    return seen


def greedy(max_tokens: int, step: int = 4) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, prefill_step_size=step)


def test_last_prompt_token_rides_the_last_chunk(qwen3, monkeypatch):
    model, tok = qwen3
    assert head_view(model) is not None
    seen = passes(monkeypatch, model)
    gen = Generation(model, tok, PROMPT, greedy(1))
    steps = [s for s in gen if s.token is not None]
    # chunks of 4, 4 and the last 2 with the first token; before: 4, 4, 1 (the last
    # prompt token alone) and a pipelined step for a token nobody asked for
    assert seen == [4, 4, 2]
    assert len(steps) == 1 and gen.outcome.tokens_in_cache == PROMPT


def test_same_tokens_as_generate_step(qwen3):
    """Greedy output equals mlx-lm's generate_step (its separate last pass) on these prompts,
    with and without a cached prefix."""
    model, tok = qwen3
    rng = random.Random(3)
    for _ in range(6):
        prompt = [rng.randrange(1, 400) for _ in range(rng.randrange(2, 40))]
        want = [t for t, _ in zip(generate_step(mx.array(prompt), model, max_tokens=12,
                                                prompt_cache=make_prompt_cache(model)), range(12))]
        want = [int(t) for t, _ in want]
        got = Generation(model, tok, prompt, greedy(12)).__iter__()
        tokens = [s.token for s in got if s.token is not None]
        assert tokens == want[: len(tokens)] and len(tokens) >= 1
        cache = make_prompt_cache(model)
        model(mx.array([prompt[:-1]]), cache=cache)
        mx.eval([c.state for c in cache])
        if len(prompt) > 2:
            gen = Generation(model, tok, prompt, greedy(12), cache=cache, n_cached=len(prompt) - 1)
            assert [s.token for s in gen if s.token is not None] == tokens


class _ScaledLogits:
    """A model whose logits are its head's, scaled (as granite's ``logits_scaling``)."""

    def __init__(self, model):
        self.inner = model
        self.model = model.model
        self.layers = model.layers
        self.args = model.args

    def __call__(self, inputs, cache=None):
        return self.inner(inputs, cache=cache) * 0.5


def test_model_with_logits_after_the_head_keeps_a_pass_for_the_last_token(qwen3, monkeypatch):
    model, tok = qwen3
    scaled = _ScaledLogits(model)
    assert head_view(scaled) is None
    seen = passes(monkeypatch, model)
    gen = Generation(scaled, tok, PROMPT, greedy(3))
    tokens = [s.token for s in gen if s.token is not None]
    assert seen[:3] == [4, 4, 1] and seen[3] == 1  # the last prompt token alone, then decoding
    want = [int(t) for (t, _), _ in zip(generate_step(mx.array(PROMPT), scaled, max_tokens=3,
                                                      prompt_cache=make_prompt_cache(model)), range(3))]
    assert tokens == want[: len(tokens)]


def test_one_pass_gives_the_cache_layout_and_decides_the_head(monkeypatch):
    model, _ = load(str(tiny_model("qwen3")))  # a model nobody has probed yet
    seen = passes(monkeypatch, model)
    cache = probe_model(model)
    assert seen == [1] and all(c.offset == 1 for c in cache)
    assert head_view(model) is not None and seen == [1]  # decided by that pass


class _StackFedOtherwise(nn.Module):
    """A model that feeds its stack something besides the tokens (here doubled embeddings)
    and applies the plain head to what comes out: head(stack output) is its logits, yet the
    split forward (the stack on the tokens alone) is not the model."""

    def __init__(self, model):
        super().__init__()
        self.model = model.model
        self.head = TargetView(model, None)
        self.args = model.args

    @property
    def layers(self):
        return self.model.layers

    def __call__(self, inputs, cache=None):
        h = self.model(inputs, cache=cache, input_embeddings=self.model.embed_tokens(inputs) * 2)
        return self.head.logits(h)


def test_a_stack_fed_more_than_the_tokens_is_checked_with_a_pass_of_its_own(monkeypatch):
    model, _ = load(str(tiny_model("qwen3")))
    other = _StackFedOtherwise(model)
    seen = passes(monkeypatch, model)
    probe_model(other)
    assert seen == [1, 1]  # the recorded call was not a plain one: the split was run too
    assert head_view(other) is None
    assert other.model is model.model  # the stack is back in its place after the probe


def test_verifier_prefill_shares_the_last_chunk(tmp_path: Path, monkeypatch):
    values = {"model": str(tiny_model("qwen3")), "cache_dir": str(tmp_path / "cache"), "spec": "ngram",
              "prefix_cache": False}
    with Engine.from_settings(Settings.load(values, env={})).start(timeout=T) as engine:
        engine.submit(Request(prompt_tokens=[5, 6], params=greedy(1))).result(timeout=T)  # probes the head
        seen = passes(monkeypatch, engine.loaded.model)
        spec = engine.submit(Request(prompt_tokens=PROMPT, params=greedy(4))).result(timeout=T)
        first = list(seen)
        plain = engine.submit(Request(prompt_tokens=PROMPT, params=greedy(4), spec="off")).result(timeout=T)
    assert spec.stats.spec is not None and spec.stats.spec["source"] == "ngram"
    assert first[:3] == [4, 4, 2]  # before: 4, 4, 1, then the verifier's rounds
    assert spec.tokens == plain.tokens


# ------------------------------------------------------------------- the detokenizer
def _segments(detok, tokens: list[int]) -> list[str]:
    out = []
    for t in tokens:
        detok.add_token(t)
        out.append(detok.last_segment)
    detok.finalize()
    out.append(detok.last_segment)
    return out


def test_stray_continuation_byte_is_released_at_once(qwen3):
    _, tok = qwen3
    stray = tok.convert_tokens_to_ids("Ĩ")  # byte 0x86: a continuation byte, never a start
    lead = tok.convert_tokens_to_ids("æ")  # byte 0xE6: starts a three-byte sequence
    word = tok.encode("hello", add_special_tokens=False)
    assert _segments(tok.detokenizer, [stray] + word)[0] == ""  # mlx-lm's holds it
    eager = _segments(stream_detokenizer(tok), [stray] + word)
    assert eager[0] == "\ufffd" and "".join(eager) == "\ufffdhello"
    # a lead byte may still complete: held until the next token breaks it
    eager = _segments(stream_detokenizer(tok), [lead] + word)
    assert eager[0] == "" and "".join(eager) == "\ufffdhello"
    complete = tok.encode("日本", add_special_tokens=False)
    assert "".join(_segments(stream_detokenizer(tok), complete)) == "日本"


def test_eager_detokenizer_text_is_mlx_lms(qwen3):
    """Over random token streams, the joined text is mlx-lm's and never comes later."""
    _, tok = qwen3
    vocab = len(tok.get_vocab()) if hasattr(tok, "get_vocab") else tok.vocab_size
    for seed in range(200):
        rng = random.Random(seed)
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        theirs = _segments(tok.detokenizer, tokens)
        ours = _segments(stream_detokenizer(tok), tokens)
        assert "".join(ours) == "".join(theirs)
        for k in range(len(ours)):
            assert len("".join(ours[: k + 1])) >= len("".join(theirs[: k + 1]))


def test_the_head_is_probed_while_loading_not_in_the_first_request(tmp_path: Path, monkeypatch):
    # head_view's probe (one one-token pass) runs as the engine loads, so the first
    # request after a start (the restart TTFT) pays only its own prefill.
    values = {"model": str(tiny_model("qwen3")), "cache_dir": str(tmp_path / "cache"), "spec": "off",
              "prefix_cache": False}
    with Engine.from_settings(Settings.load(values, env={})).start(timeout=T) as engine:
        seen = passes(monkeypatch, engine.loaded.model)
        engine.submit(Request(prompt_tokens=PROMPT, params=greedy(1))).result(timeout=T)
    # The prompt's passes come first (before: 1, 1, the probe, then the prompt's); after
    # them, the last prompt token and the decode step.
    assert seen[:2] == [4, 4], seen
