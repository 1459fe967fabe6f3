"""The demo model's training corpus, generated offline and deterministically.

Multi-turn chat dialogues about mlxkv itself: each dialogue has one to MAX_TURNS user
turns, each turn a question about a random fact (or small talk) in a random surface form
(the phrasings in facts.py, lower-cased, without punctuation, contracted, wrapped in a
greeting), answered with that fact's canonical answer. Every answer in a dialogue is trained
on, so the model learns to answer the last question whatever came before it. Plain project
prose rides along; with ``stdlib_chars`` > 0 a little Python standard library docstring text
(PSF-licensed) too, as English filler.

``build_corpus(seed)`` returns the same corpus for the same seed on the same Python.
"""

from __future__ import annotations

import importlib
import inspect
import random
import re
from dataclasses import dataclass

from support.demo.facts import FACTS, PROSE, SMALL_TALK

# Short system prompts a front end might send; about a third of the dialogues have one.
SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are the mlxkv demo model. Answer briefly.",
    "You are a helpful assistant that answers questions about mlxkv.",
    "You are a friendly assistant.",
]
SYSTEM_SHARE = 0.35

# Ways people wrap a question (a few turns only).
PREFIXES = ["Hi! ", "Hello, ", "Quick question: ", "Hey, ", "Please tell me: ", "I have a question. ",
            "Can you help? ", "ok, ", "Another question: ", "And "]
CONTRACTIONS = [(r"\b([Ww]hat|[Ww]here|[Hh]ow|[Ww]ho) is\b", r"\1's"), (r"\bdo not\b", "don't"),
                (r"\bdoes not\b", "doesn't"), (r"\bI am\b", "I'm")]

# Dialogue length in user turns: every length up to MAX_TURNS, long ones as often as short.
MAX_TURNS = 7
# The README's sample questions are about the first facts; they come up more often.
SAMPLE_FACTS, SAMPLE_WEIGHT = 5, 3.0
SMALL_TALK_WEIGHT = 0.6  # per small-talk topic, against 1.0 per fact
CANONICAL_QUESTION_SHARE = 0.25  # a turn asks the fact's canonical question exactly as written
# An earlier turn sometimes carries another phrasing of its answer (as after sampling); those
# answers are context only, never trained on: greedy decoding should say the canonical one.
ALT_CONTEXT_SHARE = 0.15
N_TURNS = 20_000  # user turns in the whole corpus

# Modules whose docstrings are stable across Python versions (English filler).
STDLIB_MODULES = ["textwrap", "string", "json", "heapq", "bisect", "queue", "threading",
                  "functools", "collections", "shutil", "tempfile", "pathlib", "difflib"]


@dataclass(frozen=True)
class Corpus:
    # chat messages: {"role": ..., "content": ...}; an assistant message with "train": False
    # is context only (no loss on it)
    dialogues: list[list[dict]]
    texts: list[str]  # plain text trained on every token


def question_variant(question: str, rng: random.Random) -> str:
    """One surface form of a question: contractions, a dropped "the", no final
    punctuation, lower case, a greeting in front; each independently now and then."""
    q = question
    if rng.random() < 0.25:
        for pattern, repl in CONTRACTIONS:
            q = re.sub(pattern, repl, q)
    if rng.random() < 0.15:
        q = re.sub(r"\bthe ", "", q, count=1)
    if rng.random() < 0.35:
        q = q.rstrip("?.!")
    r = rng.random()
    if r < 0.35:
        q = q.lower()
    elif r < 0.5 and not q.startswith(("I ", "I'", "MLX", "SSD", "RAM", "TUI", "KV")):
        q = q[0].lower() + q[1:]
    if rng.random() < 0.12:
        prefix = rng.choice(PREFIXES)
        if q[:1].isupper() and not q.startswith(("I ", "I'", "MLX", "SSD", "RAM", "TUI", "KV")):
            q = q[0].lower() + q[1:]
        q = prefix + q
    return q or question


def _turn(rng: random.Random, topics: list[dict], weights: list[float], last: bool) -> list[dict]:
    topic = rng.choices(topics, weights)[0]
    questions, answers = topic["q"], topic["a"]
    if rng.random() < CANONICAL_QUESTION_SHARE:
        question = questions[0]
    else:
        question = question_variant(rng.choice(questions), rng)
    answer = {"role": "assistant", "content": answers[0]}
    if not last and len(answers) > 1 and rng.random() < ALT_CONTEXT_SHARE:
        answer = {"role": "assistant", "content": rng.choice(answers[1:]), "train": False}
    return [{"role": "user", "content": question}, answer]


def _dialogues(rng: random.Random, n_turns: int) -> list[list[dict]]:
    topics = FACTS + SMALL_TALK
    weights = ([SAMPLE_WEIGHT] * SAMPLE_FACTS + [1.0] * (len(FACTS) - SAMPLE_FACTS)
               + [SMALL_TALK_WEIGHT] * len(SMALL_TALK))
    out: list[list[dict]] = []
    turns = 0
    while turns < n_turns:
        k = rng.randint(1, MAX_TURNS)
        msgs = []
        if rng.random() < SYSTEM_SHARE:
            msgs.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        for t in range(k):
            msgs += _turn(rng, topics, weights, last=t == k - 1)
        out.append(msgs)
        turns += k
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


def build_corpus(seed: int = 0, n_turns: int = N_TURNS, stdlib_chars: int = 0) -> Corpus:
    """The training corpus; deterministic for a given seed (and, with ``stdlib_chars`` > 0,
    for a given Python version). The demo model trains without the stdlib filler: at its
    size every token of capacity goes to the project's own answers."""
    rng = random.Random(seed)
    dialogues = _dialogues(rng, n_turns)
    filler = stdlib_docstrings(stdlib_chars) if stdlib_chars else []
    return Corpus(dialogues=dialogues, texts=list(PROSE) + filler)


def render(messages: list[dict]) -> str:
    """Messages in the project's chat format (the same string CHAT_TEMPLATE produces)."""
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def tokenizer_texts(corpus: Corpus, stdlib_chars: int = 20_000) -> list[str]:
    """Text the tokenizer is trained on: each distinct question and answer, the questions
    as the dialogues ask them (lower-cased ones too, so those get whole-word tokens), the
    plain texts, and a little stdlib docstring English for general words."""
    seen: dict[str, None] = {}
    for f in FACTS + SMALL_TALK:
        for s in f["q"] + f["a"]:
            seen[s] = None
    for d in corpus.dialogues:
        for m in d:
            if m["role"] == "user":
                seen[m["content"]] = None
    return list(seen) + corpus.texts + stdlib_docstrings(stdlib_chars)
