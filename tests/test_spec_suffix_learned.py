"""The suffix source's global index learns from every finished request of the model (any
speculation, alone or batched) and lives beside the SSD cache: saved at flush and
shutdown (and while idle), restored by a new engine, verified on read (a damaged,
truncated or hostile file is dropped with one warning), private, written atomically (a
writer killed mid-write leaves the old file), listed and removed by ``mlxkv cache``.
Real engines on a tiny model, real files, real subprocesses."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from common import T, greedy

from mlxkv.engine.cache.tokens import store_namespace
from mlxkv.engine.engine import Engine, Request
from mlxkv.engine.settings import Settings
from mlxkv.storage import format as fmt
from mlxkv.storage.store import BlockStore
from support.modelgen import tiny_model

ROOT = Path(__file__).resolve().parent.parent
CODE = [{"role": "user", "content": "def area(r):\n    return 3.14 * r * r\n" * 3}]
OTHER = [{"role": "user", "content": "class Point:\n    x: int\n    y: int\n" * 3}]


def settings(cache: Path, **values) -> Settings:
    base = {"model": str(tiny_model("llama")), "cache_dir": str(cache), "block_tokens": 16,
            "ram_cache_bytes": 256 << 20}
    return Settings.load({**base, **values}, env={})


def learned_file(cache: Path, eng: Engine) -> Path:
    return cache / store_namespace(eng.namespace) / "learned" / "suffix.lrn"


def ask(eng: Engine, messages: list, spec: str = "off", n: int = 24):
    r = eng.submit(Request(messages=messages, params=greedy(max_tokens=n), spec=spec)).result(timeout=T)
    eng.sync()  # the engine thread learns once the answer is out: read what it learned after that
    return r


def learned_tokens(eng: Engine) -> int:
    return eng.call(lambda: eng.spec_providers["suffix"].learned_tokens).result(timeout=T)


@pytest.fixture
def learned_cache(tmp_path):
    """A cache folder whose suffix index learned two plain replies; (folder, namespace,
    the replies' tokens)."""
    cache = tmp_path / "cache"
    with Engine.from_settings(settings(cache)).start(timeout=T) as eng:
        replies = [ask(eng, CODE).tokens, ask(eng, OTHER).tokens]
        ns = eng.namespace
        assert learned_tokens(eng) == sum(map(len, replies))
    return cache, ns, replies


def test_every_finished_request_teaches_the_global_index_alone_and_batched(tmp_path):
    with Engine.from_settings(settings(tmp_path / "c", prefix_cache=False)).start(timeout=T) as eng:
        plain = ask(eng, CODE, spec="off")
        assert learned_tokens(eng) == len(plain.tokens)  # a request that did not speculate
        ask(eng, CODE, spec="ngram")
        assert learned_tokens(eng) == 2 * len(plain.tokens)
        prompts = [[5, 6, 7, 8, 9] * 6, [11, 12, 13] * 9, [20 + i for i in range(30)]]
        handles = [eng.submit(Request(prompt_tokens=p, params=greedy(max_tokens=12), spec="off"))
                   for p in prompts]
        rows = [h.result(timeout=T) for h in handles]
        eng.sync()
        assert any(r.stats.batched for r in rows)  # they decoded together
        assert learned_tokens(eng) == 2 * len(plain.tokens) + sum(len(r.tokens) for r in rows)
        figures = eng.stats()["spec"]["suffix"]
        assert figures["learned_replies"] == 5 and figures["learned_tokens"] == learned_tokens(eng)


def test_a_new_engine_proposes_from_what_the_last_one_learned(learned_cache, tmp_path):
    cache, ns, replies = learned_cache
    with Engine.from_settings(settings(cache, prefix_cache=True)).start(timeout=T) as eng:
        suffix = eng.spec_providers["suffix"]
        assert [s.tolist() for s in suffix.learned_sequences()] == replies
        restored = ask(eng, CODE, spec="suffix")
    # the same request in an engine that learned nothing: its own prompt only
    with Engine.from_settings(settings(tmp_path / "empty")).start(timeout=T) as eng:
        cold = ask(eng, CODE, spec="suffix")
    assert restored.tokens == cold.tokens == replies[0]  # lossless either way
    assert restored.stats.spec["accepted"] > cold.stats.spec["accepted"]
    assert restored.stats.spec["accepted"] >= len(replies[0]) // 2


def test_the_learned_file_is_private_and_listed_and_removed_by_the_cache_commands(learned_cache):
    cache, ns, replies = learned_cache
    store_ns = store_namespace(ns)
    path = cache / store_ns / "learned" / "suffix.lrn"
    assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700
    st = cli("--cache-dir", str(cache), "--json", "stats")
    info = st["learned"][store_ns]["suffix"]
    assert info["tokens"] == sum(map(len, replies)) and info["sequences"] == 2
    text = subprocess.run(mlxkv_cmd("--cache-dir", str(cache), "cache", "stats"), cwd=ROOT, capture_output=True,
                          text=True, env=cli_env(), timeout=60).stdout
    assert f"suffix index: {info['tokens']} tokens learned from 2 replies" in text
    ls = cli("--cache-dir", str(cache), "--json", "ls")
    assert [e for e in ls[store_ns] if e["kind"] == "learned"][0]["tokens"] == info["tokens"]
    assert cli("--cache-dir", str(cache), "--json", "verify")[store_ns]["learned_damaged"] == {}
    cleared = cli("--cache-dir", str(cache), "--json", "clear", "--yes")
    assert store_ns in cleared["namespaces"] and cleared["left"] == []
    assert not path.exists() and not (cache / store_ns).exists()


def test_cache_verify_reports_and_removes_a_damaged_learned_file(learned_cache):
    cache, ns, _ = learned_cache
    store_ns = store_namespace(ns)
    path = cache / store_ns / "learned" / "suffix.lrn"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01
    path.write_bytes(bytes(data))
    assert "damaged" in cli("--cache-dir", str(cache), "--json", "stats")["learned"][store_ns]["suffix"]
    assert path.exists()  # stats only looks
    r = subprocess.run(mlxkv_cmd("cache", "--cache-dir", str(cache), "--json", "verify"), cwd=ROOT,
                       capture_output=True, text=True, env=cli_env(), timeout=60)
    assert r.returncode == 1 and "header hash mismatch" in json.loads(r.stdout)[store_ns]["learned_damaged"]["suffix"]
    assert not path.exists()


@pytest.mark.parametrize("damage", ["flipped-bit", "truncated", "empty"])
def test_a_damaged_file_is_dropped_with_one_warning(learned_cache, damage, caplog):
    cache, ns, _ = learned_cache
    path = cache / store_namespace(ns) / "learned" / "suffix.lrn"
    data = bytearray(path.read_bytes())
    if damage == "flipped-bit":
        data[len(data) // 2] ^= 0x10
    elif damage == "truncated":
        data = data[: len(data) - 7]
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="mlxkv"):
        with Engine.from_settings(settings(cache)).start(timeout=T) as eng:
            assert learned_tokens(eng) == 0
            assert ask(eng, CODE, spec="suffix").tokens  # it still answers, and learns anew
    warnings = [r.getMessage() for r in caplog.records if "suffix index" in r.getMessage()]
    assert len(warnings) == 1 and "removed" in warnings[0], warnings
    assert path.exists()  # written again at shutdown, from what the new engine learned
    assert BlockStore(cache).get_learned(store_namespace(ns), "suffix").tokens > 0


def test_a_hostile_file_with_a_valid_hash_is_not_used(learned_cache, caplog):
    # Whole-file hash right, contents wrong: a token id the model does not have, or the
    # sequences of another namespace. Neither is used; neither crashes or hangs.
    cache, ns, _ = learned_cache
    store_ns = store_namespace(ns)
    path = cache / store_ns / "learned" / "suffix.lrn"
    huge = fmt.Learned(store_ns, "suffix-outputs-v1", (np.array([1, 2, 4_000_000_000], dtype=np.uint32),), 0.0)
    path.write_bytes(fmt.encode_learned(huge))
    with caplog.at_level(logging.WARNING, logger="mlxkv"):
        with Engine.from_settings(settings(cache)).start(timeout=T) as eng:
            assert learned_tokens(eng) == 0
    assert any("outside the model's vocabulary" in r.getMessage() for r in caplog.records)
    other = fmt.Learned("another-model", "suffix-outputs-v1", (np.array([1, 2, 3], dtype=np.uint32),), 0.0)
    path.write_bytes(fmt.encode_learned(other))
    with Engine.from_settings(settings(cache)).start(timeout=T) as eng:
        assert learned_tokens(eng) == 0


def test_hostile_sizes_are_format_errors():
    good = fmt.encode_learned(fmt.Learned("ns", "s", (np.arange(4, dtype=np.uint32),), 0.0))
    body = bytearray(good[fmt.PREFIX_SIZE:-8])
    (mlen,) = fmt._MAN.unpack_from(body, 0)
    meta = json.loads(bytes(body[4:4 + mlen]))
    for changed in ({"sequences": 3}, {"tokens": 1 << 40}, {"tokens": 5}, {"sequences": -1}):
        m = json.dumps({**meta, **changed}).encode()
        forged = fmt._prefix(fmt.KIND_LEARNED, fmt._MAN.pack(len(m)) + m + bytes(body[4 + mlen:]))
        with pytest.raises(fmt.FormatError):
            fmt.decode_learned(forged)
    zero_length = fmt._prefix(fmt.KIND_LEARNED, fmt._MAN.pack(mlen) + bytes(body[4:4 + mlen])
                              + np.array([0], "<u4").tobytes() + bytes(16))
    with pytest.raises(fmt.FormatError):
        fmt.decode_learned(zero_length)


_WRITER = """
import sys, time, numpy as np
from mlxkv.storage.format import Learned
from mlxkv.storage.store import BlockStore
store = BlockStore(sys.argv[1])
print("ready", flush=True)
i = 0
while True:  # ever newer, larger files, until killed
    i += 1
    seqs = tuple(np.full(50_000, i % 1000, dtype=np.uint32) for _ in range(8))
    store.put_learned("ns-a", "suffix", Learned("ns-a", "s", seqs, time.time()))
"""


def test_a_writer_killed_mid_write_leaves_the_last_complete_file(tmp_path):
    cache = tmp_path / "cache"
    store = BlockStore(cache)
    store.put_learned("ns-a", "suffix", fmt.Learned("ns-a", "s", (np.arange(10, dtype=np.uint32),), 0.0))
    rng = np.random.default_rng(0)
    for _ in range(6):
        child = subprocess.Popen([sys.executable, "-c", _WRITER, str(cache)], cwd=ROOT, stdout=subprocess.PIPE,
                                 env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert child.stdout.readline().strip() == b"ready"
        time.sleep(float(rng.uniform(0.05, 0.6)))
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=T)
        got = BlockStore(cache).get_learned("ns-a", "suffix")  # never a partial file
        assert got is not None
        if len(got.sequences) == 1:  # still the first file
            assert got.sequences[0].tolist() == list(range(10))
        else:  # one the writer finished: eight whole sequences of one value
            assert len(got.sequences) == 8 and len({int(v) for s in got.sequences for v in set(s.tolist())}) == 1
    temps = list((cache / "ns-a" / "learned").glob("*.tmp"))
    store.scan()  # what a killed writer left behind goes at the next start
    assert not [t for t in temps if t.exists()]


def test_an_idle_engine_saves_now_and_then_without_a_flush(tmp_path, monkeypatch):
    import mlxkv.engine.cache.learned as learned

    monkeypatch.setattr(learned, "SAVE_EVERY_S", 0.0)
    cache = tmp_path / "cache"
    eng = Engine.from_settings(settings(cache)).start(timeout=T)
    try:
        reply = ask(eng, CODE)
        path = learned_file(cache, eng)
        deadline = time.monotonic() + T
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        got = BlockStore(cache).get_learned(store_namespace(eng.namespace), "suffix")
        assert got is not None and got.sequences[0].tolist() == reply.tokens
    finally:
        eng.shutdown()


def test_without_an_ssd_tier_nothing_is_written(tmp_path):
    cache = tmp_path / "cache"
    with Engine.from_settings(settings(cache, ssd_cache_bytes=0)).start(timeout=T) as eng:
        ask(eng, CODE)
        assert learned_tokens(eng) > 0
    assert not list(cache.rglob("*.lrn"))


def cli_env() -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "XDG_CONFIG_HOME": str(ROOT / ".cache" / "no-config")}
    env.pop("MLXKV_CONFIG", None)
    env.pop("MLXKV_DEBUG", None)
    return env


def mlxkv_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "mlxkv", *args]


def cli(*args: str) -> dict:
    r = subprocess.run(mlxkv_cmd("cache", *args), cwd=ROOT, capture_output=True, text=True, env=cli_env(),
                       timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])
