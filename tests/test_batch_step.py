"""The compiled batch decode step (engine.batch_step) and the chunked CPU weight layout
(engine.weight_layout): rows decoded together through mlx-lm's BatchGenerator with the
compiled step give, greedy, token for token what each row gives alone (mlx-lm's own
generate_step on its own load of the folder), on llama, qwen2, qwen3 and the real model,
with rows joining and leaving mid-decode; the caches it leaves are mlx-lm's; a step that
would compute other numbers, or a cache it cannot run, decodes through the forward pass."""

from __future__ import annotations

import logging

import mlx.core as mx
import mlx.nn as nn
import pytest
from common import scaled_logits
from mlx_lm import load as mlx_lm_load
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

from mlxkv.engine import native_ops, weight_layout
from mlxkv.engine.batch_step import BatchStepModel, CompiledBatchStep, batch_decode_step
from mlxkv.engine.blas import blas_info
from mlxkv.engine.mlx_lm_compat import install_attention
from mlxkv.engine.models import load_model
from mlxkv.engine.weight_layout import (
    GROUPS,
    ChunkedEmbedding,
    ChunkedLinear,
    GroupedRowLinear,
    RowEmbedding,
    RowLinear,
    chunked_product,
    layout_for_cpu,
    row_product_available,
    to_chunks,
)
from support.modelgen import TEST_MODELS, build_random_model, tiny_model, tiny_model_of_type
from support.real_model import float32_folder, real_model_path

ROW_PRODUCT = pytest.mark.skipif(not row_product_available(), reason="the row product is not built (make ext)")


def folder(arch: str):
    return tiny_model_of_type(arch) if arch == "qwen2" else tiny_model(arch)


def alone(path, prompt: list[int], n: int, model=None) -> list[int]:
    """Greedy tokens of mlx-lm's generate_step on mlx-lm's own load of ``path``."""
    model = model if model is not None else mlx_lm_load(str(path))[0]
    return [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)]


def decode_together(model, prompts: list[list[int]], n: int, join: dict[int, list[int]] | None = None,
                    leave: dict[int, int] | None = None) -> dict[int, list[int]]:
    """Greedy tokens of each prompt decoded in one BatchGenerator over ``BatchStepModel``:
    ``join`` maps a step to a prompt inserted then, ``leave`` a prompt's index to the step it
    is removed at (its tokens so far kept). Returns tokens by prompt index."""
    gen = BatchGenerator(BatchStepModel(model), stop_tokens=None, completion_batch_size=8,
                         prefill_batch_size=8)
    index: dict[int, int] = {}

    def insert(i: int, prompt: list[int]) -> None:
        (uid,) = gen.insert([prompt], max_tokens=[n], caches=[make_prompt_cache(model)])
        index[uid] = i

    for i, p in enumerate(prompts):
        insert(i, p)
    out: dict[int, list[int]] = {i: [] for i in range(len(prompts) + len(join or {}))}
    waiting, removed = dict(join or {}), set()
    step = 0
    while waiting or not all(len(out[i]) >= n or i in removed for i in out):
        assert step < 1000
        if step in waiting:
            insert(len(prompts) + sorted(join).index(step), waiting.pop(step))
        for i, at in (leave or {}).items():
            if at == step:
                uid = next(u for u, j in index.items() if j == i)
                cache, tokens = gen.remove([uid], return_prompt_caches=True)[uid]
                assert all(type(c) is KVCache for c in cache) and cache[0].offset == len(tokens)
                removed.add(i)
        _, got = gen.next()
        for r in got:
            out[index[r.uid]].append(r.token)
        step += 1
    gen.close()
    return out


def prompts_for(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    return [[(i * 37 + seed * 11 + j * 5) % 200 + 3 for i in range(length)] for j, length in enumerate(lengths)]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_rows_decoded_together_are_each_row_alone(arch):
    path = folder(arch)
    loaded = load_model(str(path))
    reference = mlx_lm_load(str(path))[0]
    prompts = prompts_for(1, (5, 40, 23, 240))  # left padding up to 235; decoding crosses 256 slots
    got = decode_together(loaded.model, prompts, 24)
    assert batch_decode_step(loaded.model).enabled is True  # it ran compiled
    for i, p in enumerate(prompts):
        assert got[i] == alone(path, p, 24, reference), i


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_rows_joining_and_leaving_mid_decode_are_each_row_alone(arch):
    path = folder(arch)
    loaded = load_model(str(path))
    reference = mlx_lm_load(str(path))[0]
    prompts = prompts_for(2, (30, 9, 61))
    joiners = {4: prompts_for(3, (17,))[0], 9: prompts_for(4, (120,))[0]}
    got = decode_together(loaded.model, prompts, 20, join=joiners, leave={1: 6})
    assert batch_decode_step(loaded.model).enabled is True
    for i, p in enumerate(prompts + [joiners[4], joiners[9]]):
        want = alone(path, p, 20, reference)
        assert got[i] == want[: len(got[i])] and len(got[i]) >= (3 if i == 1 else 20), i


@pytest.mark.skipif(native_ops.native() is None, reason="the CPU primitives are not built (make ext)")
@pytest.mark.parametrize("native_blocks", [True, False])
def test_the_engines_attention_reads_each_rows_slots_past_its_padding(monkeypatch, native_blocks):
    """With the engine's attention installed (as loading does), the compiled step's layers
    attend through the slot primitive with each row's left padding as its first slot, not
    through a mask over the whole buffer: inside the native layer step (each row at its own
    position), or, without it, from the layer's own code; rows joining and leaving stay
    each row alone."""
    from mlxkv.engine import compiled_step, native_layers

    monkeypatch.setattr(native_layers, "ENABLED", native_blocks)
    path = folder("qwen3")
    loaded = load_model(str(path))
    install_attention(loaded.model)  # (the module stays rebound, as an engine's load leaves it)
    reference = mlx_lm_load(str(path))[0]
    attended = []

    def counting(module, name):
        primitive = getattr(module, name)

        def counted(*args, **kwargs):
            out = primitive(*args, **kwargs)
            attended.append(out is not None and kwargs.get("start") is not None)
            return out
        monkeypatch.setattr(module, name, counted)

    counting(compiled_step, "slot_attention")
    counting(native_layers, "decode_layer")
    prompts = prompts_for(6, (5, 40, 240))  # left padding up to 235; decoding crosses 256 slots
    joiners = {5: prompts_for(7, (90,))[0]}
    got = decode_together(loaded.model, prompts, 24, join=joiners, leave={0: 8})
    assert batch_decode_step(loaded.model).enabled is True
    assert attended and all(attended)  # traced through the primitive, every layer
    assert any(type(layer).__name__.startswith("Native") for layer in loaded.model.layers) == native_blocks
    for i, p in enumerate(prompts + [joiners[5]]):
        want = alone(path, p, 24, reference)
        assert got[i] == want[: len(got[i])] and len(got[i]) >= (4 if i == 0 else 24), i


def test_the_compiled_step_computes_the_forward_passs_numbers():
    loaded = load_model(str(folder("qwen3")))
    model = loaded.model
    layout_for_cpu(model)
    caches = []
    for p in prompts_for(5, (12, 30, 7)):
        c = make_prompt_cache(model)
        mx.eval(model(mx.array([p]), cache=c))
        caches.append(c)
    batch = [BatchKVCache.merge([c[layer] for c in caches]) for layer in range(len(caches[0]))]
    step = CompiledBatchStep(model)
    x = mx.array([[11], [12], [13]])
    got = step(x, batch)  # its first use: checked against the forward pass over 3 steps
    assert step.enabled is True
    assert all(type(c) is BatchKVCache for c in batch) and batch[0].state[4] == 31
    assert batch[0].state[0].shape[2] % 256 == 0  # its buffers at full capacity
    for c in batch:
        c.trim(1)
    want = model(x, cache=batch)[:, -1, :]
    assert mx.allclose(got, want, rtol=1e-5, atol=1e-5).item()
    for c in batch:
        c.trim(1)
    again = step(x, batch)  # compiled now: what it wrote is what the forward pass wrote
    assert mx.allclose(again, want, rtol=1e-5, atol=1e-5).item()


def test_a_step_that_differs_from_the_forward_pass_is_not_used(caplog):
    model = scaled_logits(load_model(str(tiny_model("qwen3"))).model, BatchKVCache)
    caches = []
    for p in prompts_for(6, (4, 9)):
        c = make_prompt_cache(model.inner)
        mx.eval(model.inner(mx.array([p]), cache=c))
        caches.append(c)
    batch = [BatchKVCache.merge([c[layer] for c in caches]) for layer in range(len(caches[0]))]
    step = CompiledBatchStep(model)
    x = mx.array([[6], [7]])
    with caplog.at_level(logging.DEBUG, logger="mlxkv.engine"):
        got = step(x, batch)
    assert step.enabled is False
    assert sum("compiled batch decode step differs" in r.getMessage() for r in caplog.records) == 1, caplog.text
    assert batch[0].state[4] == 10
    for c in batch:
        c.trim(1)
    assert mx.array_equal(got, model(x, cache=batch)[:, -1, :]).item()


def test_a_sliding_window_batch_decodes_through_the_forward_pass():
    path = build_random_model(TEST_MODELS / "llama-tiny-sliding16", arch="llama", sliding_window=16,
                              layer_types=["sliding_attention", "full_attention"])
    loaded = load_model(str(path))
    reference = mlx_lm_load(str(path))[0]
    prompts = prompts_for(7, (10, 33))
    got = decode_together(loaded.model, prompts, 12)
    assert batch_decode_step(loaded.model).enabled is not True
    for i, p in enumerate(prompts):
        assert got[i] == alone(path, p, 12, reference), i


@pytest.mark.parametrize("path", ["chunks", pytest.param("rows", marks=ROW_PRODUCT)])
def test_the_cpu_layouts_keep_every_product(path):
    loaded = load_model(str(folder("qwen2")))  # q/k/v with a bias
    model = loaded.model
    before = {n: (type(m), m.weight) for n, m in model.named_modules() if type(m) in (nn.Linear, nn.Embedding)}
    embed = model.model.embed_tokens
    tokens = mx.array([[3, 170, 4, 199]])
    rows, head_in = embed(tokens), mx.random.normal((5, embed.weight.shape[1]))
    head = head_in @ embed.weight.T
    assert layout_for_cpu(model, path) == len(before) and layout_for_cpu(model, path) == 0
    linear, embedding = (ChunkedLinear, ChunkedEmbedding) if path == "chunks" else (RowLinear, RowEmbedding)
    grouped = {n for group in GROUPS for n in group}
    for name, module in model.named_modules():
        if name in before:
            kind, weight = before[name]
            if path == "rows" and name.rsplit(".", 1)[-1] in grouped:
                assert type(module) is GroupedRowLinear  # its rows in the group's one matrix
            else:
                assert type(module) is (linear if kind is nn.Linear else embedding)
            if path == "chunks":
                assert "weight" not in module.parameters() and module.weight.shape == weight.shape
            elif type(module) is not GroupedRowLinear:
                assert module["weight"] is weight  # nothing copied
            assert mx.array_equal(module.weight, weight).item()  # the lazy view holds the same numbers
    assert embed is model.model.embed_tokens  # changed in place
    assert mx.array_equal(embed(tokens), rows).item()
    assert mx.allclose(embed.as_linear(head_in), head, rtol=1e-5, atol=1e-5).item()
    x = mx.random.normal((3, 40, embed.weight.shape[1]))  # more rows than a row product takes
    assert mx.allclose(embed.as_linear(x), x @ embed.weight.T, rtol=1e-5, atol=1e-5).item()
    attn = model.model.layers[0].self_attn
    for rows in (1, 3, 16, 17, 24, 25):
        x = mx.random.normal((rows, attn.q_proj.weight.shape[1]))
        for layer in (attn.q_proj, attn.k_proj, attn.v_proj):  # in order, as the layer calls them
            assert mx.allclose(layer(x), x @ layer.weight.T + layer.bias, rtol=1e-5, atol=1e-5).item(), rows


@ROW_PRODUCT
def test_sibling_projections_multiply_once_and_give_each_its_own_columns():
    model = load_model(str(folder("qwen3"))).model
    mlp = model.model.layers[1].mlp
    attn = model.model.layers[1].self_attn
    plain = {n: mx.array(m.weight) for n, m in (("gate", mlp.gate_proj), ("up", mlp.up_proj), ("q", attn.q_proj),
                                                ("k", attn.k_proj), ("v", attn.v_proj))}
    layout_for_cpu(model)
    assert type(mlp.gate_proj) is GroupedRowLinear and mlp.gate_proj.group is mlp.up_proj.group
    group = attn.q_proj.group
    assert group is attn.k_proj.group is attn.v_proj.group and group.fused.shape[0] == sum(
        plain[n].shape[0] for n in "qkv")
    x = mx.random.normal((4, plain["q"].shape[1]))
    calls = []
    real_product = weight_layout.row_product

    def counted(a, w):
        calls.append(w.shape)
        return real_product(a, w)

    weight_layout.row_product = counted
    try:
        q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        assert calls == [group.fused.shape]  # one product for the three
        for got, n in ((q, "q"), (k, "k"), (v, "v")):
            assert mx.allclose(got, x @ plain[n].T, rtol=1e-5, atol=1e-5).item(), n
        # a model that feeds a member another input: the group stops, each multiplies alone
        other = mx.random.normal(x.shape)
        q, k = attn.q_proj(x), attn.k_proj(other)
        assert not group.on
        assert mx.allclose(q, x @ plain["q"].T, rtol=1e-5, atol=1e-5).item()
        assert mx.allclose(k, other @ plain["k"].T, rtol=1e-5, atol=1e-5).item()
        assert mx.allclose(attn.v_proj(x), x @ plain["v"].T, rtol=1e-5, atol=1e-5).item()
    finally:
        weight_layout.row_product = real_product
    # the MLP's group still runs, and a prefill's many rows take sgemm member by member
    for rows in (2, 40):
        x = mx.random.normal((rows, plain["gate"].shape[1]))
        for layer, n in ((mlp.gate_proj, "gate"), (mlp.up_proj, "up")):
            assert mx.allclose(layer(x), x @ plain[n].T, rtol=1e-4, atol=1e-4).item(), (rows, n)
    assert mlp.gate_proj.group.on


@pytest.mark.skipif(not blas_info().get("active"), reason="the small-matrix kernels are OpenBLAS's")
def test_a_chunked_product_of_rows_is_each_row_alone_bit_for_bit():
    weight = mx.random.normal((1536, 576), key=mx.random.key(3))
    chunks = to_chunks(weight)
    x = mx.random.normal((8, 576), key=mx.random.key(4))
    together = chunked_product(x, chunks)
    for i in range(8):
        assert mx.array_equal(together[i: i + 1], chunked_product(x[i: i + 1], chunks)).item()


REAL = real_model_path()


@pytest.mark.skipif(REAL is None, reason="the real model is not fetched: run `make fixtures`")
def test_the_real_model_decodes_rows_together_as_each_alone():
    path = float32_folder(REAL)
    loaded = load_model(str(path))
    reference, _ = mlx_lm_load(str(path))
    texts = ("What is the capital of France?", "Write a haiku about the sea.",
             "List three prime numbers.")
    prompts = [loaded.tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)
               for t in texts]
    got = decode_together(loaded.model, prompts, 20)
    assert batch_decode_step(loaded.model).enabled is True
    for i, p in enumerate(prompts):
        assert got[i] == alone(path, p, 20, reference), texts[i]
