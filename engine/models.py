"""Load mlx-lm models (local folder, GGUF file or hub id), apply the compute-dtype policy,
and compute a stable model fingerprint for the prefix cache's namespace."""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlxkv.engine.arrays import named_parameters
from mlxkv.engine.model_stores import ModelNotFoundError
from mlxkv.engine.model_stores import resolve as resolve_store_name
from mlxkv.engine.settings import DEQUANTIZE_CHOICES

# Files whose bytes change what the tokenizer (and so the token ids) produce.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
    "generation_config.json",
)
FINGERPRINT_VERSION = b"mlxkv-model-fingerprint-v1"
# What a model snapshot needs (as mlx-lm fetches); kept here so that resolving a hub id
# (and failing fast offline) does not have to import mlx-lm first.
DEFAULT_ALLOW_PATTERNS = ["*.json", "model*.safetensors", "*.py", "tokenizer.model",
                          "*.tiktoken", "tiktoken.model", "*.txt", "*.jsonl", "*.jinja"]


def _looks_like_path(spec: str) -> bool:
    return (spec.startswith(("/", ".", "~")) or spec.endswith(("/", ".gguf")) or spec.count("/") > 1
            or os.sep != "/" and os.sep in spec)


def _starts_with_gguf_magic(path: Path) -> bool:
    try:
        with open(path, "rb") as fh:
            return fh.read(4) == b"GGUF"
    except OSError:
        return False


def gguf_file(path: str | os.PathLike) -> Path | None:
    """The GGUF file ``path`` names: the file itself (a ``.gguf`` file, or any file that
    starts with the GGUF magic: Ollama's blobs have no suffix), or the one ``.gguf`` file of
    a folder that has no ``config.json``; None when it is not one. A folder holding several
    is an error that names them (which one is meant?)."""
    path = Path(path)
    if path.is_file():
        return path if path.suffix.lower() == ".gguf" or _starts_with_gguf_magic(path) else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = sorted(p for p in path.iterdir() if p.suffix.lower() == ".gguf" and p.is_file())
    if len(found) > 1:
        raise ModelNotFoundError(f"{path} holds {len(found)} GGUF files "
                                 f"({', '.join(p.name for p in found[:4])}): name one")
    return found[0] if found else None


def _offline() -> bool:
    return any(os.environ.get(v, "").lower() in ("1", "true", "yes", "on")
               for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "MLXKV_OFFLINE"))


def resolve_model_path(spec: str | os.PathLike) -> Path:
    """A local folder or GGUF file for ``spec``: a store name (``ollama:qwen3:4b``,
    ``lmstudio:...``, ``hf:ORG/NAME``: where that tool keeps it, see
    :mod:`mlxkv.engine.model_stores`), the folder or file itself, or a hub id from the local
    Hugging Face cache (downloading it when online). Raises :class:`ModelNotFoundError`."""
    stored = resolve_store_name(str(spec))
    if stored is not None:
        return stored
    text = os.path.expanduser(str(spec))
    path = Path(text)
    if path.exists():
        gguf = gguf_file(path)
        if gguf is not None:
            return gguf
        if path.is_file():
            raise ModelNotFoundError(f"{path} is a file, not a model folder or a .gguf file")
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path} is not a model folder (no config.json in it, "
                                     "nor a .gguf file)")
        return path
    if _looks_like_path(str(spec)):
        hint = ""
        if path.resolve() == (Path(__file__).resolve().parent / "demo" / "model"):
            hint = " (the demo model is not built yet: run `make demo-model`, or pass --model)"
        what = "GGUF file" if text.lower().endswith(".gguf") else "model folder"
        raise ModelNotFoundError(f"{what} not found: {spec}{hint}")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(text, local_files_only=True,
                                      allow_patterns=DEFAULT_ALLOW_PATTERNS))
    except Exception:
        if _offline():
            raise ModelNotFoundError(
                f"unknown model {text!r}: no such folder, and not in the local Hugging Face "
                "cache while offline (HF_HUB_OFFLINE is set)") from None
    try:
        return Path(snapshot_download(text, allow_patterns=DEFAULT_ALLOW_PATTERNS))
    except Exception as e:  # RepositoryNotFoundError, connection errors, bad ids...
        raise ModelNotFoundError(
            f"unknown model {text!r}: no such folder, and the hub download failed "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None


def _file_digest(path: Path) -> bytes:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            h.update(chunk)
    return h.digest()


# Weight files up to this size in total are always hashed by content: a few milliseconds,
# and the fingerprint then does not depend on mtimes, so a copy of the folder (the demo
# model unpacked by a PyInstaller one-file binary on every start, a checkout, a backup)
# shares the cache with the original.
CONTENT_HASH_MAX_BYTES = 64 << 20


def _in_frozen_bundle(path: Path) -> bool:
    base = getattr(sys, "_MEIPASS", None)
    if not base:
        return False
    return path.resolve().is_relative_to(Path(base).resolve())


_GGUF_DIGESTS: dict[tuple, bytes] = {}


def gguf_digest(path: Path) -> bytes:
    """The content digest (xxh3-128) of a GGUF file: weights, tokenizer and template are
    all in it. Kept per process for an unchanged file (size, mtime, inode), as hashing a
    multi-GB file takes seconds."""
    import xxhash

    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ino)
    if key not in _GGUF_DIGESTS:
        h = xxhash.xxh3_128()
        with open(path, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 22), b""):
                h.update(chunk)
        _GGUF_DIGESTS[key] = h.digest()
    return _GGUF_DIGESTS[key]


def model_fingerprint(path: str | os.PathLike, full_hash: bool = False) -> str:
    """128-bit hex fingerprint of a model folder: canonical config.json, weight files
    (sizes + mtimes, or content hashes), tokenizer files and chat template. Equal folders
    give equal fingerprints in every process; the path is not part of it.

    Weights are hashed by content with ``full_hash``, when they are small (at most
    ``CONTENT_HASH_MAX_BYTES`` together: the demo models, test models) and inside a frozen
    (PyInstaller) bundle, which unpacks with fresh mtimes on every start. A GGUF file is
    always hashed by content, the whole file."""
    root = Path(path)
    if root.is_file():
        h = hashlib.sha256(FINGERPRINT_VERSION)
        h.update(b"gguf\0" + gguf_digest(root))
        return h.hexdigest()[:32]
    config = json.loads((root / "config.json").read_text())
    weights = sorted(p for p in root.glob("*.safetensors") if p.is_file())
    if not weights:
        raise ModelNotFoundError(f"no *.safetensors weight files in {root}")
    stats = [w.stat() for w in weights]
    full_hash = (full_hash or sum(st.st_size for st in stats) <= CONTENT_HASH_MAX_BYTES
                 or _in_frozen_bundle(root))
    h = hashlib.sha256(FINGERPRINT_VERSION)

    def put(tag: str, data: bytes) -> None:
        h.update(tag.encode() + b"\0" + len(data).to_bytes(8, "little") + data)

    put("config", json.dumps(config, sort_keys=True, separators=(",", ":")).encode())
    put("weights-mode", b"sha256" if full_hash else b"stat")
    for w, st in zip(weights, stats):
        if full_hash:
            put("weight:" + w.name, _file_digest(w))
        else:
            put("weight:" + w.name, f"{st.st_size}:{st.st_mtime_ns}".encode())
    for name in TOKENIZER_FILES:
        p = root / name
        if p.is_file():
            put("tok:" + name, _file_digest(p))
    return h.hexdigest()[:32]


def model_label(spec: str | os.PathLike, path: Path | None = None,
                fingerprint: str | None = None) -> str:
    """How to show a model to a user: the embedded demo models by name and version
    (``demo model (1a2b3c4d)``: never the temporary folder a one-file binary unpacks them
    to), anything else as it was given (a folder, a hub id, or a store name such as
    ``ollama:qwen3:4b``: never the blob it resolved to)."""
    from mlxkv.engine.demo import DEMO_MODEL_DIR, DRAFT_MODEL_DIR

    where = Path(path if path is not None else os.path.expanduser(str(spec)))
    try:
        resolved = where.resolve()
    except OSError:
        return str(spec)
    for folder, name in ((DEMO_MODEL_DIR, "demo model"), (DRAFT_MODEL_DIR, "demo draft model")):
        if resolved == folder.resolve():
            if fingerprint is None:
                try:
                    fingerprint = model_fingerprint(folder)
                except (OSError, ValueError):
                    return name
            return f"{name} ({fingerprint[:8]})"
    return str(spec)


def weights_dtype(model: Any) -> str:
    """The most common floating dtype among the model's parameters (e.g. "bfloat16")."""
    import mlx.core as mx

    counts: Counter = Counter()
    for _, p in named_parameters(model):
        if mx.issubdtype(p.dtype, mx.floating):
            counts[p.dtype] += p.size
    if not counts:
        return "none"
    return str(counts.most_common(1)[0][0]).replace("mlx.core.", "")


def apply_dtype_policy(model: Any, policy: str = "auto") -> str:
    """Cast floating parameters per ``policy`` and return the compute dtype name.

    auto: float32 on CPU when the weights are bfloat16/float16 (the CPU backend has no
    fast half-precision matmul; float32 runs on BLAS), else keep them; native: never cast."""
    import mlx.core as mx

    native = weights_dtype(model)
    target = compute_dtype(policy, native)
    if target != native:
        model.set_dtype(getattr(mx, target))
        mx.eval(model.parameters())
    return target


@dataclass
class LoadedModel:
    """A model ready to run: mlx-lm model + TokenizerWrapper + facts about it."""

    model: Any
    tokenizer: Any
    config: dict
    path: Path
    spec: str
    fingerprint: str
    weights_dtype: str
    compute_dtype: str
    extra: dict = field(default_factory=dict)
    context_limit: int | None = None  # the settings' context_tokens, over the model's own

    @property
    def name(self) -> str:
        return self.spec if not Path(self.spec).exists() else self.path.name

    @property
    def label(self) -> str:
        """What to show a user (see :func:`model_label`)."""
        return model_label(self.spec, self.path, self.fingerprint)

    @property
    def context_tokens(self) -> int | None:
        """The context a prompt and its reply may fill: the settings' ``context_tokens``, else
        the model's own (``max_position_embeddings``), when its config says."""
        if self.context_limit is not None:
            return self.context_limit
        for cfg in (self.config, self.config.get("text_config") or {}):
            value = cfg.get("max_position_embeddings")
            if isinstance(value, int) and value > 0:
                return value
        return None


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def dequantize_wanted(setting: str, dequantized_bytes: int) -> bool:
    """Whether to dequantize a quantized model at load (``--dequantize``): "on", "off", or
    "auto": on the CPU backend when the dequantized weights take at most half the machine's
    memory (mlx's CPU quantized matmul is many times slower than the float32 matmul on
    BLAS), never on Metal or CUDA (whose quantized kernels are fast and read fewer bytes)."""
    import mlx.core as mx

    if setting not in DEQUANTIZE_CHOICES:
        raise ValueError(f"unknown dequantize setting {setting!r}")
    if setting != "auto":
        return setting == "on"
    return mx.default_device() == mx.cpu and dequantized_bytes <= _physical_memory() // 2


def dequantized_fingerprint(fingerprint: str) -> str:
    """The fingerprint of a quantized model loaded dequantized: dequantized weights compute
    other numbers than quantized matmuls (in the same compute dtype), so their KV state is
    another cache namespace and neither seeds the other."""
    return hashlib.blake2b(f"{fingerprint}:dequantized".encode(), digest_size=16).hexdigest()


def compute_dtype(policy: str, native: str) -> str:
    """The dtype ``policy`` computes a model whose floating weights are ``native`` in."""
    import mlx.core as mx

    if policy == "native" or native == "none":
        return native
    if policy == "auto":
        on_cpu = mx.default_device() == mx.cpu
        return "float32" if on_cpu and native in ("bfloat16", "float16") else native
    if policy in ("float32", "bfloat16", "float16"):
        return policy
    raise ValueError(f"unknown dtype policy {policy!r}")


def quantized_layers(model: Any) -> list[tuple[str, Any]]:
    """(name, module) of every quantized linear or embedding layer of an mlx-lm model."""
    import mlx.nn as nn

    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))]


def dequantize_layers(model: Any, dtype: str) -> int:
    """Replace ``model``'s quantized linear and embedding layers (mlx-lm's 4/8-bit folders)
    by float layers of ``dtype`` holding the same weights, dequantized from scales and biases
    cast to ``dtype`` first (so float32 weights are the exact ``scale * q + bias``); the
    number of layers replaced. mlx-lm's own ``dequantize_model`` does the replacing."""
    import mlx.core as mx
    from mlx_lm.utils import dequantize_model

    layers = quantized_layers(model)
    target = getattr(mx, dtype)
    for _, m in layers:
        m.scales = m.scales.astype(target)
        if getattr(m, "biases", None) is not None:
            m.biases = m.biases.astype(target)
    if layers:
        dequantize_model(model)
        mx.eval(model.parameters())
    return len(layers)


def _dequantized_bytes(model: Any, dtype: str) -> int:
    """Bytes of ``model``'s weights once its quantized layers hold ``dtype`` matrices."""
    import mlx.core as mx

    size = getattr(mx, dtype).size if dtype in ("float32", "bfloat16", "float16") else 4
    layers = dict(quantized_layers(model))
    total = 0
    for name, p in named_parameters(model):
        layer, _, leaf = name.rpartition(".")
        if layer not in layers:
            total += p.nbytes
        elif leaf == "weight":  # packed: 32 // bits values in each uint32
            total += p.size * (32 // layers[layer].bits) * size
    return total


def load_gguf_model(path: Path, spec: str, dtype: str = "auto", dequantize: str = "auto") -> LoadedModel:
    """Load the GGUF file at ``path`` (:mod:`mlxkv.engine.gguf`) and apply the dtype policy.

    Q4_0 / Q4_1 / Q8_0 weights stay quantized unless :func:`dequantize_wanted` says
    otherwise (``dequantize``; auto: on the CPU when that fits); dequantized, they become
    float32 and the dtype policy then casts them like any float weights."""
    import mlx.core as mx

    from mlxkv.engine.gguf import load_gguf, read_header

    header = read_header(path)  # GGUFError (a ValueError) names what is wrong with the file
    counts = Counter(t.type_name for t in header.tensors.values())
    quantized = any(t in ("Q4_0", "Q4_1", "Q8_0") for t in counts)
    float32_bytes = 4 * sum(math.prod(t.shape) for t in header.tensors.values())
    wanted = quantized and dequantize_wanted(dequantize, float32_bytes)
    loaded = load_gguf(path, dequantize=mx.float32 if wanted else None, header=header)
    native = counts.most_common(1)[0][0] if counts else "none"
    compute = apply_dtype_policy(loaded.model, dtype)
    fingerprint = model_fingerprint(path)
    if loaded.dequantized:
        fingerprint = dequantized_fingerprint(fingerprint)
    return LoadedModel(model=loaded.model, tokenizer=loaded.tokenizer, config=loaded.config,
                       path=path, spec=str(spec), fingerprint=fingerprint,
                       weights_dtype=f"gguf {native}", compute_dtype=compute,
                       extra={"gguf": {"types": dict(counts), "dequantized": loaded.dequantized,
                                       "architecture": header.get("general.architecture"),
                                       "name": header.get("general.name")},
                              "dequantized": loaded.dequantized})


def load_model(spec: str | os.PathLike, dtype: str = "auto", full_hash: bool = False,
               tokenizer_config: dict | None = None, dequantize: str = "auto") -> LoadedModel:
    """Load ``spec`` (folder, GGUF file, hub id or store name) with ``mlx_lm.load`` (a GGUF file with
    :func:`load_gguf_model`), dequantize a quantized model when ``dequantize`` says so
    (:func:`dequantize_wanted`) and apply the dtype policy. Call it on the thread that will
    run the model (MLX streams are thread-local)."""
    path = resolve_model_path(spec)
    if path.is_file():
        return load_gguf_model(path, str(spec), dtype, dequantize)
    model, config, tokenizer = _load_folder(path, tokenizer_config)
    native = weights_dtype(model)
    fingerprint = model_fingerprint(path, full_hash)
    dequantized = False
    if quantized_layers(model):
        target = compute_dtype(dtype, native)
        if dequantize_wanted(dequantize, _dequantized_bytes(model, target)):
            dequantized = dequantize_layers(model, target) > 0
            fingerprint = dequantized_fingerprint(fingerprint)
    compute = apply_dtype_policy(model, dtype)
    return LoadedModel(model=model, tokenizer=tokenizer, config=config, path=path,
                       spec=str(spec), fingerprint=fingerprint,
                       weights_dtype=native, compute_dtype=compute,
                       extra={"dequantized": dequantized})


def _load_folder(path: Path, tokenizer_config: dict | None) -> tuple[Any, dict, Any]:
    """What ``mlx_lm.utils.load`` does for a local folder (the model with its weights
    evaluated, its config, its tokenizer), with the tokenizer loaded while the weights are
    read: the two no longer add up in the time to the first token."""
    from concurrent.futures import ThreadPoolExecutor

    import mlx.core as mx
    from mlx_lm.utils import load_model as mlx_lm_load_model
    from mlx_lm.utils import load_tokenizer

    model, config = mlx_lm_load_model(path, lazy=True)
    # The tokenizer is Python and JSON (the GIL); MLX evaluates the weights without it. The
    # pool's exit waits for the tokenizer whatever happens to the weights.
    with ThreadPoolExecutor(1, thread_name_prefix="mlxkv-tokenizer-load") as pool:
        tokenizer = pool.submit(load_tokenizer, path, tokenizer_config,
                                eos_token_ids=config.get("eos_token_id", None))
        mx.eval(model.parameters())
    return model, config, tokenizer.result()


def chat_prompt_tokens(tokenizer: Any, messages: list[dict[str, str]],
                       add_generation_prompt: bool = True,
                       tools: list[dict[str, Any]] | None = None,
                       template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Token ids for ``messages`` through the model's chat template (plain text join when
    the tokenizer has none); ``tools`` (OpenAI function-tool JSON) and ``template_kwargs``
    (``enable_thinking``, ...) go to the template."""
    if getattr(tokenizer, "has_chat_template", False):
        # Same path as the mlx_lm.generate CLI: render text, then encode without adding
        # special tokens again (the template already holds them).
        extra: dict[str, Any] = dict(template_kwargs or {})
        if tools:
            extra["tools"] = tools
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **extra)
        return list(tokenizer.encode(text, add_special_tokens=False))
    text = "\n".join(m["content"] for m in messages)
    return list(tokenizer.encode(text))
