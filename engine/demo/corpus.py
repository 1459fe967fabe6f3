"""The demo model's training corpus, generated offline and deterministically.

Question/answer dialogues about mlxkv itself (many paraphrased questions per fact,
several answer phrasings), some general small talk, plain project prose, and a little
Python standard library docstring text (PSF-licensed) as English filler.

``build_corpus(seed)`` returns the same corpus for the same seed on the same Python.
"""

from __future__ import annotations

import importlib
import inspect
import random
from dataclasses import dataclass

from engine.demo.facts import FACTS, PROSE, SMALL_TALK

# Short system prompts a front end might send; most dialogues have none.
SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are the mlxkv demo model. Answer briefly.",
    "You are a helpful assistant that answers questions about mlxkv.",
]

# Ways people wrap a question; the empty wrapper dominates.
PREFIXES = ["", "", "", "", "Hi! ", "Hello, ", "Quick question: ", "Hey, ", "Please tell me: ",
            "I have a question. ", "Can you help? "]

# How often a paraphrased question gets the canonical answer rather than another phrasing.
CANONICAL_SHARE = 0.6

# Modules whose docstrings are stable across Python versions (English filler).
STDLIB_MODULES = ["textwrap", "string", "json", "heapq", "bisect", "queue", "threading",
                  "functools", "collections", "shutil", "tempfile", "pathlib", "difflib"]


@dataclass(frozen=True)
class Corpus:
    dialogues: list[list[dict]]  # chat messages: [{"role": ..., "content": ...}, ...]
    texts: list[str]  # plain text trained on every token


def _variants(question: str, rng: random.Random) -> str:
    """One surface variant of a question: wrapper, case and final punctuation."""
    q = question
    if rng.random() < 0.15:
        q = q.rstrip("?.!")
    if rng.random() < 0.12:
        q = q[0].lower() + q[1:]
    prefix = rng.choice(PREFIXES)
    if prefix and q[:1].isupper() and not q.startswith(("I ", "I'", "MLX", "SSD", "RAM", "TUI")):
        q = q[0].lower() + q[1:]
    return prefix + q


def _pick_answer(answers: list[str], rng: random.Random, canonical: bool = False) -> str:
    """The canonical (first) answer most of the time: a small model memorizes one phrasing
    per fact far faster than several equally likely ones, and greedy decoding follows it."""
    if canonical or len(answers) == 1 or rng.random() < CANONICAL_SHARE:
        return answers[0]
    return rng.choice(answers[1:])


def _dialogues(rng: random.Random, repeats: int) -> list[list[dict]]:
    out: list[list[dict]] = []
    for fact in FACTS:
        questions, answers = fact["q"], fact["a"]
        for _ in range(repeats):
            for i, q in enumerate(questions):
                # The canonical question (first) is always asked as written, so the
                # README's sample questions are answered from the first phrasing.
                text = q if i == 0 else _variants(q, rng)
                answer = _pick_answer(answers, rng, canonical=i == 0)
                msgs = []
                if rng.random() < 0.12:
                    msgs.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
                msgs += [{"role": "user", "content": text},
                         {"role": "assistant", "content": answer}]
                out.append(msgs)
    for _ in range(repeats):
        for talk in SMALL_TALK:
            for q in talk["q"]:
                out.append([{"role": "user", "content": q},
                            {"role": "assistant", "content": rng.choice(talk["a"])}])
    # Two-turn conversations: a follow-up question after a first answer.
    for _ in range(len(FACTS) * repeats // 2):
        f1, f2 = rng.sample(FACTS, 2)
        out.append([
            {"role": "user", "content": rng.choice(f1["q"])},
            {"role": "assistant", "content": _pick_answer(f1["a"], rng)},
            {"role": "user", "content": rng.choice(f2["q"])},
            {"role": "assistant", "content": _pick_answer(f2["a"], rng)},
        ])
    rng.shuffle(out)
    return out


def stdlib_docstrings(limit_chars: int = 60_000) -> list[str]:
    """First paragraphs of docstrings from a fixed list of standard library modules."""
    texts, total = [], 0
    for name in STDLIB_MODULES:
        mod = importlib.import_module(name)
        for attr in sorted(vars(mod)):
            obj = getattr(mod, attr)
            if attr.startswith("_") or getattr(obj, "__module__", None) != name:
                continue
            doc = inspect.getdoc(obj) or ""
            para = doc.split("\n\n")[0].replace("\n", " ").strip()
            if len(para) < 40 or not para[0].isupper():
                continue
            texts.append(para)
            total += len(para)
            if total >= limit_chars:
                return texts
    return texts


def build_corpus(seed: int = 0, repeats: int = 1, stdlib_chars: int = 0) -> Corpus:
    """The training corpus; deterministic for a given seed (and, with ``stdlib_chars`` > 0,
    for a given Python version). The demo model trains without the stdlib filler: at its
    size every token of capacity goes to the project's own answers."""
    rng = random.Random(seed)
    dialogues = _dialogues(rng, repeats)
    filler = stdlib_docstrings(stdlib_chars) if stdlib_chars else []
    return Corpus(dialogues=dialogues, texts=list(PROSE) + filler)


def render(messages: list[dict]) -> str:
    """Messages in the project's chat format (the same string CHAT_TEMPLATE produces)."""
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def tokenizer_texts(corpus: Corpus, stdlib_chars: int = 20_000) -> list[str]:
    """Text the tokenizer is trained on: each distinct question and answer, the plain
    texts, and a little stdlib docstring English for general words."""
    seen: dict[str, None] = {}
    for f in FACTS + SMALL_TALK:
        for s in f["q"] + f["a"]:
            seen[s] = None
    return list(seen) + corpus.texts + stdlib_docstrings(stdlib_chars)
