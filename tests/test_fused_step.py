"""The fused decode-and-prefill pass (engine.fused_step): a stream decoding in a batch while
another prompt prefills beside it gets its tokens from passes that also feed the prompt's
chunks, and both rows give, greedy, token for token what each gives alone (mlx-lm's own
``generate_step`` on its own load of the folder), on llama, qwen3 and the real model; the
prompt's cache is what a prefill alone writes; a model whose fused pass would compute other
numbers, or which it cannot run, keeps two passes per step."""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm import load as mlx_lm_load
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.models.cache import KVCache, make_prompt_cache

from mlxkv.engine.batch_step import BatchStepModel, fused_step
from mlxkv.engine.fused_step import FusedKV
from mlxkv.engine.mlx_lm_compat import install_attention, next_prompt_chunk
from mlxkv.engine.models import load_model
from support.modelgen import TEST_MODELS, build_random_model, tiny_model
from support.real_model import float32_folder, real_model_path


def alone(path, prompt: list[int], n: int, model=None) -> list[int]:
    model = model if model is not None else mlx_lm_load(str(path))[0]
    return [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)]


def tokens_for(seed: int, length: int) -> list[int]:
    return [(i * 37 + seed * 11) % 200 + 3 for i in range(length)]


def beside(model: Any, stream: list[int], prompt: list[int], n: int, chunk: int,
           fuse: bool = True) -> tuple[list[int], list[int], list, BatchStepModel]:
    """``stream`` decodes alone for 3 steps, then ``prompt`` joins and prefills ``chunk``
    tokens a step beside it; both greedy, ``n`` tokens each. Returns their tokens, the
    prompt row's cache once it has its ``n`` (holding prompt + output but the last), and
    the step model."""
    install_attention(model)  # as an engine's load leaves it
    stepper = BatchStepModel(model)
    gen = BatchGenerator(stepper, stop_tokens=None, completion_batch_size=8, prefill_batch_size=8)
    if fuse:
        stepper.upcoming = lambda: next_prompt_chunk(gen)
    (first,) = gen.insert([stream], max_tokens=[n], caches=[make_prompt_cache(model)])
    out: dict[int, list[int]] = {first: []}
    while len(out[first]) < 3:
        for r in gen.next()[1]:
            out[r.uid].append(r.token)
    gen.prefill_step_size = chunk
    (second,) = gen.insert([prompt], max_tokens=[n + 1], caches=[make_prompt_cache(model)])
    out[second] = []
    for _ in range(1000):
        for r in gen.next()[1]:
            out[r.uid].append(r.token)
        if len(out[second]) >= n:
            break
    cache, _ = gen.remove([second], return_prompt_caches=True)[second]
    while len(out[first]) < n:
        for r in gen.next()[1]:
            out[r.uid].append(r.token)
    gen.close()
    return out[first][:n], out[second][:n], cache, stepper


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_stream_beside_a_prefill_decodes_in_fused_passes_as_each_alone(arch):
    path = tiny_model(arch)
    loaded = load_model(str(path))
    reference = mlx_lm_load(str(path))[0]
    stream, prompt = tokens_for(1, 20), tokens_for(2, 150)
    got_stream, got_prompt, cache, stepper = beside(loaded.model, stream, prompt, 12, chunk=16)
    assert fused_step(loaded.model).enabled is True
    assert stepper.fused_steps >= 5  # the prompt's later chunks each rode a decode step
    assert got_stream == alone(path, stream, 12, reference)
    assert got_prompt == alone(path, prompt, 12, reference)
    # the prompt's cache holds what a prefill alone writes
    assert all(type(c) is KVCache for c in cache)
    held = cache[0].offset
    want = make_prompt_cache(reference)
    mx.eval(reference((mx.array([prompt + got_prompt])[:, :held]), cache=want))
    for c, w in zip(cache, want):
        k, v = c.keys[..., :held, :], c.values[..., :held, :]
        wk, wv = w.keys[..., :held, :], w.values[..., :held, :]
        assert mx.allclose(k, wk, atol=1e-4).item() and mx.allclose(v, wv, atol=1e-4).item()


def test_a_stream_beside_a_prefill_without_fusing_runs_two_passes():
    path = tiny_model("llama")
    loaded = load_model(str(path))
    stream, prompt = tokens_for(3, 9), tokens_for(4, 70)
    got_stream, got_prompt, _, stepper = beside(loaded.model, stream, prompt, 8, chunk=16, fuse=False)
    assert stepper.fused_steps == 0
    reference = mlx_lm_load(str(path))[0]
    assert got_stream == alone(path, stream, 8, reference)
    assert got_prompt == alone(path, prompt, 8, reference)


class HalvedWhenFused(nn.Module):
    """An mlx-lm model whose logits are halved in a fused pass: a stand-in for an
    architecture whose fused pass would compute other numbers than its two passes."""

    def __init__(self, inner: Any):
        super().__init__()
        self.inner = inner
        self.model = inner.model

    @property
    def layers(self) -> list:
        return self.inner.layers

    def __call__(self, x: Any, cache: Any = None) -> Any:
        out = self.inner(x, cache=cache)
        return out * 0.5 if cache is not None and type(cache[0]) is FusedKV else out


def test_a_fused_pass_that_differs_from_two_passes_is_not_used(caplog):
    path = tiny_model("qwen3")
    model = HalvedWhenFused(load_model(str(path)).model)
    reference = mlx_lm_load(str(path))[0]
    stream, prompt = tokens_for(5, 11), tokens_for(6, 90)
    with caplog.at_level(logging.DEBUG, logger="mlxkv.engine"):
        got_stream, got_prompt, _, stepper = beside(model, stream, prompt, 10, chunk=16)
    assert fused_step(model).enabled is False
    assert stepper.fused_steps == 0
    assert sum("fused step differs from two passes" in r.getMessage() for r in caplog.records) == 1, caplog.text
    assert got_stream == alone(path, stream, 10, reference)
    assert got_prompt == alone(path, prompt, 10, reference)


def test_a_sliding_window_model_prefills_beside_a_stream_in_two_passes():
    path = build_random_model(TEST_MODELS / "llama-tiny-sliding16", arch="llama", sliding_window=16,
                              layer_types=["sliding_attention", "full_attention"])
    loaded = load_model(str(path))
    reference = mlx_lm_load(str(path))[0]
    stream, prompt = tokens_for(7, 10), tokens_for(8, 60)
    got_stream, got_prompt, _, stepper = beside(loaded.model, stream, prompt, 8, chunk=16)
    assert stepper.fused_steps == 0
    assert got_stream == alone(path, stream, 8, reference)
    assert got_prompt == alone(path, prompt, 8, reference)


REAL = real_model_path()


@pytest.mark.skipif(REAL is None, reason="the real model is not fetched: run `make fixtures`")
def test_the_real_model_decodes_beside_a_prefill_in_fused_passes_as_each_alone():
    path = float32_folder(REAL)
    loaded = load_model(str(path))
    reference, _ = mlx_lm_load(str(path))
    chat = loaded.tokenizer.apply_chat_template
    stream = chat([{"role": "user", "content": "List three prime numbers."}], add_generation_prompt=True)
    text = "Summarize this: " + " ".join(f"item {i} is a {'red' if i % 2 else 'blue'} box." for i in range(60))
    prompt = chat([{"role": "user", "content": text}], add_generation_prompt=True)
    got_stream, got_prompt, _, stepper = beside(loaded.model, stream, prompt, 12, chunk=32)
    assert fused_step(loaded.model).enabled is True and stepper.fused_steps >= 5
    assert got_stream == alone(path, stream, 12, reference)
    assert got_prompt == alone(path, prompt, 12, reference)
