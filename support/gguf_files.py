"""GGUF files for tests and benchmarks: write an mlx-lm model folder as GGUF (as llama.cpp's
converter lays it out), and convert a GGUF file to an mlx-lm folder by an independent path
(the ``gguf`` package's reader and dequantization, transformers' GGUF tokenizer)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np

_LAYER = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
QTYPES = ("F32", "F16", "Q8_0", "Q4_0", "Q4_1")


def gguf_name(name: str) -> str:
    """mlx-lm parameter name -> GGUF tensor name."""
    stem, _, leaf = name.rpartition(".")
    m = re.match(r"^model\.layers\.(\d+)\.(.+)$", stem)
    if m:
        return f"blk.{m.group(1)}.{_LAYER[m.group(2)]}.{leaf}"
    return f"{_GLOBAL[stem]}.{leaf}"


def llama_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """The row order llama.cpp's converter gives llama's q/k projections."""
    return (w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def write_gguf(model_dir: str | os.PathLike, out: str | os.PathLike, qtype: str = "F32",
               overrides: dict | None = None, tensor_types: dict[str, str] | None = None,
               extra_tensors: dict[str, np.ndarray] | None = None) -> Path:
    """Write the mlx-lm model folder ``model_dir`` (llama, qwen2 or qwen3, float weights,
    byte-level BPE tokenizer) as a GGUF file whose matrices are of type ``qtype``; norms
    and biases stay F32, as llama.cpp writes them. ``overrides`` replace metadata values
    (by full key; a ``(kind, value)`` pair picks the GGUF type) or, mapped to ``None``,
    drop them; ``tensor_types`` gives some tensors (by GGUF name) another type (a name of
    ``gguf.GGMLQuantizationType``: those the gguf package cannot quantize get seeded
    random blocks); ``extra_tensors`` are added as F32 (e.g. ``rope_freqs.weight``)."""
    import gguf
    import mlx.core as mx

    src = Path(model_dir)
    config = json.loads((src / "config.json").read_text())
    arch = config["model_type"]
    weights = {}
    for f in sorted(src.glob("*.safetensors")):
        weights.update({k: np.array(v.astype(mx.float32)) for k, v in mx.load(str(f)).items()})
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads",
                                                                   config["num_attention_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    tok = json.loads((src / "tokenizer.json").read_text())
    tcfg = json.loads((src / "tokenizer_config.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    added = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
    vocab.update(added)
    tokens = [None] * (max(vocab.values()) + 1)
    for t, i in vocab.items():
        tokens[i] = t
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    types = [3 if t in added else 1 for t in tokens]
    template = tcfg.get("chat_template")
    if template is None and (src / "chat_template.jinja").is_file():
        template = (src / "chat_template.jinja").read_text()
    eos = tcfg.get("eos_token")

    meta: dict = {
        "general.name": src.name,
        f"{arch}.block_count": ("u32", config["num_hidden_layers"]),
        f"{arch}.context_length": ("u32", config.get("max_position_embeddings", 4096)),
        f"{arch}.embedding_length": ("u32", config["hidden_size"]),
        f"{arch}.feed_forward_length": ("u32", config["intermediate_size"]),
        f"{arch}.attention.head_count": ("u32", heads),
        f"{arch}.attention.head_count_kv": ("u32", kv_heads),
        f"{arch}.attention.key_length": ("u32", head_dim),
        f"{arch}.attention.value_length": ("u32", head_dim),
        f"{arch}.rope.dimension_count": ("u32", head_dim),
        f"{arch}.rope.freq_base": ("f32", config.get("rope_theta", 10000.0)),
        f"{arch}.attention.layer_norm_rms_epsilon": ("f32", config["rms_norm_eps"]),
        "tokenizer.ggml.model": "gpt2",
        # transformers reads a qwen2 folder's tokenizer with Qwen2's own split (digits one
        # by one), whatever the folder's tokenizer.json says; the file says the same.
        "tokenizer.ggml.pre": "qwen2" if arch == "qwen2" else "gpt-2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.token_type": ("i32[]", types),
        "tokenizer.ggml.add_bos_token": ("bool", False),
    }
    if eos in vocab:
        meta["tokenizer.ggml.eos_token_id"] = ("u32", vocab[eos])
    if "<|endoftext|>" in vocab:
        meta["tokenizer.ggml.padding_token_id"] = ("u32", vocab["<|endoftext|>"])
    if template:
        meta["tokenizer.chat_template"] = template
    for k, v in (overrides or {}).items():
        if v is None:
            meta.pop(k, None)
        else:
            meta[k] = v

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    w = gguf.GGUFWriter(str(tmp), arch)
    for key, value in meta.items():
        kind, value = value if isinstance(value, tuple) else (None, value)
        if kind == "u32":
            w.add_uint32(key, int(value))
        elif kind == "f32":
            w.add_float32(key, float(value))
        elif kind == "bool":
            w.add_bool(key, bool(value))
        elif kind == "i32[]":
            w.add_array(key, [int(x) for x in value])
        elif isinstance(value, list):
            w.add_array(key, value)
        else:
            w.add_string(key, str(value))
    for name in sorted(weights):
        x = weights[name]
        gname = gguf_name(name)
        if arch == "llama" and re.match(r"^blk\.\d+\.attn_[qk]\.", gname):
            x = llama_permute(x, heads if ".attn_q." in gname else kv_heads)
        kind = (tensor_types or {}).get(gname, "F32" if x.ndim == 1 else qtype)
        _add_tensor(w, gname, x, kind)
    for gname, x in (extra_tensors or {}).items():
        w.add_tensor(gname, np.asarray(x, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, out)
    return out


def _add_tensor(w, gname: str, x: np.ndarray, kind: str) -> None:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

    if kind == "F32":
        w.add_tensor(gname, x.astype(np.float32))
    elif kind == "F16":
        w.add_tensor(gname, x.astype(np.float16))
    else:
        qt = GGMLQuantizationType[kind]
        try:
            w.add_tensor(gname, quants.quantize(x, qt), raw_dtype=qt)
        except NotImplementedError:
            # Random blocks with small half-precision fields: the file is well formed, its
            # values are not the model's (for the types nothing here quantizes).
            block, size = GGML_QUANT_SIZES[qt]
            rows = int(np.prod(x.shape[:-1]))
            data = np.random.default_rng(0).integers(0, 256, (rows, x.shape[-1] // block * size),
                                                     dtype=np.uint8)
            data[:, 1::2] &= 0x1B
            w.add_tensor(gname, data.reshape(*x.shape[:-1], -1), raw_dtype=qt)


def convert_gguf(path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """An mlx-lm model folder (float32 safetensors, config.json, tokenizer files) holding
    the same model as the GGUF file at ``path``, read without the project's loader: the
    ``gguf`` package reads and dequantizes the tensors, llama's q/k rows are put back
    with the inverse of llama.cpp's permutation, transformers builds the tokenizer from
    the metadata. Written once: an existing complete folder is returned as is."""
    import mlx.core as mx
    from gguf import GGUFReader, quants

    out = Path(out_dir)
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    reader = GGUFReader(str(path))
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    arch = meta["general.architecture"]

    def a(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    heads, kv_heads = a("attention.head_count"), a("attention.head_count_kv")
    layer = {v: k for k, v in _LAYER.items()}
    glob = {v: k for k, v in _GLOBAL.items()}
    tensors = {}
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            continue
        x = quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        x = x.reshape([int(d) for d in reversed(t.shape)])
        m = re.match(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$", t.name)
        if m:
            kind = m.group(2)
            if arch == "llama" and kind in ("attn_q", "attn_k"):
                n = heads if kind == "attn_q" else kv_heads
                x = (x.reshape(n, x.shape[0] // n // 2, 2, *x.shape[1:])
                     .swapaxes(1, 2).reshape(x.shape))
            name = f"model.layers.{m.group(1)}.{layer[kind]}.{m.group(3)}"
        else:
            stem, _, leaf = t.name.rpartition(".")
            name = f"{glob[stem]}.{leaf}"
        tensors[name] = mx.array(x)
    mx.save_safetensors(str(tmp / "model.safetensors"), tensors)
    tokens = meta["tokenizer.ggml.tokens"]
    hidden = a("embedding_length")
    config = {
        "model_type": arch, "hidden_size": hidden, "num_hidden_layers": a("block_count"),
        "intermediate_size": a("feed_forward_length"), "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": a("attention.key_length", hidden // heads),
        "rms_norm_eps": a("attention.layer_norm_rms_epsilon"),
        "vocab_size": int(tensors["model.embed_tokens.weight"].shape[0]),
        "max_position_embeddings": a("context_length"), "rope_theta": a("rope.freq_base"),
        "tie_word_embeddings": "lm_head.weight" not in tensors,
    }
    if "tokenizer.ggml.eos_token_id" in meta:
        config["eos_token_id"] = int(meta["tokenizer.ggml.eos_token_id"])
    (tmp / "config.json").write_text(json.dumps(config, indent=2))

    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    tok, _ = convert_gguf_tokenizer(arch, {
        "tokenizer_type": meta["tokenizer.ggml.model"],
        "pre_tokenizer_type": meta.get("tokenizer.ggml.pre"), "tokens": tokens,
        "merges": meta["tokenizer.ggml.merges"],
        "token_type": [int(x) for x in meta.get("tokenizer.ggml.token_type", [])]})

    def token(key):
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(i)] if i is not None else None

    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=token("eos"),
                                   bos_token=token("bos"), pad_token=token("padding"))
    if meta.get("tokenizer.chat_template"):
        fast.chat_template = meta["tokenizer.chat_template"]
    fast.save_pretrained(str(tmp))
    if out.exists():
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        return out
    os.replace(tmp, out)
    return out


# Bump when write_gguf changes what it writes: cached files of an older writer are rebuilt.
WRITER_VERSION = 1


def tiny_model_dir(arch: str) -> Path:
    """The random-weight model folder of ``arch`` (llama, qwen2, qwen3) the tiny GGUF files
    are written from."""
    from support.modelgen import tiny_model, tiny_model_of_type

    return tiny_model_of_type("qwen2") if arch == "qwen2" else tiny_model(arch)


def tiny_gguf(arch: str, qtype: str = "F32") -> Path:
    """A tiny GGUF file of ``arch`` with matrices of ``qtype``, written once into the
    git-ignored test-model folder."""
    from support.modelgen import TEST_MODELS

    out = TEST_MODELS / "gguf" / f"{arch}-tiny-{qtype}-w{WRITER_VERSION}.gguf"
    if out.is_file():
        return out
    return write_gguf(tiny_model_dir(arch), out, qtype)
