"""One settings object for every front end.

Precedence: command-line flags > ``MLXKV_*`` environment > TOML config file > the model
folder's ``generation_config.json`` (sampling values only, as its authors recommend) >
defaults. Each value remembers where it came from; ``mlxkv config`` prints them. No mlx here.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# What a request or the settings may ask for: off, auto (the best source available), or a
# source (engine.speculation).
SPEC_CHOICES = ("off", "auto", "draft", "ngram", "suffix", "mtp")

ENGINE_DIR = Path(__file__).resolve().parent
DEMO_MODEL = ENGINE_DIR / "demo" / "model"
DEMO_DRAFT_MODEL = ENGINE_DIR / "demo" / "draft"
DTYPE_POLICIES = ("auto", "float32", "bfloat16", "float16", "native")
DEQUANTIZE_CHOICES = ("auto", "on", "off")


class SettingsError(ValueError):
    """A setting has a value that cannot be used; the message says which and why."""


def default_config_path(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    base = env.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "mlxkv" / "config.toml"


def parse_bytes(value: Any) -> int:
    """``"2GiB"``, ``"512MB"``, ``"1e9"`` or an int -> bytes."""
    if isinstance(value, bool):
        raise SettingsError(f"not a size: {value!r}")
    if isinstance(value, (int, float)):
        return int(value)
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([kKmMgGtT]?)(i?)[bB]?\s*", str(value))
    if not m:
        raise SettingsError(f"not a size: {value!r} (use e.g. 2GiB, 512MB or a byte count)")
    number, unit, binary = float(m.group(1)), m.group(2).upper(), m.group(3)
    power = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}[unit]
    return int(number * ((1024 if binary else 1000) ** power))


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise SettingsError(f"not a boolean: {value!r} (use true or false)")


def _optional(conv: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def parse(value: Any) -> Any:
        if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none")):
            return None
        return conv(value)
    return parse


def _choice(*choices: str) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        text = str(value).strip().lower()
        if text not in choices:
            raise SettingsError(f"{value!r} is not one of {', '.join(choices)}")
        return text
    return parse


def _path(value: Any) -> str:
    return os.path.expanduser(str(value))


def _paths(value: Any) -> tuple[str, ...] | None:
    """Folders: a TOML list of strings, or one string of them separated by commas or the
    OS path separator (``:``; ``;`` on Windows), as the environment and a flag give them."""
    if value is None:
        return None
    if isinstance(value, str):
        items = re.split("[," + re.escape(os.pathsep) + "]", value)
    elif isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        items = list(value)
    else:
        raise SettingsError(f"not a list of folders: {value!r} (use a list of strings, or "
                            f"folders separated by commas or {os.pathsep!r})")
    folders = tuple(os.path.expanduser(v.strip()) for v in items if v.strip())
    return folders or None


# Settings a served model's [[models]] table may set for itself (the rest, the server's and
# the cache folder's, are the process's), and the table's own keys.
PER_MODEL = frozenset({
    "draft_model", "dtype", "dequantize", "cpu_attention", "full_hash", "context_tokens",
    "prefill_step_size", "max_batch", "batch_itl_factor", "max_queue", "system_prompt",
    "chat_template", "spec", "spec_tokens", "spec_ngram_min", "spec_ngram_max",
    "spec_suffix_tokens", "ram_cache_bytes", "temperature", "top_p", "top_k", "min_p",
    "repetition_penalty", "max_tokens",
})
MODEL_TABLE_KEYS = frozenset({"name", "path", "model", "aliases", "pin"})


def model_tables(value: Any, where: str = "models") -> tuple[dict[str, Any], ...] | None:
    """The config file's ``[[models]]`` tables, checked: ``path`` (or ``model``), an optional
    ``name``, ``aliases`` (names or shell patterns), ``pin`` and per-model settings of
    :data:`PER_MODEL`, parsed as their fields parse them. Each comes back as ``{"name": str |
    None, "path": str, "aliases": tuple, "pin": bool, "settings": dict}``."""
    if value is None:
        return None
    if isinstance(value, tuple):
        value = list(value)
    if not isinstance(value, list):
        raise SettingsError(f"{where} must be a list of tables ([[models]]), got {type(value).__name__}")
    out = []
    for i, item in enumerate(value):
        at = f"{where}[{i}]"
        if not isinstance(item, dict):
            raise SettingsError(f"{at} must be a table, got {type(item).__name__}")
        path = item.get("path", item.get("model"))
        if not isinstance(path, str) or not path:
            raise SettingsError(f"{at}: path (a folder, GGUF file, hub id or store name) is required")
        name = item.get("name")
        if name is not None and (not isinstance(name, str) or not name):
            raise SettingsError(f"{at}: name must be a non-empty string")
        aliases = item.get("aliases", [])
        if isinstance(aliases, str):
            aliases = [aliases]
        if not isinstance(aliases, list) or not all(isinstance(a, str) and a for a in aliases):
            raise SettingsError(f"{at}: aliases must be a list of names")
        pin = item.get("pin", False)
        if not isinstance(pin, bool):
            raise SettingsError(f"{at}: pin must be true or false")
        own = {k: v for k, v in item.items() if k not in MODEL_TABLE_KEYS}
        unknown = sorted(k for k in own if k not in PER_MODEL)
        if unknown:
            allowed = "name, path, aliases, pin, " + ", ".join(sorted(PER_MODEL))
            raise SettingsError(f"{at}: unknown key(s) {', '.join(unknown)} (a model takes {allowed})")
        for k, v in own.items():
            try:
                own[k] = FIELD_BY_NAME[k].parse(v)
            except (SettingsError, ValueError, TypeError) as e:
                raise SettingsError(f"{at}.{k}: {e}") from None
        out.append({"name": name, "path": path, "aliases": tuple(aliases), "pin": pin, "settings": own})
    return tuple(out)


def _positive_int(value: Any) -> int:
    number = int(value)
    if number <= 0:
        raise SettingsError(f"must be a positive integer, got {value!r}")
    return number


def _nonnegative_int(value: Any) -> int:
    number = int(value)
    if number < 0:
        raise SettingsError(f"must be 0 or a positive integer, got {value!r}")
    return number


def _above_one(value: Any) -> float:
    number = _positive_float(value)
    if number <= 1.0:
        raise SettingsError(f"must be above 1, got {value!r}")
    return number


def _positive_float(value: Any) -> float:
    number = float(value)
    if not number > 0:
        raise SettingsError(f"must be a positive number, got {value!r}")
    return number


@dataclass(frozen=True)
class Field:
    """One setting, and how the command line spells it (the CLI builds its flags from these).

    ``flag``: the option (default ``--`` + the name with dashes; None: no flag).
    ``arg_type``: what argparse converts the flag's text with, so that a typo is reported
    at once (``parse`` still validates it, as it does for the environment and config file).
    Booleans get ``flag`` and ``--no-...`` (``negation``); ``off`` is an extra switch
    ``(flag, value, help)`` that sets one value, e.g. ``--no-ssd-cache`` = 0 bytes."""

    name: str
    default: Any
    parse: Callable[[Any], Any]
    help: str
    flag: str | None = ""
    arg_type: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    negation: str | None = None
    off: tuple[str, Any, str] | None = None

    @property
    def option(self) -> str | None:
        """The flag that sets this field (None: the field has none)."""
        if self.flag is None:
            return None
        return self.flag or "--" + self.name.replace("_", "-")

    @property
    def is_bool(self) -> bool:
        return isinstance(self.default, bool)

    @property
    def negative(self) -> str | None:
        """A boolean field's ``--no-...`` flag."""
        if not self.is_bool or self.option is None:
            return None
        return self.negation or "--no-" + self.option[2:]

    def flag_source(self, value: Any) -> str:
        """How ``mlxkv config`` names the flag that gave ``value``."""
        if self.off is not None and value == self.off[1]:
            return "flag " + self.off[0]
        if self.is_bool and value is False and self.negative:
            return "flag " + self.negative
        return f"flag {self.option}"


SIZE = "SIZE"  # metavar of byte sizes: 2GiB, 512MB, a byte count

FIELDS: tuple[Field, ...] = (
    Field("model", str(DEMO_MODEL), str,
          "model folder, GGUF file, Hugging Face hub id, or a name `mlxkv models` lists "
          "(ollama:NAME[:TAG], lmstudio:PUBLISHER/MODEL, hf:ORG/NAME) (default: the demo model)",
          metavar="PATH|ID"),
    Field("draft_model", None, _optional(str),
          "draft model for speculative decoding (shares the model's tokenizer; the demo model "
          "pairs with the demo draft model by default)", metavar="PATH|ID"),
    Field("model_dirs", None, _paths,
          "more folders to find models in (`mlxkv models`): each model folder and .gguf file "
          "in them, beside the Hugging Face cache, Ollama's and LM Studio's; separated by "
          "commas (a list in the config file)", metavar="DIRS"),
    Field("cache_dir", os.path.expanduser(os.path.join("~", ".cache", "mlxkv")), _path,
          "prefix cache folder (SSD tier; default ~/.cache/mlxkv)", metavar="DIR"),
    Field("prefix_cache", True, _bool, "keep and reuse the KV state of prompts"),
    Field("ram_cache_bytes", 2 * 1024**3, parse_bytes, "RAM tier capacity, e.g. 2GiB", metavar=SIZE),
    Field("ssd_cache_bytes", 20 * 1024**3, parse_bytes, "SSD tier capacity, e.g. 20GiB (0: SSD tier off)",
          metavar=SIZE, off=("--no-ssd-cache", 0, "SSD tier off: cache in RAM only (= --ssd-cache-bytes 0)")),
    Field("block_tokens", 256, _positive_int, "tokens per cache block", arg_type=int, metavar="N"),
    Field("restore_timeout_s", 30.0, _positive_float,
          "seconds an SSD restore may take before it counts as a miss (a hung disk)",
          arg_type=float, metavar="S"),
    Field("dtype", "auto", _choice(*DTYPE_POLICIES),
          "compute dtype (auto: float32 on CPU for bf16/fp16 weights)", choices=DTYPE_POLICIES),
    Field("dequantize", "auto", _choice(*DEQUANTIZE_CHOICES),
          "quantized weights (GGUF Q4/Q8, mlx-lm 4/8-bit folders): on = dequantize at load and "
          "compute in --dtype, off = quantized matmuls, auto = on for the CPU backend when the "
          "dequantized model fits in half the memory, off on Metal/CUDA",
          choices=DEQUANTIZE_CHOICES),
    Field("cpu_attention", True, _bool,
          "CPU backend: attention and the MLP's silu over several tokens (prefill, speculation) "
          "with vectorised kernels, equal to MLX's up to rounding and faster (off: MLX's)"),
    Field("full_hash", False, _bool,
          "fingerprint weights by content (slow once) instead of size + mtime"),
    Field("temperature", 0.0, float, "sampling temperature (0 = greedy)", flag="--temp",
          arg_type=float, metavar="T"),
    Field("top_p", 1.0, float, "nucleus sampling threshold (1 = off)", arg_type=float, metavar="P"),
    Field("top_k", 0, int, "top-k sampling (0 = off)", arg_type=int, metavar="K"),
    Field("min_p", 0.0, float, "min-p sampling (0 = off)", arg_type=float, metavar="P"),
    Field("repetition_penalty", 1.0, float, "repetition penalty (1 = off)", arg_type=float,
          metavar="X"),
    Field("seed", None, _optional(int), "random seed for sampling", arg_type=int, metavar="N"),
    Field("max_tokens", 512, _positive_int, "maximum tokens to generate", arg_type=int, metavar="N"),
    Field("context_tokens", None, _optional(_positive_int),
          "tokens a prompt and its reply may fill (default: the model's context, its "
          "max_position_embeddings); beyond what the model was trained on it still runs, with "
          "replies of lower quality", arg_type=int, metavar="N"),
    Field("prefill_step_size", 2048, _positive_int, "prompt tokens per prefill chunk", arg_type=int,
          metavar="N"),
    Field("max_batch", 8, _positive_int,
          "requests decoded together at most (continuous batching; 1 = one at a time)",
          arg_type=int, metavar="N"),
    Field("batch_itl_factor", 3.0, _above_one,
          "while a prompt prefills beside decoding streams, a batch step takes at most this many "
          "times a decode step (the prefill chunk is sized from the measured step costs)",
          arg_type=float, metavar="X"),
    Field("max_queue", 64, _positive_int,
          "requests waiting to be served at most; more are refused at once", arg_type=int,
          metavar="N"),
    Field("lookup_history", 32, _positive_int,
          "requests whose cache lookup (matched tokens, where the prompt parted from the "
          "closest cached state) stats and the inspector's misses view keep",
          arg_type=int, metavar="N"),
    Field("system_prompt", None, _optional(str), "system message for chat", metavar="TEXT"),
    Field("chat_template", None, _optional(_path),
          "a Jinja chat template file used instead of the model's own (as llama.cpp's "
          "--chat-template-file); tool-call and reasoning formats follow it", metavar="FILE"),
    Field("blas", "auto", str, "CPU BLAS on Linux: auto, off, or a library path",
          metavar="auto|off|PATH"),
    # speculative decoding
    Field("spec", "auto", _choice(*SPEC_CHOICES),
          "speculative decoding: off, auto (the best source available, off when slower), "
          "draft, ngram (prompt lookup), suffix (the conversation's and earlier outputs' "
          "suffixes) or mtp", choices=SPEC_CHOICES),
    Field("spec_tokens", None, _optional(_positive_int),
          "most tokens a speculation round proposes (default: the source's own, 32 for suffix, "
          "12 for the others)", arg_type=int, metavar="N"),
    Field("spec_ngram_min", 2, _positive_int, "prompt lookup: shortest n-gram matched", arg_type=int,
          metavar="N"),
    Field("spec_ngram_max", 4, _positive_int, "prompt lookup: longest n-gram matched", arg_type=int,
          metavar="N"),
    Field("spec_suffix_tokens", 32768, _nonnegative_int,
          "suffix speculation: output tokens of earlier requests a model's global index keeps "
          "(the oldest are forgotten first; saved beside the SSD cache; 0: none)", arg_type=int,
          metavar="N"),
    # under a distributed launch (mlx.launch)
    Field("shard", "auto", _choice("auto", "tensor", "pipeline"),
          "under mlx.launch: how the model is split across the ranks: tensor (every layer "
          "split), pipeline (the layers divided) or auto (tensor when the model supports it)",
          choices=("auto", "tensor", "pipeline")),
    Field("dist_timeout_s", 60.0, _positive_float,
          "under mlx.launch: seconds a rank waits for the others before it stops with an error "
          "(a rank died, hung or was stopped); longer than the slowest prefill chunk",
          arg_type=float, metavar="S"),
    # `mlxkv serve`
    Field("models", None, model_tables,
          "serve: the models served, as [[models]] tables in the config file (name, path, aliases, "
          "pin and per-model settings such as draft_model or context_tokens); on the command "
          "line repeat --model (NAME=SPEC names one)", flag=None),
    Field("default_model", None, _optional(str),
          "serve, several models: the one a request naming no model, or an unknown one, gets "
          "(without it an unknown name is a 404 that lists the names)", metavar="NAME"),
    Field("models_memory_bytes", None, _optional(parse_bytes),
          "serve, several models: memory the loaded models may hold together (weights, RAM "
          "cache tier, KV in flight), e.g. 16GiB; the least recently used one is unloaded "
          "first (default: no budget)", metavar=SIZE),
    Field("model_idle_s", None, _optional(_positive_float),
          "serve, several models: unload a model (not pinned) no request used for this many "
          "seconds, its cache flushed to the SSD tier first (default: never)", arg_type=float,
          metavar="S"),
    Field("host", "127.0.0.1", str, "serve: address to listen on (0.0.0.0: every interface)",
          metavar="ADDR"),
    Field("port", 8000, _positive_int, "serve: TCP port", arg_type=int, metavar="N"),
    Field("api_key", None, _optional(str),
          "serve: require this key (Authorization: Bearer KEY, or x-api-key: KEY)", metavar="KEY"),
    Field("api_key_file", None, _optional(str),
          "serve: the keys to require, one 'NAME KEY [share=GROUP] [admin]' a line; each key's "
          "prompt cache is its own unless keys share a GROUP", metavar="FILE"),
    Field("cors_origins", None, _optional(str),
          "serve: comma-separated origins allowed by CORS, or * (default: CORS off)",
          metavar="ORIGINS"),
    Field("max_body_bytes", 8 * 1024**2, parse_bytes, "serve: largest request body, e.g. 8MiB",
          metavar=SIZE),
    Field("max_requests", 64, _positive_int,
          "serve: requests in flight at once (queued or decoding); more are answered 429",
          arg_type=int, metavar="N"),
    Field("max_tokens_limit", None, _optional(_positive_int),
          "serve: largest max_tokens a request may ask for (default: the model's context); "
          "more is clamped to it, and the reply's x-mlxkv-max-tokens header says so",
          arg_type=int, metavar="N"),
    Field("responses_store_bytes", 64 * 1024**2, parse_bytes,
          "serve: memory for earlier /v1/responses answers kept for previous_response_id, "
          "e.g. 64MiB (0: none kept)", metavar=SIZE),
    Field("quiet", False, _bool, "serve: print no access line per request (route, status, "
          "token counts, time to first token, cache outcome)"),
    Field("churn_rules", True, _bool,
          "serve: remove text agents put in their system prompts that changes with every "
          "conversation (Claude Code's billing header line), so that a new conversation reuses "
          "the cached prompt it shares with the last (rules: server/churn.py)"),
)
FIELD_BY_NAME = {f.name: f for f in FIELDS}
# Sampling values a model folder may recommend in Hugging Face's generation_config.json.
MODEL_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def model_sampling_defaults(model: str) -> tuple[dict[str, Any], Path | None]:
    """Sampling defaults from ``<model>/generation_config.json`` of a local model folder.

    ``"do_sample": false`` means greedy. A missing or unreadable file gives nothing: the
    model loader reports broken model folders, settings do not."""
    path = Path(os.path.expanduser(model)) / "generation_config.json"
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}, None
    if not isinstance(cfg, dict):
        return {}, None
    out = {k: cfg[k] for k in MODEL_SAMPLING_KEYS
           if isinstance(cfg.get(k), (int, float)) and not isinstance(cfg.get(k), bool)}
    if cfg.get("do_sample") is False:
        out["temperature"] = 0.0
    return out, path


def _read_toml(path: Path) -> dict:
    try:
        fh = open(path, "rb")
    except FileNotFoundError:
        return {}
    except OSError as e:
        raise SettingsError(f"cannot read config file {path}: {e.strerror}") from None
    # Imported only when there is a file: keeps `mlxkv generate` start-up lean.
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    try:
        with fh:
            data = tomllib.load(fh)
    except tomllib.TOMLDecodeError as e:
        raise SettingsError(f"config file {path} is not valid TOML: {e}") from None
    except OSError as e:
        raise SettingsError(f"cannot read config file {path}: {e.strerror}") from None
    # Accept both a flat file and one with an [mlxkv] table.
    return dict(data.get("mlxkv", data))


def config_file_value(name: str) -> Any:
    """One key of the config file named by MLXKV_CONFIG or the default (None if absent)."""
    path = Path(os.environ.get("MLXKV_CONFIG") or default_config_path())
    return _read_toml(path).get(name)


class Settings:
    """Effective settings: attribute access to values, ``sources[name]`` says where from.

    The annotations below type the values; their defaults live in :data:`FIELDS` only (a
    test checks that both name the same settings). Code that needs a setting reads it from
    here, never with a default of its own: :meth:`defaults` is the table's values."""

    model: str
    draft_model: str | None
    model_dirs: tuple[str, ...] | None
    cache_dir: str
    prefix_cache: bool
    ram_cache_bytes: int
    ssd_cache_bytes: int
    block_tokens: int
    restore_timeout_s: float
    dtype: str
    dequantize: str
    cpu_attention: bool
    full_hash: bool
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    seed: int | None
    max_tokens: int
    context_tokens: int | None
    prefill_step_size: int
    max_batch: int
    batch_itl_factor: float
    max_queue: int
    lookup_history: int
    system_prompt: str | None
    chat_template: str | None
    blas: str
    spec: str
    spec_tokens: int | None
    spec_ngram_min: int
    spec_ngram_max: int
    spec_suffix_tokens: int
    shard: str
    dist_timeout_s: float
    models: tuple[dict[str, Any], ...] | None
    default_model: str | None
    models_memory_bytes: int | None
    model_idle_s: float | None
    host: str
    port: int
    api_key: str | None
    api_key_file: str | None
    cors_origins: str | None
    max_body_bytes: int
    max_requests: int
    max_tokens_limit: int | None
    responses_store_bytes: int
    quiet: bool
    churn_rules: bool

    def __init__(self, values: dict[str, Any], sources: dict[str, str], config_path: Path):
        self._values = values
        self.sources = sources
        self.config_path = config_path

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["_values"][name]
        except KeyError:
            raise AttributeError(name) from None

    @classmethod
    def defaults(cls, **changes: Any) -> Settings:
        """Every setting at its default (no flags, environment, config file or model
        recommendation), with ``changes`` applied as :meth:`replace` applies them."""
        values = {f.name: f.default for f in FIELDS}
        settings = cls(values, {f.name: "default" for f in FIELDS}, default_config_path({}))
        return settings.replace(**changes) if changes else settings

    def as_dict(self) -> dict[str, Any]:
        return dict(self._values)

    def replace(self, **changes: Any) -> Settings:
        """A copy with some values changed (source "override")."""
        values, sources = dict(self._values), dict(self.sources)
        for name, value in changes.items():
            if name not in FIELD_BY_NAME:
                raise SettingsError(f"unknown setting {name!r}")
            values[name] = FIELD_BY_NAME[name].parse(value) if value is not None else None
            sources[name] = "override"
        return Settings(values, sources, self.config_path)

    @classmethod
    def load(
        cls,
        flags: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        config_path: str | os.PathLike | None = None,
    ) -> Settings:
        """Resolve every field. ``flags`` holds only the flags the user gave (None = unset)."""
        env = os.environ if env is None else env
        flags = {k: v for k, v in (flags or {}).items() if v is not None}
        explicit = config_path or env.get("MLXKV_CONFIG")
        path = Path(os.path.expanduser(str(explicit))) if explicit else default_config_path(env)
        if explicit and not path.exists():
            raise SettingsError(f"config file not found: {path}")
        file_values = _read_toml(path)
        unknown = sorted(set(file_values) - set(FIELD_BY_NAME))
        if unknown:
            raise SettingsError(f"config file {path}: unknown setting(s) {', '.join(unknown)}")
        values, sources = {}, {}
        for f in FIELDS:
            env_name = "MLXKV_" + f.name.upper()
            if f.name in flags:
                raw, source = flags[f.name], f.flag_source(flags[f.name])
            elif env.get(env_name) not in (None, ""):
                raw, source = env[env_name], "env " + env_name
            elif f.name in file_values:
                raw, source = file_values[f.name], f"config {path}"
            else:
                values[f.name], sources[f.name] = f.default, "default"
                continue
            try:
                values[f.name] = f.parse(raw)
            except (SettingsError, ValueError, TypeError) as e:
                raise SettingsError(f"{f.name} from {source}: {e}") from None
            sources[f.name] = source
        recommended, gen_path = model_sampling_defaults(values["model"])
        for name, raw in recommended.items():
            if sources[name] == "default":
                try:
                    values[name] = FIELD_BY_NAME[name].parse(raw)
                except (SettingsError, ValueError, TypeError):
                    continue  # a bad recommendation is ignored, the default stands
                sources[name] = f"model {gen_path}"
        return cls(values, sources, path)

    def describe(self) -> list[tuple[str, Any, str]]:
        return [(f.name, self._values[f.name], self.sources[f.name]) for f in FIELDS]
