"""Models already on this machine, where other tools keep them: the Hugging Face hub cache,
Ollama's store, LM Studio's folders and the folders the ``model_dirs`` setting names.

:func:`find_models` lists them (``mlxkv models``), reading only ``config.json`` files,
Ollama manifests and GGUF headers, never weights. :func:`resolve` turns a store name
(``ollama:qwen3:4b``, ``lmstudio:PUBLISHER/MODEL``, ``hf:ORG/NAME``) into the path to load,
read-only where the tool keeps it: nothing is copied.

No mlx at import time: only checking a GGUF header the way the loader does imports it."""

from __future__ import annotations

import difflib
import importlib.util
import json
import os
import re
import sys
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


class ModelNotFoundError(FileNotFoundError):
    """The model could not be found; the message says what was tried and what to do
    (defined here, the lowest of the modules that raise it; ``engine.models`` has it too)."""


STORES = ("hf", "ollama", "lmstudio", "dir")
STORE_TITLES = {"hf": "the Hugging Face cache", "ollama": "Ollama's store",
                "lmstudio": "LM Studio's folders", "dir": "the model_dirs folders"}
PREFIXES = {"hf:": "hf", "ollama:": "ollama", "lmstudio:": "lmstudio"}

OLLAMA_HOST = "registry.ollama.ai"
OLLAMA_NAMESPACE = "library"
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
OLLAMA_SYSTEM_STORE = Path("/usr/share/ollama/.ollama/models")  # the Linux service's own
_DIGEST = re.compile(r"sha256[:-]([0-9a-f]{64})")

# ggml's file types (``general.file_type``, llama.cpp's llama_ftype); a test checks them
# against the gguf package's LlamaFileType.
GGUF_FILE_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
    11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S",
    17: "Q5_K_M", 18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS",
    23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S",
    29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16", 36: "TQ1_0", 37: "TQ2_0",
    38: "MXFP4_MOE", 39: "NVFP4", 40: "Q1_0",
}
# The model_type names mlx-lm loads under another module (a few of mlx_lm.utils'
# MODEL_REMAPPING, the common ones; a test checks them against it).
MLX_LM_REMAPPING = {"mistral": "llama", "llava": "mistral3", "phi-msft": "phixtral",
                    "falcon_mamba": "mamba", "qwen2_5_vl": "qwen2_vl"}
_MODEL_TYPE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_\-]*")


@dataclass(frozen=True)
class FoundModel:
    """One model found on this machine, as ``mlxkv models`` shows it. ``path`` is what
    loads: a model folder, or a GGUF file (an Ollama blob has no ``.gguf`` suffix)."""

    name: str
    store: str  # "hf" | "ollama" | "lmstudio" | "dir"
    path: Path
    format: str  # "mlx" | "gguf"
    size_bytes: int
    architecture: str | None
    quantization: str | None
    context_tokens: int | None
    loadable: bool
    why_not: str | None

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "path": str(self.path)}


@dataclass(frozen=True)
class _Entry:
    """A model as a store's layout names it, before its files are read; ``problem``: why
    it cannot load, when the layout alone says so (a manifest without its blob)."""

    name: str
    store: str
    path: Path
    format: str
    problem: str | None = None


# --- where the stores are ------------------------------------------------------------

def _home(env: Mapping[str, str]) -> Path:
    return Path(env.get("HOME") or os.path.expanduser("~"))


def _env_path(env: Mapping[str, str], name: str) -> Path | None:
    value = env.get(name, "").strip()
    return Path(os.path.expanduser(value)) if value else None


def hf_cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """The Hugging Face hub cache, found as huggingface_hub finds it: ``$HF_HUB_CACHE``,
    else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub`` (``$XDG_CACHE_HOME`` for
    ``~/.cache``)."""
    env = os.environ if env is None else env
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        path = _env_path(env, name)
        if path is not None:
            return path
    home = _env_path(env, "HF_HOME")
    if home is not None:
        return home / "hub"
    cache = _env_path(env, "XDG_CACHE_HOME") or _home(env) / ".cache"
    return cache / "huggingface" / "hub"


def ollama_dirs(env: Mapping[str, str] | None = None) -> list[Path]:
    """Ollama's model stores: ``$OLLAMA_MODELS``, else ``~/.ollama/models`` and, on Linux,
    the system service's ``/usr/share/ollama/.ollama/models`` when it can be read."""
    env = os.environ if env is None else env
    named = _env_path(env, "OLLAMA_MODELS")
    if named is not None:
        return [named]
    dirs = [_home(env) / ".ollama" / "models"]
    if sys.platform.startswith("linux") and os.access(OLLAMA_SYSTEM_STORE, os.R_OK | os.X_OK):
        dirs.append(OLLAMA_SYSTEM_STORE)
    return _distinct(dirs)


def lmstudio_dirs(env: Mapping[str, str] | None = None) -> list[Path]:
    """LM Studio's model folders: ``$LMSTUDIO_MODELS`` when set, ``~/.lmstudio/models``
    and the older ``~/.cache/lm-studio/models``."""
    env = os.environ if env is None else env
    named = _env_path(env, "LMSTUDIO_MODELS")
    home = _home(env)
    return _distinct([*([named] if named else []), home / ".lmstudio" / "models",
                      home / ".cache" / "lm-studio" / "models"])


def search_dirs(model_dirs: Sequence[str] = (), env: Mapping[str, str] | None = None
                ) -> list[tuple[str, Path]]:
    """(store, folder) of every place :func:`find_models` looks, present or not."""
    return ([("hf", hf_cache_dir(env))] + [("ollama", d) for d in ollama_dirs(env)]
            + [("lmstudio", d) for d in lmstudio_dirs(env)]
            + [("dir", Path(os.path.expanduser(d))) for d in model_dirs])


def _distinct(paths: Iterable[Path]) -> list[Path]:
    seen, out = set(), []
    for p in paths:
        try:
            key = p.resolve()
        except OSError:
            key = p
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out


def _children(folder: Path) -> list[Path]:
    """The entries of ``folder``, sorted, hidden ones left out; none when it cannot be
    read (a store that does not exist is empty)."""
    try:
        return sorted(p for p in folder.iterdir() if not p.name.startswith("."))
    except OSError:
        return []


def _is_gguf_name(path: Path) -> bool:
    """A ``.gguf`` file that is a model, not a vision projector (``mmproj-*.gguf``)."""
    return (path.suffix.lower() == ".gguf" and not path.name.lower().startswith("mmproj")
            and path.is_file())


# --- what each store holds -----------------------------------------------------------

def _hf_snapshot(repo: Path) -> Path | None:
    """The snapshot ``refs/main`` names, else the newest one."""
    snapshots = repo / "snapshots"
    try:
        rev = (repo / "refs" / "main").read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        rev = ""
    if rev and "/" not in rev and "\\" not in rev and rev not in (".", "..") and (snapshots / rev).is_dir():
        return snapshots / rev
    found = [p for p in _children(snapshots) if p.is_dir()]
    return max(found, key=_mtime) if found else None


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _hf_entries(root: Path) -> Iterator[_Entry]:
    for repo in _children(root):
        if not repo.name.startswith("models--") or not repo.is_dir():
            continue
        snapshot = _hf_snapshot(repo)
        if snapshot is not None and (snapshot / "config.json").is_file():
            yield _Entry("hf:" + repo.name[len("models--"):].replace("--", "/"), "hf", snapshot, "mlx")


def ollama_name(host: str, namespace: str, model: str, tag: str) -> str:
    """The name Ollama lists a model by, with the ``ollama:`` prefix: ``NAME:TAG`` from its
    own registry's library, ``NAMESPACE/NAME:TAG`` from another namespace there,
    ``HOST/NAMESPACE/NAME:TAG`` from anywhere else (``hf.co/...``)."""
    if host != OLLAMA_HOST:
        return f"ollama:{host}/{namespace}/{model}:{tag}"
    return f"ollama:{model}:{tag}" if namespace == OLLAMA_NAMESPACE else f"ollama:{namespace}/{model}:{tag}"


def _ollama_entries(root: Path) -> Iterator[_Entry]:
    manifests = root / "manifests"
    for host in _children(manifests):
        for namespace in _children(host):
            for model in _children(namespace):
                for tag in _children(model):
                    if tag.is_file():
                        name = ollama_name(host.name, namespace.name, model.name, tag.name)
                        yield _ollama_entry(root, name, tag)


def _ollama_entry(root: Path, name: str, manifest: Path) -> _Entry:
    """The model blob an Ollama manifest names (its ``application/vnd.ollama.image.model``
    layer: a GGUF file), or the manifest itself with what is wrong."""
    def broken(problem: str) -> _Entry:
        return _Entry(name, "ollama", manifest, "gguf", problem)

    try:
        data = json.loads(manifest.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return broken(f"manifest {manifest} cannot be read ({type(e).__name__}: {e})")
    layers = data.get("layers") if isinstance(data, dict) else None
    layer = next((la for la in (layers if isinstance(layers, list) else ()) if isinstance(la, dict)
                  and la.get("mediaType") == OLLAMA_MODEL_LAYER), None)
    if layer is None:
        return broken(f"manifest {manifest} has no model layer ({OLLAMA_MODEL_LAYER})")
    m = _DIGEST.fullmatch(str(layer.get("digest", "")))
    if m is None:
        return broken(f"manifest {manifest}: model layer digest {layer.get('digest')!r} is not sha256:<hex>")
    blob = root / "blobs" / f"sha256-{m.group(1)}"
    pull = f"`ollama pull {name.removeprefix('ollama:')}`"
    try:
        size = blob.stat().st_size
    except OSError:
        return _Entry(name, "ollama", blob, "gguf",
                      f"blob {blob.name} is missing (an unfinished or removed download: {pull})")
    want = layer.get("size")
    if isinstance(want, int) and want != size:
        return _Entry(name, "ollama", blob, "gguf",
                      f"blob {blob.name} is {size} bytes, the manifest says {want} (damaged or "
                      f"still downloading: {pull})")
    return _Entry(name, "ollama", blob, "gguf")


def _lmstudio_entries(root: Path) -> Iterator[_Entry]:
    """``PUBLISHER/MODEL`` folders: an MLX folder (config.json), or GGUF files, one entry
    per file (named by the folder when it holds one)."""
    for publisher in _children(root):
        for folder in _children(publisher):
            if not folder.is_dir():
                continue
            name = f"lmstudio:{publisher.name}/{folder.name}"
            if (folder / "config.json").is_file():
                yield _Entry(name, "lmstudio", folder, "mlx")
                continue
            files = [p for p in _children(folder) if _is_gguf_name(p)]
            for p in files:
                yield _Entry(name if len(files) == 1 else f"{name}/{p.name}", "lmstudio", p, "gguf")


def _dir_entries(folder: Path) -> Iterator[_Entry]:
    """A ``model_dirs`` folder: the folder itself when it is a model folder, else each
    model folder and each ``.gguf`` file in it (a folder's one GGUF file is named by the
    folder, as ``--model FOLDER`` loads it)."""
    if (folder / "config.json").is_file():
        yield _Entry(str(folder), "dir", folder, "mlx")
        return
    for child in _children(folder):
        if _is_gguf_name(child):
            yield _Entry(str(child), "dir", child, "gguf")
        elif child.is_dir() and (child / "config.json").is_file():
            yield _Entry(str(child), "dir", child, "mlx")
        elif child.is_dir():
            files = [p for p in _children(child) if _is_gguf_name(p)]
            for p in files:
                yield _Entry(str(child) if len(files) == 1 else str(p), "dir", p, "gguf")


def _entries(store: str, env: Mapping[str, str] | None, model_dirs: Sequence[str] = ()) -> list[_Entry]:
    if store == "hf":
        return list(_hf_entries(hf_cache_dir(env)))
    if store == "ollama":
        return [e for d in ollama_dirs(env) for e in _ollama_entries(d)]
    if store == "lmstudio":
        return [e for d in lmstudio_dirs(env) for e in _lmstudio_entries(d)]
    return [e for d in model_dirs for e in _dir_entries(Path(os.path.expanduser(d)))]


# --- what each model is --------------------------------------------------------------

def mlx_lm_supports(model_type: str) -> bool:
    """Whether the installed mlx-lm has a model module for ``model_type``: looked up as a
    file, without importing mlx-lm (a one-file binary keeps the modules in its archive, not
    as files: there the import system is asked, which imports mlx-lm's package)."""
    if not _MODEL_TYPE.fullmatch(model_type):
        return False
    spec = importlib.util.find_spec("mlx_lm")
    if spec is None or not spec.submodule_search_locations:
        return False
    module = MLX_LM_REMAPPING.get(model_type, model_type)
    folders = [Path(d) / "models" for d in spec.submodule_search_locations]
    folders = [d for d in folders if (d / "__init__.py").is_file()]
    if folders:
        return any((d / f"{module}.py").is_file() for d in folders)
    try:
        return importlib.util.find_spec(f"mlx_lm.models.{module}") is not None
    except (ImportError, ValueError):
        return False


def _folder_quantization(config: dict) -> str | None:
    """``4-bit`` for mlx-lm's quantized folders, the quantization method of others
    (gptq, awq...), else the weights' dtype."""
    for key in ("quantization", "quantization_config"):
        q = config.get(key)
        if isinstance(q, dict):
            if isinstance(q.get("bits"), int):
                return f"{q['bits']}-bit"
            if isinstance(q.get("quant_method"), str):
                return q["quant_method"]
    dtype = config.get("torch_dtype") or config.get("dtype")
    return dtype if isinstance(dtype, str) else None


def _context(config: dict) -> int | None:
    for cfg in (config, config.get("text_config") or {}):
        value = cfg.get("max_position_embeddings") if isinstance(cfg, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _describe_folder(entry: _Entry) -> FoundModel:
    """An MLX / Hugging Face folder: config.json and the ``*.safetensors`` weights."""
    def found(size: int = 0, arch: Any = None, quant: Any = None, context: Any = None,
              why_not: str | None = None) -> FoundModel:
        return FoundModel(entry.name, entry.store, entry.path, "mlx", size, arch, quant, context,
                          why_not is None, why_not)

    try:
        config = json.loads((entry.path / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return found(why_not=f"config.json cannot be read ({type(e).__name__}: {e})")
    if not isinstance(config, dict):
        return found(why_not="config.json is not a JSON object")
    size, missing = 0, []
    weights = sorted(p for p in entry.path.glob("*.safetensors"))
    for w in weights:
        try:
            size += w.stat().st_size  # follows the hub cache's links into blobs/
        except OSError:
            missing.append(w.name)
    arch = config.get("model_type") if isinstance(config.get("model_type"), str) else None
    why_not = None
    if not weights:
        why_not = "no *.safetensors weights (mlx-lm loads safetensors)"
    elif missing:
        why_not = f"weight file {missing[0]} is missing (an unfinished download?)"
    elif arch is None:
        why_not = "config.json names no model_type"
    elif not mlx_lm_supports(arch):
        why_not = f"architecture {arch} not supported by the installed mlx-lm"
    return found(size, arch, _folder_quantization(config), _context(config), why_not)


def gguf_problem(header: Any) -> str | None:
    """Why the loader would refuse the GGUF file ``header`` describes, from the header alone
    (the architecture, its config, the tokenizer kind, a split file), or None."""
    from mlxkv.engine.gguf import GGUFError
    from mlxkv.engine.gguf.arch import model_config

    parts = header.get("split.count", 1)
    if isinstance(parts, int) and parts > 1:  # as load_gguf refuses it
        return f"one part of a model split into {parts} files (merge them first)"
    try:
        model_config(header)
    except GGUFError as e:
        return str(e).removeprefix(f"{header.path}: ")
    kind = header.get("tokenizer.ggml.model")  # as the tokenizer builder refuses it
    if kind != "gpt2":
        return (f"tokenizer kind {kind!r} is not supported (byte-level BPE, 'gpt2', is)" if kind
                else "the file has no tokenizer (tokenizer.ggml.model)")
    return None


def _describe_gguf(entry: _Entry) -> FoundModel:
    """A GGUF file, from its header (the tensor data is never read)."""
    from mlxkv.engine.gguf import read_header

    try:
        size = entry.path.stat().st_size
    except OSError:
        size = 0
    if entry.problem is not None:
        return FoundModel(entry.name, entry.store, entry.path, "gguf", size, None, None, None,
                          False, entry.problem)
    try:
        header = read_header(entry.path)
    except (OSError, ValueError) as e:  # GGUFError is a ValueError
        return FoundModel(entry.name, entry.store, entry.path, "gguf", size, None, None, None,
                          False, str(e).removeprefix(f"{entry.path}: "))
    arch = header.get("general.architecture")
    arch = arch if isinstance(arch, str) else None
    file_type = header.get("general.file_type")
    quant: str | None
    if isinstance(file_type, int) and not isinstance(file_type, bool):
        quant = GGUF_FILE_TYPES.get(file_type, f"type {file_type}")
    else:  # older files: the most common tensor type
        counts = Counter(t.type_name for t in header.tensors.values() if len(t.shape) > 1)
        quant = counts.most_common(1)[0][0] if counts else None
    context = header.get(f"{arch}.context_length") if arch else None
    context = int(context) if isinstance(context, int) and not isinstance(context, bool) else None
    why_not = gguf_problem(header)
    return FoundModel(entry.name, entry.store, entry.path, "gguf", size, arch, quant, context,
                      why_not is None, why_not)


def describe(entry: _Entry) -> FoundModel:
    """What ``entry`` is; a file that cannot be read is a model that does not load, said
    why, never an exception."""
    try:
        return _describe_gguf(entry) if entry.format == "gguf" else _describe_folder(entry)
    except Exception as e:  # an odd file system, a file changing while it is read
        return FoundModel(entry.name, entry.store, entry.path, entry.format, 0, None, None, None,
                          False, f"cannot be read ({type(e).__name__}: {e})")


def find_models(model_dirs: Sequence[str] = (), env: Mapping[str, str] | None = None) -> list[FoundModel]:
    """Every model in the stores (and the ``model_dirs`` folders), sorted by store, then
    name. Stores that do not exist are empty."""
    found = [describe(e) for store in STORES for e in _entries(store, env, model_dirs)]
    return sorted(found, key=lambda m: (m.store, m.name))


# --- names to paths ------------------------------------------------------------------

def store_of(spec: str) -> str | None:
    """The store a model name is in (``ollama:...`` -> "ollama"); None for anything else."""
    return next((store for prefix, store in PREFIXES.items() if spec.startswith(prefix)), None)


def _ollama_canonical(spec: str) -> str:
    """``ollama:qwen3`` -> ``ollama:qwen3:latest``, ``ollama:library/qwen3:4b`` and
    ``ollama:registry.ollama.ai/library/qwen3:4b`` -> ``ollama:qwen3:4b``, as Ollama reads them."""
    text = spec.removeprefix("ollama:")
    path, _, last = text.rpartition("/")
    model, colon, tag = last.partition(":")
    parts = path.split("/") if path else []
    if not model or (colon and not tag) or len(parts) > 2 or any(p in ("", ".", "..") for p in parts):
        raise ModelNotFoundError(f"{spec!r} is not an Ollama model name (ollama:NAME[:TAG], "
                                 "ollama:NAMESPACE/NAME[:TAG] or ollama:HOST/NAMESPACE/NAME[:TAG])")
    host, namespace = ((OLLAMA_HOST, OLLAMA_NAMESPACE) if not parts else
                       (OLLAMA_HOST, parts[0]) if len(parts) == 1 else (parts[0], parts[1]))
    return ollama_name(host, namespace, model, tag or "latest")


def _where(store: str, env: Mapping[str, str] | None) -> str:
    dirs = {"hf": lambda: [hf_cache_dir(env)], "ollama": lambda: ollama_dirs(env),
            "lmstudio": lambda: lmstudio_dirs(env)}[store]()
    return ", ".join(map(str, dirs))


def resolve(spec: str, env: Mapping[str, str] | None = None) -> Path | None:
    """The path to load for a store name (``ollama:NAME[:TAG]``, the tag ``latest`` unless
    given; ``lmstudio:PUBLISHER/MODEL[/FILE.gguf]``; ``hf:ORG/NAME``, from the local cache
    only): a folder or a GGUF file, where the tool keeps it. None when ``spec`` is not a
    store name. Raises :class:`ModelNotFoundError` naming what was looked for, where, and
    the closest names found."""
    store = store_of(spec)
    if store is None:
        return None
    wanted = _ollama_canonical(spec) if store == "ollama" else spec.rstrip("/")
    entries = _entries(store, env)
    match = (next((e for e in entries if e.name == wanted), None)
             or next((e for e in entries if e.name.lower() == wanted.lower()), None))
    if match is not None:
        if match.problem is not None:
            raise ModelNotFoundError(f"{wanted} cannot be loaded: {match.problem}")
        return match.path
    names = [e.name for e in entries]
    within = [n for n in names if n.startswith(wanted + "/")]  # a folder of several GGUF files
    if within:
        raise ModelNotFoundError(f"{wanted} holds {len(within)} GGUF files: name one "
                                 f"({', '.join(within[:4])})")
    close = difflib.get_close_matches(wanted, names, n=3, cutoff=0.5)
    found = (f"closest: {', '.join(close)}" if close else
             f"it holds {len(names)} other model{'s' * (len(names) != 1)}" if names else "it holds no models")
    raise ModelNotFoundError(f"model {wanted} not found in {STORE_TITLES[store]} ({_where(store, env)}); "
                             f"{found} (`mlxkv models` lists every model found)")


def describe_spec(spec: str) -> FoundModel | None:
    """What a ``--model`` spec names, when it is on this machine (a store name, a folder or a
    GGUF file) without loading it: its size, context and the rest; None for a hub id that is
    not a store name, or a path that is not there."""
    try:
        path = resolve(spec) or Path(os.path.expanduser(spec))
    except Exception:  # an unknown store name: the load will say so
        return None
    if path.is_file():
        return describe(_Entry(spec, "dir", path, "gguf"))
    if path.is_dir() and (path / "config.json").is_file():
        return describe(_Entry(spec, "dir", path, "mlx"))
    return None
