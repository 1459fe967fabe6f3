"""The committed demo and draft models: they load through plain mlx-lm, share one
tokenizer with a ChatML template, and the demo model answers a sample question on topic.
Also: the training corpus is generated deterministically."""

from __future__ import annotations

import json

import pytest

import engine  # noqa: F401  (loads the system BLAS before mlx.core, where present)
from engine.demo import DEMO_MODEL_DIR, DRAFT_MODEL_DIR, SAMPLE_QUESTIONS
from engine.demo.corpus import build_corpus, render
from engine.demo.facts import FACTS


@pytest.fixture(scope="module")
def demo():
    from mlx_lm import load

    return load(str(DEMO_MODEL_DIR))


@pytest.fixture(scope="module")
def draft():
    from mlx_lm import load

    return load(str(DRAFT_MODEL_DIR))


def test_model_folders_are_committed_and_small():
    for folder in (DEMO_MODEL_DIR, DRAFT_MODEL_DIR):
        weights = list(folder.glob("*.safetensors"))
        assert weights, f"no weights in {folder}"
        assert (folder / "config.json").exists() and (folder / "tokenizer.json").exists()
        assert json.loads((folder / "config.json").read_text())["model_type"] == "qwen3"
    total = sum(f.stat().st_size for d in (DEMO_MODEL_DIR, DRAFT_MODEL_DIR) for f in d.iterdir())
    assert total < 25 * 1024 * 1024, f"demo + draft folders are {total / 1e6:.1f} MB"


def test_demo_and_draft_share_the_tokenizer(demo, draft):
    _, tok = demo
    _, dtok = draft
    assert tok.vocab_size == dtok.vocab_size
    assert tok.get_vocab() == dtok.get_vocab()
    text = "How does the SSD cache work? mlxkv keeps KV blocks on disk."
    assert tok.encode(text) == dtok.encode(text)


def test_draft_is_much_smaller(demo, draft):
    from mlx.utils import tree_flatten

    def count(model):
        return sum(v.size for _, v in tree_flatten(model.parameters()))

    assert count(draft[0]) * 3 < count(demo[0])
    assert draft[0].args.vocab_size == demo[0].args.vocab_size


def test_chat_template_and_eos(demo):
    _, tok = demo
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>"
    assert tok.convert_tokens_to_ids("<|im_end|>") in tok.eos_token_ids


def test_greedy_answer_is_on_topic(demo):
    import mlx.core as mx
    from mlx_lm import generate

    model, tok = demo
    model.set_dtype(mx.float32)  # CPU compute in float32, as the engine does
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": SAMPLE_QUESTIONS[0]}], add_generation_prompt=True,
        tokenize=False)
    answer = generate(model, tok, prompt, max_tokens=60)
    words = {w.strip(".,:;!?").lower() for w in answer.split()}
    assert {"mlxkv", "cache", "mlx"} & words, answer
    assert "<|im_start|>" not in answer


def test_sample_questions_are_in_the_corpus():
    canonical = {fact["q"][0] for fact in FACTS}
    assert set(SAMPLE_QUESTIONS) <= canonical


def test_corpus_is_deterministic():
    a, b = build_corpus(seed=7), build_corpus(seed=7)
    assert a == b
    assert [render(d) for d in a.dialogues] == [render(d) for d in b.dialogues]
    c = build_corpus(seed=8)
    assert c.dialogues != a.dialogues  # the seed matters
    roles = {m["role"] for d in a.dialogues for m in d}
    assert roles == {"system", "user", "assistant"}
    assert all(d[-1]["role"] == "assistant" for d in a.dialogues)
