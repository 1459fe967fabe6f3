"""Any stored prefix is reusable: a state stored past the prompt (a tail, or a full block
the prompt ends inside) serves the prompt up to its last token, from SSD as from RAM, in a
new process too; greedy output after such a hit is the cold run's."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlxkv.engine.cache import PrefixCache
from mlxkv.storage import format as fmt
from mlxkv.storage.store import BlockStore
from support.modelgen import init_model, model_config

BT = 16
ROOT = Path(__file__).resolve().parent.parent


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def run(model, tokens, n_new=5, cache=None, n_cached=0):
    cache = make_prompt_cache(model) if cache is None else cache
    logits = model(mx.array(tokens[n_cached:])[None], cache=cache)[0, -1]
    out = []
    for _ in range(n_new):
        t = int(mx.argmax(logits).item())
        out.append(t)
        logits = model(mx.array([[t]]), cache=cache)[0, -1]
    return out, cache


def pc_at(path: Path) -> PrefixCache:
    return PrefixCache(ram_bytes=1 << 30, cache_dir=str(path), block_tokens=BT)


# ----------------------------------------------------------------------------- storage
def test_store_serves_a_prompt_ending_inside_a_stored_block(tmp_path):
    """The stored state runs past the prompt through full blocks: the block the prompt
    ends inside serves its first rows, verified, after a rescan (a new process)."""
    layout = fmt.make_layout([fmt.SegmentSpec("k", "uint8", (8,), 2, 8)])
    toks = np.arange(4 * BT + 5, dtype=np.uint32) + 7
    src = np.random.default_rng(0).integers(0, 255, (2, toks.size, 8), dtype=np.uint8)
    BlockStore(tmp_path, block_tokens=BT).put_blocks("ns", toks, layout, [(src, 2, toks.size, 8)])
    store = BlockStore(tmp_path, block_tokens=BT)
    store.scan()
    for length in (2 * BT, 2 * BT + 9, 3 * BT):  # multiples of the block size and not
        q = toks[:length]
        m = store.lookup("ns", q, max_tokens=length - 1)
        assert m.n_tokens == length - 1, length
        dst = np.full((2, length, 8), 0xEE, dtype=np.uint8)
        r = store.get_blocks("ns", q, layout, [(dst, 2, length, 8)], n_tokens=m)
        assert r.n_tokens == length - 1 and r.corrupt == 0
        np.testing.assert_array_equal(dst[:, : length - 1], src[:, : length - 1])
        assert (dst[:, length - 1 :] == 0xEE).all()  # rows past the match are not written
    # a prompt diverging inside that block gets exactly the common part
    q = np.concatenate([toks[: 2 * BT + 3], np.array([1, 2, 3, 4], np.uint32)])
    assert store.lookup("ns", q, max_tokens=q.size - 1).n_tokens == 2 * BT + 3


# ----------------------------------------------------------------------------- prefix cache
def _models():
    dense = init_model(model_config("qwen3", 512), seed=3)
    quant = init_model(model_config("llama", 512, head_dim=32), seed=4)
    return {"dense": dense, "quantized": quant}


@pytest.fixture(scope="module")
def models():
    return _models()


def _state(model, kind, tokens):
    out, cache = run(model, tokens)
    if kind == "quantized":
        cache = [c.to_quantized(group_size=32, bits=8) for c in cache]
        mx.eval([c.state for c in cache])
    return out, cache


@pytest.mark.parametrize("kind", ["dense", "quantized"])
@pytest.mark.parametrize("length", [3 * BT, 3 * BT + 7])
def test_repeated_prompt_after_restart_reuses_all_but_its_last_token(models, kind, length,
                                                                     tmp_path):
    model = models[kind]
    t = prompt(length, length)
    out, cache = _state(model, kind, t)
    pc = pc_at(tmp_path)
    pc.store(t + out[:-1], cache, "ns-" + kind)  # the turn's state: prompt + reply
    assert pc.close(30)["durable"] == 1
    pc2 = pc_at(tmp_path)  # empty RAM, a fresh scan of the folder
    n, c = pc2.lookup(t, "ns-" + kind)
    assert n == length - 1 and pc2.stats()["last"]["tier"] == "ssd"
    assert all(x.offset == n for x in c)
    # the cold run of this exact prompt, and the run continued from the restored state
    if kind == "quantized":
        # quantized rows depend on the pass that computed them: compare with the stored
        # state itself, trimmed in memory to the same position
        from mlx_lm.models.cache import trim_prompt_cache

        _, ref = _state(model, kind, t)
        trim_prompt_cache(ref, ref[0].offset - n)
        want = np.array(model(mx.array(t[n:])[None], cache=ref)[0, -1])
        got = np.array(model(mx.array(t[n:])[None], cache=c)[0, -1])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    else:
        cold, _ = run(model, t)
        warm, _ = run(model, t, cache=c, n_cached=n)
        assert warm == cold
    pc2.close()


def test_ram_tier_serves_a_prompt_ending_inside_a_stored_block(models):
    model = models["dense"]
    t = prompt(2 * BT, 5)
    out, cache = run(model, t)
    pc = PrefixCache(ram_bytes=1 << 30, cache_dir=None, block_tokens=BT)
    pc.store(t + out[:-1], cache, "ns")
    n, c = pc.lookup(t, "ns")
    assert n == len(t) - 1
    cold, _ = run(model, t)
    assert run(model, t, cache=c, n_cached=n)[0] == cold


_CHILD = textwrap.dedent("""
    import json, sys
    from mlxkv.engine.blas import preload
    preload()
    from mlxkv.engine.cache import PrefixCache
    pc = PrefixCache(ram_bytes=1 << 30, cache_dir=sys.argv[1], block_tokens=int(sys.argv[2]))
    out = []
    for t in json.loads(sys.argv[3]):
        n, c = pc.lookup(t, "ns")
        out.append([n, pc.stats()["last"]["tier"]])
    pc.close()
    print(json.dumps(out))
""")


def test_tail_reuse_in_a_new_process(models, tmp_path):
    model = models["dense"]
    prompts = [prompt(4 * BT, 6), prompt(4 * BT + 3, 7)]
    pc = pc_at(tmp_path)
    for t in prompts:
        out, cache = run(model, t, n_new=BT + 2)  # the reply fills whole blocks past the prompt
        pc.store(t + out[:-1], cache, "ns")
    assert pc.close(30)["durable"] == 2
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path), str(BT),
                           json.dumps(prompts)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == [[len(t) - 1, "ssd"] for t in prompts]
