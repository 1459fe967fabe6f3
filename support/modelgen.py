"""Build small mlx-lm models offline: a byte-level BPE tokenizer with a chat template, and
random-weight models from mlx-lm's own model classes.

Used by the tests' fixtures, the benchmarks' "bench" model and the demo-model trainer.
Nothing here touches the network: the tokenizer is trained on local text and the weights
are random (or trained by ``support.demo.train``).
"""

from __future__ import annotations

import glob
import importlib
import json
import os
import sysconfig
from collections.abc import Iterable
from pathlib import Path

# ChatML-style template: one template for every model the project builds, so prompts
# look the same to the demo model, the draft model and the test models.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_TOKEN = "<|im_end|>"

# Architectures the project can build, with the config keys each ModelArgs needs.
BASE_CONFIGS: dict[str, dict] = {
    "qwen3": {
        "model_type": "qwen3",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
    },
    "llama": {
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    },
}


def stdlib_corpus(limit_bytes: int = 4_000_000) -> list[str]:
    """Local text that is always present: the Python standard library's own sources."""
    root = sysconfig.get_paths()["stdlib"]
    texts, total = [], 0
    for path in sorted(glob.glob(os.path.join(root, "*.py"))):
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        texts.append(text)
        total += len(text)
        if total >= limit_bytes:
            break
    return texts


def build_tokenizer(out_dir: str | os.PathLike, texts: Iterable[str], vocab_size: int = 512):
    """Train a byte-level BPE tokenizer on ``texts`` and save it in Hugging Face format
    (loadable by ``mlx_lm.load`` and by transformers 4.x and 5.x)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        bos_token=None,
        pad_token="<|endoftext|>",
        unk_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    # transformers 5 writes its own class name and puts the template in a .jinja file;
    # keep the config readable by transformers 4.x as well.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg["eos_token"] = EOS_TOKEN
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return len(tok.get_vocab())


def build_spm_tokenizer(out_dir: str | os.PathLike, texts: Iterable[str], vocab_size: int = 400,
                        trim_space: bool = True) -> Path:
    """Train a SentencePiece-style tokenizer (Llama's layout: ``▁`` for a space, BPE with
    ``<0xNN>`` byte fallback) on ``texts`` and save it in Hugging Face format. Its decoder is
    the one mlx-lm recognises as SentencePiece (with ``trim_space``: the leading space is
    stripped, the other variant keeps it)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if trim_space:
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tok.train_from_iterator(texts, trainer=trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, show_progress=False))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", bos_token=None,
                            unk_token="<unk>").save_pretrained(str(out))
    return out


def model_config(arch: str, vocab_size: int, **overrides) -> dict:
    if arch not in BASE_CONFIGS:
        raise ValueError(f"unknown architecture {arch!r}; known: {sorted(BASE_CONFIGS)}")
    cfg = dict(BASE_CONFIGS[arch])
    cfg["vocab_size"] = vocab_size
    cfg.update(overrides)
    return cfg


def init_model(config: dict, seed: int = 0, scale: float = 0.02):
    """Instantiate mlx-lm's model class for ``config`` with small random weights."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(config))
    mx.random.seed(seed)
    params = []
    for name, p in tree_flatten(model.parameters()):
        if "norm" in name and p.ndim == 1:
            params.append((name, mx.ones_like(p)))
        else:
            params.append((name, (mx.random.normal(p.shape) * scale).astype(p.dtype)))
    model.update(tree_unflatten(params))
    mx.eval(model.parameters())
    return model


def save_model_dir(model, config: dict, out_dir: str | os.PathLike) -> Path:
    from mlx_lm.utils import save_config, save_model

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_model(out, model)
    save_config(dict(config), config_path=out / "config.json")
    return out


def build_random_model(
    out_dir: str | os.PathLike,
    arch: str = "qwen3",
    vocab_size: int = 512,
    seed: int = 0,
    tokenizer_texts: Iterable[str] | None = None,
    **overrides,
) -> Path:
    """A complete model folder (tokenizer + config + random weights) for ``arch``.

    Idempotent: an existing complete folder is returned as is."""
    out = Path(out_dir)
    if (out / "config.json").exists() and list(out.glob("*.safetensors")):
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    texts = tokenizer_texts if tokenizer_texts is not None else stdlib_corpus(1_000_000)
    real_vocab = build_tokenizer(tmp, texts, vocab_size=vocab_size)
    config = model_config(arch, real_vocab, **overrides)
    save_model_dir(init_model(config, seed=seed), config, tmp)
    if out.exists():  # a concurrent builder won the race
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        return out
    os.replace(tmp, out)
    return out


def quantized_copy(source: str | os.PathLike, bits: int = 4, dtype: str | None = "bfloat16") -> Path:
    """An mlx-lm quantized folder (``bits``-bit affine, mlx-lm's default groups) of the float
    model folder ``source``, made by mlx-lm's own converter as a user's download would be
    (weights cast to ``dtype`` first, so the scales are ``dtype`` as in bf16 checkpoints);
    built once beside it as ``<name>-q<bits>``."""
    import shutil

    from mlx_lm.convert import convert

    source = Path(source)
    out = source.with_name(f"{source.name}-q{bits}")
    if (out / "config.json").exists() and list(out.glob("*.safetensors")):
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    convert(str(source), str(tmp), quantize=True, q_bits=bits, dtype=dtype)
    if out.exists():  # a concurrent builder won the race
        shutil.rmtree(tmp, ignore_errors=True)
        return out
    os.replace(tmp, out)
    return out


TEST_MODELS = Path(os.environ.get("MLXKV_TEST_MODELS",
                                  Path(__file__).resolve().parent.parent / ".cache" / "models"))


def tiny_model(arch: str, **overrides) -> Path:
    """A tiny random-weight model of ``arch`` (tests' and benchmarks' fixture), built once
    into the git-ignored ``.cache/models`` (or ``$MLXKV_TEST_MODELS``)."""
    suffix = "-".join(f"{k}{v}" for k, v in sorted(overrides.items()))
    name = f"{arch}-tiny" + (f"-{suffix}" if suffix else "")
    return build_random_model(TEST_MODELS / name, arch=arch, **overrides)


def tiny_model_of_type(model_type: str, **overrides) -> Path:
    """A tiny random-weight model of an mlx-lm architecture whose model arguments are the
    qwen3 base config's (``qwen2``: mlx-lm splits it by pipeline as well as by tensor),
    built once like :func:`tiny_model`. The folder has ``model.safetensors.index.json``,
    the weight map that mlx-lm's pipeline loading reads."""
    suffix = "-".join(f"{k}{v}" for k, v in sorted(overrides.items()))
    name = f"{model_type}-tiny" + (f"-{suffix}" if suffix else "")
    out = build_random_model(TEST_MODELS / name, arch="qwen3", model_type=model_type, **overrides)
    if not (out / "model.safetensors.index.json").is_file():
        raise RuntimeError(f"{out} has no model.safetensors.index.json (mlx-lm's save_model "
                           "writes one; a folder from elsewhere lacks it)")
    return out


# A Qwen3.5-style text config (hybrid: Gated DeltaNet layers with a full-attention layer
# every ``full_attention_interval``; 1 = every layer full attention) whose checkpoint
# carries one multi-token-prediction (MTP) layer under ``mtp.*``.
MTP_TEXT_CONFIG: dict = {
    "model_type": "qwen3_5_text",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 32768,
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "full_attention_interval": 2,
    "tie_word_embeddings": False,
    "mtp_num_hidden_layers": 1,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                        "mrope_section": [2, 1, 1]},
}
# The same trunk as Qwen3-Next: always MoE (one tensor per expert in its checkpoint), the
# MTP layer counted by num_nextn_predict_layers.
QWEN3_NEXT_CONFIG: dict = {
    **{k: v for k, v in MTP_TEXT_CONFIG.items() if k not in ("rope_parameters", "mtp_num_hidden_layers")},
    "model_type": "qwen3_next", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
    "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "norm_topk_prob": True,
    "num_nextn_predict_layers": 1,
}
# Norms Qwen3-Next / Qwen3.5 checkpoints store zero-centred (the layer computes x̂·(1 + w));
# mlx-lm adds the 1 when it loads the trunk.
_ZERO_CENTRED_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", ".q_norm.weight",
                       ".k_norm.weight", "model.norm.weight")


def mtp_weights(text_args, seed: int = 0, scale: float = 0.02, init: str = "random", arch: str = "qwen3_5") -> dict:
    """MTP weights in the checkpoint layout (``mtp.fc`` [H, 2H], the two pre-fc norms, one
    full-attention decoder layer ``mtp.layers.0.*``, ``mtp.norm``).

    ``init="random"``: random, norms zero-centred around small random offsets so that a
    forward that forgets the ``1 +`` (or swaps the two norms) gives different numbers.
    ``init="copy"``: constructed, not trained: fc passes the embedding half through, the
    layer's attention and MLP outputs are zero and the norms are plain, so with tied
    embeddings the MTP predicts that the token it is given comes again. A random tiny
    target with tied embeddings mostly repeats its last token, so this MTP is often right:
    what the tests need to exercise accepted drafts."""
    if init not in ("random", "copy"):
        raise ValueError(f"unknown MTP init {init!r} (random or copy)")
    import mlx.core as mx
    from mlx.utils import tree_flatten

    if arch == "qwen3_next":
        from mlx_lm.models.qwen3_next import Qwen3NextDecoderLayer as DecoderLayer
    else:
        from mlx_lm.models.qwen3_5 import DecoderLayer
    mx.random.seed(seed + 1)
    hidden = text_args.hidden_size
    layer = DecoderLayer(text_args, text_args.full_attention_interval - 1)
    out = {"mtp.fc.weight": mx.random.normal((hidden, 2 * hidden)) * scale}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        out[f"mtp.{name}.weight"] = mx.random.normal((hidden,)) * 0.1
    for name, p in tree_flatten(layer.parameters()):
        key = f"mtp.layers.0.{name}"
        out[key] = mx.random.normal(p.shape) * (0.1 if "norm" in name and p.ndim == 1 else scale)
    if init == "copy":
        out["mtp.fc.weight"] = mx.concatenate([mx.eye(hidden), mx.zeros((hidden, hidden))], axis=1)
        for key in list(out):
            if key.endswith(("norm.weight", "o_proj.weight", "down_proj.weight")):
                out[key] = mx.zeros_like(out[key])
    return _per_expert(out) if arch == "qwen3_next" else _fused_experts(out)


def _per_expert(weights: dict) -> dict:
    """Stacked experts as Qwen3-Next ships them: ``mlp.experts.{e}.{proj}.weight``."""
    out = dict(weights)
    for key in [k for k in out if ".mlp.switch_mlp." in k]:
        prefix, proj = key.split(".switch_mlp.")
        stacked = out.pop(key)
        for e in range(stacked.shape[0]):
            out[f"{prefix}.experts.{e}.{proj}"] = stacked[e]
    return out


def _fused_experts(weights: dict) -> dict:
    """mlx-lm's stacked MoE experts (``mlp.switch_mlp.{gate,up,down}_proj.weight``) in the
    Qwen3.5-MoE checkpoint layout (``mlp.experts.gate_up_proj`` [E, 2I, H] and
    ``mlp.experts.down_proj``), which mlx-lm's ``qwen3_5_moe`` splits again at load."""
    import mlx.core as mx

    out = dict(weights)
    for key in [k for k in out if k.endswith(".mlp.switch_mlp.gate_proj.weight")]:
        prefix = key[: -len("switch_mlp.gate_proj.weight")]
        gate, up = out.pop(key), out.pop(prefix + "switch_mlp.up_proj.weight")
        out[prefix + "experts.gate_up_proj"] = mx.concatenate([gate, up], axis=-2)
        out[prefix + "experts.down_proj"] = out.pop(prefix + "switch_mlp.down_proj.weight")
    return out


def build_mtp_checkpoint(out_dir: str | os.PathLike, vocab_size: int = 512, seed: int = 0,
                         tokenizer_texts: Iterable[str] | None = None, sidecar: bool = False,
                         mtp_init: str = "random", scale: float = 0.02, arch: str = "qwen3_5",
                         **overrides) -> Path:
    """A Qwen3.5-style (or, with ``arch="qwen3_next"``, Qwen3-Next) model folder in the
    Hugging Face checkpoint layout (what mlx-lm loads straight from a hub download):
    ``model.language_model.*`` (Qwen3-Next: ``model.*``) trunk with zero-centred norms,
    PyTorch-shaped conv1d weights and the experts as the family ships them, ``lm_head``,
    and the MTP weights under ``mtp.*``, which mlx-lm's ``sanitize`` drops. ``sidecar`` puts the MTP weights in their
    own ``mtp.safetensors`` (how a converted checkpoint keeps them) instead of
    ``model.safetensors``; ``mtp_init`` is :func:`mtp_weights`' ``init``; ``scale`` the
    trunk's weight scale (larger: the trunk strays more from its input). ``overrides``
    change ``MTP_TEXT_CONFIG`` (``QWEN3_NEXT_CONFIG``). Idempotent."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen3_5, qwen3_next

    if arch not in ("qwen3_5", "qwen3_next"):
        raise ValueError(f"unknown MTP architecture {arch!r} (qwen3_5 or qwen3_next)")

    out = Path(out_dir)
    if (out / "config.json").exists() and list(out.glob("*.safetensors")):
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    texts = tokenizer_texts if tokenizer_texts is not None else stdlib_corpus(1_000_000)
    real_vocab = build_tokenizer(tmp, texts, vocab_size=vocab_size)
    if arch == "qwen3_next":
        config = {**QWEN3_NEXT_CONFIG, "vocab_size": real_vocab, **overrides,
                  "architectures": ["Qwen3NextForCausalLM"]}
        model = init_model(config, seed=seed, scale=scale)
        mtp_args = qwen3_next.ModelArgs.from_dict(config)
    else:
        text_config = {**MTP_TEXT_CONFIG, "vocab_size": real_vocab, **overrides}
        moe = text_config.get("num_experts", 0) > 0
        model_type = "qwen3_5_moe" if moe else "qwen3_5"
        config = {"model_type": model_type,
                  "architectures": ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
                  "tie_word_embeddings": text_config["tie_word_embeddings"], "text_config": text_config}
        model = init_model({"model_type": model_type, "text_config": text_config}, seed=seed, scale=scale)
        mtp_args = qwen3_5.TextModelArgs.from_dict(text_config)
    weights = {}
    for name, p in tree_flatten(model.parameters()):
        if name.startswith("language_model.model."):
            name = "model.language_model." + name[len("language_model.model."):]
        elif name.startswith("language_model."):
            name = name[len("language_model."):]
        if name.endswith("conv1d.weight"):
            p = p.moveaxis(2, 1)  # MLX [C, K, 1] -> PyTorch [C, 1, K]
        if p.ndim == 1 and name.endswith(_ZERO_CENTRED_NORMS):
            p = p - 1.0
        weights[name] = p
    weights = _per_expert(weights) if arch == "qwen3_next" else _fused_experts(weights)
    mtp = mtp_weights(mtp_args, seed=seed, init=mtp_init, arch=arch)
    if sidecar:
        mx.save_safetensors(str(tmp / "mtp.safetensors"), mtp, metadata={"format": "pt"})
    else:
        weights.update(mtp)
    mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    if out.exists():  # a concurrent builder won the race
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        return out
    os.replace(tmp, out)
    return out


def mtp_model(arch: str = "qwen3_5", **overrides) -> Path:
    """A tiny random-weight Qwen3.5-style (or Qwen3-Next) model with MTP weights (see
    :func:`build_mtp_checkpoint`), built once into the tests' model folder."""
    suffix = "-".join(f"{k}{v}" for k, v in sorted(overrides.items()))
    name = f"{arch}-mtp-tiny" + (f"-{suffix}" if suffix else "")
    return build_mtp_checkpoint(TEST_MODELS / name, arch=arch, **overrides)
