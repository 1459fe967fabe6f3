"""Prefetch while the engine is busy never waits: the blocks are read on the storage
reader thread and enter RAM when the engine thread next looks (the lookup that needs them
waits for them as for its own restore); a prefetch RAM cannot hold is dropped."""

from __future__ import annotations

import random

from common import greedy_tokens

from mlxkv.engine.cache import PrefixCache
from support.modelgen import init_model, model_config

BT = 16


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def stored(tmp_path, model, t):
    out, cache = greedy_tokens(model, t, n_new=5, feed_last=True)
    pc = PrefixCache(ram_bytes=1 << 30, cache_dir=str(tmp_path), block_tokens=BT)
    pc.store(t + out[:-1], cache, "ns")
    assert pc.close(30)["durable"] == 1
    return t + out[:-1]


def test_busy_prefetch_reads_in_the_background_and_the_lookup_finds_it_in_ram(tmp_path):
    model = init_model(model_config("qwen3", 512), seed=9)
    held = stored(tmp_path, model, prompt(3 * BT + 4, 1))
    pc = PrefixCache(ram_bytes=1 << 30, cache_dir=str(tmp_path), block_tokens=BT)
    pc.bind_model("ns", model)
    pc.busy(True)  # a generation is running
    nxt = held + prompt(6, 2)
    assert pc.prefetch(nxt, "ns") == len(held)
    st = pc.stats()
    assert st["prefetches_background"] == 1 and st["ram_entries"] == 0  # not waited for
    assert pc.prefetch(nxt, "ns") == len(held)  # already on its way: not read twice
    n, c = pc.lookup(nxt, "ns")  # waits for the read it needs, from RAM
    assert n == len(held) and pc.last["tier"] == "ram"
    assert pc.stats()["ssd_hits"] == 0 and pc.stats()["prefetched_tokens"] == len(held)
    warm = greedy_tokens(model, nxt, cache=c, n_cached=n, n_new=5, feed_last=True)[0]
    assert warm == greedy_tokens(model, nxt, n_new=5, feed_last=True)[0]
    pc.close()


def test_finished_prefetch_enters_ram_when_the_engine_goes_idle(tmp_path):
    model = init_model(model_config("qwen3", 512), seed=9)
    held = stored(tmp_path, model, prompt(2 * BT + 9, 3))
    pc = PrefixCache(ram_bytes=1 << 30, cache_dir=str(tmp_path), block_tokens=BT)
    pc.busy(True)
    pc.prefetch(held + [5], "ns")
    assert pc.prefetch_wait(30) == 0  # (waits for the read, moves it into RAM)
    pc.busy(False)
    assert pc.stats()["ram_entries"] == 1
    n, c = pc.lookup(held + [5, 6], "ns")
    assert n == len(held) and pc.last["tier"] == "ram"
    pc.close()


def test_prefetch_is_dropped_when_ram_is_needed(tmp_path):
    model = init_model(model_config("qwen3", 512), seed=9)
    held = stored(tmp_path, model, prompt(2 * BT + 9, 4))
    pc = PrefixCache(ram_bytes=4096, cache_dir=str(tmp_path), block_tokens=BT)  # too small
    pc.busy(True)
    assert pc.prefetch(held + [5], "ns") == len(held)
    pc.prefetch_wait(30)
    assert pc.stats()["prefetches_cancelled"] == 1 and pc.stats()["ram_entries"] == 0
    n, c = pc.lookup(held + [5], "ns")  # the lookup restores it itself
    assert n == len(held) and pc.last["tier"] == "ssd"
    pc.close()
