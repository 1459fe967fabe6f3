"""The embedded demo model: a small qwen3-architecture model the project trains and ships
(``engine/demo/model``), a much smaller draft model with the same tokenizer for speculative
decoding (``engine/demo/draft``), and the questions the README shows it answering.

Rebuild both with ``python -m support.demo.train`` (``make demo-model``). Importing this
package is light: paths and constants only."""

from __future__ import annotations

from pathlib import Path

DEMO_DIR = Path(__file__).resolve().parent
DEMO_MODEL_DIR = DEMO_DIR / "model"
DRAFT_MODEL_DIR = DEMO_DIR / "draft"

# The README's sample questions; each is the canonical phrasing of a fact in facts.py.
SAMPLE_QUESTIONS = [
    "What is mlxkv?",
    "How does the SSD cache work?",
    "How do I run the tests?",
    "Does speculative decoding change the output?",
    "How do I use a different model?",
]
