"""Build small mlx-lm models offline: a byte-level BPE tokenizer with a chat template, and
random-weight models from mlx-lm's own model classes.

Used by the tests' fixtures, the benchmarks' "bench" model and the demo-model trainer.
Nothing here touches the network: the tokenizer is trained on local text and the weights
are random (or trained by ``engine.demo.train``).
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


TEST_MODELS = Path(os.environ.get("MLXKV_TEST_MODELS",
                                  Path(__file__).resolve().parent.parent / ".cache" / "models"))


def tiny_model(arch: str, **overrides) -> Path:
    """A tiny random-weight model of ``arch`` (tests' and benchmarks' fixture), built once
    into the git-ignored ``.cache/models`` (or ``$MLXKV_TEST_MODELS``)."""
    suffix = "-".join(f"{k}{v}" for k, v in sorted(overrides.items()))
    name = f"{arch}-tiny" + (f"-{suffix}" if suffix else "")
    return build_random_model(TEST_MODELS / name, arch=arch, **overrides)
