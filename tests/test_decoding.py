"""Plain decoding through the compiled step (engine.decoding, engine.compiled_step) and the
CPU weight layout (engine.weight_layout): greedy output token for token what mlx-lm's own
``generate_step`` gives on mlx-lm's own load of the same folder, on llama, qwen2, qwen3 and
the real model; the caches it leaves are plain KVCaches; caches and architectures the
compiled step cannot run decode through the forward pass."""

from __future__ import annotations

import logging

import mlx.core as mx
import pytest
from common import scaled_logits
from mlx_lm import load as mlx_lm_load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, make_prompt_cache

from mlxkv.engine.compiled_step import CompiledStep
from mlxkv.engine.decoding import decode_step
from mlxkv.engine.generate import Generation, SamplingParams
from mlxkv.engine.models import load_model
from mlxkv.engine.weight_layout import layout_for_cpu
from support.modelgen import TEST_MODELS, build_random_model, tiny_model, tiny_model_of_type
from support.real_model import float32_folder, real_model_path

GREEDY = SamplingParams(max_tokens=40, temperature=0.0)


def folder(arch: str):
    return tiny_model_of_type(arch) if arch == "qwen2" else tiny_model(arch)


def mlx_lm_tokens(path, prompt: list[int], n: int, model=None) -> list[int]:
    """Greedy tokens of mlx-lm's generate_step on mlx-lm's own load of ``path``."""
    model = model if model is not None else mlx_lm_load(str(path))[0]
    return [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)]


def ours(loaded, prompt: list[int], params: SamplingParams = GREEDY) -> tuple[list[int], Generation]:
    gen = Generation(loaded.model, loaded.tokenizer, prompt, params)
    tokens = [s.token for s in gen if s.token is not None]
    return tokens, gen


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_decoding_is_mlx_lms_generate_step(arch):
    loaded = load_model(str(folder(arch)))
    loaded.tokenizer.eos_token_ids = set()  # random weights may pick EOS: decode every token
    prompt = [(i * 37) % 200 + 3 for i in range(230)]  # decoding crosses the 256-slot buffer
    got, gen = ours(loaded, prompt)
    assert decode_step(loaded.model).enabled is True  # it ran compiled
    assert got == mlx_lm_tokens(folder(arch), prompt, len(got)) and len(got) == GREEDY.max_tokens
    # what the prefix cache, trims and speculation see: plain KVCaches at the right offset
    # (the step after the last token was queued before it was handed out, as generate_step does)
    n = gen.cache[0].offset
    assert n in (len(prompt) + len(got) - 1, len(prompt) + len(got))
    assert all(type(c) is KVCache and c.offset == n for c in gen.cache)
    assert gen.outcome.tokens_in_cache == (prompt + got)[:n]


def test_sampled_decoding_with_processors_is_mlx_lms():
    path = folder("llama")
    loaded = load_model(str(path))
    loaded.tokenizer.eos_token_ids = set()
    params = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, repetition_penalty=1.3, seed=7)
    prompt = [(i * 11) % 200 + 3 for i in range(20)]
    got, _ = ours(loaded, prompt, params)
    again, _ = ours(loaded, prompt, params)
    assert got == again and len(got) == 24  # seeded: reproducible through the compiled step
    # the same draws as plain forward passes (the compiled step switched off)
    step = decode_step(loaded.model)
    step.enabled = False
    try:
        plain, _ = ours(loaded, prompt, params)
    finally:
        step.enabled = True
    assert got == plain


@pytest.mark.parametrize("settings", [dict(top_p=0.9), dict(top_k=20, min_p=0.05), dict()])
def test_a_seeded_sampler_draws_mlx_lms_seeded_tokens_and_leaves_the_global_key(settings):
    """A seeded request's own sampler draws, call by call, what mlx-lm's sampler draws
    after ``mx.random.seed``; MLX's global key is left as it was; a rewind goes back to the
    draws after that many calls, and no further than it keeps."""
    from mlx_lm.sample_utils import make_sampler

    from mlxkv.engine.sampling import SeededSampler

    logits = mx.random.normal((1, 300), key=mx.random.key(1)) * 3
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    params = SamplingParams(temperature=0.8, seed=11, **settings)
    mx.random.seed(11)
    theirs = [make_sampler(0.8, params.top_p, params.min_p, top_k=params.top_k)(logprobs).item()
              for _ in range(12)]
    mx.random.seed(99)
    before = mx.array(mx.random.state[0])
    ours = SeededSampler(params)
    mine = [ours(logprobs).item() for _ in range(12)]
    assert mine == theirs and len(set(mine)) > 2
    assert mx.array_equal(mx.random.state[0], before).item()
    ours.rewind(9)
    assert [ours(logprobs).item() for _ in range(3)] == theirs[9:]
    with pytest.raises(ValueError, match="cannot rewind"):
        ours.rewind(12 - SeededSampler.KEEP)
    window = mx.concatenate([logprobs, logprobs])  # a plain row's window: the first is drawn
    ours.rewind(11)
    got = ours(window).tolist()
    assert got == [theirs[11], mx.argmax(logprobs).item()]


def test_a_sliding_window_model_decodes_through_the_forward_pass():
    path = build_random_model(TEST_MODELS / "llama-tiny-sliding16", arch="llama", sliding_window=16,
                              layer_types=["sliding_attention", "full_attention"])
    loaded = load_model(str(path))
    loaded.tokenizer.eos_token_ids = set()
    prompt = [(i * 13) % 200 + 3 for i in range(40)]
    got, gen = ours(loaded, prompt, SamplingParams(max_tokens=20, temperature=0.0))
    assert got == mlx_lm_tokens(path, prompt, 20)
    assert decode_step(loaded.model).enabled is not True
    assert any(type(c) is not KVCache for c in gen.cache)


def test_a_step_that_differs_from_the_forward_pass_is_not_used(caplog):
    model = scaled_logits(load_model(str(tiny_model("qwen3"))).model, KVCache)
    step = CompiledStep(model)
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[3, 4, 5]]), cache=cache))
    x = mx.array([[6]])
    with caplog.at_level(logging.DEBUG, logger="mlxkv.engine"):
        got = step(x, cache)  # checked: the forward pass's logits come back
    assert step.enabled is False
    lines = [r.getMessage() for r in caplog.records if "compiled decode step differs" in r.getMessage()]
    assert len(lines) == 1, caplog.text
    for c in cache:
        c.trim(1)
    assert mx.array_equal(got, model(x, cache=cache)[0, -1:]).item()
    got = step(mx.array([[7]]), cache)  # the forward pass from now on
    assert got.shape == (1, model.inner.args.vocab_size) and cache[0].offset == 5


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_cpu_layout_computes_the_same_numbers(arch):
    path = folder(arch)
    loaded = load_model(str(path))
    ours(loaded, [3, 4, 5], SamplingParams(max_tokens=3, temperature=0.0))
    assert layout_for_cpu(loaded.model) == 0  # done once, at its first decoding
    theirs, _ = mlx_lm_load(str(path))
    assert layout_for_cpu(theirs) > 0
    reference, _ = mlx_lm_load(str(path))
    x = mx.array([[(i * 7) % 200 + 3 for i in range(50)]])
    a, b = make_prompt_cache(theirs), make_prompt_cache(reference)
    # the same products, summed in the order BLAS picks for each layout: equal to rounding
    # (bit for bit on the reference BLAS; OpenBLAS's small-matrix kernels may round apart)
    outs = [(theirs(x, cache=a), reference(x, cache=b))]  # prefill
    for t in (5, 9, 11):  # decode steps
        y = mx.array([[t]])
        outs.append((theirs(y, cache=a), reference(y, cache=b)))
    for got, want in outs:
        assert mx.allclose(got, want, rtol=1e-5, atol=1e-6).item()
        assert mx.array_equal(mx.argmax(got, axis=-1), mx.argmax(want, axis=-1)).item()


REAL = real_model_path()


@pytest.mark.skipif(REAL is None, reason="the real model is not fetched: run `make fixtures`")
def test_the_real_model_decodes_as_mlx_lm_does():
    path = float32_folder(REAL)
    loaded = load_model(str(path))
    reference, _ = mlx_lm_load(str(path))
    for text in ("What is the capital of France?", "Write a haiku about the sea."):
        prompt = loaded.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True)
        got, _ = ours(loaded, prompt, SamplingParams(max_tokens=24, temperature=0.0))
        assert len(got) > 4
        assert got == mlx_lm_tokens(path, prompt, 24, reference)[: len(got)]
        assert decode_step(loaded.model).enabled is True
