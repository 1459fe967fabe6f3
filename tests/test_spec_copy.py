"""The copy model (``bench.models.copy_weights``, the target of the prompt-lookup benchmark)
really does input-grounded work: built small with the same construction, its greedy
continuation of a document's opening reproduces the document, its circuit does what its
construction says, and prompt lookup on it is lossless and accepts most drafts."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from bench.models import COPY_MODEL_VERSION, MATCH_BITS, build_copy_model, copy_config, copy_weights
from mlxkv.engine.generate import Generation, SamplingParams
from mlxkv.engine.models import load_model
from mlxkv.engine.speculation.base import TargetView
from mlxkv.engine.speculation.ngram import NgramProvider
from mlxkv.engine.speculation.providers import Speculation
from support.modelgen import TEST_MODELS

ROOT = Path(__file__).resolve().parent.parent
# The bench construction at a test model's size: 16 heads (10 previous-token heads), room
# for the 12 code slots in the residual, 3 layers (the third random, scaled).
SMALL = {"hidden_size": 256, "num_hidden_layers": 3, "intermediate_size": 256, "num_attention_heads": 16,
         "num_key_value_heads": 4, "head_dim": 64}


@pytest.fixture(scope="module")
def copier():
    path = build_copy_model(TEST_MODELS / f"copy{COPY_MODEL_VERSION}-tiny-h256-l3", SMALL)
    return load_model(str(path))


def _greedy(loaded, prompt: list[int], n: int, spec: Speculation | None = None) -> Generation:
    gen = Generation(loaded.model, loaded.tokenizer, prompt, SamplingParams(max_tokens=n), speculation=spec)
    list(gen)
    return gen


def _ngram(loaded) -> Speculation:
    """Prompt lookup proposing 4 tokens a round (fixed: what is accepted does not depend on
    how long rounds take)."""
    return Speculation(NgramProvider(2, 4), TargetView(loaded.model, loaded.tokenizer), SamplingParams(),
                       mode="ngram", max_tokens=4, timed=False)


def _random_document(vocab: int, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]  # 0..2 are the special tokens


def test_greedy_continuation_reproduces_a_random_document(copier):
    """A document of random tokens: every few-token context is unique, so the continuation
    of its opening is the document itself, token for token."""
    vocab = copier.model.args.vocab_size
    for seed in range(3):
        doc = _random_document(vocab, 240, seed)
        header = _random_document(vocab, 8, 100 + seed)
        prompt = header + doc + _random_document(vocab, 5, 200 + seed) + header + doc[:4]
        got = _greedy(copier, prompt, 160).outcome.tokens
        assert got == doc[4:164]


def test_greedy_continuation_copies_source_text(copier):
    """Source text repeats short spans (indentation, names), so the circuit matches the ten
    tokens before each position, nearest first: the opening of a real file is copied."""
    tok = copier.tokenizer
    doc = tok.encode((ROOT / "engine" / "speculation" / "policy.py").read_text())[:400]
    prompt = tok.encode("Here:\n```\n") + doc + tok.encode("\n```\nAgain:\n```\n") + doc[:3]
    got = _greedy(copier, prompt, 120).outcome.tokens
    assert got == doc[3:123]


def test_ngram_on_the_copy_model_is_lossless_and_accepts_most_drafts(copier):
    tok = copier.tokenizer
    vocab = copier.model.args.vocab_size
    doc = _random_document(vocab, 200, 7)
    text = tok.encode((ROOT / "engine" / "speculation" / "ngram.py").read_text())[:300]
    prompts = [doc + [5, 6, 7] + doc[:3],
               tok.encode("Here:\n```\n") + text + tok.encode("\n```\nAgain:\n```\n") + text[:3]]
    for prompt in prompts:
        plain = _greedy(copier, prompt, 96)
        spec = _greedy(copier, prompt, 96, _ngram(copier))
        assert spec.outcome.tokens == plain.outcome.tokens
        stats = spec.outcome.spec
        assert stats["drafted"] > 40
        assert stats["accepted"] >= 0.8 * stats["drafted"], stats
        assert stats["tokens_per_forward"] > 3.5, stats


def test_previous_token_heads_write_the_codes_of_the_tokens_before(copier):
    """Layer 0's previous-token heads put the code of the token ``delta`` positions back in
    slot T_delta, at every position of a long prompt (one position out of up to 1500)."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.base import create_attention_mask

    inner = copier.model.model
    tokens = _random_document(copier.model.args.vocab_size, 1500, 11)
    x = inner.embed_tokens(mx.array([tokens]))
    h = np.array(inner.layers[0](x, create_attention_mask(x, None), None)[0])
    codes = np.array(inner.embed_tokens.weight)[:, 1:17]
    for delta in range(1, len(MATCH_BITS) + 1):
        written = h[delta:, 1 + 16 * delta: 17 + 16 * delta]
        want = codes[np.array(tokens[:-delta])]
        assert np.abs(written - want).max() < 0.05, delta


def test_copy_weights_refuse_a_shape_without_room():
    with pytest.raises(ValueError, match="hidden >= 193"):
        copy_weights(copy_config({**SMALL, "hidden_size": 64}, 512))
    with pytest.raises(ValueError, match="head_dim 64"):
        copy_weights(copy_config({**SMALL, "head_dim": 32}, 512))
