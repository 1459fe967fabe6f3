"""The models people already have, where other tools keep them (engine/model_stores.py):
the Hugging Face hub cache, Ollama's store, LM Studio's folders and the ``model_dirs``
folders, each built in tmp_path exactly as that tool lays it out (the environment points
every store there, so the real home is never looked at). Listed with every field, named as
the tools name them, damaged entries listed with the reason; ``resolve`` of each name and
its not-found error; ``--model ollama:NAME:TAG`` loading the real GGUF file from its blob;
``mlxkv models`` as a user runs it."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mlxkv.engine import model_stores
from mlxkv.engine.gguf import read_header
from mlxkv.engine.model_stores import find_models, resolve, search_dirs
from mlxkv.engine.models import ModelNotFoundError, gguf_file, model_fingerprint, resolve_model_path
from mlxkv.engine.settings import Settings, SettingsError
from support.modelgen import quantized_copy, tiny_model
from support.real_model import GGUF_BYTES, GGUF_NAME, GGUF_SHA256, real_model_path

ROOT = Path(__file__).resolve().parent.parent
REAL = real_model_path()
needs_real = pytest.mark.skipif(REAL is None, reason="the real model (SmolLM2-135M GGUF) is not "
                                                     "fetched: run `make fixtures`")
OLLAMA_HOST = "registry.ollama.ai"
REV = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Every store's location under tmp_path, in os.environ (for the code) and returned
    (for subprocesses)."""
    values = {"HOME": str(tmp_path / "home"), "HF_HUB_CACHE": str(tmp_path / "hf"),
              "OLLAMA_MODELS": str(tmp_path / "ollama"), "LMSTUDIO_MODELS": str(tmp_path / "lmstudio")}
    (tmp_path / "home").mkdir()
    for name in ("HF_HOME", "HUGGINGFACE_HUB_CACHE", "XDG_CACHE_HOME", "MLXKV_MODEL_DIRS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    return values


def link_or_copy(src: Path, dst: Path) -> Path:
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)
    return dst


# --- the stores, laid out as their tools lay them out ----------------------------------

def put_blob(store: Path, data: bytes) -> dict:
    digest = hashlib.sha256(data).hexdigest()
    path = store / "blobs" / f"sha256-{digest}"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return {"digest": f"sha256:{digest}", "size": len(data)}


def put_ollama(store: Path, name: str, tag: str, model_layer: dict, namespace: str = "library",
               host: str = OLLAMA_HOST, projector: dict | None = None) -> Path:
    """A manifest as ``ollama pull`` writes it: a config blob, the model layer (the GGUF
    file), template and params layers (and a vision projector)."""
    config = put_blob(store, json.dumps({"model_format": "gguf", "model_family": "llama",
                                         "file_type": "Q4_1", "rootfs": {"type": "layers"}}).encode())
    template = put_blob(store, b"{{ if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}")
    params = put_blob(store, json.dumps({"stop": ["<|im_end|>"]}).encode())
    layers = [{"mediaType": "application/vnd.ollama.image.model", **model_layer}]
    if projector is not None:
        layers.append({"mediaType": "application/vnd.ollama.image.projector", **projector})
    layers += [{"mediaType": "application/vnd.ollama.image.template", **template},
               {"mediaType": "application/vnd.ollama.image.params", **params}]
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
                "config": {"mediaType": "application/vnd.docker.container.image.v1+json", **config},
                "layers": layers}
    path = store / "manifests" / host / namespace / name / tag
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest))
    return path


def put_real_blob(store: Path) -> tuple[Path, dict]:
    """The real GGUF file as Ollama keeps it: ``blobs/sha256-<its sha256>``, no suffix."""
    blob = link_or_copy(REAL, store / "blobs" / f"sha256-{GGUF_SHA256}")
    return blob, {"digest": f"sha256:{GGUF_SHA256}", "size": GGUF_BYTES}


def put_hf(cache: Path, repo_id: str, folder: Path, rev: str = REV, ref: bool = True) -> Path:
    """A hub-cache repo: each file once in ``blobs/<sha256>``, the snapshot's files
    relative links to them, ``refs/main`` naming the revision."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / rev
    snapshot.mkdir(parents=True)
    for f in sorted(folder.iterdir()):
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        blob = repo / "blobs" / digest
        if not blob.exists():
            link_or_copy(f, blob)
        (snapshot / f.name).symlink_to(os.path.join("..", "..", "blobs", digest))
    if ref:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(rev)
    return snapshot


def by_name(models: list) -> dict:
    return {m.name: m for m in models}


def weights_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


# --- listing ---------------------------------------------------------------------------

def test_stores_that_do_not_exist_are_empty(env):
    assert find_models() == []
    assert [s for s, _ in search_dirs()] == ["hf", "ollama", "lmstudio", "lmstudio", "lmstudio"]
    assert resolve("Qwen/Qwen3-4B") is None and resolve("/some/folder") is None  # not store names
    with pytest.raises(ModelNotFoundError, match=r"ollama:qwen3:4b not found in Ollama's store \(.*ollama\); "
                                                 "it holds no models"):
        resolve("ollama:qwen3:4b")


@needs_real
def test_ollama_models_are_listed_from_their_manifests_with_every_field(env):
    store = Path(env["OLLAMA_MODELS"])
    blob, layer = put_real_blob(store)
    put_ollama(store, "smollm2", "135m", layer)
    put_ollama(store, "smollm2", "latest", layer)  # one blob, two tags: as Ollama does
    put_ollama(store, "smollm2", "135m", layer, namespace="someone")
    put_ollama(store, "SmolLM2-135M-Instruct-GGUF", "Q4_1", layer, namespace="bartowski", host="hf.co")
    projector = put_blob(store, b"GGUF" + b"\0" * 60)  # a vision model's projector: the text model loads
    put_ollama(store, "smolvlm", "latest", layer, projector=projector)
    models = find_models()
    assert [m.name for m in models] == ["ollama:hf.co/bartowski/SmolLM2-135M-Instruct-GGUF:Q4_1",
                                        "ollama:smollm2:135m", "ollama:smollm2:latest",
                                        "ollama:smolvlm:latest", "ollama:someone/smollm2:135m"]
    header = read_header(REAL)
    assert header.get("llama.context_length") == 8192 and header.get("general.file_type") == 3
    m = by_name(models)["ollama:smollm2:135m"]
    assert m.as_dict() == {"name": "ollama:smollm2:135m", "store": "ollama", "path": str(blob),
                           "format": "gguf", "size_bytes": GGUF_BYTES, "architecture": "llama",
                           "quantization": "Q4_1", "context_tokens": 8192, "loadable": True, "why_not": None}
    assert all(x.loadable and x.path == blob for x in models)


def test_damaged_ollama_entries_are_listed_as_not_loadable_with_the_reason(env):
    store = Path(env["OLLAMA_MODELS"])
    put_ollama(store, "garbage", "latest", put_blob(store, b"not a gguf file at all, " * 4))
    put_ollama(store, "gone", "latest", {"digest": "sha256:" + "ab" * 32, "size": 123})
    short = put_blob(store, b"GGUF")
    put_ollama(store, "shrunk", "latest", {**short, "size": 4096})
    bad = store / "manifests" / OLLAMA_HOST / "library" / "broken" / "latest"
    bad.parent.mkdir(parents=True)
    bad.write_text("{not json")
    (store / "manifests" / OLLAMA_HOST / "library" / "nomodel").mkdir()
    (store / "manifests" / OLLAMA_HOST / "library" / "nomodel" / "latest").write_text(
        json.dumps({"schemaVersion": 2, "layers": [{"mediaType": "application/vnd.ollama.image.license",
                                                     **put_blob(store, b"MIT")}]}))
    models = by_name(find_models())
    assert not any(m.loadable for m in models.values())
    assert "not a GGUF file" in models["ollama:garbage:latest"].why_not
    assert models["ollama:garbage:latest"].size_bytes == 96
    assert models["ollama:gone:latest"].why_not == (f"blob sha256-{'ab' * 32} is missing (an unfinished or "
                                                    "removed download: `ollama pull gone:latest`)")
    assert models["ollama:shrunk:latest"].why_not.startswith("blob sha256-")
    assert "is 4 bytes, the manifest says 4096" in models["ollama:shrunk:latest"].why_not
    assert "cannot be read (JSONDecodeError" in models["ollama:broken:latest"].why_not
    assert "has no model layer (application/vnd.ollama.image.model)" in models["ollama:nomodel:latest"].why_not
    with pytest.raises(ModelNotFoundError, match="ollama:gone:latest cannot be loaded: blob .* is missing"):
        resolve("ollama:gone")


@needs_real
def test_a_truncated_gguf_and_an_unsupported_one_say_why(env, tmp_path):
    from support.gguf_files import tiny_gguf

    store = Path(env["OLLAMA_MODELS"])
    header_end = read_header(REAL).data_offset
    with open(REAL, "rb") as fh:
        cut = fh.read(header_end + 4096)  # the whole header, the tensor data cut short
    put_ollama(store, "cut", "latest", put_blob(store, cut))
    # a GGUF of an architecture the loader does not build (the same bytes, renamed)
    key = b"general.architecture" + (8).to_bytes(4, "little") + (5).to_bytes(8, "little")
    tiny = tiny_gguf("llama", "Q4_0").read_bytes()
    assert tiny.count(key + b"llama") == 1
    put_ollama(store, "gemmaish", "latest", put_blob(store, tiny.replace(key + b"llama", key + b"gemma")))
    put_ollama(store, "tiny", "latest", put_blob(store, tiny))
    models = by_name(find_models())
    cut_model = models["ollama:cut:latest"]
    assert not cut_model.loadable and cut_model.why_not.startswith("truncated GGUF file: tensor ")
    assert cut_model.size_bytes == header_end + 4096
    gemma = models["ollama:gemmaish:latest"]
    assert (gemma.loadable, gemma.architecture) == (False, "gemma")
    assert gemma.why_not == "architecture 'gemma' is not supported (supported: llama, qwen2, qwen3)"
    ok = models["ollama:tiny:latest"]
    # no general.file_type in it: the most common matrix type stands in
    assert (ok.loadable, ok.architecture, ok.quantization, ok.context_tokens) == (True, "llama", "Q4_0", 32768)


@needs_real
def test_lm_studio_folders_list_each_gguf_file_and_mlx_folders(env):
    root = Path(env["LMSTUDIO_MODELS"])
    one = root / "lmstudio-community" / "SmolLM2-135M-Instruct-GGUF"
    link_or_copy(REAL, one / "SmolLM2-135M-Instruct-Q4_1.gguf")
    (one / "mmproj-SmolLM2-f16.gguf").write_bytes(b"GGUF")  # a projector: not a model
    two = root / "bartowski" / "SmolLM2-135M-Instruct-GGUF"
    link_or_copy(REAL, two / "SmolLM2-135M-Instruct-Q4_1.gguf")
    link_or_copy(REAL, two / "SmolLM2-135M-Instruct-Q4_1-copy.gguf")
    quantized = quantized_copy(tiny_model("llama"), bits=4)
    shutil.copytree(quantized, root / "mlx-community" / "tiny-llama-4bit")
    older = Path(env["HOME"]) / ".cache" / "lm-studio" / "models" / "old" / "SmolLM2"
    link_or_copy(REAL, older / GGUF_NAME)
    models = by_name(find_models())
    assert sorted(models) == ["lmstudio:bartowski/SmolLM2-135M-Instruct-GGUF/SmolLM2-135M-Instruct-Q4_1-copy.gguf",
                              "lmstudio:bartowski/SmolLM2-135M-Instruct-GGUF/SmolLM2-135M-Instruct-Q4_1.gguf",
                              "lmstudio:lmstudio-community/SmolLM2-135M-Instruct-GGUF",
                              "lmstudio:mlx-community/tiny-llama-4bit", "lmstudio:old/SmolLM2"]
    g = models["lmstudio:lmstudio-community/SmolLM2-135M-Instruct-GGUF"]
    assert (g.path, g.format, g.size_bytes, g.quantization, g.loadable) == (
        one / "SmolLM2-135M-Instruct-Q4_1.gguf", "gguf", GGUF_BYTES, "Q4_1", True)
    m = models["lmstudio:mlx-community/tiny-llama-4bit"]
    assert m.as_dict() == {"name": "lmstudio:mlx-community/tiny-llama-4bit", "store": "lmstudio",
                           "path": str(root / "mlx-community" / "tiny-llama-4bit"), "format": "mlx",
                           "size_bytes": weights_bytes(quantized), "architecture": "llama",
                           "quantization": "4-bit", "context_tokens": 32768, "loadable": True, "why_not": None}
    assert resolve("lmstudio:mlx-community/tiny-llama-4bit") == root / "mlx-community" / "tiny-llama-4bit"
    assert resolve("lmstudio:lmstudio-community/SmolLM2-135M-Instruct-GGUF") == g.path
    assert resolve("lmstudio:old/SmolLM2") == older / GGUF_NAME
    with pytest.raises(ModelNotFoundError, match="holds 2 GGUF files: name one"):
        resolve("lmstudio:bartowski/SmolLM2-135M-Instruct-GGUF")
    file_name = "lmstudio:bartowski/SmolLM2-135M-Instruct-GGUF/SmolLM2-135M-Instruct-Q4_1.gguf"
    assert resolve(file_name) == two / "SmolLM2-135M-Instruct-Q4_1.gguf"


def test_hub_cache_snapshots_are_listed_through_their_links(env, tiny_llama):
    cache = Path(env["HF_HUB_CACHE"])
    snapshot = put_hf(cache, "org/tiny-llama", tiny_llama)
    # refs/main wins over a newer snapshot; without it, the newest one
    newer = cache / "models--org--tiny-llama" / "snapshots" / ("f" * 40)
    shutil.copytree(snapshot, newer, symlinks=True)
    os.utime(snapshot, (1, 1))
    other = put_hf(cache, "other/tiny-llama", tiny_llama, ref=False)
    os.utime(other, (1, 1))
    (other.parent / ("e" * 40)).mkdir()  # newest, but no config.json: not a model
    unknown = Path(env["HOME"]) / "unknown"
    shutil.copytree(tiny_llama, unknown)
    config = json.loads((unknown / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps({**config, "model_type": "no_such_arch",
                                                     "torch_dtype": "bfloat16"}))
    put_hf(cache, "org/unknown-arch", unknown)
    put_hf(cache, "org/torch-only", Path(_torch_only(env)))
    gone = put_hf(cache, "org/half-downloaded", tiny_llama)
    os.unlink((gone / "model.safetensors").resolve())
    (cache / "datasets--org--data" / "snapshots" / REV).mkdir(parents=True)
    models = by_name(find_models())
    assert sorted(models) == ["hf:org/half-downloaded", "hf:org/tiny-llama", "hf:org/torch-only",
                              "hf:org/unknown-arch"]  # other/tiny-llama's newest snapshot has no config
    m = models["hf:org/tiny-llama"]
    assert m.as_dict() == {"name": "hf:org/tiny-llama", "store": "hf", "path": str(snapshot), "format": "mlx",
                           "size_bytes": weights_bytes(tiny_llama), "architecture": "llama",
                           "quantization": None, "context_tokens": 32768, "loadable": True, "why_not": None}
    assert models["hf:org/unknown-arch"].why_not == "architecture no_such_arch not supported by the installed mlx-lm"
    assert models["hf:org/unknown-arch"].quantization == "bfloat16"
    assert models["hf:org/torch-only"].why_not == "no *.safetensors weights (mlx-lm loads safetensors)"
    assert models["hf:org/half-downloaded"].why_not == ("weight file model.safetensors is missing "
                                                        "(an unfinished download?)")
    shutil.rmtree(other.parent / ("e" * 40))
    assert by_name(find_models())["hf:other/tiny-llama"].path == other
    os.unlink(cache / "models--org--tiny-llama" / "refs" / "main")
    assert by_name(find_models())["hf:org/tiny-llama"].path == newer
    assert resolve("hf:org/tiny-llama") == newer
    with pytest.raises(ModelNotFoundError, match=r"hf:org/tiny-lama not found in the Hugging Face cache \("
                                                 + str(cache) + r"\); closest: hf:org/tiny-llama"):
        resolve("hf:org/tiny-lama")


def _torch_only(env: dict) -> Path:
    folder = Path(env["HOME"]) / "torch-only"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 2048}))
    (folder / "pytorch_model.bin").write_bytes(b"\0" * 16)
    return folder


@needs_real
def test_model_dirs_list_model_folders_and_gguf_files(env, tmp_path, tiny_llama):
    mine = tmp_path / "mine"
    shutil.copytree(tiny_llama, mine / "tiny-llama")
    link_or_copy(REAL, mine / GGUF_NAME)
    link_or_copy(REAL, mine / "gguf-folder" / "model.gguf")
    (mine / "notes.txt").write_text("not a model")
    settings = Settings.load({"model_dirs": f"{mine},{tmp_path / 'absent'}"}, env={})
    models = by_name(find_models(settings.model_dirs))
    assert sorted(models) == [str(mine / GGUF_NAME), str(mine / "gguf-folder"), str(mine / "tiny-llama")]
    assert {m.store for m in models.values()} == {"dir"}
    assert models[str(mine / "gguf-folder")].path == mine / "gguf-folder" / "model.gguf"
    assert models[str(mine / "tiny-llama")].loadable and models[str(mine / GGUF_NAME)].quantization == "Q4_1"
    # a folder named is itself a model folder
    assert [m.name for m in find_models([str(mine / "tiny-llama")])] == [str(mine / "tiny-llama")]


def test_the_model_dirs_setting_takes_a_list_or_separated_folders(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('model_dirs = ["~/models", "/srv/models"]\n')
    home = os.path.expanduser("~")
    assert Settings.load(env={}, config_path=cfg).model_dirs == (f"{home}/models", "/srv/models")
    env = {"MLXKV_MODEL_DIRS": f"/a, /b{os.pathsep}/c"}
    assert Settings.load(env=env, config_path=cfg).model_dirs == ("/a", "/b", "/c")
    assert Settings.defaults().model_dirs is None
    cfg.write_text("model_dirs = 3\n")
    with pytest.raises(SettingsError, match="model_dirs from config .*not a list of folders"):
        Settings.load(env={}, config_path=cfg)


# --- names to paths, and loading by name -------------------------------------------------

@needs_real
def test_ollama_names_resolve_as_ollama_reads_them(env):
    store = Path(env["OLLAMA_MODELS"])
    blob, layer = put_real_blob(store)
    put_ollama(store, "smollm2", "135m", layer)
    put_ollama(store, "smollm2", "latest", layer)
    put_ollama(store, "smollm2", "135m", layer, namespace="someone")
    put_ollama(store, "Smol", "Q4_1", layer, namespace="bartowski", host="hf.co")
    for name in ("ollama:smollm2:135m", "ollama:smollm2", "ollama:library/smollm2:135m",
                 f"ollama:{OLLAMA_HOST}/library/smollm2", "ollama:someone/smollm2:135m",
                 "ollama:hf.co/bartowski/Smol:Q4_1", "ollama:hf.co/bartowski/smol:q4_1"):
        assert resolve(name) == blob, name
    assert resolve_model_path("ollama:smollm2:135m") == blob
    with pytest.raises(ModelNotFoundError) as e:
        resolve("ollama:smollm2:136m")
    assert str(e.value) == (f"model ollama:smollm2:136m not found in Ollama's store ({store}); closest: "
                            "ollama:smollm2:135m, ollama:someone/smollm2:135m, ollama:smollm2:latest "
                            "(`mlxkv models` lists every model found)")
    with pytest.raises(ModelNotFoundError, match="not an Ollama model name"):
        resolve("ollama:a/b/c/d:tag")


@needs_real
def test_a_file_that_starts_with_the_gguf_magic_is_a_gguf_file(env, tmp_path):
    blob, _ = put_real_blob(Path(env["OLLAMA_MODELS"]))
    assert gguf_file(blob) == blob and resolve_model_path(blob) == blob
    (tmp_path / "notes").write_text("GGU")
    assert gguf_file(tmp_path / "notes") is None
    with pytest.raises(ModelNotFoundError, match="is a file, not a model folder or a .gguf file"):
        resolve_model_path(tmp_path / "notes")


@needs_real
def test_load_model_by_its_ollama_name(env):
    from mlxkv.engine.models import dequantized_fingerprint, load_model

    store = Path(env["OLLAMA_MODELS"])
    blob, layer = put_real_blob(store)
    put_ollama(store, "smollm2", "135m", layer)
    loaded = load_model("ollama:smollm2:135m")
    assert loaded.path == blob and loaded.spec == "ollama:smollm2:135m"
    assert loaded.label == loaded.name == "ollama:smollm2:135m"
    assert loaded.extra["gguf"]["architecture"] == "llama" and loaded.context_tokens == 8192
    fingerprint = model_fingerprint(REAL)  # the file's content, wherever it lies
    assert loaded.fingerprint == (dequantized_fingerprint(fingerprint) if loaded.extra["dequantized"]
                                  else fingerprint)


# --- tables kept in step with the packages they mirror ----------------------------------

def test_the_file_type_and_remapping_tables_match_gguf_and_mlx_lm():
    from gguf.constants import LlamaFileType
    from mlx_lm.utils import MODEL_REMAPPING

    names = {t.value: t.name.removeprefix("MOSTLY_").removeprefix("ALL_") for t in LlamaFileType
             if t.name != "GUESSED"}
    assert model_stores.GGUF_FILE_TYPES == names
    assert model_stores.MLX_LM_REMAPPING.items() <= MODEL_REMAPPING.items()
    assert model_stores.mlx_lm_supports("mistral") and model_stores.mlx_lm_supports("qwen3")
    assert not model_stores.mlx_lm_supports("../utils") and not model_stores.mlx_lm_supports("nope")


# --- the command line -----------------------------------------------------------------

def mlxkv(env: dict, *args: str) -> subprocess.CompletedProcess:
    full = {**os.environ, **env, "HF_HUB_OFFLINE": "1",
            "XDG_CONFIG_HOME": str(Path(env["HOME"]) / ".config")}
    full.pop("MLXKV_CONFIG", None)
    return subprocess.run([sys.executable, "-m", "mlxkv", "models", *args], cwd=ROOT, capture_output=True,
                          text=True, env=full, timeout=120)


@needs_real
def test_mlxkv_models_prints_a_table_and_json(env, tiny_llama, tmp_path):
    r = mlxkv(env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("no models found; looked in ") and f"{env['OLLAMA_MODELS']} (ollama)" in r.stdout
    store = Path(env["OLLAMA_MODELS"])
    blob, layer = put_real_blob(store)
    put_ollama(store, "smollm2", "135m", layer)
    put_ollama(store, "gone", "latest", {"digest": "sha256:" + "cd" * 32, "size": 1})
    put_hf(Path(env["HF_HUB_CACHE"]), "org/tiny-llama", tiny_llama)
    r = mlxkv(env, "--json")
    assert r.returncode == 0, r.stderr
    listed = json.loads(r.stdout)
    assert [m["name"] for m in listed] == ["hf:org/tiny-llama", "ollama:gone:latest", "ollama:smollm2:135m"]
    assert listed == [m.as_dict() for m in find_models()]
    assert set(listed[0]) == {"name", "store", "path", "format", "size_bytes", "architecture", "quantization",
                              "context_tokens", "loadable", "why_not"}
    r = mlxkv(env, "--model-dirs", str(tmp_path / "nothing-here"))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["NAME", "STORE", "FORMAT", "SIZE", "ARCH", "QUANT", "CONTEXT", "LOADS"]
    row = next(ln for ln in lines if ln.startswith("ollama:smollm2:135m "))
    assert row.split() == ["ollama:smollm2:135m", "ollama", "gguf", "93.8", "MiB", "llama", "Q4_1", "8192", "yes"]
    assert next(ln for ln in lines if ln.startswith("ollama:gone:latest ")).endswith(
        "no: blob sha256-" + "cd" * 32 + " is missing (an unfinished or removed download: `ollama pull gone:latest`)")
