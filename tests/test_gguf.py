"""GGUF files as mlx-lm models, on tiny files the ``gguf`` package writes from the
random-weight models: every supported architecture and quantization type gives the same
logits as mlx-lm running the same weights (read by an independent path: the gguf package's
reader and dequantization, transformers' GGUF tokenizer); the tokenizer, EOS and chat
template come from the metadata; refused types and architectures are named; hostile or
truncated files are a clear error, never a crash or a hang."""

from __future__ import annotations

import random
import struct
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm import load as mlx_lm_load

from mlxkv.engine.gguf import GGUFError, load_gguf, read_header
from mlxkv.engine.gguf.reader import GGML_TYPES
from mlxkv.engine.gguf.weights import _load_mapped
from support.gguf_files import QTYPES, convert_gguf, tiny_gguf, tiny_model_dir, write_gguf

ARCHS = ("llama", "qwen2", "qwen3")
TOKENS = mx.array([[5, 17, 99, 200, 3, 42, 64, 300, 7, 1]])
SAMPLES = ["def f(x):\n    return x ** 2  # square\n", "Größe, Übermaß — déjà vu. 12345",
           "日本語のテキスト", "<|im_start|>user\nhi<|im_end|>\n", "  two  spaces\n\n\tand a tab"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """mlx-lm's model and tokenizer for a GGUF file, by the independent conversion."""
    root = tmp_path_factory.mktemp("ref")
    made: dict[Path, tuple] = {}

    def get(path: Path) -> tuple:
        if path not in made:
            made[path] = mlx_lm_load(str(convert_gguf(path, root / path.stem)))
        return made[path]

    return get


def quantized_modules(model) -> dict[str, tuple[int, int]]:
    return {name: (m.bits, m.group_size) for name, m in model.named_modules()
            if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))}


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_each_architecture_and_type_runs_like_mlx_lm(arch, qtype, reference):
    path = tiny_gguf(arch, qtype)
    ref_model, ref_tok = reference(path)
    got = load_gguf(path)
    want = ref_model(TOKENS)
    logits = got.model(TOKENS)
    quantized = quantized_modules(got.model)
    if qtype in ("F32", "F16"):
        assert not quantized
        assert mx.array_equal(logits, want)  # the same float weights: bit for bit
    else:
        bits = 8 if qtype == "Q8_0" else 4
        # every matrix stays quantized (groups of 32), the tied or separate head included
        assert set(quantized.values()) == {(bits, 32)}
        linear = [n for n, m in ref_model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))]
        assert sorted(quantized) == sorted(linear)
        # mlx's quantized matmul against float matmul of the same values: close, not equal
        assert float(mx.max(mx.abs(logits - want))) < 2e-3 * float(mx.max(mx.abs(want)))
        # dequantized in float32, the weights are the gguf package's to the bit
        assert mx.array_equal(load_gguf(path, dequantize=mx.float32).model(TOKENS), want)
    # the config is the source folder's
    import json

    source = json.loads((tiny_model_dir(arch) / "config.json").read_text())
    for key in ("model_type", "hidden_size", "num_hidden_layers", "intermediate_size",
                "num_attention_heads", "num_key_value_heads", "tie_word_embeddings", "vocab_size"):
        assert got.config[key] == source[key], key
    # the tokenizer, its EOS and its chat template are the source folder's
    _, src_tok = mlx_lm_load(str(tiny_model_dir(arch)))
    for text in SAMPLES:
        ids = got.tokenizer.encode(text, add_special_tokens=False)
        assert ids == src_tok.encode(text, add_special_tokens=False) == ref_tok.encode(
            text, add_special_tokens=False), text
        assert got.tokenizer.decode(ids) == text
    assert got.tokenizer.eos_token_ids == src_tok.eos_token_ids
    msgs = [{"role": "user", "content": "hi"}]
    assert (got.tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
            == src_tok.apply_chat_template(msgs, add_generation_prompt=True))
    assert type(got.tokenizer.detokenizer).__name__ == "BPEStreamingDetokenizer"


def test_mlx_reader_and_the_memory_map_read_the_same_arrays(tmp_path):
    # A file with a type mlx cannot read goes through the memory map; the types it can
    # read must come out of both paths the same, to the bit.
    for qtype in QTYPES:
        path = tiny_gguf("llama", qtype)
        theirs = mx.load(str(path))
        ours = _load_mapped(read_header(path))
        assert sorted(ours) == sorted(theirs)
        for k, v in theirs.items():
            assert ours[k].dtype == v.dtype and mx.array_equal(ours[k], v), (qtype, k)


def test_types_mlx_cannot_read_are_dequantized_by_the_gguf_package(tmp_path, reference):
    # Mixed types, as a Q4_K_M file mixes them: Q4_0 matrices stay quantized, the Q5_0,
    # Q5_1 and IQ4_NL ones (an embedding of random IQ4_NL blocks: nothing here writes that
    # type) are the gguf package's dequantization.
    src = tiny_model_dir("qwen3")
    path = write_gguf(src, tmp_path / "mixed.gguf", "Q4_0", tensor_types={
        "token_embd.weight": "IQ4_NL", "blk.0.ffn_down.weight": "Q5_0", "blk.1.attn_v.weight": "Q5_1"})
    types = {t.type_name for t in read_header(path).tensors.values()}
    assert types == {"F32", "Q4_0", "Q5_0", "Q5_1", "IQ4_NL"}
    ref_model, _ = reference(path)
    got = load_gguf(path)
    quantized = quantized_modules(got.model)
    assert "model.embed_tokens" not in quantized and "model.layers.0.mlp.down_proj" not in quantized
    assert quantized["model.layers.0.mlp.up_proj"] == (4, 32)
    want = ref_model(TOKENS)
    assert float(mx.max(mx.abs(got.model(TOKENS) - want))) < 2e-3 * float(mx.max(mx.abs(want)))
    assert mx.array_equal(load_gguf(path, dequantize=mx.float32).model(TOKENS), want)


def test_a_type_nothing_can_dequantize_is_refused_by_name(tmp_path):
    path = write_gguf(tiny_model_dir("llama"), tmp_path / "q8_1.gguf", "Q4_0",
                      tensor_types={"blk.1.ffn_up.weight": "Q8_1"})
    with pytest.raises(GGUFError, match=r"'blk\.1\.ffn_up\.weight' has type Q8_1, which cannot be loaded"):
        load_gguf(path)


def test_llama_rope_factors_are_applied(tmp_path):
    # A llama 3.1 style file: the rope scaling as per-frequency factors (rope_freqs),
    # which must reproduce mlx-lm's own llama3 rotary embedding.
    import json

    from mlx_lm.models.rope_utils import Llama3RoPE

    src = tiny_model_dir("llama")
    cfg = json.loads((src / "config.json").read_text())
    dims = cfg["hidden_size"] // cfg["num_attention_heads"]
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    rope = Llama3RoPE(dims, max_position_embeddings=cfg["max_position_embeddings"],
                      base=cfg["rope_theta"], scaling_config=scaling)
    base_wavelengths = cfg["rope_theta"] ** (np.arange(0, dims, 2, dtype=np.float32) / dims)
    factors = np.array(rope._freqs) / base_wavelengths
    assert factors.max() > 7  # the scaling does something to these dims
    path = write_gguf(src, tmp_path / "rope.gguf", "F32",
                      extra_tensors={"rope_freqs.weight": factors})
    folder = tmp_path / "llama3"
    folder.mkdir()
    for f in src.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    (folder / "config.json").write_text(json.dumps({**cfg, "rope_scaling": scaling}))
    want, _ = mlx_lm_load(str(folder))
    plain, _ = mlx_lm_load(str(src))
    got = load_gguf(path).model
    long = mx.array([list(range(3, 3 + 40))])
    assert not mx.allclose(plain(long), want(long), atol=1e-4)  # the factors matter here
    assert mx.allclose(got(long), want(long), atol=1e-5)


@pytest.mark.parametrize("kind", ["linear", "yarn"])
def test_rope_scaling_from_the_metadata(kind, tmp_path):
    import json

    src = tiny_model_dir("qwen3")
    cfg = json.loads((src / "config.json").read_text())
    overrides = {"qwen3.rope.scaling.type": kind, "qwen3.rope.scaling.factor": ("f32", 4.0),
                 "qwen3.rope.scaling.original_context_length": ("u32", 32)}
    path = write_gguf(src, tmp_path / f"{kind}.gguf", overrides=overrides)
    folder = tmp_path / kind
    folder.mkdir()
    for f in src.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    scaling = {"type": kind, "factor": 4.0, **({"original_max_position_embeddings": 32}
                                                if kind == "yarn" else {})}
    (folder / "config.json").write_text(json.dumps({**cfg, "rope_scaling": scaling}))
    want, _ = mlx_lm_load(str(folder))
    plain, _ = mlx_lm_load(str(src))
    got = load_gguf(path)
    assert got.config["rope_scaling"] == scaling
    long = mx.array([list(range(3, 3 + 40))])
    assert not mx.allclose(plain(long), want(long), atol=1e-4)
    assert mx.array_equal(got.model(long), want(long))


def test_unsupported_architecture_and_tokenizer_are_named(tmp_path):
    src = tiny_model_dir("llama")
    path = write_gguf(src, tmp_path / "gemma.gguf", overrides={"general.architecture": "gemma"})
    with pytest.raises(GGUFError, match="architecture 'gemma' is not supported .*llama, qwen2, qwen3"):
        load_gguf(path)
    path = write_gguf(src, tmp_path / "spm.gguf", overrides={"tokenizer.ggml.model": "llama"})
    with pytest.raises(GGUFError, match="tokenizer kind 'llama' is not supported"):
        load_gguf(path)
    path = write_gguf(src, tmp_path / "layers.gguf", overrides={"llama.block_count": ("u32", 1 << 30)})
    t0 = time.perf_counter()
    with pytest.raises(GGUFError, match="block_count is 1073741824, the file has tensors for 2 layers"):
        load_gguf(path)
    assert time.perf_counter() - t0 < 5
    path = write_gguf(src, tmp_path / "split.gguf", overrides={"split.count": ("u32", 3)})
    with pytest.raises(GGUFError, match="one part of a model split into 3 files"):
        load_gguf(path)
    path = write_gguf(src, tmp_path / "heads.gguf", overrides={"llama.attention.head_count": ("u32", 8)})
    with pytest.raises(GGUFError):
        load_gguf(path)


def test_the_tokenizer_follows_the_metadata(tmp_path):
    src = tiny_model_dir("llama")
    _, src_tok = mlx_lm_load(str(src))
    endoftext = src_tok.convert_tokens_to_ids("<|endoftext|>")
    # an end-of-turn id ends generation as EOS does; BOS is added when the file says so
    path = write_gguf(src, tmp_path / "eot.gguf", overrides={
        "tokenizer.ggml.eot_token_id": ("u32", endoftext),
        "tokenizer.ggml.bos_token_id": ("u32", endoftext),
        "tokenizer.ggml.add_bos_token": ("bool", True)})
    tok = load_gguf(path).tokenizer
    assert tok.eos_token_ids == {*src_tok.eos_token_ids, endoftext}
    assert tok.encode("hi") == [endoftext, *src_tok.encode("hi", add_special_tokens=False)]
    # a pre-tokenizer llama.cpp knows and this loader does not: GPT-2's split, and a warning
    path = write_gguf(src, tmp_path / "pre.gguf", overrides={"tokenizer.ggml.pre": "mystery-bpe"})
    with pytest.warns(UserWarning, match="unknown pre-tokenizer 'mystery-bpe'"):
        tok = load_gguf(path).tokenizer
    for text in SAMPLES:
        assert tok.encode(text, add_special_tokens=False) == src_tok.encode(text, add_special_tokens=False)
    # no template in the file: no chat template (prompts are the plain join)
    path = write_gguf(src, tmp_path / "bare.gguf", overrides={"tokenizer.chat_template": None})
    assert not load_gguf(path).tokenizer.has_chat_template


def test_the_type_table_is_the_gguf_packages():
    from gguf import GGML_QUANT_SIZES

    assert {t.value: (t.name, *sizes) for t, sizes in GGML_QUANT_SIZES.items()} == GGML_TYPES


# hostile and broken files ----------------------------------------------------------------

def _refused(data: bytes, tmp_path: Path, needle: str = "") -> str:
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    with pytest.raises(GGUFError) as info:
        load_gguf(path)
    assert needle in str(info.value), str(info.value)
    return str(info.value)


@pytest.fixture(scope="module")
def good() -> bytes:
    return tiny_gguf("llama", "Q4_0").read_bytes()


def test_broken_headers_are_clear_errors(good, tmp_path):
    u32, u64 = (lambda v: struct.pack("<I", v)), (lambda v: struct.pack("<Q", v))
    _refused(b"", tmp_path, "too short for a header")
    _refused(b"GGUX" + good[4:], tmp_path, "not a GGUF file (starts with b'GGUX'")
    _refused(good[:4] + u32(1) + good[8:], tmp_path, "GGUF version 1 is not supported")
    _refused(good[:8] + u64(1 << 60) + good[16:], tmp_path, "claims 1152921504606846976 tensors")
    _refused(good[:16] + u64(1 << 40) + good[24:], tmp_path, "claims 1099511627776 metadata entries")
    _refused(good[:16] + u64(60000) + good[24:], tmp_path, "")  # plausible count, wrong
    _refused(good[:24] + u64(1 << 62) + good[32:], tmp_path, "metadata key 0 is 4611686018427387904 bytes long")
    _refused(good[: len(good) // 2], tmp_path, "truncated GGUF file: tensor")
    _refused(good[:-1], tmp_path, "truncated GGUF file: tensor 'output_norm.weight'")
    header = read_header(tiny_gguf("llama", "Q4_0"))
    _refused(good[: header.data_offset], tmp_path, "truncated GGUF file")


def _with_kv(good: bytes, key: str, vtype: int, payload: bytes) -> bytes:
    """``good`` with one more metadata entry (raw value bytes) after the counts."""
    n_keys = struct.unpack_from("<Q", good, 16)[0]
    entry = struct.pack("<Q", len(key)) + key.encode() + struct.pack("<I", vtype) + payload
    return good[:16] + struct.pack("<Q", n_keys + 1) + entry + good[24:]


def test_hostile_metadata_is_bounded(good, tmp_path):
    arr = lambda etype, count: struct.pack("<IQ", etype, count)  # noqa: E731
    _refused(_with_kv(good, "x.huge", 9, arr(4, 1 << 40)), tmp_path, "has 1099511627776 items")
    _refused(_with_kv(good, "x.strs", 9, arr(8, 1 << 22)), tmp_path, "strings (at most")
    _refused(_with_kv(good, "x.strs", 9, arr(8, 100_000)), tmp_path, "truncated GGUF file")
    _refused(_with_kv(good, "x.nest", 9, arr(9, 1)), tmp_path, "array of arrays")
    _refused(_with_kv(good, "x.type", 77, b""), tmp_path, "unknown value type 77")
    _refused(_with_kv(good, "x.str", 8, struct.pack("<Q", 1 << 50)), tmp_path, "bytes long")
    _refused(_with_kv(good, "x.utf8", 8, struct.pack("<Q", 2) + b"\xff\xfe"), tmp_path, "not valid UTF-8")
    _refused(_with_kv(good, "general.architecture", 8, struct.pack("<Q", 5) + b"llama"), tmp_path,
             "appears twice")
    _refused(_with_kv(good, "general.alignment", 4, struct.pack("<I", 24)), tmp_path,
             "is not a power of two")


def _tensor_entry_offset(data: bytes, name: str) -> int:
    """Where tensor ``name``'s table entry (its name's length) starts."""
    key = struct.pack("<Q", len(name)) + name.encode()
    return data.index(key)


def test_hostile_tensor_tables_are_refused(good, tmp_path):
    name = "blk.0.attn_q.weight"
    at = _tensor_entry_offset(good, name) + 8 + len(name)
    n_dims = struct.unpack_from("<I", good, at)[0]
    dims_end = at + 4 + 8 * n_dims
    patch = lambda off, raw: good[:off] + raw + good[off + len(raw):]  # noqa: E731
    _refused(patch(at, struct.pack("<I", 5)), tmp_path, "has 5 dimensions")
    _refused(patch(at + 4, struct.pack("<Q", 1 << 41)), tmp_path, "bad shape")
    _refused(patch(at + 4, struct.pack("<Q", 33)), tmp_path, "not a multiple of its block of 32")
    _refused(patch(dims_end, struct.pack("<I", 99)), tmp_path, "unknown type id 99")
    offset = struct.unpack_from("<Q", good, dims_end + 4)[0]
    _refused(patch(dims_end + 4, struct.pack("<Q", offset + 1)), tmp_path, "is not aligned")
    _refused(patch(dims_end + 4, struct.pack("<Q", 1 << 50)), tmp_path, "truncated GGUF file")
    # another tensor's data offset: two tensors on the same bytes
    other = "blk.0.attn_k.weight"
    at2 = _tensor_entry_offset(good, other) + 8 + len(other)
    end2 = at2 + 4 + 8 * struct.unpack_from("<I", good, at2)[0]
    _refused(patch(end2 + 4, struct.pack("<Q", offset)), tmp_path, "overlap")


def test_every_truncation_and_random_damage_is_an_error_or_a_model(good, tmp_path):
    # Cut the file at many points (the whole header, into the data) and flip random bytes
    # of the header: each load ends, with the model or a GGUFError; never anything else.
    header = read_header(tiny_gguf("llama", "Q4_0"))
    path = tmp_path / "cut.gguf"
    t0 = time.perf_counter()
    cuts = list(range(0, header.data_offset + 256, 29)) + [len(good) - 1]
    for n in cuts:
        path.write_bytes(good[:n])
        with pytest.raises(GGUFError):
            load_gguf(path)
    rng = random.Random(19)
    outcomes = {"model": 0, "error": 0}
    for _ in range(120):
        damaged = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            damaged[rng.randrange(header.data_offset)] = rng.randrange(256)
        path.write_bytes(bytes(damaged))
        try:
            load_gguf(path)
            outcomes["model"] += 1
        except GGUFError:
            outcomes["error"] += 1
    assert outcomes["error"] > 60, outcomes
    assert time.perf_counter() - t0 < 120


def test_a_file_that_is_not_there_or_not_a_file(tmp_path):
    with pytest.raises(GGUFError, match="cannot open"):
        read_header(tmp_path / "nope.gguf")
    with pytest.raises(GGUFError, match="cannot open"):
        read_header(tmp_path)
