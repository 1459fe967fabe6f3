"""Prefix cache, front-end facade and robustness: one key scheme for both tiers; versioned
namespaces; stored states that do not fit the model are misses, never crashes; bounded
durability memory; a hung disk is a miss within the restore timeout; entries, pin, evict,
delete, verify, invalidate, events and sessions; RAM-only when the SSD tier is unusable."""

from __future__ import annotations

import gc
import logging
import random
import threading
import types
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlxkv.engine.cache import NullPrefixCache, PrefixCache
from mlxkv.engine.cache import events as cache_events
from mlxkv.engine.cache import layout as dl
from mlxkv.engine.cache.tokens import chain_keys, entry_id, store_namespace
from mlxkv.engine.settings import Settings
from support.modelgen import init_model, model_config

BT = 16
GEMMA3 = {"model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": 2,
          "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 16, "query_pre_attn_scalar": 16, "vocab_size": 512, "sliding_window": 16,
          "sliding_window_pattern": 2, "max_position_embeddings": 4096}


@pytest.fixture(scope="module")
def llama(tiny_llama):
    from mlx_lm import load

    return load(str(tiny_llama))[0]


@pytest.fixture(scope="module")
def qwen3(tiny_qwen3):
    from mlx_lm import load

    return load(str(tiny_qwen3))[0]


@pytest.fixture
def fresh_warnings(monkeypatch):
    """Warnings are once per condition per process: start this test with none given."""
    monkeypatch.setattr(cache_events, "_warned", set())


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def prefill(model, tokens, cache=None, n_cached=0):
    """(logits of the last prompt position, cache holding ``tokens``)."""
    cache = make_prompt_cache(model) if cache is None else cache
    logits = model(mx.array(tokens[n_cached:])[None], cache=cache)[0, -1]
    mx.eval(logits, [c.state for c in cache])
    return np.array(logits), cache


def assert_same(model, tokens, n, cache):
    """Continuing from the cached prefix (or a miss) gives the cold run's logits."""
    cold, _ = prefill(model, tokens)
    warm, _ = prefill(model, tokens, cache, n) if n else prefill(model, tokens)
    np.testing.assert_allclose(warm, cold, rtol=1e-4, atol=1e-4)


def pc_at(path, **kw) -> PrefixCache:
    kw.setdefault("ram_bytes", 1 << 30)
    kw.setdefault("block_tokens", BT)
    return PrefixCache(cache_dir=None if path is None else str(path), **kw)


def stored(pc, model, tokens, ns, **kw):
    _, c = prefill(model, tokens)
    pc.store(tokens, c, ns, **kw)


# ----------------------------------------------------------------------------- keys
def test_both_tiers_use_the_store_chain_keys(llama, tmp_path):
    pc = pc_at(tmp_path)
    t = prompt(3 * BT + 5, 1)
    stored(pc, llama, t, "ns")
    pc.flush(30)
    disk_keys = pc.disk.chain_keys("ns", np.array(t))
    assert chain_keys("ns", np.array(t, dtype=np.uint32), BT) == disk_keys
    entry = next(iter(pc.ram.entries.values()))
    m = pc.disk.lookup("ns", t)
    assert [r.key for r in entry.runs] == [*disk_keys, m.tail_key]  # tail included
    pc.close()


def test_a_prompt_is_hashed_once_per_lookup(llama, tmp_path, monkeypatch):
    import mlxkv.storage.index
    from mlxkv.engine.cache import tokens as ctokens

    t = prompt(4 * BT + 5, 1)
    pc = pc_at(tmp_path)
    stored(pc, llama, t, "ns")
    pc.close(30)
    pc2 = pc_at(tmp_path)
    calls = {"cache": 0, "store": 0}

    def counted(where, fn):
        def key(*a):
            calls[where] += 1
            return fn(*a)
        return key

    monkeypatch.setattr(ctokens, "block_key", counted("cache", ctokens.block_key))
    monkeypatch.setattr(mlxkv.storage.index, "block_key", counted("store", mlxkv.storage.index.block_key))
    n, _ = pc2.lookup(t + [1], "ns")  # an SSD hit: both tiers walk the prompt's keys
    assert n == len(t) and pc2.stats()["last"]["tier"] == "ssd"
    assert calls == {"cache": 4, "store": 0}
    pc2.close()


# ----------------------------------------------------------------------------- versions
def test_namespace_folds_layout_version_and_state_schema(monkeypatch):
    fp = "0123456789abcdef0123456789abcdef"
    ns = dl.kv_namespace(fp, "bfloat16")
    assert store_namespace(ns) == ns and fp in ns and "bfloat16" in ns
    monkeypatch.setattr(dl, "KV_LAYOUT_VERSION", dl.KV_LAYOUT_VERSION + 1)
    assert dl.kv_namespace(fp, "bfloat16") != ns
    monkeypatch.undo()
    assert dl.kv_namespace(fp, "bfloat16") == ns

    class Swapped:  # a cache class whose positional state lists the same fields reordered
        @property
        def state(self):
            return self.keys, self.values, self.max_size, self.keep, self.offset, self._idx

    class Rotating(Swapped):
        @property
        def state(self):
            return self.keys, self.values, self.offset, self.keep, self.max_size, self._idx

    Swapped.__name__ = Rotating.__name__ = "RotatingKVCache"
    assert dl.state_schema((Swapped,)) != dl.state_schema((Rotating,))
    with pytest.raises(ValueError, match="compute dtype"):
        dl.kv_namespace(fp, "__class__")


def _fake_layout_blocks(pc, ns, toks, dtype="float31", n_layers=2, d=16):
    """Blocks under ``ns`` whose (hash-valid) header names ``dtype``."""
    from mlxkv.storage.format import SegmentSpec

    row = d * 4
    specs, segs = [], []
    for li in range(n_layers):
        for name in ("k", "v"):
            specs.append(SegmentSpec(f"{li}.kv.{name}", dtype, (d,), 2, row))
            segs.append((np.zeros(2 * len(toks) * row, np.uint8), 2, len(toks), row))
    pc.disk.put_blocks(ns, toks, tuple(specs), segs)


@pytest.mark.parametrize("dtype", ["float31", "__class__"])
def test_stored_state_with_an_unknown_dtype_is_a_miss(llama, tmp_path, dtype, fresh_warnings,
                                                      caplog):
    t = prompt(2 * BT + 3, 2)
    pc = pc_at(tmp_path)
    _fake_layout_blocks(pc, "ns", t, dtype)
    pc.close(30)
    pc2 = pc_at(tmp_path)
    n, c = pc2.lookup(t + [7], "ns")
    assert (n, c) == (0, None)
    assert pc2.stats()["layout_mismatches"] == 1 and dtype in caplog.text
    assert_same(llama, t + [7], 0, None)
    pc2.close()


def test_restored_state_that_does_not_fit_the_model_is_a_miss(llama, tmp_path,
                                                              fresh_warnings):
    # a state of another shape (head size 32) under this namespace: an mlx-lm that lays
    # the cache out differently, or a bug; either way it must not reach the model
    other = init_model(model_config("llama", 512, head_dim=32), seed=3)
    t = prompt(2 * BT + 5, 3)
    pc = pc_at(tmp_path)
    stored(pc, other, t, "ns")
    pc.close(30)
    pc2 = pc_at(tmp_path)
    stored(pc2, llama, prompt(20, 4), "ns")  # this process's caches of the model
    n, c = pc2.lookup(t + [9], "ns")
    assert (n, c) == (0, None) and pc2.stats()["layout_mismatches"] == 1
    assert_same(llama, t + [9], n, c)
    pc2.close()
    pc3 = pc_at(tmp_path)  # a restart: the model is bound before the first lookup
    pc3.bind_model("ns", llama)
    assert pc3.lookup(t + [9], "ns") == (0, None)
    pc3.bind_model("ns", other)  # the model that wrote it: restored
    n, c = pc3.lookup(t + [9], "ns")
    assert n == len(t)
    assert_same(other, t + [9], n, c)
    pc3.close()


def test_checkpoint_of_another_window_is_a_miss(tmp_path, fresh_warnings):
    model = init_model(GEMMA3, seed=1, scale=0.1)
    narrow = init_model({**GEMMA3, "sliding_window": 8}, seed=1, scale=0.1)
    t = prompt(2 * BT + 3, 5)
    pc = pc_at(tmp_path)
    stored(pc, model, t, "g")
    pc.close(30)
    pc2 = pc_at(tmp_path)
    pc2.bind_model("g", narrow)
    assert pc2.lookup(t + [4, 4], "g") == (0, None)  # never the wrong window, silently
    assert pc2.stats()["layout_mismatches"] == 1
    pc2.bind_model("g", model)
    n, c = pc2.lookup(t + [4, 4], "g")
    assert n == len(t)
    assert_same(model, t + [4, 4], n, c)
    pc2.close()


# ----------------------------------------------------------------------------- memory, hangs
def _held_bytes(*roots) -> int:
    """Bytes of the numpy arrays and bytes objects reachable from ``roots``."""
    seen, todo, total = set(), list(roots), 0
    while todo:
        o = todo.pop()
        if id(o) in seen or isinstance(o, (type, types.ModuleType, types.FunctionType)):
            continue
        seen.add(id(o))
        if isinstance(o, np.ndarray):
            total += o.nbytes
        elif isinstance(o, (bytes, bytearray)):
            total += len(o)
        todo.extend(gc.get_referents(o))
    return total


def test_durability_memory_is_bounded_after_many_stores(tmp_path):
    from mlxkv.engine.cache.durability import Durability
    from mlxkv.storage.format import SegmentSpec
    from mlxkv.storage.io import StorageIO, WriteRequest
    from mlxkv.storage.store import BlockStore

    store = BlockStore(str(tmp_path), block_tokens=1 << 20, durable=False)
    io = StorageIO(store)
    dur = Durability(lambda s: io.submit_write(s, block=False))
    n, count = 20_000, 60
    layout = (SegmentSpec("x", "uint8", (1,), 1, 1),)
    for i in range(count):
        toks = np.arange(i, i + n, dtype=np.uint32)  # a long agent context each time
        dur.mark("ns", toks, WriteRequest("ns", toks, layout, [(np.zeros(n, np.uint8), 1, n, 1)]),
                 coalesce=False)
    assert dur.flush(60)["durable"] == count
    assert dur.state("ns", np.arange(3, 3 + n, dtype=np.uint32)) == "durable"
    held = _held_bytes(dur._jobs, dur._queue)
    assert held < 64 * count  # small records: no token arrays (they were 80 kB each)
    dur.close(10)
    io.close(10)


def test_hung_restore_is_a_miss_within_the_timeout(llama, tmp_path, fresh_warnings):
    t = prompt(4 * BT + 5, 6)
    pc = pc_at(tmp_path)
    stored(pc, llama, t, "ns")
    pc.close(30)
    pc2 = pc_at(tmp_path, restore_timeout_s=0.5)
    # The storage reader thread hangs inside a real restore until the "disk" answers (the
    # store itself refuses to open a FIFO, so the hang is an Event in front of it).
    disk_answers, reading = threading.Event(), threading.Event()
    real_get_blocks = pc2.disk.get_blocks

    def hung_get_blocks(*a, **kw):
        reading.set()
        disk_answers.wait(120)
        return real_get_blocks(*a, **kw)

    pc2.disk.get_blocks = hung_get_blocks
    engine_thread = ThreadPoolExecutor(1)
    try:
        n, c = engine_thread.submit(pc2.lookup, t + [1], "ns").result(timeout=60)
        assert (n, c) == (0, None) and reading.is_set()
        st = pc2.stats()
        assert st["ssd_restore_timeouts"] == 1 and st["misses"] == 1
        # while that read is stuck, the SSD tier is skipped: no second wait
        assert engine_thread.submit(pc2.lookup, t + [2], "ns").result(timeout=60) == (0, None)
        assert pc2.stats()["ssd_restore_timeouts"] == 1 and pc2.stats()["ssd_skipped_stuck"] >= 1
    finally:
        disk_answers.set()
    [stuck] = pc2.ssd._stuck
    stuck.result(timeout=60)  # the reader finished that read (into buffers nobody uses)
    n, c = engine_thread.submit(pc2.lookup, t + [3], "ns").result(timeout=60)
    assert n == len(t) and pc2.stats()["last"]["tier"] == "ssd"
    assert_same(llama, t + [3], n, c)
    engine_thread.shutdown(wait=True)
    pc2.close()


# ----------------------------------------------------------------------------- facade
def test_entries_describe_both_tiers_and_ids_are_stable(llama, tmp_path):
    system = prompt(2 * BT, 7)
    a, b = system + prompt(9, 8), system + prompt(21, 9)
    pc = pc_at(tmp_path)
    stored(pc, llama, system, "ns")
    pc.flush(30)  # on disk before the conversations supersede it in RAM
    stored(pc, llama, a, "ns", session="s1")
    stored(pc, llama, b, "ns")
    pc.flush(30)
    es = {e.id: e for e in pc.entries("ns")}
    ida, idb, ids = (entry_id("ns", np.array(x, np.uint32)) for x in (a, b, system))
    assert set(es) == {ida, idb, ids}
    assert es[ida].tier == es[idb].tier == "both" and es[ids].tier == "ssd"
    assert es[ids].kind == "prefix" and es[ida].kind == es[idb].kind == "conversation"
    assert es[ida].session == "s1" and es[ida].tokens == len(a)
    assert es[ida].blocks == 3 and es[ida].shared_bytes > 0 and es[ida].unique_bytes > 0
    assert es[ida].bytes == es[ida].shared_bytes + es[ida].unique_bytes
    assert pc.lookup(a + [1], "ns")[0] == len(a)
    assert {e.id: e.hits for e in pc.entries()}[ida] == 1
    d = pc.entry(ida)
    assert d.token_ids == a and len(d.blocks) == 3 and d.blocks[0].shared_by >= 2
    assert all(blk.verified is None for blk in d.blocks)
    assert pc.entry("0" * 16) is None
    pc.close(30)
    pc2 = pc_at(tmp_path)  # another process: same ids, from the SSD tier
    assert {e.id for e in pc2.entries()} == {ida, idb, ids}
    assert all(e.tier == "ssd" for e in pc2.entries())
    pc2.close()


def test_pin_keeps_an_entry_in_ram(llama):
    t_a = prompt(40, 10)
    pc = pc_at(None, ram_bytes=1 << 30)
    stored(pc, llama, t_a, "ns")
    one = pc.ram.nbytes
    pc.close()
    pc = pc_at(None, ram_bytes=int(2.5 * one))
    stored(pc, llama, t_a, "ns")
    ida = entry_id("ns", np.array(t_a, np.uint32))
    assert pc.pin(ida) is True and pc.pin("nope") is False
    for seed in (11, 12, 13):
        stored(pc, llama, prompt(40, seed), "ns")
    assert [e.pinned for e in pc.entries() if e.id == ida] == [True]
    n, c = pc.lookup(t_a + [3], "ns")  # continues it exactly, yet it is lent, not handed over
    assert n == len(t_a) and pc.ram.moves == 0 and pc.ram.find(ida) is not None
    assert pc.pin(ida, False) is True
    for seed in (14, 15, 16):
        stored(pc, llama, prompt(40, seed), "ns")
    assert pc.ram.find(ida) is None
    pc.close()


def test_evict_delete_and_events(qwen3, tmp_path, fresh_warnings):
    got, lock = [], threading.Lock()

    def receiver(ev):
        with lock:
            got.append(ev)

    pc = pc_at(tmp_path, on_event=receiver)
    t1, t2 = prompt(2 * BT + 4, 20), prompt(2 * BT + 6, 21)
    stored(pc, qwen3, t1, "ns")
    stored(pc, qwen3, t2, "ns")
    pc.flush(30)
    id1, id2 = (entry_id("ns", np.array(t, np.uint32)) for t in (t1, t2))
    assert pc.evict(id1) is True and pc.evict(id1) is False
    assert [e.tier for e in pc.entries() if e.id == id1] == ["ssd"]
    n, c = pc.lookup(t1 + [5], "ns")
    assert n == len(t1) and pc.stats()["last"]["tier"] == "ssd"
    assert_same(qwen3, t1 + [5], n, c)
    assert pc.delete(id2) is True and pc.delete(id2) is False
    assert pc.lookup(t2 + [5], "ns") == (0, None)
    assert id2 not in {e.id for e in pc.entries()}
    pc.close(30)
    pc2 = pc_at(tmp_path)  # deleted on disk too; the other entry is intact
    assert pc2.lookup(t2 + [5], "ns") == (0, None)
    assert pc2.lookup(t1 + [5], "ns")[0] == len(t1)
    pc2.close()
    kinds = [e["type"] for e in got]
    for k in ("cache.store", "cache.persisted", "cache.evict", "cache.hit", "cache.delete"):
        assert k in kinds, (k, kinds)
    hit = next(e for e in got if e["type"] == "cache.hit")
    assert hit["tier"] == "ssd" and hit["tokens"] == len(t1)
    assert next(e for e in got if e["type"] == "cache.evict")["id"] == id1


def test_verify_finds_damaged_blocks_and_manifests(llama, tmp_path):
    pc = pc_at(tmp_path)
    t1, t2 = prompt(3 * BT + 1, 30), prompt(3 * BT + 2, 31)
    stored(pc, llama, t1, "ns")
    stored(pc, llama, t2, "ns")
    pc.flush(30)
    id1, id2 = (entry_id("ns", np.array(t, np.uint32)) for t in (t1, t2))
    assert pc.verify() == {"checked": 2, "ok": 2, "damaged": [], "manifests_damaged": 0}
    assert all(b.verified for b in pc.entry(id1).blocks)
    key = pc.disk.chain_keys("ns", np.array(t2))[1].hex()
    blk = tmp_path / "ns" / key[:2] / f"{key}.blk"
    data = bytearray(blk.read_bytes())
    data[4096 + 7] ^= 0x40
    blk.write_bytes(bytes(data))
    assert pc.verify(id2) == {"checked": 1, "ok": 0, "damaged": [id2], "manifests_damaged": 0}
    pc.close()
    man = next((tmp_path / "ns" / "manifests").glob("*.man"))
    man.write_bytes(man.read_bytes()[:-3])
    pc2 = pc_at(tmp_path)
    assert pc2.verify()["manifests_damaged"] == 1
    pc2.close()


def test_invalidate_drops_what_would_seed_the_prompt(qwen3, tmp_path):
    pc = pc_at(tmp_path)
    t = prompt(3 * BT + 3, 40)
    stored(pc, qwen3, t, "ns")
    stored(pc, qwen3, t, "other")
    pc.flush(30)
    pc.invalidate(t + [1, 2], "ns")
    assert pc.lookup(t + [1, 2], "ns") == (0, None)  # neither RAM nor SSD
    assert pc.lookup(t + [1, 2], "other")[0] == len(t)  # another namespace is untouched
    pc.close(30)
    pc2 = pc_at(tmp_path)
    assert pc2.lookup(t + [1, 2], "ns") == (0, None)
    assert not [e for e in pc2.entries("ns")]
    pc2.close()


def test_sessions_pin_their_latest_entry(llama):
    pc = pc_at(None)
    t = prompt(30, 50)
    pc.open_session("chat")
    stored(pc, llama, t, "ns", session="chat")
    [e] = pc.entries()
    assert e.session == "chat" and e.session_pinned and pc.stats()["sessions"] == 1
    pc.close_session("chat")
    [e] = pc.entries()
    assert not e.session_pinned and pc.stats()["sessions"] == 0
    pc.close()


def _settings(**kw):
    base = {"prefix_cache": True, "ram_cache_bytes": 1 << 30, "block_tokens": BT,
            "ssd_cache_bytes": None, "cache_dir": None}
    return Settings.defaults(**{**base, **kw})


def test_both_prefix_caches_satisfy_the_engines_cache_client():
    """The engine calls every CacheClient member without probing: each cache defines each
    one, with the protocol's parameters."""
    import inspect

    from mlxkv.engine.cache.client import CacheClient

    members = [n for n in vars(CacheClient) if not n.startswith("_")] + ["enabled", "on_event"]
    for cls in (PrefixCache, NullPrefixCache):
        for name in members:
            assert hasattr(cls, name), (cls.__name__, name)
            want = vars(CacheClient).get(name)
            if inspect.isfunction(want):
                got = inspect.signature(getattr(cls, name))
                assert list(got.parameters) == list(inspect.signature(want).parameters), (cls, name)
    assert isinstance(NullPrefixCache(), CacheClient)
    assert NullPrefixCache.enabled is False and PrefixCache.enabled is True


def test_unusable_ssd_tier_falls_back_to_ram_with_one_warning(llama, tmp_path, fresh_warnings,
                                                              caplog):
    caplog.set_level(logging.WARNING, logger="mlxkv.cache")
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("mine")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("a user's files")
    for where in (not_a_folder, theirs):
        pc = PrefixCache.from_settings(_settings(cache_dir=str(where)))
        st = pc.stats()
        assert st["ssd"] is False and st["ssd_disabled_reason"]
        t = prompt(30, 60)
        stored(pc, llama, t, "ns")
        assert pc.lookup(t + [1], "ns")[0] == len(t)  # the RAM tier works
        pc.close()
        if where is not_a_folder:  # a receiver connected later still hears why
            got = []
            pc.on_event = got.append
            assert [e["type"] for e in got] == ["cache.warning"] and "RAM only" in got[0]["message"]
    warnings = [r for r in caplog.records if r.name == "mlxkv.cache"]
    assert len(warnings) == 1 and "RAM only" in warnings[0].getMessage()
    assert (theirs / "notes.txt").read_text() == "a user's files"
    caplog.clear()
    pc = PrefixCache.from_settings(_settings(cache_dir=str(tmp_path / "c"), ssd_cache_bytes=0))
    st = pc.stats()
    assert st["ssd"] is False and st["ssd_disabled_reason"] is None and not caplog.records
    assert not (tmp_path / "c").exists()
    pc.close()


def test_engine_binds_its_model_so_a_misfit_state_is_never_restored(tiny_llama, tmp_path):
    from mlxkv.engine.engine import Engine, Request
    from mlxkv.engine.generate import SamplingParams

    params = SamplingParams(max_tokens=4)
    t = prompt(2 * BT + 5, 70)
    with Engine(str(tiny_llama)).start() as plain:
        ns = plain.namespace
        cold = plain.submit(Request(prompt_tokens=t + [3], params=params)).result(timeout=120)
    other = init_model(model_config("llama", 512, head_dim=32), seed=3)
    pc = pc_at(tmp_path)
    stored(pc, other, t, ns)  # another model's state under this model's namespace
    pc.close(30)
    made: list[PrefixCache] = []

    def factory(loaded, namespace):
        made.append(pc_at(tmp_path))
        return made[-1]

    with Engine(str(tiny_llama), prefix_cache=factory).start() as eng:  # a restart
        r = eng.submit(Request(prompt_tokens=t + [3], params=params)).result(timeout=120)
        eng.sync()
    assert r.stats.cached_tokens == 0 and r.tokens == cold.tokens
    assert made[0].stats()["layout_mismatches"] == 1


def test_settings_reach_the_tiers(tmp_path):
    from mlxkv.engine.settings import FIELDS

    assert {f.name: f.default for f in FIELDS}["restore_timeout_s"] == 30.0
    pc = PrefixCache.from_settings(_settings(cache_dir=str(tmp_path), restore_timeout_s=7.0))
    assert pc.ssd.restore_timeout_s == 7.0 and pc.block_tokens == BT and pc.stats()["ssd"]
    pc.close()


# ----------------------------------------------------------------------------- front-end figures
def test_dedup_ratio_counts_sharing_not_buffer_headroom(llama):
    """One entry: ratio 1 (its preallocated rows are no sharing); two conversations on one
    prefix: the shared rows count once, so the ratio is above 1."""
    system = prompt(2 * BT, 60)
    pc = pc_at(None)
    stored(pc, llama, system + prompt(5, 61), "ns")
    assert pc.stats()["dedup_ratio"] == pytest.approx(1.0, abs=0.01)
    stored(pc, llama, system + prompt(7, 62), "ns")
    s = pc.stats()
    assert s["ram_entries"] == 2 and s["dedup_ratio"] > 1.3
    assert s["ram_token_bytes"] <= s["ram_bytes"]
    pc.close()


def test_session_hold_is_not_an_explicit_pin(llama):
    pc = pc_at(None)
    t = prompt(30, 63)
    pc.open_session("chat")
    stored(pc, llama, t, "ns", session="chat")
    [e] = pc.entries()
    assert e.session_pinned and not e.pinned
    assert pc.pin(e.id) is True
    [e] = pc.entries()
    assert e.session_pinned and e.pinned
    pc.close_session("chat")
    [e] = pc.entries()
    assert not e.session_pinned and e.pinned
    pc.close()


def test_listing_after_verify_shows_what_is_restorable(llama, tmp_path):
    """A damaged second block that verify removed: the SSD-only entry lists the tokens a
    restore gives back (up to the missing block), not all it once held."""
    t = prompt(3 * BT + 5, 64)
    pc = pc_at(tmp_path)
    stored(pc, llama, t, "ns")
    pc.close(30)
    eid = entry_id("ns", np.array(t, np.uint32))
    key = chain_keys("ns", np.array(t, np.uint32), BT)[1].hex()
    blk = tmp_path / "ns" / key[:2] / f"{key}.blk"
    data = bytearray(blk.read_bytes())
    data[4096 + 7] ^= 0x40
    blk.write_bytes(bytes(data))
    pc2 = pc_at(tmp_path)
    assert [(e.tokens, e.tier) for e in pc2.entries()] == [(len(t), "ssd")]
    assert pc2.verify() == {"checked": 1, "ok": 0, "damaged": [eid], "manifests_damaged": 0}
    [e] = pc2.entries()
    assert e.id == eid and e.tokens == BT and e.blocks == 1
    d = pc2.entry(eid)
    assert d.token_ids == t[:BT] and len(d.blocks) == 1
    assert pc2.lookup(t + [1], "ns")[0] == BT  # what the listing says is what restores
    pc2.close()


def test_verify_reports_progress_per_entry(llama, tmp_path):
    got = []
    pc = pc_at(tmp_path, on_event=got.append)
    for seed in (65, 66, 67):
        stored(pc, llama, prompt(BT + 3, seed), "ns")
    pc.flush(30)
    assert pc.verify()["checked"] == 3
    progress = [(e["done"], e["total"]) for e in got if e["type"] == "cache.verify"]
    assert progress == [(1, 3), (2, 3), (3, 3)]
    pc.close()


def test_gc_removes_what_no_manifest_names(llama, tmp_path):
    t1, t2 = prompt(2 * BT + 3, 68), prompt(2 * BT + 4, 69)
    pc = pc_at(tmp_path)
    stored(pc, llama, t1, "ns")
    stored(pc, llama, t2, "ns")
    pc.flush(30)
    assert pc.gc("ns")["removed"] == 0
    name = next(s.manifest for s in pc.manager.saved("ns") if s.entry_id == entry_id("ns", np.array(t2, np.uint32)))
    assert pc.disk.delete_manifest("ns", name)
    rep = pc.gc("ns")
    assert rep["removed"] == 3 and rep["bytes"] > 0  # two blocks and the tail of t2
    pc.close(30)
    pc2 = pc_at(tmp_path)
    assert pc2.lookup(t1 + [1], "ns")[0] == len(t1) and pc2.lookup(t2 + [1], "ns")[0] == 0
    assert pc_at(None).gc("ns")["removed"] == 0  # no SSD tier: nothing to collect
    pc2.close()


def test_prefetch_warms_the_ssd_state_into_ram(llama, tmp_path):
    t = prompt(3 * BT + 5, 70)
    pc = pc_at(tmp_path)
    stored(pc, llama, t, "ns")
    pc.close(30)
    pc2 = pc_at(tmp_path)
    assert pc2.prefetch(t + [9, 9], "ns") == len(t) and len(pc2.ram) == 1
    assert pc2.prefetch(t + [9, 9], "ns") == len(t)  # already warm: nothing read again
    assert pc2.stats()["ssd_hits"] == 0
    n, c = pc2.lookup(t + [9, 9], "ns")
    assert n == len(t) and pc2.last["tier"] == "ram"
    assert (pc2.last["ram_tokens"], pc2.last["ssd_tokens"]) == (len(t), 0)
    assert_same(llama, t + [9, 9], n, c)
    assert pc2.prefetch([5], "ns") == 0 and pc_at(None).prefetch(t, "ns") == 0
    pc2.close()
