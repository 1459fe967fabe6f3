"""``--dequantize`` on mlx-lm's quantized folders (4-bit, made by mlx-lm's own converter):
auto dequantizes on the CPU backend, the float layers compute what the quantized ones do
to ~1e-3, and KV computed one way never seeds the other (another cache namespace), while
each way still finds its own."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from common import T

from mlxkv.engine.engine import Engine, Request
from mlxkv.engine.generate import SamplingParams
from mlxkv.engine.models import dequantize_wanted, load_model
from mlxkv.engine.settings import Settings, SettingsError
from support.modelgen import quantized_copy, tiny_model


@pytest.fixture(scope="module")
def q4() -> Path:
    return quantized_copy(tiny_model("llama"))


def quantized(model) -> bool:
    return any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in model.named_modules())


def test_auto_dequantizes_on_the_cpu(q4):
    assert mx.default_device() == mx.cpu
    auto = load_model(str(q4))
    off = load_model(str(q4), dequantize="off")
    on = load_model(str(q4), dequantize="on")
    assert auto.extra["dequantized"] is True and not quantized(auto.model)
    assert off.extra["dequantized"] is False and quantized(off.model)
    assert auto.weights_dtype == "bfloat16" and auto.compute_dtype == "float32"
    x = mx.array([[(i * 7) % 200 + 3 for i in range(24)]])
    assert mx.allclose(auto.model(x), off.model(x), atol=1e-3).item()
    # one namespace per path: "on" is auto's, "off" another
    assert auto.fingerprint == on.fingerprint != off.fingerprint
    # a float folder has nothing to dequantize: its fingerprint is the folder's
    plain = load_model(str(tiny_model("llama")))
    assert plain.extra["dequantized"] is False
    assert load_model(str(tiny_model("llama")), dequantize="on").fingerprint == plain.fingerprint


def test_the_setting_is_checked_and_auto_keeps_to_the_memory_budget():
    assert Settings.defaults().dequantize == "auto"
    with pytest.raises(SettingsError, match="not one of auto, on, off"):
        Settings.load({"dequantize": "yes"}, env={})
    assert Settings.load({}, env={"MLXKV_DEQUANTIZE": "off"}).dequantize == "off"
    assert dequantize_wanted("auto", 1 << 20) is True  # the CPU backend, fits
    assert dequantize_wanted("auto", 1 << 62) is False  # more than half the memory
    assert dequantize_wanted("on", 1 << 62) is True and dequantize_wanted("off", 1) is False


def test_cached_kv_of_one_path_never_seeds_the_other(q4, tmp_path):
    prompt = [(i * 13) % 200 + 3 for i in range(300)]
    greedy = SamplingParams(max_tokens=4, temperature=0.0)

    def run(dequantize: str) -> tuple[int, str]:
        settings = Settings.load({"model": str(q4), "cache_dir": str(tmp_path / "cache"),
                                  "dequantize": dequantize}, env={})
        with Engine.from_settings(settings).start(timeout=T) as engine:
            result = engine.submit(Request(prompt_tokens=prompt, params=greedy)).result(timeout=T)
            engine.cache_flush(timeout=T)
            return result.stats.cached_tokens, engine.namespace

    cached, quantized_ns = run("off")
    assert cached == 0
    cached, dequantized_ns = run("auto")
    assert cached == 0 and dequantized_ns != quantized_ns  # the quantized path's KV is not used
    assert run("auto")[0] > 0  # its own is, from the SSD tier in a new process
    assert run("off")[0] > 0
