"""The CPU attention of several queries (engine.cpu_attention): MLX's numbers up to rounding
for every mask and grouping mlx-lm's models pass, masked keys weigh exactly nothing, the
query blocks join seamlessly; it runs only on a thread that opted in, so another thread
computes exactly what mlx-lm computes; and the engine's greedy output on the real model
and the demo model is the same with it as without."""

from __future__ import annotations

import os
import sys
import threading

import mlx.core as mx
import pytest
from common import T, greedy
from mlx_lm.models.cache import make_prompt_cache

from mlxkv.engine import cpu_attention, mlx_lm_compat, native_ops
from mlxkv.engine.mlx_lm_compat import install_attention, install_swiglu
from mlxkv.engine.models import load_model
from support.modelgen import tiny_model
from support.real_model import real_model_path

REAL = real_model_path()


def _qkv(length: int, keys: int, heads: int, kv_heads: int, seed: int = 0):
    mx.random.seed(seed)
    q = mx.random.normal((1, heads, length, 16))
    k = mx.random.normal((1, kv_heads, keys, 16))
    v = mx.random.normal((1, kv_heads, keys, 16))
    return q, k, v


def _only(way: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Leave ``attention`` one way to take: "flash" (the primitive), "kernel" (the row
    softmax kernel) or "graph" (the MLX graph)."""
    if way == "flash":
        if native_ops.native() is None:
            pytest.skip("the CPU primitives are not built (make ext)")
        return
    monkeypatch.setattr(native_ops, "chunk_attention", lambda *args, **kwargs: None)
    if way == "graph":
        monkeypatch.setattr(cpu_attention, "_kernels", None)
    elif cpu_attention._kernels is None:
        pytest.fail("the engine's _kernels extension is not built (make ext)")


@pytest.mark.parametrize("length,keys,heads,kv_heads", [(7, 7, 4, 4), (5, 40, 6, 2), (33, 300, 8, 1), (2, 9, 3, 3)])
@pytest.mark.parametrize("kind", ["causal", "none", "bool2d", "bool4d", "additive"])
@pytest.mark.parametrize("softmax", ["flash", "kernel", "graph"])
def test_it_computes_mlxs_attention_up_to_rounding(length, keys, heads, kv_heads, kind, softmax, monkeypatch):
    """Every way it takes: the flash-style primitive (no mask, the causal one), the row
    kernel (the same, where the primitive is not built; and mask arrays) and the MLX graph
    (every mask; no kernel built)."""
    _only(softmax, monkeypatch)
    monkeypatch.setattr(cpu_attention, "BLOCK_BYTES", 4 * heads * keys * 3)  # blocks of 3 queries
    monkeypatch.setattr(cpu_attention, "KERNEL_BLOCK_BYTES", 4 * heads * keys * 3)
    q, k, v = _qkv(length, keys, heads, kv_heads)
    mask = {"causal": "causal", "none": None,
            "bool2d": mx.random.uniform(shape=(length, keys)) > 0.4,
            "bool4d": mx.random.uniform(shape=(1, heads, length, keys)) > 0.4,
            "additive": mx.random.normal((1, 1, length, keys))}[kind]
    if isinstance(mask, mx.array) and mask.dtype == mx.bool_:
        mask[..., 0] = True  # every query sees a key
    ours = cpu_attention.attention(q, k, v, 0.25, mask)
    theirs = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
    assert ours.shape == theirs.shape == (1, heads, length, 16)
    assert mx.allclose(ours, theirs, rtol=1e-5, atol=1e-5).item(), float(mx.abs(ours - theirs).max())


@pytest.mark.parametrize("softmax", ["flash", "kernel", "graph"])
def test_masked_keys_weigh_exactly_nothing(softmax, monkeypatch):
    """A causal query's output does not change in any bit when the keys it may not see
    change (their exponentials are exactly 0, not merely tiny)."""
    _only(softmax, monkeypatch)
    q, k, v = _qkv(6, 20, 4, 2)
    before = cpu_attention.attention(q, k, v, 0.25, "causal")
    k2, v2 = mx.array(k), mx.array(v)
    k2[:, :, 15:] = 1e4  # the last 5 keys: only the last query sees the first of them
    v2[:, :, 15:] = -7.0
    after = cpu_attention.attention(q, k2, v2, 0.25, "causal")
    assert mx.array_equal(before[:, :, :1], after[:, :, :1]).item()


def test_the_exponential_is_close_and_exactly_zero_far_below():
    x = mx.concatenate([mx.linspace(-80.0, 0.0, 10_001), mx.array([-200.0, -mx.inf])])
    got = cpu_attention._exp_shifted(x, mx.array(0.0))
    want = mx.exp(x)
    assert mx.allclose(got[:-2], want[:-2], rtol=2e-6, atol=0).item()
    assert got[-2].item() == 0.0 and got[-1].item() == 0.0


def test_only_the_calls_it_covers_take_it():
    q, k, v = _qkv(4, 10, 4, 2)
    cpu_attention.use_on_this_thread(True)
    try:
        assert cpu_attention.applies(q, k, "causal")
        assert not cpu_attention.applies(q[:, :, :1], k, None)  # a decode step: MLX's vector kernel
        assert not cpu_attention.applies(q, k, "causal", sinks=mx.zeros((4,)))
        assert not cpu_attention.applies(q.astype(mx.float16), k.astype(mx.float16), "causal")
        assert not cpu_attention.applies(q, k, mx.zeros((1, 4, 10)))  # a 3-D mask: not a shape it maps
    finally:
        cpu_attention.use_on_this_thread(False)
    assert not cpu_attention.applies(q, k, "causal")


def _prefill_logits(model, tokens):
    cache = make_prompt_cache(model)
    out = model(mx.array(tokens)[None], cache=cache)
    mx.eval(out)
    return out


def test_swiglu_takes_the_calls_it_covers_and_matches_mlx():
    gate, up = mx.random.normal((1, 7, 40)) * 4, mx.random.normal((1, 7, 40))
    want = mx.sigmoid(gate) * gate * up
    cpu_attention.use_on_this_thread(True)
    try:
        assert cpu_attention.swiglu_applies(gate, up)
        assert not cpu_attention.swiglu_applies(gate[:, :1], up[:, :1])  # a decode step: traced, MLX's
        assert not cpu_attention.swiglu_applies(gate.astype(mx.float16), up.astype(mx.float16))
        got = cpu_attention.swiglu(gate, up)
    finally:
        cpu_attention.use_on_this_thread(False)
    assert not cpu_attention.swiglu_applies(gate, up)
    assert mx.allclose(got, want, rtol=1e-5, atol=1e-6).item()
    assert mx.allclose(gate * 1.0, gate).item()  # the gate itself is left as it was


def test_swiglu_reads_views_where_they_lie():
    """Gate and up as the columns of one product (a grouped gate-and-up projection): each
    row's values a whole width apart in one buffer, which MLX exports as it lies."""
    both = mx.random.normal((7, 80)) * 3
    mx.eval(both)
    gate, up = both[:, :40], both[:, 40:]
    want = mx.sigmoid(gate) * gate * up
    cpu_attention.use_on_this_thread(True)
    try:
        got = cpu_attention.swiglu(gate, up)
    finally:
        cpu_attention.use_on_this_thread(False)
    assert got is not None and mx.allclose(got, want, rtol=1e-5, atol=1e-6).item()
    assert mx.allclose(both[:, :40], gate).item()  # the product itself is left as it was


def test_installed_it_runs_on_the_opted_in_thread_only():
    loaded = load_model(str(tiny_model("qwen3")))
    model = loaded.model
    tokens = list(range(3, 60))
    reference = _prefill_logits(model, tokens)  # mlx-lm's attention (this thread never opted in)
    install_attention(model)  # (an engine that loaded qwen3 in this process may have done it)
    install_swiglu(model)
    assert sys.modules[type(model).__module__].scaled_dot_product_attention is mlx_lm_compat._attention
    assert sys.modules[type(model).__module__].swiglu is mlx_lm_compat._swiglu
    assert install_attention(model) == 0 and install_swiglu(model) == 0  # once per architecture module

    results: dict[str, mx.array] = {}

    def run(name: str, opt_in: bool) -> None:
        cpu_attention.use_on_this_thread(opt_in)
        results[name] = _prefill_logits(model, tokens)

    for name, opt_in in (("other", False), ("engine", True)):
        t = threading.Thread(target=run, args=(name, opt_in))
        t.start()
        t.join(T)
    assert mx.array_equal(results["other"], reference).item()  # bit for bit mlx-lm's
    assert mx.allclose(results["engine"], reference, rtol=1e-4, atol=1e-4).item()
    assert not cpu_attention.enabled()  # this thread never opted in


def _greedy_text(model: str, prompt: str, on: bool, tmp_path) -> list[int]:
    from mlxkv.engine.engine import Engine, Request
    from mlxkv.engine.settings import Settings

    settings = Settings.load({"model": model, "prefix_cache": False, "cpu_attention": on, "spec": "off",
                              "cache_dir": str(tmp_path / f"c{on}")}, env={})
    with Engine.from_settings(settings).start(timeout=T) as eng:
        r = eng.submit(Request(messages=[{"role": "user", "content": prompt}], params=greedy(max_tokens=24))
                       ).result(timeout=T)
    return r.tokens


@pytest.mark.parametrize("which", ["demo", "real"])
def test_the_engine_answers_the_same_with_it(which, tmp_path):
    if which == "real" and REAL is None:
        pytest.fail("the real model is not fetched: run `make fixtures`")
    from mlxkv.engine.demo import DEMO_MODEL_DIR, SAMPLE_QUESTIONS

    model = str(DEMO_MODEL_DIR) if which == "demo" else str(REAL)
    prompt = SAMPLE_QUESTIONS[0] if which == "demo" else "Write a Python function that reverses a list."
    prompt = prompt * (1 if which == "demo" else 6)  # a prompt long enough to cross query blocks
    assert _greedy_text(model, prompt, True, tmp_path) == _greedy_text(model, prompt, False, tmp_path)


def test_inside_mx_compile_the_kernels_give_way_to_the_graph():
    """A compiled step of several positions (a draft model's, say) traces through attention
    and swiglu: the kernels cannot eval there, so the MLX graph computes it, and the
    compiled result equals the uncompiled one. (A mask array: the causal mask goes to the
    flash-style primitive, which composes with mx.compile as any MLX op does.)"""
    q, k, v = _qkv(5, 12, 4, 2)
    gate, up = mx.random.normal((1, 5, 24)), mx.random.normal((1, 5, 24))
    causal = mx.arange(12)[None] <= mx.arange(7, 12)[:, None]

    def step(q, k, v, gate, up):
        return cpu_attention.attention(q, k, v, 0.25, causal), mlx_lm_compat._swiglu(gate, up)

    cpu_attention.use_on_this_thread(True)
    try:
        from mlx_lm.models import activations

        mlx_lm_compat._mlx_lm_swiglu = mlx_lm_compat._mlx_lm_swiglu or activations.swiglu
        want = step(q, k, v, gate, up)
        got = mx.compile(step)(q, k, v, gate, up)
    finally:
        cpu_attention.use_on_this_thread(False)
    for a, b in zip(want, got):
        assert mx.allclose(a, b, rtol=1e-5, atol=1e-6).item()


@pytest.mark.parametrize("setting, want", [("1", 1), ("3", 3), ("", None), ("0", None), ("two", None)])
def test_the_kernels_threads_follow_the_engines_thread_cap(monkeypatch, setting, want):
    """MLXKV_ROW_THREADS caps the kernels' threads as it caps the primitives' pool; an empty,
    zero or unreadable setting leaves every core (up to 8)."""
    monkeypatch.setenv("MLXKV_ROW_THREADS", setting)
    assert cpu_attention._threads() == (want or max(1, min(8, os.cpu_count() or 1)))
