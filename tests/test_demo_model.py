"""The committed demo and draft models: they load through plain mlx-lm, share one
tokenizer with a ChatML template, and the demo model answers its facts greedily: each sample
question in a six-turn conversation in any order, with or without a system prompt, and
terse or lower-case paraphrases of them, with the fact's canonical answer.
Also: the training corpus is generated deterministically."""

from __future__ import annotations

import difflib
import json
import random
import re

import pytest

from mlxkv.engine.demo import DEMO_MODEL_DIR, DRAFT_MODEL_DIR, SAMPLE_QUESTIONS
from support.demo.corpus import build_corpus, render
from support.demo.facts import FACTS

CANONICAL = {fact["q"][0]: fact["a"][0] for fact in FACTS}

# Paraphrases of each sample question: the forms people type (lower case, no punctuation,
# terse, contracted) and other phrasings of the same fact.
PARAPHRASES = {
    "What is mlxkv?": ["what's mlxkv", "what is mlxkv", "Tell me about mlxkv."],
    "How does the SSD cache work?": ["how does the ssd cache work", "How does the disk cache work?",
                                     "explain the ssd cache"],
    "How do I run the tests?": ["how do i run tests", "How can I run the test suite?", "how do I run the tests"],
    "Does speculative decoding change the output?": [
        "does speculative decoding change the output", "Is the output the same with speculative decoding?",
        "is speculative decoding lossless?"],
    "How do I use a different model?": ["how do i use another model", "How do I change the model?",
                                        "can i use another model"],
}
SYSTEM_PROMPT = "You are a helpful assistant."
MAX_TOKENS = 100  # every canonical answer is shorter; greedy decoding stops at <|im_end|>


def key_sentence(answer: str) -> str:
    """The sentence that says what the answer is about: its first one of some length
    ("No." alone says nothing)."""
    sentences = re.split(r"(?<=[.!?]) ", answer)
    return next((s for s in sentences if len(s) >= 25), sentences[0])


def carries_answer(reply: str, canonical: str) -> bool:
    """The canonical answer, or one that starts like it, holds its key sentence and differs
    from it in a few words at most (word salad, a cut-off or another fact's answer fail)."""
    reply = reply.strip()
    if reply == canonical:
        return True
    same = difflib.SequenceMatcher(None, reply.split(), canonical.split(), autojunk=False).ratio()
    return key_sentence(canonical) in reply and reply[:20] == canonical[:20] and same >= 0.9


@pytest.fixture(scope="module")
def demo():
    import mlx.core as mx
    from mlx_lm import load

    model, tok = load(str(DEMO_MODEL_DIR))
    model.set_dtype(mx.float32)  # CPU compute in float32, as the engine does
    return model, tok


@pytest.fixture(scope="module")
def draft():
    from mlx_lm import load

    return load(str(DRAFT_MODEL_DIR))


def reply(demo, messages: list[dict]) -> str:
    from mlx_lm import generate

    model, tok = demo
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return generate(model, tok, prompt, max_tokens=MAX_TOKENS)  # greedy: mlx-lm's default sampler


def converse(demo, questions: list[str], system: str | None) -> list[tuple[str, str]]:
    """Ask the questions in one conversation (each reply stays in the context)."""
    messages = [{"role": "system", "content": system}] if system else []
    turns = []
    for q in questions:
        messages.append({"role": "user", "content": q})
        answer = reply(demo, messages)
        messages.append({"role": "assistant", "content": answer})
        turns.append((q, answer))
    return turns


def six_turns(seed: int) -> list[str]:
    """The sample questions in a shuffled order, one of them asked twice."""
    rng = random.Random(seed)
    questions = SAMPLE_QUESTIONS + [rng.choice(SAMPLE_QUESTIONS)]
    rng.shuffle(questions)
    return questions


def assert_answered(turns: list[tuple[str, str]], canonical_of) -> None:
    wrong = [f"turn {i + 1}: {q!r} -> {a!r}" for i, (q, a) in enumerate(turns)
             if not carries_answer(a, canonical_of(q))]
    assert not wrong, "wrong answers:\n" + "\n".join(wrong)


def test_model_folders_are_committed_and_small():
    for folder in (DEMO_MODEL_DIR, DRAFT_MODEL_DIR):
        weights = list(folder.glob("*.safetensors"))
        assert weights, f"no weights in {folder}"
        assert (folder / "config.json").exists() and (folder / "tokenizer.json").exists()
        assert json.loads((folder / "config.json").read_text())["model_type"] == "qwen3"
        assert json.loads((folder / "generation_config.json").read_text()) == {"do_sample": False}
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


def test_draft_agrees_with_the_demo_model(demo, draft):
    """Speculative decoding with the draft gives the demo model's own answers, and the
    target accepts most of the draft's tokens (the draft learned the same answers)."""
    import mlx.core as mx
    from mlx_lm import stream_generate

    model, tok = demo
    draft[0].set_dtype(mx.float32)
    accepted = total = 0
    for q in SAMPLE_QUESTIONS:
        prompt = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                         tokenize=False)
        plain = "".join(r.text for r in stream_generate(model, tok, prompt, max_tokens=MAX_TOKENS))
        text = ""
        for r in stream_generate(model, tok, prompt, max_tokens=MAX_TOKENS, draft_model=draft[0],
                                 num_draft_tokens=3):
            text += r.text
            accepted += r.from_draft
            total += 1
        assert text == plain
    assert accepted >= 0.6 * total, f"the target accepted {accepted} of {total} tokens from the draft"


def test_chat_template_and_eos(demo):
    _, tok = demo
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>"
    assert tok.convert_tokens_to_ids("<|im_end|>") in tok.eos_token_ids


def test_answer_check_rejects_word_salad():
    canonical = CANONICAL["What is mlxkv?"]
    assert carries_answer(canonical, canonical)
    # What the previous demo model said on the fourth turn of a conversation.
    salad = ("mlxkv is a local LLM engine on MLX whose long prompts come back instantly. It keeps the "
             "tokens in the cache, mlxkv. In a content hash. A shared prefix cache of every conversation.")
    assert not carries_answer(salad, canonical)
    assert not carries_answer(CANONICAL["How do I run the tests?"], canonical)
    assert not carries_answer(canonical[: len(canonical) // 2], canonical)


@pytest.mark.parametrize("system", [None, SYSTEM_PROMPT], ids=["no-system", "system"])
@pytest.mark.parametrize("seed", [1, 2])
def test_six_turn_conversation_in_any_order(demo, seed, system):
    questions = six_turns(seed if system else seed + 10)
    assert_answered(converse(demo, questions, system), CANONICAL.__getitem__)


def test_paraphrases_are_answered(demo):
    turns = [(p, reply(demo, [{"role": "user", "content": p}]))
             for ps in PARAPHRASES.values() for p in ps]
    of = {p: CANONICAL[q] for q, ps in PARAPHRASES.items() for p in ps}
    assert_answered(turns, of.__getitem__)


def test_paraphrases_in_a_conversation(demo):
    rng = random.Random(3)
    questions = [rng.choice(ps) for ps in PARAPHRASES.values()]
    questions.append(rng.choice(questions))
    rng.shuffle(questions)
    of = {p: CANONICAL[q] for q, ps in PARAPHRASES.items() for p in ps}
    assert_answered(converse(demo, questions, None), of.__getitem__)


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
    assert all(d[-1]["role"] == "assistant" and d[-1].get("train", True) for d in a.dialogues)


def test_corpus_has_long_conversations_and_paraphrases():
    corpus = build_corpus(seed=7)
    turns = [sum(m["role"] == "user" for m in d) for d in corpus.dialogues]
    assert max(turns) >= 6 and sum(t >= 6 for t in turns) > len(turns) // 10
    asked = {m["content"] for d in corpus.dialogues for m in d if m["role"] == "user"}
    lower = {q.lower().rstrip("?") for q in SAMPLE_QUESTIONS}
    assert lower <= asked, lower - asked
    assert {"how do i run tests", "what's mlxkv"} <= asked
