"""mlxkv on 2 ranks of this machine (ring backend on loopback, a tiny qwen2 built offline):
the same output as one process for tensor and pipeline sharding, each rank's prefix cache
(reuse on both ranks, the SSD tier after a restart, one rank's blocks deleted), a clear
refusal, and a rank that dies or is stopped making the other stop within the bound."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess

import pytest

from tests import dist_support as ds

MAX_TOKENS = 10
PROMPT = "The prefix cache keeps every conversation"
LONGER = PROMPT + " and answers the next turn from where it stopped"


@pytest.fixture(scope="module")
def model() -> str:
    from support.modelgen import tiny_model_of_type

    return str(tiny_model_of_type("qwen2"))


@pytest.fixture(scope="module")
def reference(model: str) -> dict:
    """What one process answers (no cache): greedy for both prompts, and seeded sampling."""
    from mlxkv.engine.engine import Engine, Request
    from mlxkv.engine.generate import SamplingParams

    out = {}
    with Engine(model, prefix_cache=None, max_batch=1).start(timeout=120) as engine:
        for key, prompt, params in (
                ("short", PROMPT, SamplingParams(max_tokens=MAX_TOKENS)),
                ("longer", LONGER, SamplingParams(max_tokens=MAX_TOKENS)),
                ("sampled", LONGER, SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=7))):
            out[key] = engine.submit(Request(prompt=prompt, params=params)).result(timeout=120)
    return out


def _generate(model: str, cache: str, *flags: str, prompt: str = LONGER) -> tuple[dict, str]:
    out, err = ds.run_launch(["generate", "--model", model, "--cache-dir", cache, "--raw",
                              "--max-tokens", str(MAX_TOKENS), "--json", "--prompt", prompt,
                              "--dist-timeout-s", "30", *flags])
    return ds.last_json(out), err


def _namespace_dir(cache: str, rank: int, tag: str) -> list:
    from pathlib import Path

    return [p for p in Path(cache).iterdir() if p.name.endswith(f"-{tag}2r{rank}")]


def test_tensor_sharding_serves_caches_per_rank_and_restores_from_ssd(model, reference, tmp_path):
    cache = str(tmp_path / "cache")
    port = ds.free_ports(1)
    launcher = ds.launch(["serve", "--model", model, "--cache-dir", cache, "--port", str(port),
                          "--shard", "tensor", "--dist-timeout-s", "30"])
    try:
        ds.wait_http(port, launcher)
        first = ds.http(port, "/v1/completions", {"prompt": PROMPT, "max_tokens": MAX_TOKENS,
                                                  "temperature": 0, "logprobs": 0})
        second = ds.http(port, "/v1/completions", {"prompt": LONGER, "max_tokens": MAX_TOKENS,
                                                   "temperature": 0})
        stats = ds.http(port, "/stats")["engine"]["distributed"]
        sampled = ds.http(port, "/v1/completions", {"prompt": LONGER, "max_tokens": MAX_TOKENS,
                                                    "temperature": 1.0, "seed": 7})
        # a stop string ends every rank's generation at the same token (each rank matches it)
        ref = reference["sampled"].text
        stop = ref[len(ref) // 2: len(ref) // 2 + 2]
        stopped = ds.http(port, "/v1/completions", {"prompt": LONGER, "max_tokens": MAX_TOKENS,
                                                    "temperature": 1.0, "seed": 7, "stop": [stop]})
        # a client that leaves a streamed reply: rank 0 cancels, every rank stops with it
        ds.leave_stream(port, {"prompt": LONGER, "max_tokens": 5000, "temperature": 0})
        after = ds.http(port, "/v1/completions", {"prompt": LONGER, "max_tokens": MAX_TOKENS,
                                                  "temperature": 0})
        counts = ds.http(port, "/stats")["engine"]
        pids = ds.rank_pids(launcher)
        os.kill(pids[0], signal.SIGTERM)  # rank 0 drains, flushes every rank's cache, stops all
        status, out, err = ds.wait_exit(launcher, 60)
    finally:
        ds.kill(launcher)
    assert "error" not in err, err
    assert "Node with rank" not in err, err  # both ranks ended with status 0
    # one process's answers, greedy and seeded sampling (rank 0 samples for every rank)
    assert first["choices"][0]["text"] == reference["short"].text
    assert second["choices"][0]["text"] == reference["longer"].text
    assert sampled["choices"][0]["text"] == reference["sampled"].text
    # the second prompt continues the first: both ranks found the first one's state
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0
    last = stats["last_request"]
    assert (stats["world"], stats["shard"]) == (2, "tensor")
    assert last["used"] == cached and all(n >= cached for n in last["cached_by_rank"]), last
    assert sampled["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert stopped["choices"][0]["text"] == ref[:ref.find(stop)], (stop, ref)
    assert counts["cancelled"] >= 1  # the long stream did not run to its end
    assert after["choices"][0]["text"] == reference["longer"].text  # still in step

    # new processes: the SSD tier serves both ranks (their RAM is empty), same tokens
    got, _ = _generate(model, cache, "--shard", "tensor")
    assert got["tokens"] == reference["longer"].tokens
    last = got["distributed"]["last_request"]
    assert got["stats"]["cached_ssd_tokens"] > 0 and all(n > 0 for n in last["ssd_by_rank"]), last

    # rank 1 loses its blocks: both ranks compute the whole prompt, with the same output
    for folder in _namespace_dir(cache, 1, "tp"):
        shutil.rmtree(folder)
    got, _ = _generate(model, cache, "--shard", "tensor")
    last = got["distributed"]["last_request"]
    assert last["cached_by_rank"][0] > 0 and last["cached_by_rank"][1] == 0, last
    assert last["used"] == 0 and got["stats"]["cached_tokens"] == 0
    assert got["tokens"] == reference["longer"].tokens


def test_pipeline_sharding_matches_one_process_and_caches_per_rank(model, reference, tmp_path):
    cache = str(tmp_path / "cache")
    got, _ = _generate(model, cache, "--shard", "pipeline")
    assert got["tokens"] == reference["longer"].tokens
    assert got["model"]["distributed"] == {"world": 2, "rank": 0, "shard": "pipeline"}
    assert got["model"]["namespace"].endswith("-pp2r0")
    assert len(_namespace_dir(cache, 0, "pp")) == 1 and len(_namespace_dir(cache, 1, "pp")) == 1
    got, _ = _generate(model, cache, "--shard", "pipeline")
    last = got["distributed"]["last_request"]
    assert got["tokens"] == reference["longer"].tokens
    assert last["used"] > 0 and last["cached_by_rank"] == [last["used"]] * 2, last


def test_a_model_type_without_the_asked_sharding_is_refused_clearly(tmp_path):
    from support.modelgen import tiny_model

    out, err = ds.run_launch(["generate", "--model", str(tiny_model("qwen3")), "--no-ssd-cache",
                              "--shard", "pipeline", "--prompt", "hi", "--dist-timeout-s", "30"])
    # each rank refuses; the launcher stops the other once the first has
    assert re.search(r"mlxkv: error: rank [01]: the model type 'qwen3' cannot be split by "
                     r"pipeline sharding: mlx-lm supports tensor for it \(--shard tensor\)", err), err
    assert "Traceback" not in err and not out.strip()


def _serve_ranks(model: str, tmp_path) -> tuple[list[subprocess.Popen], int]:
    port = ds.free_ports(1)
    procs = ds.start_ranks(["serve", "--model", model, "--cache-dir", str(tmp_path / "cache"),
                            "--port", str(port), "--shard", "pipeline", "--dist-timeout-s", "3"],
                           tmp_path)
    ds.wait_http(port, procs[0])
    return procs, port


@pytest.mark.parametrize("victim, how", [(1, "kill"), (1, "stop"), (0, "stop")])
def test_a_rank_that_dies_or_stops_makes_the_other_stop_with_a_clear_error(model, tmp_path,
                                                                          victim, how):
    procs, port = _serve_ranks(model, tmp_path)
    try:
        ds.http(port, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "temperature": 0})
        procs[victim].send_signal(signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        survivor = 1 - victim
        # bounded: the dist timeout (3 s) and a heartbeat, with room for a loaded machine;
        # a survivor that hangs fails here (TimeoutExpired)
        status, _, err = ds.wait_exit(procs[survivor], 60)
    finally:
        for p in procs:
            ds.kill(p)
    assert status == 1, err
    if how == "kill":  # the backend reports the lost connection at the next heartbeat
        assert f"mlxkv: error: rank {survivor}: lost the other ranks while" in err, err
    else:
        assert (f"mlxkv: error: rank {survivor}: no answer from the other ranks for 3 s while"
                in err), err
    assert "Traceback" not in err
