"""The tokenizer a GGUF file's metadata describes, as an mlx-lm ``TokenizerWrapper``:
byte-level BPE from ``tokenizer.ggml.tokens`` / ``merges`` (the ``tokenizers`` library),
llama.cpp's pre-tokenizer split for ``tokenizer.ggml.pre``, the control tokens whole,
the chat template and end-of-sequence ids from the metadata."""

from __future__ import annotations

import warnings
from typing import Any

from .reader import GGUFError, GGUFHeader

# llama.cpp token types.
NORMAL, CONTROL, USER_DEFINED = 1, 3, 4

# Pre-tokenizer splits by ``tokenizer.ggml.pre``, as the models' own tokenizer.json
# files write them (the expressions llama.cpp adapts for its own regex engine).
_GPT2 = (r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+")
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DIGITS = r"\p{N}"
# name -> (splits applied in turn, ignore_merges: whole-vocabulary words skip BPE)
PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool]] = {
    "gpt-2": ((_GPT2,), False), "gpt2": ((_GPT2,), False), "phi-2": ((_GPT2,), False),
    "olmo": ((_GPT2,), False), "mpt": ((_GPT2,), False),
    "llama3": ((_LLAMA3,), True), "llama-v3": ((_LLAMA3,), True),
    "llama-bpe": ((_LLAMA3,), True), "falcon3": ((_LLAMA3,), True),
    "dbrx": ((_LLAMA3,), False), "smaug-bpe": ((_LLAMA3,), False),
    "qwen2": ((_QWEN2,), False), "stablelm2": ((_QWEN2,), False),
    "megrez": ((_QWEN2,), False), "deepseek-r1-qwen": ((_QWEN2,), False),
    "smollm": ((_DIGITS, _GPT2), False), "starcoder": ((_DIGITS, _GPT2), False),
    "refact": ((_DIGITS, _GPT2), False), "codeshell": ((_DIGITS, _GPT2), False),
}


def _special_ids(header: GGUFHeader, vocab_size: int) -> dict[str, int]:
    ids = {}
    for name in ("bos", "eos", "eot", "eom", "unknown", "padding"):
        value = header.get(f"tokenizer.ggml.{name}_token_id")
        if value is None:
            continue
        value = int(value)
        if not 0 <= value < vocab_size:
            raise GGUFError(f"{header.path}: tokenizer.ggml.{name}_token_id {value} is "
                            f"outside the vocabulary of {vocab_size}")
        ids[name] = value
    return ids


def build_tokenizer(header: GGUFHeader) -> Any:
    """``TokenizerWrapper`` for the file's tokenizer (``tokenizer.ggml.model`` "gpt2",
    byte-level BPE; other kinds are refused by name)."""
    try:
        return _build(header)
    except GGUFError:
        raise
    except Exception as e:  # what the tokenizers library makes of odd tokens or merges
        raise GGUFError(f"{header.path}: cannot build the tokenizer from the metadata "
                        f"({type(e).__name__}: {e})") from None


def _build(header: GGUFHeader) -> Any:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = header.get("tokenizer.ggml.model")
    if kind is None:
        raise GGUFError(f"{header.path}: the file has no tokenizer (tokenizer.ggml.model)")
    if kind != "gpt2":
        raise GGUFError(f"{header.path}: tokenizer kind {kind!r} is not supported "
                        "(byte-level BPE, 'gpt2', is)")
    tokens = header.get("tokenizer.ggml.tokens")
    merges = header.get("tokenizer.ggml.merges")
    if not isinstance(tokens, list) or not tokens:
        raise GGUFError(f"{header.path}: tokenizer.ggml.tokens is missing or empty")
    if not isinstance(merges, list):
        raise GGUFError(f"{header.path}: tokenizer.ggml.merges is missing")
    types = header.get("tokenizer.ggml.token_type")
    types = [int(t) for t in types] if types is not None else [NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise GGUFError(f"{header.path}: {len(types)} token types for {len(tokens)} tokens")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise GGUFError(f"{header.path}: tokenizer.ggml.tokens lists a token twice")
    pairs = []
    for i, m in enumerate(merges):
        parts = m.split(" ")
        if len(parts) != 2:
            raise GGUFError(f"{header.path}: merge {i} ({m!r}) is not two tokens")
        pairs.append((parts[0], parts[1]))
    pre = header.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        warnings.warn(f"{header.path.name}: unknown pre-tokenizer {pre!r}; splitting text "
                      "as GPT-2 does", stacklevel=2)
    splits, ignore_merges = PRE_TOKENIZERS.get(pre, ((_GPT2,), False))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=ignore_merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    special = [AddedToken(t, special=True, normalized=False)
               for t, ty in zip(tokens, types) if ty == CONTROL]
    user = [AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, types) if ty == USER_DEFINED]
    if special:
        tok.add_special_tokens(special)
    if user:
        tok.add_tokens(user)
    ids = _special_ids(header, len(tokens))
    add_bos = header.get("tokenizer.ggml.add_bos_token")
    if add_bos is None:
        add_bos = pre in ("llama3", "llama-v3", "llama-bpe", "falcon3")
    if bool(add_bos) and "bos" in ids:
        bos = tokens[ids["bos"]]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, ids["bos"])])
    return _wrap(header, tok, tokens, ids, [t.content for t in special])


def _wrap(header: GGUFHeader, tok: Any, tokens: list[str], ids: dict[str, int],
          control: list[str]) -> Any:
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper
    from transformers import PreTrainedTokenizerFast

    def name(key: str) -> str | None:
        return tokens[ids[key]] if key in ids else None

    named = {name(k) for k in ("bos", "eos", "unknown", "padding")}
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=name("bos"), eos_token=name("eos"),
        unk_token=name("unknown"), pad_token=name("padding"),
        # the control tokens are special to transformers too (all_special_tokens lists them)
        additional_special_tokens=[t for t in control if t not in named])
    template = header.get("tokenizer.chat_template")
    if isinstance(template, str) and template.strip():
        fast.chat_template = template
    eos = [ids[k] for k in ("eos", "eot", "eom") if k in ids]
    kwargs: dict[str, Any] = {}
    try:  # mlx-lm's own tool-call format detection, as its loader runs it
        import importlib

        from mlx_lm.tokenizer_utils import _infer_tool_parser

        parser = _infer_tool_parser(fast)
        if parser is not None:
            mod = importlib.import_module(f"mlx_lm.tool_parsers.{parser}")
            kwargs = {"tool_parser": mod.parse_tool_call,
                      "tool_call_start": mod.tool_call_start,
                      "tool_call_end": mod.tool_call_end}
    except ImportError:
        pass
    return TokenizerWrapper(fast, BPEStreamingDetokenizer, eos_token_ids=eos, **kwargs)
