"""Our streaming detokenizer (``engine.detokenize``) against mlx-lm's own, on the project's
byte-level BPE tokenizers (the test models', the demo model's) and on SentencePiece-style
ones (both of mlx-lm's variants), over multilingual and emoji text and random token
streams: the same text, never later; bytes that can no longer become UTF-8 at once."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from mlx_lm.tokenizer_utils import (
    BPEStreamingDetokenizer,
    NaiveStreamingDetokenizer,
    SPMStreamingDetokenizer,
)
from mlx_lm.tokenizer_utils import load as load_tokenizer

from mlxkv.engine.detokenize import StreamDetokenizer, stream_detokenizer
from support.modelgen import build_spm_tokenizer, stdlib_corpus, tiny_model

DEMO = Path(__file__).resolve().parents[1] / "engine" / "demo" / "model"

TEXTS = [
    "Hello, world! This is plain ASCII text.",
    " a leading space, and  two spaces,\ttabs\nand new\n\nlines ",
    "Grüße aus Köln: Äpfel, Öl, Übermaß, ß.",
    "Ça va ? Déjà vu, façade, naïve, cœur.",
    "Привет, мир! Съешь же ещё этих мягких французских булок.",
    "Καλημέρα κόσμε — ελληνικά.",
    "مرحبا بالعالم، هذا نص عربي.",
    "שלום עולם",
    "नमस्ते दुनिया, यह हिन्दी है।",
    "สวัสดีชาวโลก",
    "你好，世界！这是中文文本。",
    "こんにちは世界、日本語のテキストです。カタカナも。",
    "안녕하세요 세계, 한국어 텍스트.",
    "emoji 😀🎉👍🏽 👨‍👩‍👧‍👦 🇩🇪🇯🇵 ❤️‍🔥 done",
    "combining: e\u0301 a\u0308 n\u0303; zero\u200bwidth; math 𝔸𝔹ℂ ∑∫√",
    "def f(x):\n    return {'k': [1, 2, 3]}  # code",
]


def _corpus() -> list[str]:
    # Some of the texts above, so the tokenizer has merges for them; the rest of their
    # characters go through byte tokens.
    return stdlib_corpus(200_000) + TEXTS[:6] * 4


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("tokenizers")
    spm = build_spm_tokenizer(root / "spm", _corpus(), trim_space=True)
    spm_keep = build_spm_tokenizer(root / "spm-keep", _corpus(), trim_space=False)
    return {"bpe-test-model": load_tokenizer(tiny_model("qwen3")), "bpe-demo": load_tokenizer(DEMO),
            "spm": load_tokenizer(spm), "spm-keep-space": load_tokenizer(spm_keep)}


KINDS = ["bpe-test-model", "bpe-demo", "spm", "spm-keep-space"]


def _compare(tok, tokens: list[int]) -> str:
    """Feed ``tokens`` to mlx-lm's detokenizer and to ours; after every token mlx-lm's text
    so far is a prefix of ours (ours is never later); at the end both are the same."""
    theirs, ours = tok.detokenizer, stream_detokenizer(tok)
    segments = []
    for t in tokens:
        theirs.add_token(t)
        ours.add_token(t)
        segments.append(ours.last_segment)
        assert ours.text.startswith(theirs.text), (tokens, theirs.text, ours.text)
    theirs.finalize()
    ours.finalize()
    segments.append(ours.last_segment)
    assert ours.text == theirs.text
    assert "".join(segments) == ours.text
    assert ours.tokens == tokens
    return ours.text


def test_mlx_lm_picks_the_kinds_ours_covers(tokenizers):
    assert type(tokenizers["bpe-test-model"].detokenizer) is BPEStreamingDetokenizer
    assert type(tokenizers["bpe-demo"].detokenizer) is BPEStreamingDetokenizer
    assert type(tokenizers["spm"].detokenizer) is SPMStreamingDetokenizer
    assert tokenizers["spm"].detokenizer.trim_space
    assert not tokenizers["spm-keep-space"].detokenizer.trim_space
    for kind in KINDS:
        assert isinstance(stream_detokenizer(tokenizers[kind]), StreamDetokenizer)


@pytest.mark.parametrize("kind", KINDS)
def test_multilingual_and_emoji_text_is_mlx_lms(tokenizers, kind):
    tok = tokenizers[kind]
    byte_pieces = 0
    for text in TEXTS:
        tokens = tok.encode(text, add_special_tokens=False)
        byte_pieces += sum(p.startswith("<0x") for p in tok.convert_ids_to_tokens(tokens))
        out = _compare(tok, tokens)
        assert out.strip() == tok.decode(tokens).strip()  # and it is the text
    if kind.startswith("spm"):
        assert byte_pieces > 20  # the scripts it was not trained on went through byte tokens


@pytest.mark.parametrize("kind", KINDS)
def test_random_token_streams_are_mlx_lms(tokenizers, kind):
    tok = tokenizers[kind]
    vocab = len(tok)
    for seed in range(300):
        rng = random.Random(seed)
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        _compare(tok, tokens)


@pytest.mark.parametrize("kind", KINDS)
def test_a_text_cut_anywhere_inside_a_character_comes_out_whole(tokenizers, kind):
    # Emoji and CJK split into byte tokens: every prefix of the stream is mlx-lm's or ahead.
    tok = tokenizers[kind]
    tokens = tok.encode(TEXTS[13] + TEXTS[10], add_special_tokens=False)
    for cut in range(1, len(tokens) + 1):
        _compare(tok, tokens[:cut])


def test_a_stray_byte_is_released_at_once_in_sentencepiece(tokenizers):
    tok = tokenizers["spm"]
    stray = tok.convert_tokens_to_ids("<0x86>")  # a continuation byte: never starts a character
    lead = tok.convert_tokens_to_ids("<0xE6>")  # starts a three-byte sequence
    word = tok.encode("hello", add_special_tokens=False)
    theirs = tok.detokenizer
    theirs.add_token(stray)
    assert theirs.last_segment == ""  # mlx-lm's holds it
    ours = stream_detokenizer(tok)
    ours.add_token(stray)
    assert ours.last_segment == "\ufffd"
    ours = stream_detokenizer(tok)
    ours.add_token(lead)
    assert ours.last_segment == ""  # may still complete: held
    assert _compare(tok, [stray] + word) == _compare(tok, [lead] + word) == "\ufffd hello"


def test_an_id_past_the_vocabulary_reads_as_mlx_lm_reads_it(tokenizers):
    tok = tokenizers["bpe-test-model"]
    _compare(tok, tok.encode("ab", add_special_tokens=False) + [len(tok) + 5])


def test_other_tokenizers_keep_mlx_lms_detokenizer(tmp_path: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(TEXTS, trainer=trainers.WordPieceTrainer(
        vocab_size=300, special_tokens=["[UNK]"], show_progress=False))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(str(tmp_path))
    wrapper = load_tokenizer(tmp_path)
    assert type(stream_detokenizer(wrapper)) is NaiveStreamingDetokenizer


@pytest.mark.parametrize("kind", ["bpe-test-model", "bpe-demo"])
def test_a_lone_space_first_trims_as_mlx_lm_trims(tokenizers, kind):
    # mlx-lm holds a lone-space token and trims one space off the text's start: two
    # spaces there leave one.
    tok = tokenizers[kind]
    space = tok.convert_tokens_to_ids("Ġ")
    word = tok.encode(" hello", add_special_tokens=False)
    assert _compare(tok, [space] + word) == " hello"
    assert _compare(tok, [space, space] + word) == "  hello"
    assert _compare(tok, [space]) == ""
