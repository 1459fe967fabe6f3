"""A GGUF file's tensors as mlx arrays: Q4_0 / Q4_1 / Q8_0 stay quantized in mlx's affine
layout (``name.weight`` packed uint32, ``name.scales``, ``name.biases``, groups of 32),
float tensors stay float, other quantized types are dequantized by the ``gguf`` package."""

from __future__ import annotations

from typing import Any, cast

from .reader import GGUFError, GGUFHeader, TensorInfo

GROUP_SIZE = 32
# Types mlx's reader returns in mlx's own layout; checked against the gguf package's
# dequantization by the tests.
QUANT_BITS = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}
MLX_NATIVE = {"F32", "F16", *QUANT_BITS}


def tensor_types(header: GGUFHeader) -> dict[str, str]:
    return {name: t.type_name for name, t in header.tensors.items()}


def load_tensors(header: GGUFHeader, dequantized_dtype: Any = None) -> dict[str, Any]:
    """Every tensor of the file, keyed as mlx's reader keys them: a quantized
    ``blk.0.attn_q.weight`` gives that name (packed), ``blk.0.attn_q.scales`` and
    ``blk.0.attn_q.biases``.

    When every tensor is of a type mlx reads natively, mlx's reader loads the file (in
    C, straight into mlx arrays); otherwise each tensor is read from a memory map here,
    and the types mlx has no layout for are dequantized to ``dequantized_dtype``
    (default float16)."""
    import mlx.core as mx

    types = set(tensor_types(header).values())
    if types <= MLX_NATIVE:
        # (an Ollama blob has no .gguf suffix; without return_metadata mx.load gives the dict)
        arrays = cast("dict[str, mx.array]", mx.load(str(header.path), format="gguf"))
        missing = set(header.tensors) - set(arrays)
        if missing:
            raise GGUFError(f"{header.path}: mlx's reader returned no "
                            f"{sorted(missing)[0]!r}")
        return arrays
    return _load_mapped(header, dequantized_dtype)


def _stem(name: str) -> str:
    return name[: -len(".weight")] if name.endswith(".weight") else name


def _load_mapped(header: GGUFHeader, dequantized_dtype: Any = None) -> dict[str, Any]:
    import mlx.core as mx
    import numpy as np

    dtype = dequantized_dtype if dequantized_dtype is not None else mx.float16
    raw_file = np.memmap(header.path, dtype=np.uint8, mode="r")
    out: dict[str, Any] = {}
    for name, info in header.tensors.items():
        raw = raw_file[info.offset:info.offset + info.nbytes]
        tname = info.type_name
        if tname in QUANT_BITS:
            w, scales, biases = repack(raw, info)
            out[name] = mx.array(w)
            out[_stem(name) + ".scales"] = mx.array(scales)
            out[_stem(name) + ".biases"] = mx.array(biases)
        elif tname == "F32":
            out[name] = mx.array(np.asarray(raw).view(np.float32).reshape(info.shape))
        elif tname == "F16":
            out[name] = mx.array(np.asarray(raw).view(np.float16).reshape(info.shape))
        elif tname == "BF16":
            bits = mx.array(np.asarray(raw).view(np.uint16).reshape(info.shape))
            out[name] = bits.view(mx.bfloat16)
        else:
            out[name] = mx.array(dequantize(raw, info, header)).astype(dtype)
        del raw
    return out


def repack(raw: Any, info: TensorInfo) -> tuple[Any, Any, Any]:
    """Q4_0 / Q4_1 / Q8_0 blocks of one tensor -> (packed uint32, scales, biases), the
    layout of ``mx.quantize(w, group_size=32, bits=4 or 8)``: ``w = scale * q + bias``
    with q unsigned, packed least significant bits first."""
    import numpy as np

    *outer, cols = info.shape
    rows = int(np.prod(outer)) if outer else 1
    groups = cols // GROUP_SIZE
    tname = info.type_name
    block_bytes = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[tname]
    blocks = np.asarray(raw).reshape(rows, groups, block_bytes)
    d = np.ascontiguousarray(blocks[:, :, 0:2]).view(np.float16)[..., 0]
    if tname == "Q8_0":
        q = np.ascontiguousarray(blocks[:, :, 2:]).view(np.int8)
        packed = (q.astype(np.int16) + 128).astype(np.uint8)  # (rows, groups, 32) bytes
        scales, biases = d, (d * np.float16(-128)).astype(np.float16)
    else:
        qs = blocks[:, :, 4:] if tname == "Q4_1" else blocks[:, :, 2:]
        # ggml: element j of a block is the low nibble of byte j, element j+16 the high
        # nibble; mlx packs element 2k in the low nibble of byte k and 2k+1 in the high.
        nib = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # (rows, groups, 32)
        packed = (nib[..., 0::2] | (nib[..., 1::2] << 4)).astype(np.uint8)
        if tname == "Q4_1":
            scales = d
            biases = np.ascontiguousarray(blocks[:, :, 2:4]).view(np.float16)[..., 0]
        else:
            scales, biases = d, (d * np.float16(-8)).astype(np.float16)
    packed = np.ascontiguousarray(packed).reshape(rows, -1).view("<u4")
    shape_w = (*outer, packed.shape[-1]) if outer else (packed.shape[-1],)
    shape_g = (*outer, groups) if outer else (groups,)
    return (packed.reshape(shape_w), np.ascontiguousarray(scales).reshape(shape_g),
            np.ascontiguousarray(biases).reshape(shape_g))


def dequantize(raw: Any, info: TensorInfo, header: GGUFHeader) -> Any:
    """Any other type, dequantized (float32) by the ``gguf`` package, llama.cpp's own
    Python reference; a type it cannot dequantize is refused by name. (mlx's reader has
    dequantizers for a few of these, but its Q4_K disagrees with llama.cpp's.)"""
    import numpy as np

    try:
        from gguf import GGMLQuantizationType, quants
    except ImportError:
        raise GGUFError(f"{header.path}: tensor {info.name!r} is {info.type_name}, which "
                        "needs the 'gguf' package to dequantize (pip install gguf)") from None
    *outer, cols = info.shape
    rows = int(np.prod(outer)) if outer else 1
    try:
        values = quants.dequantize(np.asarray(raw).reshape(rows, -1),
                                   GGMLQuantizationType[info.type_name])
    except NotImplementedError:
        raise GGUFError(f"{header.path}: tensor {info.name!r} has type {info.type_name}, "
                        "which cannot be loaded (supported: F32, F16, BF16, Q4_0, Q4_1, "
                        "Q8_0, and the types the gguf package dequantizes)") from None
    return values.astype(np.float32, copy=False).reshape(info.shape)
