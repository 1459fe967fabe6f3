"""The multi-token-prediction (MTP) weights of a Qwen3-Next / Qwen3.5-style checkpoint, and
the MTP module they fill.

mlx-lm's ``sanitize`` drops every ``mtp.*`` tensor, so they are read here, straight from the
checkpoint's safetensors files (``model*.safetensors`` of a hub download, or a sidecar such
as ``mtp.safetensors`` beside a converted model): only the headers are parsed and only the
MTP byte ranges are read. The layout is the one Qwen ships:

- ``mtp.fc.weight`` [H, 2H], no bias: projects the concatenation [embedding, hidden]
  (embedding first) back to H;
- ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``, ``mtp.norm``: RMS norms;
- ``mtp.layers.0.*``: one full-attention decoder layer of the trunk's own kind (dense MLP,
  or the trunk's MoE layout, per-expert or fused ``experts.gate_up_proj``).

Qwen3-Next and Qwen3.5 store every RMS norm zero-centred (the layer computes x̂·(1 + w));
mlx-lm adds the 1 only to the trunk's norms, so it is added here to all MTP norms.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

# Bumped whenever the MTP module's computation or the state it keeps changes meaning: it is
# part of the namespace of the MTP state stored in the prefix cache.
MTP_SCHEMA = "mtp-v1"
# Model types whose checkpoints carry ``mtp.*`` in this layout, all with zero-centred norms.
SUPPORTED_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
# MTP weights up to this size are fingerprinted by content; larger ones by name, shape,
# dtype and the size and mtime of their files (as the model fingerprint does).
CONTENT_HASH_MAX_BYTES = 64 << 20
_HEADER_MAX_BYTES = 100 << 20
_DTYPES = {"F32": ("float32", None), "F16": ("float16", None), "BF16": ("uint16", "bfloat16"),
           "I32": ("int32", None), "U32": ("uint32", None), "I64": ("int64", None), "U8": ("uint8", None)}


class MTPWeightsError(ValueError):
    """The checkpoint's ``mtp.*`` weights cannot be used; the message says why."""


@dataclass
class MTPWeights:
    """The MTP tensors of a checkpoint, by name without the ``mtp.`` prefix."""

    tensors: dict[str, mx.array]
    fingerprint: str
    nbytes: int
    files: list[str]


def _header(path: Path) -> tuple[int, dict]:
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) != 8:
            raise MTPWeightsError(f"{path}: not a safetensors file (shorter than its header length)")
        n = int.from_bytes(raw, "little")
        if n <= 0 or n > _HEADER_MAX_BYTES:
            raise MTPWeightsError(f"{path}: not a safetensors file (header length {n})")
        try:
            header = json.loads(fh.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise MTPWeightsError(f"{path}: damaged safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise MTPWeightsError(f"{path}: damaged safetensors header (not an object)")
    return 8 + n, header


def _mtp_name(key: str) -> str | None:
    for prefix in ("mtp.", "model.mtp.", "language_model.mtp.", "model.language_model.mtp."):
        if key.startswith(prefix):
            return key[len(prefix):]
    return None


def _span(info: Any, path: Path) -> int:
    try:
        start, end = info["data_offsets"]
        return int(end) - int(start)
    except (TypeError, KeyError, ValueError):
        raise MTPWeightsError(f"{path}: damaged safetensors entry") from None


def _read(fd: int, base: int, name: str, info: Any, path: Path) -> tuple[mx.array, bytes]:
    import numpy as np

    try:
        dtype, shape, (start, end) = info["dtype"], list(info["shape"]), info["data_offsets"]
    except (TypeError, KeyError, ValueError):
        raise MTPWeightsError(f"{path}: damaged safetensors entry for {name!r}") from None
    if dtype not in _DTYPES:
        raise MTPWeightsError(f"{path}: {name!r} has dtype {dtype}, which MTP weights cannot have")
    np_dtype, view = _DTYPES[dtype]
    count = 1
    for s in shape:
        count *= int(s)
    if end - start != count * np.dtype(np_dtype).itemsize or start < 0:
        raise MTPWeightsError(f"{path}: {name!r} byte range does not match its shape {shape}")
    data = os.pread(fd, end - start, base + start)
    if len(data) != end - start:
        raise MTPWeightsError(f"{path}: truncated while reading {name!r}")
    arr = mx.array(np.frombuffer(data, dtype=np_dtype).reshape(shape))
    return (arr.view(getattr(mx, view)) if view else arr), data


def read_mtp_weights(folder: str | os.PathLike) -> MTPWeights | None:
    """The ``mtp.*`` tensors in ``folder``'s safetensors files, or None when there are none."""
    root = Path(folder)
    found: list[tuple[Path, int, dict, list[str]]] = []
    for path in sorted(p for p in root.glob("*.safetensors") if p.is_file()):
        base, header = _header(path)
        names = sorted(k for k in header if k != "__metadata__" and _mtp_name(k) is not None)
        if names:
            found.append((path, base, header, names))
    if not found:
        return None
    tensors: dict[str, mx.array] = {}
    digest = hashlib.sha256(MTP_SCHEMA.encode())
    total = sum(_span(header[k], path) for path, _, header, names in found for k in names)
    by_content = total <= CONTENT_HASH_MAX_BYTES
    for path, base, header, names in found:
        if not by_content:
            st = path.stat()
            digest.update(f"{path.name}:{st.st_size}:{st.st_mtime_ns}".encode())
        fd = os.open(path, os.O_RDONLY)
        try:
            for key in names:
                short = _mtp_name(key)
                assert short is not None  # names holds MTP tensors only
                if short in tensors:
                    raise MTPWeightsError(f"{root}: MTP tensor {key!r} appears twice")
                arr, data = _read(fd, base, key, header[key], path)
                tensors[short] = arr
                digest.update(f"{short}:{header[key]['dtype']}:{list(arr.shape)}".encode())
                if by_content:
                    digest.update(hashlib.sha256(data).digest())
        finally:
            os.close(fd)
    return MTPWeights(tensors=tensors, fingerprint=digest.hexdigest()[:32], nbytes=total,
                      files=[p.name for p, *_ in found])


class MTPModule(nn.Module):
    """z = fc([norm_e(embed(x_p)), norm_h(h_{p-1})]) -> decoder layer (own KV) -> norm: predicts x_{p+1}.

    Its output hidden is what the LM head consumes, and what the next depth feeds back as
    ``h``."""

    def __init__(self, hidden_size: int, eps: float, layers: list[nn.Module]):
        super().__init__()
        self.fc = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.pre_fc_norm_embedding = nn.RMSNorm(hidden_size, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(hidden_size, eps=eps)
        self.layers = layers
        self.norm = nn.RMSNorm(hidden_size, eps=eps)

    def __call__(self, embedded: mx.array, hidden: mx.array, cache: list) -> mx.array:
        from mlx_lm.models.base import create_attention_mask

        x = self.fc(mx.concatenate([self.pre_fc_norm_embedding(embedded),
                                    self.pre_fc_norm_hidden(hidden.astype(embedded.dtype))], axis=-1))
        layer = self.layers[0]
        x = layer(x, mask=create_attention_mask(x, cache[0]), cache=cache[0])
        return self.norm(x)


def text_args(model: Any) -> Any:
    """The trunk's ModelArgs (the text config of VLM-style wrappers)."""
    owner = getattr(model, "language_model", model)
    args = getattr(owner, "args", None)
    if args is None or not hasattr(args, "hidden_size"):
        raise MTPWeightsError(f"{type(model).__name__} has no text model arguments to build an MTP layer from")
    return args


def _layer(model_type: str, args: Any) -> nn.Module:
    full_attention = getattr(args, "full_attention_interval", 1) - 1
    if model_type == "qwen3_next":
        from mlx_lm.models.qwen3_next import Qwen3NextDecoderLayer

        return Qwen3NextDecoderLayer(args, full_attention)
    from mlx_lm.models.qwen3_5 import DecoderLayer

    return DecoderLayer(args, full_attention)


def _fold_experts(tensors: dict[str, mx.array]) -> dict[str, mx.array]:
    """Per-expert ``mlp.experts.{e}.{proj}.weight`` or fused ``mlp.experts.gate_up_proj`` /
    ``down_proj`` -> the ``mlp.switch_mlp.{proj}.weight`` stacks mlx-lm's MoE block uses."""
    out = dict(tensors)
    prefix = "layers.0.mlp."
    fused = prefix + "experts.gate_up_proj"
    if fused in out:
        gate_up = out.pop(fused)
        mid = gate_up.shape[-2] // 2
        out[prefix + "switch_mlp.gate_proj.weight"] = gate_up[..., :mid, :]
        out[prefix + "switch_mlp.up_proj.weight"] = gate_up[..., mid:, :]
        if prefix + "experts.down_proj" in out:
            out[prefix + "switch_mlp.down_proj.weight"] = out.pop(prefix + "experts.down_proj")
    experts = sorted({int(k.split(".")[4]) for k in out if k.startswith(prefix + "experts.")
                      and k.split(".")[4].isdigit()})
    if experts:
        if experts != list(range(len(experts))):
            raise MTPWeightsError(f"MTP experts are not numbered 0..{len(experts) - 1}")
        for proj in ("gate_proj", "up_proj", "down_proj"):
            keys = [f"{prefix}experts.{e}.{proj}.weight" for e in experts]
            missing = [k for k in keys if k not in out]
            if missing:
                raise MTPWeightsError(f"MTP weights lack mtp.{missing[0]}")
            out[f"{prefix}switch_mlp.{proj}.weight"] = mx.stack([out.pop(k) for k in keys])
    return out


def build_mtp_module(model: Any, model_type: str, weights: MTPWeights, dtype: Any) -> MTPModule:
    """The MTP module of ``model``'s architecture filled with ``weights`` (norms made 1 + w),
    in ``dtype``. Raises :class:`MTPWeightsError` naming what is missing, extra or misshapen."""
    from mlx.utils import tree_flatten, tree_unflatten

    if model_type not in SUPPORTED_TYPES:
        raise MTPWeightsError(f"the checkpoint has mtp.* weights, but MTP drafting supports only "
                              f"{', '.join(SUPPORTED_TYPES)} (this model is {model_type!r})")
    args = text_args(model)
    layers = sorted({int(k.split(".")[1]) for k in weights.tensors if k.startswith("layers.")
                     and k.split(".")[1].isdigit()})
    if layers and layers != [0]:
        raise MTPWeightsError(f"the checkpoint has {len(layers)} MTP layers (mtp.layers.{layers}); "
                              "only checkpoints with one (mtp.layers.0) are supported")
    module = MTPModule(args.hidden_size, args.rms_norm_eps, [_layer(model_type, args)])
    quantized = sorted(k for k in weights.tensors if k.endswith((".scales", ".biases")))
    if quantized:
        raise MTPWeightsError(f"the checkpoint's MTP weights are quantized (mtp.{quantized[0]}); "
                              "MTP drafting needs them unquantized (bf16/fp16/fp32)")
    given = _fold_experts(weights.tensors)
    expected = dict(tree_flatten(module.parameters()))
    missing = sorted(set(expected) - set(given))
    extra = sorted(set(given) - set(expected))
    if missing or extra:
        what = [f"missing mtp.{k}" for k in missing[:3]] + [f"unexpected mtp.{k}" for k in extra[:3]]
        raise MTPWeightsError("the checkpoint's MTP weights do not fit this model's MTP layer: " + "; ".join(what))
    # Every RMS norm of the MTP module (not only names ending in "norm": pre_fc_norm_*).
    norms = {f"{path}.weight" for path, m in module.named_modules() if isinstance(m, nn.RMSNorm)}
    params = []
    for name, param in expected.items():
        value = given[name]
        if tuple(value.shape) != tuple(param.shape):
            raise MTPWeightsError(f"mtp.{name} has shape {tuple(value.shape)}, the model needs {tuple(param.shape)}")
        if not mx.issubdtype(value.dtype, mx.floating):
            raise MTPWeightsError(f"mtp.{name} is {value.dtype}, not a float tensor (quantized MTP is not supported)")
        if name in norms:
            value = value.astype(mx.float32) + 1.0  # zero-centred: x̂·(1 + w)
        params.append((name, value.astype(dtype)))
    module.update(tree_unflatten(params))
    module.eval()
    mx.eval(module.parameters())
    return module
