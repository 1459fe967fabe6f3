"""The parts of engine.distributed that need no second rank: the prefix agreement, the
request body, launch detection, the choice of sharding and its refusals, the watchdog."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mlxkv.engine.distributed import DistributedError, launch_rank, launched
from mlxkv.engine.distributed.protocol import decide, pack_body, unpack_body
from mlxkv.engine.distributed.sharding import choose_mode, shard_namespace, supported_modes

ROOT = Path(__file__).resolve().parent.parent


def test_the_ranks_agree_on_the_shortest_prefix_every_rank_can_hold():
    # [cached, trimmable, ram, ssd] per rank
    a = decide([[300, 1, 256, 44], [256, 1, 0, 256]])
    assert (a.used, a.cached_by_rank, a.ram_by_rank, a.ssd_by_rank) == (
        256, [300, 256], [256, 0], [44, 256])
    assert decide([[300, 1, 0, 0], [0, 0, 0, 0]]).used == 0  # a rank lost its blocks
    # a rank holding more that cannot cut its cache (an exact checkpoint): start from 0
    assert decide([[300, 0, 0, 300], [256, 1, 0, 256]]).used == 0
    assert decide([[256, 0, 0, 256], [256, 0, 0, 256]]).used == 256  # equal: nothing to cut


def test_a_request_body_survives_the_int32_words():
    body = {"params": {"max_tokens": 5, "stop": ["é\n", "}"], "seed": None}, "session": "s-1"}
    words = pack_body(body)
    assert words.dtype.name == "int32"
    assert unpack_body(words) == body


def test_a_launch_is_detected_from_what_the_launchers_set():
    assert not launched({})
    assert launched({"MLX_RANK": "1"}) and launch_rank({"MLX_RANK": "1"}) == 1
    assert launched({"OMPI_COMM_WORLD_SIZE": "2"}) and launch_rank({"OMPI_COMM_WORLD_RANK": "1"}) == 1
    assert launch_rank({}) == 0


def _modes(path: Path) -> tuple[list[str], dict]:
    from mlx_lm.utils import load_model

    model, config = load_model(path, lazy=True, strict=False)
    return supported_modes(model), json.loads((path / "config.json").read_text())


def test_the_sharding_is_chosen_from_what_mlx_lm_supports_and_refused_clearly(tmp_path):
    from support.modelgen import tiny_model, tiny_model_of_type

    qwen2 = tiny_model_of_type("qwen2")
    modes, config = _modes(qwen2)
    assert modes == ["tensor", "pipeline"]
    assert choose_mode("auto", modes, config, qwen2, 2, 0) == "tensor"
    assert choose_mode("pipeline", modes, config, qwen2, 2, 0) == "pipeline"
    # 4 attention heads do not divide by 3 ranks: auto falls back to pipeline (2 layers < 3
    # ranks: refused, saying why for each)
    with pytest.raises(DistributedError, match=r"rank 1: the model type 'qwen2' cannot be split "
                                               r"over 3 ranks \(tensor: .*; pipeline: it has 2 layers"):
        choose_mode("auto", modes, config, qwen2, 3, 1)
    qwen3 = tiny_model("qwen3")
    modes, config = _modes(qwen3)
    assert modes == ["tensor"]
    with pytest.raises(DistributedError, match="'qwen3' cannot be split by pipeline sharding: "
                                               r"mlx-lm supports tensor for it \(--shard tensor\)"):
        choose_mode("pipeline", modes, config, qwen3, 2, 0)
    with pytest.raises(DistributedError, match="has neither tensor nor pipeline"):
        choose_mode("auto", [], {"model_type": "rwkv"}, qwen3, 2, 0)
    # pipeline loading reads the weight map: a folder without one is refused, not crashed
    bare = tmp_path / "bare"
    bare.mkdir()
    with pytest.raises(DistributedError, match="no model.safetensors.index.json"):
        choose_mode("pipeline", ["tensor", "pipeline"], {"model_type": "qwen2",
                                                         "num_hidden_layers": 2}, bare, 2, 0)
    assert shard_namespace("abc-float32-kv2-x", "pipeline", 2, 1) == "abc-float32-kv2-x-pp2r1"


def _child(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    full = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env=full)


def test_the_watchdog_ends_a_wait_that_lasts_too_long_with_a_clear_error():
    r = _child("import threading\n"
               "from mlxkv.engine.distributed.watchdog import Watchdog\n"
               "dog = Watchdog(3, 0.5)\n"
               "dog.arm('waiting for a peer that never answers')\n"
               "threading.Event().wait(30)\n")
    assert r.returncode == 1, r
    assert r.stderr == ("mlxkv: error: rank 3: no answer from the other ranks for 0.5 s while waiting "
                        "for a peer that never answers: a rank has died, hung or been stopped (the "
                        "bound is --dist-timeout-s)\n")


def test_a_launch_of_one_process_runs_as_a_single_process(tmp_path):
    # mlx.launch -n 1 hands each rank an empty host file
    hosts = tmp_path / "hosts.json"
    hosts.write_text("")
    r = _child("from mlxkv.engine.distributed import join; print(join(5))",
               {"MLX_RANK": "0", "MLX_HOSTFILE": str(hosts)})
    assert r.returncode == 0 and r.stdout.strip() == "None", r
