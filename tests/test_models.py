"""Model loading, dtype policy and the model fingerprint (stability and sensitivity)."""

import json
import os
import shutil

import pytest

from mlxkv.engine.models import (
    ModelNotFoundError,
    apply_dtype_policy,
    load_model,
    model_fingerprint,
    model_label,
    resolve_model_path,
    weights_dtype,
)


@pytest.fixture
def model_copy(tiny_qwen3, tmp_path):
    # copy2 keeps mtimes, so the copy is the "same" model in stat mode.
    return shutil.copytree(tiny_qwen3, tmp_path / "m", copy_function=shutil.copy2)


@pytest.fixture
def stat_mode(monkeypatch):
    """Size + mtime fingerprints for models of any size (tiny ones are hashed by content)."""
    monkeypatch.setattr("mlxkv.engine.models.CONTENT_HASH_MAX_BYTES", 0)


def test_load_local_folder(tiny_qwen3):
    lm = load_model(tiny_qwen3)
    assert lm.config["model_type"] == "qwen3"
    assert lm.path == tiny_qwen3 and len(lm.fingerprint) == 32
    assert lm.weights_dtype == lm.compute_dtype == "float32"
    assert lm.tokenizer.has_chat_template
    assert lm.tokenizer.eos_token_ids  # <|im_end|>


def test_fingerprint_stable_across_calls_and_copies(tiny_qwen3, model_copy, stat_mode):
    a = model_fingerprint(tiny_qwen3)
    assert a == model_fingerprint(tiny_qwen3)
    assert a == model_fingerprint(model_copy)  # path is not part of it
    assert model_fingerprint(tiny_qwen3, full_hash=True) == model_fingerprint(
        model_copy, full_hash=True)
    assert a != model_fingerprint(tiny_qwen3, full_hash=True)  # the mode is recorded


def test_fingerprint_ignores_config_formatting(model_copy):
    before = model_fingerprint(model_copy)
    cfg = json.loads((model_copy / "config.json").read_text())
    (model_copy / "config.json").write_text(json.dumps(dict(reversed(cfg.items())), indent=7))
    assert model_fingerprint(model_copy) == before


def test_fingerprint_sensitive_to_config(model_copy):
    before = model_fingerprint(model_copy)
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg["rope_theta"] = cfg["rope_theta"] * 2
    (model_copy / "config.json").write_text(json.dumps(cfg))
    assert model_fingerprint(model_copy) != before


def test_fingerprint_sensitive_to_weights(model_copy, stat_mode):
    weights = next(model_copy.glob("*.safetensors"))
    stat_before = model_fingerprint(model_copy)
    full_before = model_fingerprint(model_copy, full_hash=True)
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert model_fingerprint(model_copy) != stat_before  # mtime counts in stat mode
    assert model_fingerprint(model_copy, full_hash=True) == full_before  # content didn't
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # same size, different bytes
    weights.write_bytes(bytes(data))
    assert model_fingerprint(model_copy, full_hash=True) != full_before


def test_fingerprint_inside_frozen_bundle_hashes_contents(model_copy, tmp_path, monkeypatch,
                                                         stat_mode):
    # A one-file PyInstaller bundle unpacks under sys._MEIPASS with fresh mtimes each start.
    monkeypatch.setattr("sys._MEIPASS", str(tmp_path), raising=False)
    weights = next(model_copy.glob("*.safetensors"))
    before = model_fingerprint(model_copy)
    assert before == model_fingerprint(model_copy, full_hash=True)
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert model_fingerprint(model_copy) == before
    monkeypatch.setattr("sys._MEIPASS", str(tmp_path / "elsewhere"))
    assert model_fingerprint(model_copy) != before  # outside the bundle: size + mtime


def test_demo_model_fingerprint_does_not_depend_on_place_or_mtimes(tmp_path):
    """The demo model unpacked elsewhere with fresh mtimes (a one-file binary does this on
    every start) is the same model: same fingerprint, so the same cache namespace."""
    from mlxkv.engine.demo import DEMO_MODEL_DIR

    if not (DEMO_MODEL_DIR / "config.json").exists():
        pytest.skip("the demo model is not built")
    copy = shutil.copytree(DEMO_MODEL_DIR, tmp_path / "_MEI12345" / "engine" / "demo" / "model")
    for f in copy.iterdir():
        st = f.stat()
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 3_600_000_000_000))
    assert model_fingerprint(copy) == model_fingerprint(DEMO_MODEL_DIR)
    assert model_fingerprint(DEMO_MODEL_DIR) == model_fingerprint(DEMO_MODEL_DIR, full_hash=True)


def test_small_models_are_hashed_by_content(model_copy, tiny_qwen3):
    weights = next(model_copy.glob("*.safetensors"))
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert model_fingerprint(model_copy) == model_fingerprint(tiny_qwen3)
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert model_fingerprint(model_copy) != model_fingerprint(tiny_qwen3)


def test_model_label_names_the_demo_model_not_its_folder(tiny_qwen3):
    from mlxkv.engine.demo import DEMO_MODEL_DIR

    assert model_label("mlx-community/Qwen3-4B-4bit") == "mlx-community/Qwen3-4B-4bit"
    assert model_label(str(tiny_qwen3)) == str(tiny_qwen3)
    if (DEMO_MODEL_DIR / "config.json").exists():
        label = model_label(str(DEMO_MODEL_DIR))
        assert label == f"demo model ({model_fingerprint(DEMO_MODEL_DIR)[:8]})"
        assert str(DEMO_MODEL_DIR) not in label


def test_fingerprint_sensitive_to_tokenizer_and_template(model_copy):
    before = model_fingerprint(model_copy)
    tc = model_copy / "tokenizer_config.json"
    cfg = json.loads(tc.read_text())
    cfg["chat_template"] = cfg["chat_template"].replace("<|im_start|>", "<|im_start|> ")
    tc.write_text(json.dumps(cfg))
    after_template = model_fingerprint(model_copy)
    assert after_template != before
    tok = model_copy / "tokenizer.json"
    tok.write_text(tok.read_text().replace('"<|endoftext|>"', '"<|end_of_text|>"', 1))
    assert model_fingerprint(model_copy) != after_template


def test_dtype_policy(tiny_qwen3, tmp_path):
    import mlx.core as mx

    from support.modelgen import save_model_dir

    lm = load_model(tiny_qwen3)
    lm.model.set_dtype(mx.bfloat16)
    bf16 = save_model_dir(lm.model, lm.config, tmp_path / "bf16")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(tiny_qwen3 / name, bf16 / name)
    auto = load_model(bf16)  # CPU: bf16 weights compute in float32
    assert (auto.weights_dtype, auto.compute_dtype) == ("bfloat16", "float32")
    assert weights_dtype(auto.model) == "float32"
    native = load_model(bf16, dtype="native")
    assert weights_dtype(native.model) == native.compute_dtype == "bfloat16"
    assert apply_dtype_policy(native.model, "float16") == "float16"
    assert weights_dtype(native.model) == "float16"
    with pytest.raises(ValueError):
        apply_dtype_policy(native.model, "int8")


def test_missing_folder_and_not_a_model(tmp_path):
    with pytest.raises(ModelNotFoundError, match="model folder not found"):
        resolve_model_path(tmp_path / "nope")
    with pytest.raises(ModelNotFoundError, match="not a model folder"):
        resolve_model_path(tmp_path)


def test_unknown_hub_id_offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelNotFoundError, match="offline"):
        resolve_model_path("mlxkv-test/no-such-model")
