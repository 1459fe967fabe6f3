"""From a GGUF file's metadata and tensors to an mlx-lm model: the architecture's config
(mlx-lm's ``ModelArgs`` keys), the tensor names, llama's q/k row order, quantization.
(Imports mlx: import it after the BLAS preload, as everything that runs a model does.)"""

from __future__ import annotations

import importlib
import re
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxkv.engine.arrays import named_parameters

from .reader import GGUFError, GGUFHeader
from .weights import GROUP_SIZE, QUANT_BITS

# GGUF architecture -> mlx-lm model module.
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}

# Per-layer GGUF tensor stems -> mlx-lm module paths.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                 "output": "lm_head"}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias|scales|biases)$")
_GLOBAL_RE = re.compile(r"^([a-z_]+)\.(weight|bias|scales|biases)$")
# Tensors some converters write that the model computes itself.
# (``rope_freqs``: llama 3.1's per-frequency factors, applied by _apply_rope_factors.)
_IGNORED = {"rope_freqs.weight"}


def _int(header: GGUFHeader, key: str, default: int | None = None) -> int:
    value = header.get(key, default)
    if value is None:
        raise GGUFError(f"{header.path}: metadata {key!r} is missing")
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, list):
        # Per-layer values (some hybrid models); one value for all layers is fine.
        if not value or len(set(value)) != 1:
            raise GGUFError(f"{header.path}: metadata {key!r} varies by layer "
                            "(not supported)")
        value = value[0]
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise GGUFError(f"{header.path}: metadata {key!r} = {value!r} is not a positive "
                        "integer")
    return value


def _float(header: GGUFHeader, key: str, default: float | None = None) -> float:
    value = header.get(key, default)
    if value is None:
        raise GGUFError(f"{header.path}: metadata {key!r} is missing")
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise GGUFError(f"{header.path}: metadata {key!r} = {value!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise GGUFError(f"{header.path}: metadata {key!r} = {value!r} is not positive")
    return value


def architecture(header: GGUFHeader) -> str:
    arch = header.get("general.architecture")
    if not isinstance(arch, str):
        raise GGUFError(f"{header.path}: metadata 'general.architecture' is missing")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{header.path}: architecture {arch!r} is not supported "
                        f"(supported: {', '.join(sorted(ARCHITECTURES))})")
    return arch


def model_config(header: GGUFHeader) -> dict[str, Any]:
    """The mlx-lm config (``config.json`` keys) the file's metadata describes."""
    arch = architecture(header)
    p = f"{arch}."
    hidden = _int(header, p + "embedding_length")
    heads = _int(header, p + "attention.head_count")
    kv_heads = _int(header, p + "attention.head_count_kv", heads)
    head_dim = _int(header, p + "attention.key_length", hidden // heads if hidden % heads == 0 else None)
    if _int(header, p + "attention.value_length", head_dim) != head_dim:
        raise GGUFError(f"{header.path}: key and value head sizes differ (not supported)")
    rope_dims = _int(header, p + "rope.dimension_count", head_dim)
    if rope_dims != head_dim:
        raise GGUFError(f"{header.path}: rotary embedding on {rope_dims} of {head_dim} "
                        "head dimensions (partial rotary is not supported)")
    if heads % kv_heads:
        raise GGUFError(f"{header.path}: {heads} attention heads are not a multiple of "
                        f"{kv_heads} key/value heads")
    embd = header.tensors.get("token_embd.weight")
    if embd is None or len(embd.shape) != 2 or embd.shape[1] != hidden:
        raise GGUFError(f"{header.path}: no token_embd.weight of width {hidden}")
    tokens = header.get("tokenizer.ggml.tokens")
    if isinstance(tokens, list) and len(tokens) > embd.shape[0]:
        raise GGUFError(f"{header.path}: {len(tokens)} tokens but {embd.shape[0]} rows of "
                        "token_embd.weight")
    layers = _int(header, p + "block_count")
    present = {int(m.group(1)) for m in map(_LAYER_RE.match, header.tensors) if m}
    # Checked against the tensors before anything is built for it: a hostile count
    # would otherwise build that many layers.
    if len(present) != layers or present != set(range(layers)):
        raise GGUFError(f"{header.path}: {p}block_count is {layers}, the file has tensors "
                        f"for {len(present)} layers")
    config: dict[str, Any] = {
        "model_type": ARCHITECTURES[arch],
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": _int(header, p + "feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": _float(header, p + "attention.layer_norm_rms_epsilon", 1e-6),
        "vocab_size": embd.shape[0],
        "max_position_embeddings": _int(header, p + "context_length", 4096),
        "rope_theta": _float(header, p + "rope.freq_base", 10000.0),
        "tie_word_embeddings": "output.weight" not in header.tensors,
    }
    if arch == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in header.tensors
        config["mlp_bias"] = "blk.0.ffn_up.bias" in header.tensors
    scaling = _rope_scaling(header, p)
    if scaling:
        config["rope_scaling"] = scaling
    quant = quantization(header)
    if quant:
        config["quantization"] = quant
    return config


def _rope_scaling(header: GGUFHeader, p: str) -> dict[str, Any] | None:
    kind = header.get(p + "rope.scaling.type")
    if kind in (None, "none"):
        factor = header.get(p + "rope.scale_linear")
        return {"type": "linear", "factor": float(factor)} if factor else None
    factor = _float(header, p + "rope.scaling.factor")
    if kind == "linear":
        return {"type": "linear", "factor": factor}
    if kind == "yarn":
        return {"type": "yarn", "factor": factor,
                "original_max_position_embeddings":
                    _int(header, p + "rope.scaling.original_context_length")}
    raise GGUFError(f"{header.path}: rope scaling {kind!r} is not supported")


def module_name(gguf_name: str) -> str | None:
    """The mlx-lm parameter name of a GGUF tensor (``None``: not part of the model)."""
    if gguf_name in _IGNORED:
        return None
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    m = _GLOBAL_RE.match(gguf_name)
    if m and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    raise GGUFError(f"tensor {gguf_name!r} has no place in the model")


def quantization(header: GGUFHeader) -> dict[str, Any] | None:
    """mlx-lm's ``quantization`` config: the most common quantized type as the default,
    and each module quantized otherwise under its own path (as mlx-lm writes mixed
    quantizations)."""
    quantized: dict[str, int] = {}
    for name, info in header.tensors.items():
        if info.type_name in QUANT_BITS and name.endswith(".weight"):
            target = module_name(name)
            if target is not None:
                quantized[target[: -len(".weight")]] = QUANT_BITS[info.type_name]
    if not quantized:
        return None
    counts: dict[int, int] = {}
    for bits in quantized.values():
        counts[bits] = counts.get(bits, 0) + 1
    default = max(counts, key=lambda b: (counts[b], b))
    quant: dict[str, Any] = {"group_size": GROUP_SIZE, "bits": default}
    for path, bits in sorted(quantized.items()):
        if bits != default:
            quant[path] = {"group_size": GROUP_SIZE, "bits": bits}
    return quant


def unpermute_rows(w: Any, n_heads: int) -> Any:
    """Undo the row order llama.cpp's converter gives llama's q/k projections (so that
    its interleaved rotary embedding applies): per head, rows come as pairs
    (0, d/2), (1, d/2 + 1), ...; mlx-lm's rotary embedding wants the halves apart.
    Rows only move, so packed quantized rows, scales and biases move the same way."""
    rows = w.shape[0]
    half = rows // n_heads // 2
    rest = tuple(w.shape[1:])
    return w.reshape(n_heads, half, 2, *rest).swapaxes(1, 2).reshape(rows, *rest)


def model_weights(header: GGUFHeader, arrays: dict[str, Any], config: dict[str, Any]
                  ) -> dict[str, Any]:
    """``arrays`` (from :func:`weights.load_tensors`) under mlx-lm's names, llama's q/k
    rows back in mlx-lm's order."""
    arch = header.get("general.architecture")
    out = {}
    for name, value in arrays.items():
        target = module_name(name)
        if target is None:
            continue
        if arch == "llama":
            m = _LAYER_RE.match(name)
            if m and m.group(2) in ("attn_q", "attn_k"):
                heads = (config["num_attention_heads"] if m.group(2) == "attn_q"
                         else config["num_key_value_heads"])
                value = unpermute_rows(value, heads)
        out[target] = value
    return out


def dequantize_arrays(arrays: dict[str, Any], dtype: Any) -> dict[str, Any]:
    """``arrays`` with every quantized tensor (``x.weight`` + ``x.scales`` + ``x.biases``)
    turned into a plain ``dtype`` matrix, every float tensor cast to ``dtype``."""
    out = {}
    for name, value in arrays.items():
        if name.endswith((".scales", ".biases")) and name[:-7] + ".weight" in arrays:
            continue
        stem = name[: -len(".weight")] if name.endswith(".weight") else None
        if stem is not None and f"{stem}.scales" in arrays:
            scales = arrays[f"{stem}.scales"]
            bits = value.shape[-1] * 32 // (scales.shape[-1] * GROUP_SIZE)
            # In float32: half-precision scales times the integer levels, rounded back to
            # half precision, would lose what the file's own dequantization keeps.
            value = mx.dequantize(value, scales.astype(mx.float32),
                                  arrays[f"{stem}.biases"].astype(mx.float32),
                                  group_size=GROUP_SIZE, bits=bits)
        out[name] = value.astype(dtype) if mx.issubdtype(value.dtype, mx.floating) else value
    return out


def build_model(header: GGUFHeader, arrays: dict[str, Any], dequantize: Any = None
                ) -> tuple[Any, dict[str, Any]]:
    """The mlx-lm model for the file, its weights loaded (strictly: every parameter of
    the model from the file, every tensor of the file into the model). ``dequantize``: an
    mlx dtype to turn every quantized tensor into (None: keep them quantized)."""
    config = model_config(header)
    if dequantize is not None:
        arrays = dequantize_arrays(arrays, dequantize)
        config.pop("quantization", None)
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    args = module.ModelArgs.from_dict(config)
    model = module.Model(args)
    weights = model_weights(header, arrays, config)
    quant = config.get("quantization")
    if quant:
        def predicate(path: str, mod: Any) -> Any:
            if f"{path}.scales" not in weights:
                return False
            return quant.get(path, {"group_size": quant["group_size"], "bits": quant["bits"]})

        nn.quantize(model, group_size=quant["group_size"], bits=quant["bits"],
                    class_predicate=predicate)
    expected = {k for k, _ in named_parameters(model)}
    missing = sorted(expected - set(weights))
    extra = sorted(set(weights) - expected)
    if missing:
        raise GGUFError(f"{header.path}: the {config['model_type']} model needs {missing[0]!r}, "
                        "which the file does not have"
                        + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    if extra:
        raise GGUFError(f"{header.path}: tensor for {extra[0]!r} has no place in a "
                        f"{config['model_type']} model")
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:  # a shape that does not fit the config
        raise GGUFError(f"{header.path}: {e}") from None
    if "rope_freqs.weight" in arrays:
        _apply_rope_factors(model, arrays["rope_freqs.weight"], config)
    mx.eval(model.parameters())
    model.eval()
    return model, config


def _apply_rope_factors(model: Any, factors: Any, config: dict[str, Any]) -> None:
    """Give every attention layer the rotary embedding of ``rope_freqs`` (llama 3.1 style
    files store the per-frequency factors of their rope scaling as this tensor)."""
    dims = config["head_dim"]
    factors = factors.astype(mx.float32).reshape(-1)
    if factors.shape[0] != dims // 2:
        raise GGUFError(f"rope_freqs has {factors.shape[0]} factors, {dims // 2} expected")
    # llama.cpp divides each rotation frequency by its factor; mlx's fast.rope takes the
    # wavelengths (base ** (2i / dims)), so they are multiplied.
    base = mx.array(config["rope_theta"], dtype=mx.float32)
    wavelengths = factors * (base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims))
    for layer in model.model.layers:
        layer.self_attn.rope = FactoredRoPE(dims, wavelengths)



class FactoredRoPE(nn.Module):
    """Rotary embedding with the given per-frequency wavelengths."""

    def __init__(self, dims: int, wavelengths: mx.array) -> None:
        super().__init__()
        self.dims = dims
        self._freqs = wavelengths  # a leading underscore: not a parameter

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        return mx.fast.rope(x, self.dims, traditional=False, base=None, scale=1.0,
                            offset=offset, freqs=self._freqs)
