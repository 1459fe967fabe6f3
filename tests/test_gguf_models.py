"""A GGUF file wherever a model is named: ``--model FILE.gguf`` (or a folder holding one)
resolves and loads through the engine's loader with the dtype policy; the fingerprint
covers the file's content; `mlxkv chat --model FILE.gguf` and the TUI's model switcher
take one."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from tui_pilot import drive, make_settings, pick_model, send, wait_for

from mlxkv.engine.gguf import GGUFError
from mlxkv.engine.models import ModelNotFoundError, load_model, model_fingerprint, resolve_model_path
from support.gguf_files import tiny_gguf

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def q4() -> Path:
    return tiny_gguf("qwen3", "Q4_0")


def test_a_gguf_file_or_a_folder_holding_one_resolves(q4, tmp_path):
    assert resolve_model_path(q4) == q4
    folder = tmp_path / "one"
    folder.mkdir()
    shutil.copy(q4, folder / "model.gguf")
    assert resolve_model_path(folder) == folder / "model.gguf"
    shutil.copy(q4, folder / "other.gguf")
    with pytest.raises(ModelNotFoundError, match="holds 2 GGUF files .*name one"):
        resolve_model_path(folder)
    with pytest.raises(ModelNotFoundError, match="GGUF file not found"):
        resolve_model_path("missing.gguf")  # a bare name is a path, not a hub id
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ModelNotFoundError, match="is a file, not a model folder or a .gguf file"):
        resolve_model_path(tmp_path / "notes.txt")


def test_load_model_applies_the_dequantize_setting_and_the_dtype_policy(q4):
    # On the CPU (--dequantize auto) the quantized matrices become float32 (BLAS); "off"
    # keeps them quantized, as mlx-lm's QuantizedLinear. --dtype is the compute dtype only.
    auto = load_model(q4)
    assert mx.default_device() == mx.cpu
    assert auto.compute_dtype == "float32" and auto.weights_dtype == "gguf Q4_0"
    assert auto.extra["gguf"]["dequantized"] is True
    assert not any(isinstance(m, nn.QuantizedLinear) for _, m in auto.model.named_modules())
    assert load_model(q4, dtype="native").extra["gguf"]["dequantized"] is True
    native = load_model(q4, dtype="native", dequantize="off")
    assert native.extra["gguf"]["dequantized"] is False
    assert any(isinstance(m, nn.QuantizedLinear) for _, m in native.model.named_modules())
    x = mx.array([[1, 2, 3, 4]])
    assert mx.allclose(auto.model(x), native.model(x), atol=1e-3)
    # close, not equal: the two never share cached KV, even computed in the same dtype
    quantized_f32 = load_model(q4, dtype="float32", dequantize="off")
    assert quantized_f32.extra["gguf"]["dequantized"] is False and quantized_f32.compute_dtype == "float32"
    assert quantized_f32.fingerprint == native.fingerprint == model_fingerprint(q4) != auto.fingerprint
    assert load_model(q4, dequantize="on").fingerprint == auto.fingerprint
    assert auto.config["model_type"] == "qwen3" and auto.context_tokens == 32768
    assert auto.path == q4 and auto.name == q4.name
    assert auto.tokenizer.has_chat_template and auto.tokenizer.eos_token_ids


def test_the_fingerprint_covers_the_files_content(q4, tmp_path):
    a = model_fingerprint(q4)
    copy = tmp_path / "copy.gguf"
    shutil.copy(q4, copy)
    assert model_fingerprint(copy) == a  # the path is not part of it
    data = bytearray(copy.read_bytes())
    data[-3] ^= 0x01  # one bit of the last tensor's data
    copy.write_bytes(bytes(data))
    assert model_fingerprint(copy) != a
    assert model_fingerprint(tiny_gguf("qwen3", "Q4_1")) != a
    assert len(a) == 32


def test_a_broken_file_is_one_clear_error_from_the_command_line(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 40)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "XDG_CONFIG_HOME": str(tmp_path / "config")}
    env.pop("MLXKV_CONFIG", None)
    r = subprocess.run([sys.executable, "-m", "mlxkv", "generate", "--model", str(bad), "-p", "hi",
                        "--max-tokens", "2", "--no-ssd-cache"], cwd=ROOT, capture_output=True,
                       text=True, env=env, timeout=120)
    lines = [ln for ln in r.stderr.splitlines() if "PyTorch was not found" not in ln]
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert len(lines) == 1 and lines[0].startswith("mlxkv: error: ") and "broken.gguf" in lines[0], lines
    assert "claims" in lines[0] or "truncated" in lines[0], lines


def test_mlxkv_chat_takes_a_gguf_file(q4, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MLXKV_CACHE_DIR": str(tmp_path / "cache"),
           "XDG_CONFIG_HOME": str(tmp_path / "config")}
    env.pop("MLXKV_CONFIG", None)
    r = subprocess.run([sys.executable, "-m", "mlxkv", "chat", "--model", str(q4), "--max-tokens", "4",
                        "--temp", "0"], cwd=ROOT, input="hello there\nhello there\n/quit\n",
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert f"mlxkv chat: {q4}" in r.stdout, r.stdout
    assert r.stdout.count("[prompt ") == 2, r.stdout


def test_the_tui_model_switcher_loads_a_gguf_file(q4, tmp_path: Path, data_dir: Path) -> None:
    from mlxkv.tui.app import MlxkvApp

    app = MlxkvApp(make_settings(tmp_path, max_tokens=4))

    async def scenario(pilot: Any) -> None:
        await wait_for(pilot, app.metrics.model_ready.is_set, "model")
        await pick_model(pilot, str(q4))
        await wait_for(pilot, lambda: app.bridge.ready.is_set() and app.bridge.error is None
                       and app.bridge.info.get("path") == str(q4), "the GGUF model")
        assert app.bridge.info["model_type"] == "qwen3"
        await send(pilot, "hello")
        assert app.bridge.error is None
    drive(app, scenario)


def test_a_gguf_error_is_a_value_error():
    # so every front end reports it as a clear error (the command line's one-line form)
    assert issubclass(GGUFError, ValueError)
