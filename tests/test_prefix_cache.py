"""Prefix cache: reuse from RAM, SSD and after a restart gives exactly the cold-run output;
namespaces never mix; corrupt blocks fall back to recompute; flush tells the truth;
lending is copy-on-write; non-trimmable caches are restored only at exact checkpoints."""

from __future__ import annotations

import os
import random
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, make_prompt_cache

from mlxkv.engine.cache import NullPrefixCache, PrefixCache
from mlxkv.engine.cache.tokens import store_namespace
from support.modelgen import init_model

BT = 16  # small blocks so short prompts span several


# ----------------------------------------------------------------------------- helpers
@pytest.fixture(scope="module")
def llama(tiny_llama):
    from mlx_lm import load

    model, _ = load(str(tiny_llama))
    return model


@pytest.fixture(scope="module")
def qwen3(tiny_qwen3):
    from mlx_lm import load

    model, _ = load(str(tiny_qwen3))
    return model


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def run(model, tokens, n_new=6, cache=None, n_cached=0):
    """Greedy generation; returns (new tokens, logits of the last prompt position, cache).
    The cache afterwards holds ``tokens + new`` (every generated token was fed back)."""
    if cache is None:
        assert n_cached == 0
        cache = make_prompt_cache(model)
    logits = model(mx.array(tokens[n_cached:])[None], cache=cache)[0, -1]
    first = logits
    out = []
    for _ in range(n_new):
        t = int(mx.argmax(logits).item())
        out.append(t)
        logits = model(mx.array([[t]]), cache=cache)[0, -1]
    mx.eval(first)
    return out, np.array(first), cache


def assert_same(model, tokens, n, cache, n_new=6):
    """Continuing from the cached prefix equals the cold run: tokens and logits."""
    cold, cold_logits, _ = run(model, tokens, n_new)
    warm, warm_logits, cache = run(model, tokens, n_new, cache, n)
    assert warm == cold
    np.testing.assert_allclose(warm_logits, cold_logits, rtol=1e-4, atol=1e-4)
    return warm, cache


def pc_at(path: Path | None, **kw) -> PrefixCache:
    kw.setdefault("ram_bytes", 1 << 30)
    kw.setdefault("block_tokens", BT)
    return PrefixCache(cache_dir=None if path is None else str(path), **kw)


# ----------------------------------------------------------------------------- RAM tier
@pytest.mark.parametrize("which", ["llama", "qwen3"])
def test_ram_hit_is_token_identical(which, request):
    model = request.getfixturevalue(which)
    pc = pc_at(None)
    ns = "ns-a"
    t1 = prompt(70, 1)
    assert pc.lookup(t1, ns) == (0, None)
    out, _, cache = run(model, t1)
    pc.store(t1 + out, cache, ns)
    # next turn continues exactly where the last one ended: only the new tokens are computed
    t2 = t1 + out + prompt(9, 2)
    n, c = pc.lookup(t2, ns)
    assert n == len(t1) + len(out)
    assert all(type(x) is KVCache and x.offset == n for x in c)
    warm, c = assert_same(model, t2, n, c)
    pc.store(t2 + warm, c, ns)  # as the engine does after every turn
    # a prompt that diverges inside a block reuses the common prefix (trimmed)
    t3 = t1[:37] + prompt(20, 3)
    n3, c3 = pc.lookup(t3, ns)
    held = t2 + warm  # the one state in RAM now (it superseded t1 + out)
    same = next(i for i, (a, b) in enumerate(zip(t3, held)) if a != b)
    assert same >= 37 and n3 == same  # exactly the common prefix: no more, no less
    assert_same(model, t3, n3, c3)
    s = pc.stats()
    assert s["ram_hits"] == 2 and s["misses"] == 1 and s["cached_tokens"] == n + n3
    pc.close()


def test_always_leaves_one_token_to_compute(llama):
    pc = pc_at(None)
    t = prompt(40, 4)
    _, _, cache = run(llama, t, n_new=0)
    pc.store(t, cache, "ns")
    n, c = pc.lookup(t, "ns")  # the exact stored sequence: all but the last token
    assert n == len(t) - 1 and c[0].offset == n
    assert_same(llama, t, n, c)
    assert pc.lookup(t[:1], "ns") == (0, None)
    pc.close()


def test_lending_is_copy_on_write(llama):
    pc = pc_at(None)
    t = prompt(50, 5)
    _, _, cache = run(llama, t, n_new=0)
    pc.store(t, cache, "ns")
    entry = next(iter(pc.ram.entries.values()))
    slab = entry.runs[0].slab
    before = [np.array(a) for layer in slab.arrays for a in layer]
    t2 = t[:45] + [7, 8, 9]  # shares a prefix of the entry: lent, never handed over
    n, lent = pc.lookup(t2, "ns")
    assert n == 45 and pc.ram.moves == 0
    # the borrower writes into its cache (prefill, decode, and a direct slice assignment)
    run(llama, t2, 4, lent, n)
    lent[0].keys[..., :5, :] = mx.ones_like(lent[0].keys[..., :5, :])
    mx.eval(lent[0].keys)
    after = [np.array(a) for layer in slab.arrays for a in layer]
    for b, a in zip(before, after):
        np.testing.assert_array_equal(a, b)
    # and a second borrower still gets the exact state
    n2, lent2 = pc.lookup(t2, "ns")
    assert_same(llama, t2, n2, lent2)
    pc.close()


def _address(a: mx.array) -> int:
    return np.frombuffer(memoryview(a).cast("B"), dtype=np.uint8).ctypes.data


def test_exact_continuation_is_handed_over_and_written_in_place(llama):
    pc = pc_at(None)
    t = prompt(50, 5)
    _, _, cache = run(llama, t, n_new=0)
    addr = _address(cache[0].keys)
    pc.store(t, cache, "ns")
    del cache  # as the engine does: only the prefix cache holds the state between turns
    t2 = t + [7, 8, 9]
    n, c = pc.lookup(t2, "ns")
    assert n == len(t) and pc.ram.moves == 1 and len(pc.ram) == 0
    assert _address(c[0].keys) == addr
    warm, c = assert_same(llama, t2, n, c)
    assert _address(c[0].keys) == addr  # the new turn was written in place: no copy
    pc.store(t2 + warm, c, "ns")  # and the state is back for the next turn
    assert pc.lookup(t2 + warm + [1], "ns")[0] == len(t2) + len(warm)
    pc.close()


def test_shared_prefix_is_stored_once(llama):
    pc = pc_at(None)
    system = prompt(8 * BT, 6)
    _, _, c0 = run(llama, system, n_new=0)
    pc.store(system, c0, "ns")
    one_copy = pc.ram.nbytes
    per_token = sum(a.nbytes // a.shape[2] for x in c0 for a in (x.keys, x.values))
    unique = 0
    for i in range(8):
        t = system + prompt(5 + i, 100 + i)
        n, c = pc.lookup(t, "ns")
        assert n == len(system)
        _, _, c = run(llama, t, n_new=0, cache=c, n_cached=n)
        pc.store(t, c, "ns")
        unique += per_token * (len(t) - len(system))
    s = pc.stats()
    assert s["ram_entries"] == 8  # the system prompt's own entry is reachable through them
    assert pc.ram.nbytes <= 1.2 * (one_copy + unique)
    assert s["dedup_ratio"] > 3
    for i in range(8):  # every conversation still comes back exactly
        t = system + prompt(5 + i, 100 + i) + [1, 2]
        n, c = pc.lookup(t, "ns")
        assert n == len(t) - 2
    assert_same(llama, t, n, c)
    pc.close()


def test_namespaces_never_mix(llama, tmp_path):
    pc = pc_at(tmp_path)
    t = prompt(60, 7)
    _, _, cache = run(llama, t, n_new=0)
    pc.store(t, cache, "model-a-float32")
    assert pc.lookup(t + [1], "model-b-float32") == (0, None)
    assert pc.lookup(t + [1], "model-a-float32")[0] == len(t)
    pc.flush(30)
    pc.close()
    pc2 = pc_at(tmp_path)
    assert pc2.lookup(t + [1], "model-b-float32") == (0, None)
    assert pc2.stats()["ssd_hits"] == 0
    assert pc2.lookup(t + [1], "model-a-float32")[0] == len(t)
    assert pc2.stats()["ssd_hits"] == 1
    pc2.close()


def test_lru_evicts_by_bytes_and_sessions_stay_warm(llama):
    t_a, t_b, t_c = prompt(40, 8), prompt(40, 9), prompt(40, 10)
    _, _, ca = run(llama, t_a, n_new=0)
    pc = pc_at(None, ram_bytes=1 << 30)
    pc.store(t_a, ca, "ns")
    one = pc.ram.nbytes
    pc.close()
    pc = pc_at(None, ram_bytes=int(2.5 * one))
    pc.open_session("chat-1")
    _, _, ca = run(llama, t_a, n_new=0)
    pc.store(t_a, ca, "ns", session="chat-1")
    for t in (t_b, t_c, prompt(40, 11)):
        _, _, c = run(llama, t, n_new=0)
        pc.store(t, c, "ns")
        assert pc.ram.nbytes <= pc.ram.max_bytes
    # the session's entry stayed while the oldest anonymous ones were evicted
    assert pc.lookup(t_a + [3], "ns", session="chat-1")[0] == len(t_a)
    assert pc.lookup(t_b + [3], "ns")[0] == 0
    pc.close_session("chat-1")
    for seed in (12, 13, 14):
        _, _, c = run(llama, prompt(40, seed), n_new=0)
        pc.store(prompt(40, seed), c, "ns")
    assert pc.lookup(t_a + [3], "ns")[0] == 0
    pc.close()


# ----------------------------------------------------------------------------- SSD tier
def test_ssd_restore_after_restart_is_token_identical(qwen3, tmp_path):
    pc = pc_at(tmp_path)
    ns = "qwen3-test-float32"
    t1 = prompt(75, 20)
    out, _, cache = run(qwen3, t1)
    pc.store(t1 + out, cache, ns)
    rep = pc.close(30)
    assert rep["durable"] == 1 and rep["pending"] == 0 and rep["failed"] == 0
    pc2 = pc_at(tmp_path)  # a new process: empty RAM, same folder
    t2 = t1 + out + prompt(7, 21)
    n, c = pc2.lookup(t2, ns)
    assert n == len(t1) + len(out)
    assert pc2.stats()["last"]["tier"] == "ssd"
    assert pc2.io.counts()["read"] == 1  # restored by the storage reader thread
    # restored straight into the lent arrays, with headroom for this prompt's prefill
    assert c[0].keys.shape[2] >= len(t2) and c[0].offset == n
    warm, c = assert_same(qwen3, t2, n, c)
    # the restored + extended state goes back to RAM: the next turn is a RAM hit
    pc2.store(t2 + warm, c, ns)
    t3 = t2 + warm + [5, 6]
    n3, c3 = pc2.lookup(t3, ns)
    assert n3 == len(t2) + len(warm) and pc2.stats()["last"]["tier"] == "ram"
    assert_same(qwen3, t3, n3, c3)
    pc2.close()


def test_ssd_used_when_ram_evicted(llama, tmp_path):
    t = prompt(64, 22)
    _, _, c = run(llama, t, n_new=0)
    pc = pc_at(tmp_path, ram_bytes=1)  # nothing stays in RAM
    pc.store(t, c, "ns")
    assert pc.stats()["ram_entries"] == 0
    pc.flush(30)
    n, c2 = pc.lookup(t + [9, 9], "ns")
    assert n == len(t) and pc.stats()["last"]["tier"] == "ssd"
    assert_same(llama, t + [9, 9], n, c2)
    pc.close()


def test_ram_hit_covering_the_prompt_skips_the_ssd_tier(llama, tmp_path):
    t = prompt(40, 23)
    _, _, c = run(llama, t, n_new=0)
    pc = pc_at(tmp_path)
    pc.store(t, c, "ns")
    looked: list[int] = []
    real = pc.disk.lookup
    pc.disk.lookup = lambda *a, **kw: looked.append(1) or real(*a, **kw)
    n, _ = pc.lookup(t + [9], "ns")  # RAM already has every usable token
    assert n == len(t) and pc.stats()["last"]["tier"] == "ram" and not looked
    n, _ = pc.lookup(prompt(40, 24), "ns")  # a miss still asks the SSD tier
    assert n == 0 and looked
    pc.close()


def test_corrupt_block_falls_back_to_recompute(llama, tmp_path):
    pc = pc_at(tmp_path)
    t = prompt(5 * BT + 3, 23)
    _, _, c = run(llama, t, n_new=0)
    pc.store(t, c, "ns")
    pc.close(30)
    # flip one payload byte in the third block
    key = pc.disk.chain_keys("ns", np.array(t))[2].hex()
    path = tmp_path / "ns" / key[:2] / f"{key}.blk"  # the store's documented file layout
    data = bytearray(path.read_bytes())
    data[4096 + 10] ^= 0x5A  # the payload starts on the first page boundary after the header
    path.write_bytes(bytes(data))
    pc2 = pc_at(tmp_path)
    t2 = t + [4, 4, 4]
    n, c2 = pc2.lookup(t2, "ns")
    assert n == 2 * BT  # only the verified blocks before the corrupt one
    assert pc2.stats()["ssd_corrupt"] == 1
    assert_same(llama, t2, n, c2)
    assert not path.exists()  # the corrupt block was removed
    n_again, _ = pc2.lookup(t2, "ns")
    assert n_again == 2 * BT
    pc2.close()


def test_flush_reports_only_what_is_on_disk(llama, tmp_path):
    pc = pc_at(tmp_path, debounce_s=3600)  # nothing is written until flushed
    t = prompt(40, 24)
    _, _, c = run(llama, t, n_new=0)
    pc.store(t, c, "ns")
    assert pc.durability.report() == {"durable": 0, "flushed": 0, "pending": 1, "failed": 0,
                                      "missing": 0}
    assert pc.disk.stats()["blocks"] == 0
    rep = pc.flush(30)
    assert rep == {"durable": 1, "flushed": 1, "pending": 0, "failed": 0, "missing": 0}
    assert pc.disk.stats()["blocks"] == len(t) // BT
    for e in os.scandir(tmp_path / "ns"):
        assert not e.name.endswith(".tmp")
    pc.close()


def test_failed_writes_are_never_called_durable(llama, tmp_path):
    pc = pc_at(tmp_path, retries=1, ram_bytes=1 << 30)
    # make the namespace folder impossible to create (even for root): a file in its place
    blocker = tmp_path / store_namespace("ns")
    blocker.write_bytes(b"not a folder")
    t = prompt(40, 25)
    _, _, c = run(llama, t, n_new=0)
    pc.store(t, c, "ns")
    rep = pc.flush(30)
    assert rep["durable"] == 0 and rep["failed"] == 1 and rep["pending"] == 0
    assert pc.durability.counts["retried"] == 1
    assert pc.lookup(t + [1], "ns")[0] == len(t)  # RAM still serves it
    # the disk becomes usable again: the next flush writes what had failed
    blocker.unlink()
    rep = pc.flush(30)
    assert rep == {"durable": 1, "flushed": 1, "pending": 0, "failed": 0, "missing": 0}
    assert pc.disk.longest_prefix("ns", t) == len(t)
    # another write fails, then its state leaves RAM: gone for good -> missing, never durable
    (tmp_path / store_namespace("ns2")).write_bytes(b"not a folder")
    t2 = prompt(40, 26)
    _, _, c2 = run(llama, t2, n_new=0)
    pc.store(t2, c2, "ns2")
    rep = pc.flush(30)
    assert rep["failed"] == 1 and rep["durable"] == 1
    pc.ram.max_bytes = 0
    pc.ram.evict()
    rep = pc.flush(30)
    assert rep == {"durable": 1, "flushed": 0, "pending": 0, "failed": 0, "missing": 1}
    assert pc.durability.queue_depth()["pinned_bytes"] == 0
    pc.close()


def test_writes_are_coalesced(llama, tmp_path):
    pc = pc_at(tmp_path, debounce_s=3600)
    t = prompt(30, 26)
    out, _, c = run(llama, t, n_new=4)
    pc.store(t + out, c, "ns")
    t2 = t + out + [8, 9]
    n, c2 = pc.lookup(t2, "ns")
    out2, _, c2 = run(llama, t2, 4, c2, n)
    pc.store(t2 + out2, c2, "ns")
    rep = pc.flush(30)
    # the first state was superseded by the second, which covers all its blocks
    assert rep["flushed"] == 1 and rep["durable"] == 2 and pc.durability.counts["superseded"] == 1
    pc.close()


def test_quantized_kv_cache_round_trips_through_ram_and_ssd(tmp_path):
    from mlx_lm.models.cache import QuantizedKVCache

    from support.modelgen import model_config

    llama = init_model(model_config("llama", 512, head_dim=32), seed=2)  # quantizable heads
    t = prompt(2 * BT + 7, 27)
    rest = prompt(5, 28)

    def quantized_state():
        cache = make_prompt_cache(llama)
        llama(mx.array(t)[None], cache=cache)
        q = [c.to_quantized(group_size=32, bits=8) for c in cache]
        mx.eval([x.state for x in q])
        return q

    def continue_from(cache):
        return np.array(llama(mx.array(rest)[None], cache=cache)[0, -1])

    expected = continue_from(quantized_state())
    pc = pc_at(tmp_path)
    pc.store(t, quantized_state(), "ns-q8")
    n, c = pc.lookup(t + rest, "ns-q8")
    assert n == len(t) and all(type(x) is QuantizedKVCache for x in c)
    np.testing.assert_allclose(continue_from(c), expected, rtol=1e-5, atol=1e-5)
    pc.close(30)
    pc2 = pc_at(tmp_path)  # restart: restored from SSD with the same quantized layout
    n, c = pc2.lookup(t + rest, "ns-q8")
    assert n == len(t) and pc2.stats()["last"]["tier"] == "ssd"
    assert all(type(x) is QuantizedKVCache and x.bits == 8 and x.group_size == 32 for x in c)
    np.testing.assert_allclose(continue_from(c), expected, rtol=1e-5, atol=1e-5)
    pc2.close()


# ----------------------------------------------------------------------------- checkpoints
GEMMA3 = {"model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": 2,
          "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 16, "query_pre_attn_scalar": 16, "vocab_size": 512, "sliding_window": 16,
          "sliding_window_pattern": 2, "max_position_embeddings": 4096}
QWEN3_NEXT = {"model_type": "qwen3_next", "hidden_size": 64, "num_hidden_layers": 2,
              "intermediate_size": 128, "num_attention_heads": 4, "linear_num_value_heads": 2,
              "linear_num_key_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
              "linear_conv_kernel_dim": 4, "num_experts": 4, "num_experts_per_tok": 2,
              "decoder_sparse_step": 1, "shared_expert_intermediate_size": 64,
              "mlp_only_layers": [0, 1], "moe_intermediate_size": 64, "rms_norm_eps": 1e-6,
              "vocab_size": 512, "num_key_value_heads": 2, "rope_theta": 10000.0,
              "partial_rotary_factor": 0.5, "max_position_embeddings": 4096, "head_dim": 16,
              "full_attention_interval": 2}


MAMBA = {"model_type": "mamba", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
         "state_size": 8, "num_hidden_layers": 2, "conv_kernel": 4, "use_bias": False,
         "use_conv_bias": True, "time_step_rank": 8}  # SSM state only, no KV at all
CKPT_MODELS = [GEMMA3, QWEN3_NEXT, MAMBA]
CKPT_IDS = ["rotating+kv", "ssm+kv", "ssm-only"]


@pytest.mark.parametrize("config", CKPT_MODELS, ids=CKPT_IDS)
def test_non_trimmable_caches_restore_only_at_checkpoints(config, tmp_path):
    model = init_model(config, seed=1, scale=0.1)
    kinds = {type(c).__name__ for c in make_prompt_cache(model)}
    assert kinds - {"KVCache"}  # really a non-trimmable model
    pc = pc_at(tmp_path)
    ns = config["model_type"]
    t1 = prompt(45, 30)  # longer than the sliding window: the ring has wrapped
    out, _, cache = run(model, t1)
    pc.store(t1 + out, cache, ns)
    assert pc.stats()["checkpoint_stores"] == 1
    # exactly where the turn ended: restored
    t2 = t1 + out + prompt(5, 31)
    n, c = pc.lookup(t2, ns)
    assert n == len(t1) + len(out)
    assert_same(model, t2, n, c)
    # again from the same checkpoint (the first borrower did not change it)
    n, c = pc.lookup(t2, ns)
    assert_same(model, t2, n, c)
    # diverging inside the stored range: no checkpoint there, so nothing (never a wrong state)
    t3 = t1[:30] + prompt(20, 32)
    assert pc.lookup(t3, ns) == (0, None)
    # the exact stored sequence: its checkpoint would leave nothing to compute -> miss
    assert pc.lookup(t1 + out, ns) == (0, None)
    pc.close()


@pytest.mark.parametrize("config", CKPT_MODELS, ids=CKPT_IDS)
def test_checkpoints_persist_and_restore_after_restart(config, tmp_path):
    model = init_model(config, seed=1, scale=0.1)
    ns = config["model_type"] + "-float32"
    t1 = prompt(2 * BT + 13, 33)  # a ring that wrapped, KV over full blocks and a tail
    out, _, cache = run(model, t1)
    pc = pc_at(tmp_path)
    pc.store(t1 + out, cache, ns)
    assert pc.stats()["checkpoints_persisted"] == 1
    rep = pc.close(30)
    assert rep == {"durable": 1, "flushed": 1, "pending": 0, "failed": 0, "missing": 0}
    has_kv = "KVCache" in {type(x).__name__ for x in make_prompt_cache(model)}
    st = pc.stats()
    assert st["ssd_checkpoints"] == 1 and (st["ssd_blocks"] > 0) == has_kv

    pc2 = pc_at(tmp_path)  # a new process: empty RAM, same folder
    stored = len(t1) + len(out)
    t2 = t1 + out + prompt(6, 34)
    n, c = pc2.lookup(t2, ns)
    assert n == stored and pc2.stats()["last"]["tier"] == "ssd"
    assert [type(x) for x in c] == [type(x) for x in make_prompt_cache(model)]
    warm, c = assert_same(model, t2, n, c)
    # the restored + extended state is a new checkpoint: in RAM now, and on disk
    pc2.store(t2 + warm, c, ns)
    t3 = t2 + warm + [5, 6]
    n3, c3 = pc2.lookup(t3, ns)
    assert n3 == len(t2) + len(warm) and pc2.stats()["last"]["tier"] == "ram"
    assert_same(model, t3, n3, c3)
    # only at exact checkpoint positions: a prompt that diverges inside the stored range
    # (even after whole KV blocks that are on disk) restores nothing
    assert pc2.lookup(t1[: 2 * BT + 5] + prompt(9, 35), ns) == (0, None)
    assert pc2.lookup(t1 + out, ns) == (0, None)  # would leave nothing to compute
    rep = pc2.close(30)
    assert rep["durable"] == 1 and rep["pending"] == 0 and pc2.disk.stats()["checkpoints"] == 2

    pc3 = pc_at(tmp_path, ram_bytes=1)  # restart again, and RAM too small to hold anything
    for toks, at in ((t2, stored), (t3, n3)):  # both checkpoints, each at its position
        n, c = pc3.lookup(toks, ns)
        assert n == at and pc3.stats()["last"]["tier"] == "ssd"
        assert_same(model, toks, n, c)
    pc3.close()


def test_checkpoints_are_never_coalesced(tmp_path):
    # a longer state covers a shorter one's blocks, never its exact-position checkpoint
    model = init_model(MAMBA, seed=1, scale=0.1)
    pc = pc_at(tmp_path, debounce_s=3600)
    t = prompt(BT + 3, 38)
    out, _, c = run(model, t, n_new=3)
    pc.store(t + out, c, "ns")
    t2 = t + out + [9, 9]
    n, c2 = pc.lookup(t2, "ns")
    out2, _, c2 = run(model, t2, 3, c2, n)
    pc.store(t2 + out2, c2, "ns")
    rep = pc.flush(30)
    assert rep["durable"] == 2 and rep["flushed"] == 2
    assert pc.durability.counts["superseded"] == 0 and pc.disk.stats()["checkpoints"] == 2
    pc.close()


def test_corrupt_checkpoint_is_never_restored(tmp_path):
    model = init_model(QWEN3_NEXT, seed=1, scale=0.1)
    t = prompt(BT + 9, 36)
    _, _, cache = run(model, t, n_new=0)
    pc = pc_at(tmp_path)
    pc.store(t, cache, "ns")
    pc.close(30)
    [path] = list(tmp_path.glob("ns/*/*.ckpt"))
    data = bytearray(path.read_bytes())
    data[-1 - (len(data) % 4096 or 4096) // 2] ^= 0x5A  # a byte of the (last) payload page
    data[4096 + 3] ^= 0x11  # and one at the start of the payload (the skeleton)
    path.write_bytes(bytes(data))
    pc2 = pc_at(tmp_path)
    assert pc2.lookup(t + [3, 4], "ns") == (0, None)  # recompute, never a wrong state
    assert pc2.stats()["ssd_corrupt"] == 1
    assert not path.exists()
    pc2.close()


def test_failed_request_gives_back_a_handed_over_entry(llama):
    pc = pc_at(None)
    t = prompt(50, 37)
    _, _, cache = run(llama, t, n_new=0)
    pc.store(t, cache, "ns")
    del cache
    t2 = t + [7, 8, 9]
    n, c = pc.lookup(t2, "ns")
    assert n == len(t) and pc.ram.moves == 1 and len(pc.ram) == 0  # handed over
    # the request writes part of its prompt in place, then fails before it stores
    llama(mx.array(t2[n : n + 2])[None], cache=c)
    mx.eval([x.state for x in c])
    assert pc.release(c) is True
    assert pc.release(c) is False  # once
    n2, c2 = pc.lookup(t2, "ns")
    assert n2 == len(t) and pc.ram.moves == 2
    warm, c2 = assert_same(llama, t2, n2, c2)
    pc.store(t2 + warm, c2, "ns")
    # a lent (shared) cache borrowed nothing: release is a no-op
    t3 = t[:40] + [1, 2]
    n3, c3 = pc.lookup(t3, "ns")
    assert n3 == 40 and pc.release(c3) is False and pc.ram.moves == 2
    # a store that rejects its input gives the handed-over entry back too
    t4 = t2 + warm + [4, 5]
    n4, c4 = pc.lookup(t4, "ns")
    assert n4 == len(t2 + warm) and pc.ram.moves == 3 and len(pc.ram) == 0
    with pytest.raises(ValueError, match="holds"):
        pc.store(t4 + [6], c4, "ns")
    n5, c5 = pc.lookup(t4, "ns")
    assert n5 == n4 and pc.ram.moves == 4
    # a request that fails and just drops its cache (no release): once nothing else holds
    # the cache, the next lookup takes the entry back
    llama(mx.array(t4[n5:])[None], cache=c5)
    del c5
    n6, c6 = pc.lookup(t4, "ns")
    assert n6 == n4 and pc.stats()["last"]["tier"] == "ram"
    assert_same(llama, t4, n6, c6)
    assert pc.stats()["released"] == 3
    pc.close()


def test_restore_destinations_are_real_writable_buffers():
    from mlxkv.engine.cache.kvblocks import byte_view, writable_arrays

    arrays = writable_arrays([(1, 2, 512, 16)] * 3 + [(1, 1, 256, 8)], [mx.float32] * 3 + [mx.bfloat16])
    views = [np.frombuffer(byte_view(a), dtype=np.uint8) for a in arrays]
    assert len({v.ctypes.data for v in views}) == 4  # distinct allocations
    for a, v in zip(arrays, views):
        assert v.size == a.size * a.itemsize and v.flags.writeable
    # contents are unspecified until written (no zero fill): a write shows in its own array
    # only
    before = views[0][:4].copy()
    views[1][:4] = np.frombuffer(np.float32(2.5).tobytes(), dtype=np.uint8)
    assert arrays[1][0, 0, 0, 0].item() == 2.5 and (views[0][:4] == before).all()


def test_null_prefix_cache():
    pc = NullPrefixCache()
    assert pc.lookup([1, 2, 3], "ns") == (0, None)
    assert pc.release(None) is False
    assert pc.store([1, 2], [], "ns") is None
    assert pc.flush(1)["durable"] == 0
    assert pc.stats() == {"enabled": False}
    # every facade method a front end calls, with empty answers
    assert pc.entries() == [] and pc.entry("x") is None
    assert pc.pin("x") is False and pc.evict("x") is False and pc.delete("x") is False
    assert pc.verify() == {"checked": 0, "ok": 0, "damaged": [], "manifests_damaged": 0}
    assert pc.invalidate([1, 2], "ns") is None and pc.open_session("s") is None
    assert pc.close_session("s") is None and pc.on_event is None


def test_bad_input_is_reported(llama):
    pc = pc_at(None)
    _, _, c = run(llama, prompt(10, 40), n_new=0)
    with pytest.raises(ValueError, match="holds 10 tokens but 12"):
        pc.store(prompt(12, 40), c, "ns")
    with pytest.raises(ValueError, match="integers"):
        pc.lookup([0.5, 1.5], "ns")
    pc.close()


# ----------------------------------------------------------------------------- CLI
def _cli(*argv: str) -> tuple[int, dict | None]:
    """``mlxkv cache ...`` in a subprocess (the command as a user runs it)."""
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "XDG_CONFIG_HOME": str(root / ".cache" / "no-config")}
    env.pop("MLXKV_CONFIG", None)
    r = subprocess.run([sys.executable, "-m", "mlxkv", "cache", *argv], cwd=root,
                       capture_output=True, text=True, env=env, timeout=120)
    text = r.stdout.strip()
    return r.returncode, json.loads(text.splitlines()[-1]) if "--json" in argv and text else None


def test_cache_cli(llama, tmp_path):
    pc = pc_at(tmp_path)
    t = prompt(3 * BT + 5, 50)
    _, _, c = run(llama, t, n_new=0)
    pc.store(t, c, "model-a")
    pc.close(30)
    d = str(tmp_path)
    rc, st = _cli("--cache-dir", d, "--json", "stats")
    assert rc == 0 and st["namespaces"]["model-a"]["blocks"] == 3
    assert st["namespaces"]["model-a"]["tails"] == 1
    rc, ls = _cli("--cache-dir", d, "--json", "ls")
    assert rc == 0 and ls["model-a"][0]["tokens"] == len(t)
    assert ls["model-a"][0]["cached_tokens"] == len(t)
    rc, v = _cli("--cache-dir", d, "--json", "verify")
    assert rc == 0 and v["model-a"]["ok"] == 1
    # conversations of checkpointed models (SSM only; SSM + KV) are listed and verified too
    for config, tag in ((MAMBA, "ssm"), (QWEN3_NEXT, "hybrid")):
        model = init_model(config, seed=1, scale=0.1)
        tc = prompt(BT + 7, 51)
        _, _, cc = run(model, tc, n_new=0)
        pc = pc_at(tmp_path)
        pc.store(tc, cc, f"model-{tag}")
        pc.close(30)
    rc, ls = _cli("--cache-dir", d, "--json", "ls")
    assert ls["model-ssm"][0]["checkpoint"] and ls["model-ssm"][0]["cached_tokens"] == BT + 7
    assert ls["model-hybrid"][0]["cached_tokens"] == BT + 7
    rc, v = _cli("--cache-dir", d, "--json", "verify")
    assert rc == 0 and v["model-ssm"]["ok"] == 1 and v["model-hybrid"]["ok"] == 1
    [ck] = list(tmp_path.glob("model-ssm/*/*.ckpt"))
    data = bytearray(ck.read_bytes())
    data[4096 + 1] ^= 0x20
    ck.write_bytes(bytes(data))
    rc, v = _cli("--cache-dir", d, "--json", "verify", "--ns", "model-ssm")
    assert rc == 1 and v["model-ssm"]["corrupt"] == 1 and not ck.exists()
    rc, g = _cli("--cache-dir", d, "--json", "gc", "--min-age", "0")
    assert rc == 0 and g["removed"] == 0  # everything is referenced by its conversation
    rc, cl = _cli("--cache-dir", d, "--json", "clear")
    assert rc == 0 and not cl["deleted"] and (tmp_path / "model-a").exists()
    rc, cl = _cli("--cache-dir", d, "--json", "clear", "--ns", "model-a", "--yes")
    assert rc == 0 and cl["left"] == [] and not (tmp_path / "model-a").exists()
    assert (tmp_path / "model-hybrid").exists()  # other namespaces are left alone
    rc, cl = _cli("--cache-dir", d, "--json", "clear", "--yes")
    assert rc == 0 and cl["left"] == [] and not list(tmp_path.glob("model-*"))
    assert _cli("--cache-dir", str(tmp_path / "nope"), "stats")[0] != 0  # one line, no traceback


# ----------------------------------------------------------------------------- engine
def test_engine_end_to_end_ram_ssd_restart(tiny_qwen3, tmp_path):
    from mlxkv.engine.engine import Engine, Request
    from mlxkv.engine.generate import SamplingParams

    params = SamplingParams(max_tokens=8)
    made: list[PrefixCache] = []

    def factory(loaded, namespace):
        made.append(pc_at(tmp_path))
        return made[-1]

    def ask(eng, toks, session=None):
        r = eng.submit(Request(prompt_tokens=toks, params=params, session=session)).result(
            timeout=120)
        eng.sync()  # the store runs after the finished event
        return r

    t1 = prompt(50, 60)
    with Engine(str(tiny_qwen3), prefix_cache=factory).start() as eng:
        r1 = ask(eng, t1, "chat")
        assert r1.stats.cached_tokens == 0
        t2 = t1 + r1.tokens + prompt(6, 61)
        r2 = ask(eng, t2, "chat")
        assert r2.stats.cached_tokens == len(t1) + len(r1.tokens)  # only the new turn computed
        assert made[0].stats()["last"]["tier"] == "ram"
        # a different namespace (another model) would never see this: checked in unit tests
    assert made[0].durability.report()["pending"] == 0  # engine shutdown flushed
    with Engine(str(tiny_qwen3)).start() as plain:  # no cache at all
        cold2 = plain.submit(Request(prompt_tokens=t2, params=params)).result(timeout=120)
    assert r2.tokens == cold2.tokens
    with Engine(str(tiny_qwen3), prefix_cache=factory).start() as eng:  # a restart
        r2b = ask(eng, t2)
        assert made[1].stats()["last"]["tier"] == "ssd"
        # the state stored after turn 2 runs past t2: all of t2 but its last token is reused
        assert r2b.stats.cached_tokens == len(t2) - 1
        assert r2b.tokens == cold2.tokens
