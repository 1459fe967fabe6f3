"""Which way a model is split across the ranks, and loading this rank's shard.

mlx-lm does the splitting (``mlx_lm.utils.sharded_load``): tensor parallelism through the
model's ``shard(group)`` (every layer's projections split; each rank holds
``1/size`` of the attention heads, so its KV cache is its heads' share), pipeline
parallelism through ``model.model.pipeline(group)`` (each rank runs a contiguous run of
layers; its KV cache holds only those layers; rank 0 runs the last ones). Which an
architecture has depends on mlx-lm's model class: qwen2 has both, qwen3 and llama only
tensor in mlx-lm 0.32. ``--shard auto`` takes tensor when it can, else pipeline.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mlxkv.engine.distributed import DistributedError

MODES = ("tensor", "pipeline")
TAGS = {"tensor": "tp", "pipeline": "pp"}  # in the cache namespace: -tp2r0, -pp2r1
WEIGHT_INDEX = "model.safetensors.index.json"


def supported_modes(model: Any) -> list[str]:
    """The ways mlx-lm can split ``model`` (an instance of its model class)."""
    modes = []
    if hasattr(model, "shard"):
        modes.append("tensor")
    if hasattr(getattr(model, "model", None), "pipeline"):
        modes.append("pipeline")
    return modes


def _text_config(config: dict) -> dict:
    return {**config, **(config.get("text_config") or {})}


def why_not(mode: str, config: dict, path: Path, size: int) -> str | None:
    """What keeps ``mode`` from splitting this model over ``size`` ranks (None: nothing)."""
    cfg = _text_config(config)
    if mode == "tensor":
        for key in ("num_attention_heads", "num_key_value_heads"):
            n = cfg.get(key)
            if isinstance(n, int) and n % size:
                return f"its {n} {key.removeprefix('num_').replace('_', ' ')} do not divide by {size} ranks"
        return None
    layers = cfg.get("num_hidden_layers")
    if isinstance(layers, int) and layers < size:
        return f"it has {layers} layers for {size} ranks"
    if not (path / WEIGHT_INDEX).is_file():
        return f"the model folder has no {WEIGHT_INDEX} (the weight map pipeline loading reads)"
    return None


def choose_mode(asked: str, modes: list[str], config: dict, path: Path, size: int,
                rank: int) -> str:
    """The sharding to use: ``asked`` ("auto", "tensor" or "pipeline"), or a clear
    :class:`DistributedError` naming the model type and what it supports."""
    model_type = _text_config(config).get("model_type") or config.get("model_type") or "?"
    if not modes:
        raise DistributedError(
            f"rank {rank}: the model type {model_type!r} cannot be split across ranks: mlx-lm "
            "has neither tensor nor pipeline sharding for it")
    if asked == "auto":
        reasons = []
        for mode in MODES:
            if mode in modes:
                reason = why_not(mode, config, path, size)
                if reason is None:
                    return mode
                reasons.append(f"{mode}: {reason}")
        raise DistributedError(f"rank {rank}: the model type {model_type!r} cannot be split "
                               f"over {size} ranks ({'; '.join(reasons)})")
    if asked not in modes:
        raise DistributedError(
            f"rank {rank}: the model type {model_type!r} cannot be split by {asked} sharding: "
            f"mlx-lm supports {' and '.join(modes)} for it (--shard {modes[0]})")
    reason = why_not(asked, config, path, size)
    if reason is not None:
        raise DistributedError(f"rank {rank}: {asked} sharding cannot split the model type "
                               f"{model_type!r} over {size} ranks: {reason}")
    return asked


def shard_namespace(namespace: str, mode: str, size: int, rank: int) -> str:
    """The prefix-cache namespace of this rank's shard: a shard never seeds another."""
    return f"{namespace}-{TAGS[mode]}{size}r{rank}"


def load_shard(spec: str, dtype: str, full_hash: bool, world: Any, asked: str) -> Any:
    """This rank's shard of model ``spec`` as an ``engine.models.LoadedModel`` (its
    ``extra`` says ``shard``, ``rank`` and ``world``). Every rank must call it: loading
    ends with a collective."""
    import mlx.core as mx
    from mlx_lm.utils import load_model as lazy_model
    from mlx_lm.utils import sharded_load

    from mlxkv.engine.models import (
        LoadedModel,
        ModelNotFoundError,
        apply_dtype_policy,
        model_fingerprint,
        resolve_model_path,
        weights_dtype,
    )

    path = resolve_model_path(spec)
    if path.is_file():
        raise ModelNotFoundError(f"{path}: a GGUF file is not split across ranks (mlx-lm's "
                                 "sharded loading reads model folders); convert it to a folder")
    config = json.loads((path / "config.json").read_text())
    skeleton, _ = lazy_model(path, lazy=True, strict=False)
    mode = choose_mode(asked, supported_modes(skeleton), config, path, world.size, world.rank)
    del skeleton
    group = world.group
    model, tokenizer, config = sharded_load(
        str(path), pipeline_group=group if mode == "pipeline" else None,
        tensor_group=group if mode == "tensor" else None, return_config=True)
    native = weights_dtype(model)
    compute = apply_dtype_policy(model, dtype)
    mx.eval(model.parameters())
    return LoadedModel(model=model, tokenizer=tokenizer, config=config, path=path, spec=str(spec),
                       fingerprint=model_fingerprint(path, full_hash), weights_dtype=native,
                       compute_dtype=compute,
                       extra={"shard": mode, "rank": world.rank, "world": world.size})
