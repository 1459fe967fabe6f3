"""The "bench" model: a realistic-shape qwen3 with random weights, built offline on demand
into a git-ignored folder (``.cache/models``). Sized for the BLAS in use: about 100M
parameters with OpenBLAS, about 40M on mlx's reference BLAS.

The "copy" model has the bench model's shape, tokenizer and cost per token, but its
weights are constructed, not random: an induction circuit that continues its input the
way it went before (what prompt lookup bets on), for benchmarks of input-grounded work.

    from bench.models import bench_model_path, copy_model_path
    path = bench_model_path()      # builds it the first time (tens of seconds)
    path = copy_model_path()       # the same shape, copying its input (seconds, once)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# qwen3, hidden 1024, 8 layers, 16 query heads and 4 KV heads of 64: ~97M parameters.
OPENBLAS_SHAPE = {"hidden_size": 1024, "num_hidden_layers": 8, "intermediate_size": 3072,
                  "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64}
# Without a fast BLAS a cold 4k prefill of the big one takes minutes: ~38M parameters.
REFERENCE_SHAPE = {"hidden_size": 768, "num_hidden_layers": 6, "intermediate_size": 2048,
                   "num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": 64}


def bench_shape(blas_active: bool | None = None) -> dict:
    if blas_active is None:
        from mlxkv.engine.blas import blas_info, preload

        preload()

        blas_active = blas_info()["name"] != "reference (bundled with mlx)"
    return dict(OPENBLAS_SHAPE if blas_active else REFERENCE_SHAPE)


def bench_model_path(blas_active: bool | None = None) -> Path:
    """Folder of the bench model for the BLAS in use (built once, then reused)."""
    from mlxkv.engine.blas import preload

    preload()
    from support.modelgen import TEST_MODELS, build_random_model

    shape = bench_shape(blas_active)
    name = "bench-qwen3-h{hidden_size}-l{num_hidden_layers}-kv{num_key_value_heads}".format(
        **shape)
    return build_random_model(TEST_MODELS / name, arch="qwen3", vocab_size=2048, seed=1,
                              tie_word_embeddings=False, **shape)


def parameter_count(path: Path) -> int:
    """Parameters stored in a model folder (from the safetensors headers, no loading)."""
    import json
    import struct

    total = 0
    for f in sorted(Path(path).glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for key, meta in header.items():
            if key != "__metadata__":
                count = 1
                for d in meta["shape"]:
                    count *= d
                total += count
    return total



# ---------------------------------------------------------------------------------------
# The copy model: the bench model's shape and cost, with weights that copy their input.
# ---------------------------------------------------------------------------------------
# A random-weight model never repeats its prompt, so prompt lookup has nothing to find in
# it. This target is constructed (no training, no data): an induction circuit in its first
# two layers, and the bench model's random compute in every layer, scaled so that it
# writes next to nothing. Token t is a codeword of the extended Hamming code [16, 11, 4]
# (16 signs; the codes of two tokens agree in at most 8 places).
#
# Residual stream: dim 0 a constant every embedding carries; slot T0 the current token's
# code; T1..T10 the codes of the 10 previous tokens, written by layer 0; OUT the code of
# the token to predict, written by layer 1 and read by the LM head.
# - rope_theta = 1e30: rotary pairs 0..4 turn (1, 0.12, 0.013, 0.0015, 0.00018 rad per
#   position); pairs 6..31 turn less than 0.01 rad over the whole context, so they carry
#   content, untouched by position.
# - Layer 0, heads 0..9 (previous-token heads): query and key read only the constant, so
#   after q_norm/k_norm they are fixed vectors in the turning pairs, the query's phase
#   shifted by delta = 1..10: the score peaks at exactly delta positions back (checked for
#   every distance in the context when the weights are built). Value T0, output to T_delta.
# - Layer 1, head 0 (the induction head): query (T0, ..., T9), key (T1, ..., T10), in the
#   content pairs: it attends where the 10 tokens before were the current 10 and copies
#   that position's T0 into OUT. The current token counts with its whole code, each
#   earlier one with 4 of its 16 signs, weighted 0.85^distance: the position that agrees
#   best, nearest tokens first, wins; a novel token (an edit) still finds its place from
#   the tokens around it. A slowly turning pair prefers the earliest of equal matches (the
#   source over the model's own copy of it), by less than any differing sign costs.
# - q_norm/k_norm weights scale the scores so each softmax picks one position.
# - Every other head, the MLPs and layers 2.. keep the random model's weights, with o_proj
#   and down_proj scaled by ``noise``: the same compute per token as the bench model.
COPY_ROPE_THETA = 1e30
COPY_CONTEXT = 4096
CODE_BITS = 16
MATCH_BITS = (16,) + (4,) * 9  # signs of each matched token's code the induction head compares
MATCH_DECAY = 0.85  # weight of a matched token, per position back
_POSITION_PAIRS = (0, 1, 2, 3, 4)
_POSITION_AMPLITUDES = (0.33484269, 0.60428935, 0.35564868, 0.51399909, 0.36336442)
_ORDER_PAIR = 4  # 1.8e-4 rad per position: monotone over the whole context
_CONTENT_FIRST_PAIR = 6


def hamming_codes() -> Any:
    """All 2048 codewords of the extended Hamming code [16, 11, 4] as +-1 (numpy
    [2048, 16]): any two differ in at least 4 of the 16 places."""
    import numpy as np

    data = (np.arange(2048)[:, None] >> np.arange(11)) & 1
    word = np.zeros((2048, 16), dtype=np.int64)
    word[:, [p for p in range(1, 16) if p & (p - 1)]] = data
    for b in (1, 2, 4, 8):
        word[:, b] = word[:, [p for p in range(1, 16) if p & b and p != b]].sum(1) % 2
    word[:, 0] = word[:, 1:].sum(1) % 2
    return (1 - 2 * word).astype(np.float32)


def _position_margin(freqs: Any, deltas: range) -> float:
    """Worst margin of the previous-token heads' score (at delta, against the best other
    distance in the context), per unit query and key."""
    import numpy as np

    amp = np.array(_POSITION_AMPLITUDES) / np.linalg.norm(_POSITION_AMPLITUDES)
    f = freqs[list(_POSITION_PAIRS)]
    dist = np.arange(COPY_CONTEXT + 1)
    margin = np.inf
    for delta in deltas:
        score = (amp[:, None] * np.cos(f[:, None] * (dist[None, :] - delta))).sum(0)
        margin = min(margin, float(score[delta] - np.delete(score, delta).max()))
    return margin


def copy_weights(config: dict, seed: int = 1, noise: float = 1e-3, order_per_token: float = 0.1) -> dict:
    """The copy model's weights (name -> mx.array) for a qwen3 ``config`` with head_dim 64,
    rope_theta COPY_ROPE_THETA and an untied LM head (see the comment above)."""
    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_flatten

    from support.modelgen import init_model

    H, D = config["hidden_size"], config["head_dim"]
    n_heads, n_kv, vocab = config["num_attention_heads"], config["num_key_value_heads"], config["vocab_size"]
    half, n = D // 2, len(MATCH_BITS)
    content = [d for p in range(_CONTENT_FIRST_PAIR, half) for d in (p, p + half)]
    if D != 64 or config.get("rope_theta") != COPY_ROPE_THETA or config.get("tie_word_embeddings"):
        raise ValueError("the copy model needs head_dim 64, rope_theta COPY_ROPE_THETA and an untied LM head")
    if 1 + CODE_BITS * (n + 2) > H or n > n_heads or vocab > 2048 or config["num_hidden_layers"] < 2:
        raise ValueError(f"the copy model needs hidden >= {1 + CODE_BITS * (n + 2)}, >= {n} heads, "
                         "vocab <= 2048 and >= 2 layers")
    rng = np.random.default_rng(seed)
    codes = hamming_codes()[rng.permutation(2048)[:vocab]]
    signs = [np.arange(CODE_BITS) if b == CODE_BITS else np.sort(rng.permutation(CODE_BITS)[:b])
             for b in MATCH_BITS]  # which signs of the code each matched token contributes
    freqs = COPY_ROPE_THETA ** (-np.arange(half) / half)
    slot = [np.arange(1 + CODE_BITS * s, 1 + CODE_BITS * (s + 1)) for s in range(n + 2)]  # T0..Tn, OUT

    model = init_model(config, seed=seed)
    w = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    for k in w:
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            w[k] *= noise
    emb = np.zeros((vocab, H), np.float32)
    emb[:, 0] = 1.0
    emb[:, slot[0]] = codes
    w["model.embed_tokens.weight"] = emb

    def rms(filled: int) -> float:  # RMSNorm's divisor with the constant and ``filled`` +-1 slots
        return float(np.sqrt((1.0 + CODE_BITS * filled) / H))

    # Layer 0: previous-token heads (score = q_norm * k_norm * sqrt(D) * cos-sum, unit q and k).
    a, r = "model.layers.0.self_attn.", rms(1)
    q, k, v, o = (w[a + f"{p}_proj.weight"] for p in "qkvo")
    amp = np.array(_POSITION_AMPLITUDES) / np.linalg.norm(_POSITION_AMPLITUDES)
    for h in range(n):
        delta = h + 1
        q[h * D:(h + 1) * D] = 0.0
        for amp_i, pair in zip(amp, _POSITION_PAIRS):
            q[h * D + pair, 0] = amp_i * np.cos(-delta * freqs[pair]) * r
            q[h * D + half + pair, 0] = amp_i * np.sin(-delta * freqs[pair]) * r
        o[:, h * D:(h + 1) * D] = 0.0
        o[slot[delta], h * D + np.arange(CODE_BITS)] = 1.0
    for kv in sorted({h // (n_heads // n_kv) for h in range(n)}):
        k[kv * D:(kv + 1) * D] = 0.0
        k[kv * D + np.array(_POSITION_PAIRS), 0] = r
        v[kv * D:(kv + 1) * D] = 0.0
        v[kv * D + np.arange(CODE_BITS), slot[0]] = r
    key_unit = 1.0 / np.sqrt(len(_POSITION_PAIRS))
    w[a + "q_norm.weight"][:] = 30.0 / (np.sqrt(D) * key_unit * _position_margin(freqs, range(1, n + 1)))

    # Layer 1: the induction head (query head 0 on KV head 0), scored in units of one agreeing sign.
    a, r = "model.layers.1.self_attn.", rms(n + 1)
    q, k, v, o = (w[a + f"{p}_proj.weight"] for p in "qkvo")
    weight = [MATCH_DECAY ** s for s in range(n)]
    cheapest = 2 * min(weight)  # the least a differing sign costs
    f_order = freqs[_ORDER_PAIR]
    order_range = order_per_token * np.sin(f_order * COPY_CONTEXT) / f_order
    unit = (order_range + 30.0) / cheapest  # logits per unit
    order = order_per_token / (unit * f_order)  # units, times sin(f * distance): older scores higher
    q[0:D] = 0.0
    k[0:D] = 0.0
    at = 0
    for s, bits in enumerate(MATCH_BITS):
        dims = content[at: at + bits]
        at += bits
        q[dims, slot[s][signs[s]]] = weight[s] * r
        k[dims, slot[s + 1][signs[s]]] = r
    q[half + _ORDER_PAIR, 0] = -order * r
    k[_ORDER_PAIR, 0] = r
    v[0:D] = 0.0
    v[np.arange(CODE_BITS), slot[0]] = r
    o[:, 0:D] = 0.0
    o[slot[-1], np.arange(CODE_BITS)] = 1.0
    q_len = np.sqrt(sum(b * x * x for b, x in zip(MATCH_BITS, weight)) + order ** 2)
    k_len = np.sqrt(sum(MATCH_BITS) + 1.0)
    w[a + "q_norm.weight"][:] = unit * q_len * k_len / np.sqrt(D)

    # LM head: logit of t = 4 * <code(t), OUT>: 64 for the copied token, <= 32 for any other.
    head = np.zeros((vocab, H), np.float32)
    head[:, slot[-1]] = codes * 4.0 * rms(n + 2)
    w["lm_head.weight"] = head
    return {k: mx.array(v.astype(np.float32)) for k, v in w.items()}


def copy_config(shape: dict, vocab_size: int) -> dict:
    from support.modelgen import model_config

    return model_config("qwen3", vocab_size, rope_theta=COPY_ROPE_THETA, max_position_embeddings=COPY_CONTEXT,
                        tie_word_embeddings=False, **shape)


def build_copy_model(out_dir: str | Path, shape: dict, *, tokenizer_from: str | Path | None = None,
                     vocab_size: int = 512, seed: int = 1) -> Path:
    """A copy model folder (tokenizer, config, constructed weights); idempotent. The
    tokenizer is copied from ``tokenizer_from`` (a model folder) or trained as the test
    models' is."""
    import os
    import shutil

    import mlx.core as mx
    from mlx_lm.utils import save_config

    from support.modelgen import build_tokenizer, stdlib_corpus

    out = Path(out_dir)
    if (out / "config.json").exists() and list(out.glob("*.safetensors")):
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if tokenizer_from is not None:
        for f in Path(tokenizer_from).iterdir():
            if f.is_file() and (f.name.startswith(("tokenizer", "special_tokens")) or f.suffix == ".jinja"):
                shutil.copy2(f, tmp / f.name)
        vocab = int(json.loads((Path(tokenizer_from) / "config.json").read_text())["vocab_size"])
    else:
        vocab = build_tokenizer(tmp, stdlib_corpus(1_000_000), vocab_size=vocab_size)
    config = copy_config(shape, vocab)
    weights = copy_weights(config, seed=seed)
    mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
    save_config(dict(config), config_path=tmp / "config.json")
    if out.exists():  # a concurrent builder won the race
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        os.replace(tmp, out)
    return out


COPY_MODEL_VERSION = 2  # bump when the construction changes: the folder name carries it


def copy_model_path(blas_active: bool | None = None) -> Path:
    """Folder of the copy model for the BLAS in use: the bench model's shape, tokenizer and
    cost per token, with the induction circuit above (built once, in seconds)."""
    from support.modelgen import TEST_MODELS

    shape = bench_shape(blas_active)
    name = "bench-copy{v}-qwen3-h{hidden_size}-l{num_hidden_layers}-kv{num_key_value_heads}".format(
        v=COPY_MODEL_VERSION, **shape)
    return build_copy_model(TEST_MODELS / name, shape, tokenizer_from=bench_model_path(blas_active))


# ---------------------------------------------------------------------------------------
# The real model: SmolLM2-135M-Instruct as a GGUF file (support.real_model), beside the
# synthetic ones in every benchmark that prints a speculation, TTFT or server figure.
# ---------------------------------------------------------------------------------------
REAL_SUFFIX = "_real"
REAL_FOLDER_NOTE = ("both sides on the float32 mlx-lm folder converted from the real model's GGUF "
                    "(mlx-lm cannot read GGUF)")
REAL_GGUF_NOTE = ("the real model's GGUF file, loaded by mlxkv (dequantized to float32 on the CPU under "
                  "--dequantize auto)")


class RealModelMissing(SystemExit):
    """The real model's fixture is not there (``make fixtures`` fetches it)."""


def add_real_flag(ap: Any) -> None:
    """``--no-real``: skip the pass on the real model (argparse parser ``ap``)."""
    ap.add_argument("--no-real", action="store_true",
                    help="skip the pass on the real model (SmolLM2-135M-Instruct GGUF, fetched by make fixtures)")


def real_model_file() -> Path:
    """The real model's GGUF file; a clear error when it has not been fetched."""
    from support.real_model import FIXTURES, GGUF_NAME, real_model_path

    path = real_model_path()
    if path is None:
        raise RealModelMissing(
            f"the real model {FIXTURES / GGUF_NAME} is missing: run `make fixtures` (or "
            "`python -m support.real_model`) to fetch it, or pass --no-real to skip the real pass")
    return path


def real_model_folder() -> Path:
    """An mlx-lm folder (float32 safetensors) of the real model's weights, converted once from
    the GGUF file by ``support.gguf_files.convert_gguf`` beside it (the folder the GGUF
    tests use): what a peer that cannot read GGUF runs, and ours beside it."""
    from support.real_model import float32_folder

    return float32_folder(real_model_file())


def real_keys(figures: dict) -> dict:
    """``figures`` with every key suffixed ``_real``."""
    return {f"{k}{REAL_SUFFIX}": v for k, v in figures.items()}


if __name__ == "__main__":
    for p in (bench_model_path(), copy_model_path()):
        print(p, f"{parameter_count(p) / 1e6:.1f}M parameters")
