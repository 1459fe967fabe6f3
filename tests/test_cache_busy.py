"""Persistence yields to decoding: while the engine is busy the writer waits (bounded by a
maximum delay, by memory, and never for a state only the snapshot still holds); going
idle or ``flush()`` writes at once, and the flush report stays exact."""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from mlxkv.engine.cache import NullPrefixCache, PrefixCache
from mlxkv.engine.cache.tokens import store_namespace
from support.modelgen import init_model, model_config

BT = 16
NS = "ns-busy"


def _state(model, n: int, seed: int):
    rng = random.Random(seed)
    toks = [rng.randrange(3, 500) for _ in range(n)]
    cache = make_prompt_cache(model)
    model(mx.array(toks)[None], cache=cache)
    mx.eval([c.state for c in cache])
    return toks, cache


def _model():
    return init_model(model_config("llama", 512), seed=5)


def test_writer_waits_while_busy_and_writes_when_idle(tmp_path):
    model = _model()
    pc = PrefixCache(ram_bytes=1 << 30, cache_dir=str(tmp_path), block_tokens=BT)
    d, store_ns = pc.durability, store_namespace(NS)
    pc.busy(True)
    toks, cache = _state(model, 3 * BT + 5, 1)
    pc.store(toks, cache, NS)
    # submitted synchronously when it may go: so it is still here, not at the writer
    assert d.state(store_ns, np.array(toks)) == "pending"
    assert pc.io.pending_writes == 0 and d.yielded == 1
    pc.busy(False)
    assert d.wait(store_ns, np.array(toks), timeout=30) == "durable"
    t = pc.stats()["durable_after_turn_s"]
    assert t is not None and t >= 0
    # idle: a store goes to the writer at once
    toks2, cache2 = _state(model, 2 * BT, 2)
    pc.store(toks2, cache2, NS)
    assert d.state(store_ns, np.array(toks2)) in ("writing", "durable")
    assert pc.close(30)["pending"] == 0


def test_flush_forces_writes_while_busy_and_reports_exactly(tmp_path):
    pc = PrefixCache(ram_bytes=1 << 30, cache_dir=str(tmp_path), block_tokens=BT)
    pc.busy(True)
    toks, cache = _state(_model(), 2 * BT + 3, 3)
    pc.store(toks, cache, NS)
    assert pc.flush(0)["pending"] == 1  # nothing is called durable before it is
    rep = pc.flush(30)
    assert rep["durable"] == 1 and rep["pending"] == 0 and rep["flushed"] == 1
    pc.close(30)


def test_waiting_is_bounded_by_delay_memory_and_eviction(tmp_path):
    model = _model()
    store_ns = store_namespace(NS)
    # maximum delay spent: goes although busy
    pc = PrefixCache(ram_bytes=1 << 30, cache_dir=str(tmp_path / "a"), block_tokens=BT)
    pc.durability.max_delay_s = 0.0
    pc.busy(True)
    toks, cache = _state(model, 2 * BT, 4)
    pc.store(toks, cache, NS)
    assert pc.durability.state(store_ns, np.array(toks)) in ("writing", "durable")
    pc.close(30)
    # the waiting states pin more memory than allowed: goes
    pc = PrefixCache(ram_bytes=1 << 30, cache_dir=str(tmp_path / "b"), block_tokens=BT)
    pc.durability.pressure_bytes = 0
    pc.busy(True)
    pc.store(toks, cache, NS)
    assert pc.durability.state(store_ns, np.array(toks)) in ("writing", "durable")
    pc.close(30)
    # a RAM tier too small to keep it: the snapshot is the only copy, so it goes
    pc = PrefixCache(ram_bytes=1, cache_dir=str(tmp_path / "c"), block_tokens=BT)
    pc.busy(True)
    pc.store(toks, cache, NS)
    assert pc.stats()["ram_entries"] == 0
    assert pc.durability.state(store_ns, np.array(toks)) in ("writing", "durable")
    assert pc.close(30)["durable"] == 1


def test_a_write_that_goes_while_busy_paces_itself_between_block_files(tmp_path):
    pc = PrefixCache(ram_bytes=1 << 30, cache_dir=str(tmp_path), block_tokens=BT)
    d = pc.durability
    d.max_delay_s = 0.0  # goes at once, although busy
    pc.busy(True)
    toks, cache = _state(_model(), 4 * BT + 3, 6)  # four block files and a tail
    pc.store(toks, cache, NS)
    assert d.wait(store_namespace(NS), np.array(toks), timeout=30) == "durable"
    assert d.paced == 4  # a pause before each file after the first, all while busy
    pc.busy(False)
    toks2, cache2 = _state(_model(), 4 * BT, 7)
    pc.store(toks2, cache2, NS)  # idle: no pauses
    assert d.wait(store_namespace(NS), np.array(toks2), timeout=30) == "durable"
    assert d.paced == 4 and pc.stats()["paced"] == 4
    pc.close(30)


def test_null_cache_busy_is_a_no_op():
    assert NullPrefixCache().busy(True) is None
