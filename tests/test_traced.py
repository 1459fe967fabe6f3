"""Compiled functions whose traces are counted and bounded (engine.traced): a long-running
server sees every context length, and MLX keeps a trace per input shape for as long as a
compiled function lives, so the engine's compiled steps hold at most ``limit`` traces and
say how many they hold."""

from __future__ import annotations

import mlx.core as mx

from mlxkv.engine.decoding import decode_step
from mlxkv.engine.generate import Generation, SamplingParams
from mlxkv.engine.models import load_model
from mlxkv.engine.traced import Traced, trace_figures


def _f(x: mx.array, w: mx.array) -> mx.array:
    return mx.tanh(x @ w) * 0.5 + x


def test_each_new_shape_is_a_trace_and_the_limit_starts_afresh():
    w = mx.random.normal((8, 8), key=mx.random.key(0))
    fn = Traced(_f, "test: bounded", limit=3)
    for n in (1, 2, 2, 3, 1):
        x = mx.ones((n, 8))
        assert mx.allclose(fn(x.shape, x, w), _f(x, w)).item()
    assert fn.shapes == {(1, 8), (2, 8), (3, 8)} and fn.resets == 0
    x = mx.ones((4, 8))  # a fourth shape: every trace is dropped, this one traced anew
    assert mx.allclose(fn(x.shape, x, w), _f(x, w)).item()
    assert fn.shapes == {(4, 8)} and fn.resets == 1
    mine = trace_figures()["test: bounded"]
    assert mine == {"functions": 1, "traces": 1, "limit": 3, "resets": 1}


def test_the_decode_step_holds_a_trace_per_buffer_capacity(tiny_qwen3):
    loaded = load_model(str(tiny_qwen3))
    loaded.tokenizer.eos_token_ids = set()
    prompt = [(i * 37) % 200 + 3 for i in range(240)]  # decoding crosses 256 slots: two capacities
    gen = Generation(loaded.model, loaded.tokenizer, prompt, SamplingParams(max_tokens=30, temperature=0.0))
    assert len([s for s in gen if s.token is not None]) == 30
    step = decode_step(loaded.model)
    assert step.enabled is True
    assert step._fn.shapes == {(1, 256), (1, 512)}
    figures = trace_figures()["decode step: the model"]
    assert figures["traces"] >= 2 and figures["limit"] == step._fn.limit


def test_a_step_past_its_limit_keeps_decoding_the_same_tokens(tiny_llama):
    prompt = [(i * 11) % 200 + 3 for i in range(500)]
    params = SamplingParams(max_tokens=40, temperature=0.0)

    def run(limit: int | None) -> tuple[list[int], int]:
        loaded = load_model(str(tiny_llama))
        loaded.tokenizer.eos_token_ids = set()
        step = decode_step(loaded.model)
        if limit is not None:
            step._fn.limit = limit
        out = []
        for start in (0, 250):  # two conversations: capacities 512 and 256, then 768
            gen = Generation(loaded.model, loaded.tokenizer, prompt[start:], params)
            out += [s.token for s in gen if s.token is not None]
        return out, step._fn.resets

    unbounded, resets = run(None)
    assert resets == 0
    bounded, resets = run(1)  # one trace at a time: every new capacity starts afresh
    assert resets >= 2 and bounded == unbounded
