"""Rejection sampling keeps the target's distribution: on a tiny-vocabulary model whose
next token depends only on the last one (a Markov chain of real mlx-lm layers), tokens
emitted through speculation are distributed as the target's own sampling, checked with
chi-square tests (p > 0.01) against the exact transition probabilities."""

from __future__ import annotations

import math
import types

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler

from mlxkv.engine.generate import SamplingParams
from mlxkv.engine.speculation.draft import DraftModelSource
from mlxkv.engine.speculation.draft_step import DraftModelStep
from mlxkv.engine.speculation.policy import LengthController
from mlxkv.engine.speculation.sampling import TargetSampler, rejection_walk_rows
from mlxkv.engine.speculation.suffix import SuffixProvider
from mlxkv.engine.speculation.verify import SpecStream
from support.modelgen import BASE_CONFIGS, init_model

V = 8
CONFIG = dict(BASE_CONFIGS["qwen3"], vocab_size=V, num_hidden_layers=1, hidden_size=16, head_dim=4,
              intermediate_size=16)


def markov_model(seed: int, noise: float = 0.0):
    """A one-layer qwen3 whose attention and MLP write nothing to the residual stream: the
    next token's distribution depends on the current token alone."""
    model = init_model(CONFIG, seed=seed, scale=0.1)
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
        layer.mlp.down_proj.weight = mx.zeros_like(layer.mlp.down_proj.weight)
    if noise:
        mx.random.seed(seed + 100)
        model.update(tree_unflatten([(k, v + noise * mx.random.normal(v.shape)) if "embed" in k else (k, v)
                                     for k, v in tree_flatten(model.parameters())]))
    return model


def transition_probs(model, params: SamplingParams) -> np.ndarray:
    """P(next | current) [V, V] as the sampler draws it (filters, temperature)."""
    logits = model(mx.arange(V)[None])[0]
    sampler = TargetSampler(params, [])
    return np.array(sampler.probs(sampler.logprobs(logits, list(range(V)))))


def chi2_pvalue(counts: np.ndarray, expected: np.ndarray) -> float:
    """Upper-tail p-value of Pearson's chi-square (Wilson-Hilferty normal approximation),
    over cells whose expected count is positive; a count where nothing is expected fails."""
    assert not np.any((expected == 0) & (counts > 0)), "a token the sampler cannot draw was emitted"
    cells = expected > 0
    chi = float(((counts[cells] - expected[cells]) ** 2 / expected[cells]).sum())
    df = int(cells.sum()) - (expected.shape[0] if expected.ndim == 2 else 1)
    z = ((chi / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.fixture(scope="module")
def pair():
    return markov_model(1), markov_model(2)


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.9)],
                         ids=["t1", "t0.7-top_p0.9"])
def test_rejection_walk_emits_the_target_distribution(pair, params):
    # 20,000 windows of 3 drafts drawn from a different model: the first emitted token of
    # each window follows P(. | pending), and the second (when the first draft was kept)
    # follows P(. | first), whatever the draft proposed.
    target, draft = pair
    p_t, q_t = transition_probs(target, params), transition_probs(draft, params)
    n, k, pending = 20_000, 3, 3
    mx.random.seed(7)
    drafts = np.zeros((n, k), dtype=np.int64)
    prev = np.full(n, pending)
    for j in range(k):  # drafts drawn from the draft's chain
        drafts[:, j] = np.array(mx.random.categorical(mx.log(mx.array(q_t[prev]) + 1e-30)))
        prev = drafts[:, j]
    windows = np.concatenate([np.full((n, 1), pending), drafts], axis=1)
    p = mx.array(p_t[windows])  # the target's distribution at each window position
    q = mx.array(q_t[windows[:, :k]])
    accepted, nxt = rejection_walk_rows(p, q, mx.array(drafts))
    accepted, nxt = np.array(accepted), np.array(nxt)
    first = np.where(accepted > 0, drafts[:, 0], nxt)
    counts = np.bincount(first, minlength=V)
    assert 0.2 < (accepted > 0).mean() < 0.95  # the walk both keeps and rejects drafts
    assert chi2_pvalue(counts, n * p_t[pending]) > 0.01
    two = accepted > 0
    second = np.where(accepted[two] > 1, drafts[two, 1], nxt[two])
    pairs = np.zeros((V, V))
    np.add.at(pairs, (drafts[two, 0], second), 1)
    assert pairs.sum() > 10_000
    assert chi2_pvalue(pairs, pairs.sum(1, keepdims=True) * p_t) > 0.01


def _chain_counts(tokens: list[int]) -> np.ndarray:
    counts = np.zeros((V, V))
    for a, b in zip(tokens, tokens[1:]):
        counts[a, b] += 1
    return counts


def test_speculative_stream_samples_as_plain_decoding(pair):
    # The whole verifier (draft model source, target forward, walk, trimming) over long
    # sampled generations: transitions match the exact ones, as plain decoding's do.
    target, draft = markov_model(1), markov_model(1, noise=0.05)
    params = SamplingParams(temperature=1.0, max_tokens=1500)
    p_t = transition_probs(target, params)
    spec_tokens, stats = [], None
    provider = types.SimpleNamespace(model=draft, step=DraftModelStep(draft))  # q from the compiled step
    for seed in range(2):
        mx.random.seed(seed)
        source = DraftModelSource(provider, params, V)
        stream = SpecStream(target, [1, 2, 3], 0, make_prompt_cache(target), params, source,
                            LengthController(6, 6, adaptive=False), kind="draft")
        spec_tokens.append([3] + [t for t, _ in stream])
        stats = stream.summary()
        assert len(stream.kv_tokens) == 3 + len(spec_tokens[-1]) - 2  # the pending token is not fed
    assert 0 < stats["accepted"] < stats["drafted"]
    spec = sum((_chain_counts(t) for t in spec_tokens), np.zeros((V, V)))
    assert spec.sum() >= 2990
    assert chi2_pvalue(spec, spec.sum(1, keepdims=True) * p_t) > 0.01
    mx.random.seed(11)
    plain = [3] + [int(t) for t, _ in generate_step(mx.array([1, 2, 3]), target, max_tokens=1500,
                                                      sampler=make_sampler(1.0))]
    counts = _chain_counts(plain)
    assert chi2_pvalue(counts, counts.sum(1, keepdims=True) * p_t) > 0.01


def test_suffix_source_samples_as_plain_decoding(pair):
    # An exact-match source (one-hot q) under sampling: each drafted token is kept when the
    # target's own draw at that position equals it, which is rejection sampling with q
    # one-hot. The suffix source proposes from the request's text and from a global index
    # that learned an earlier sampled reply of the same chain.
    target = markov_model(1)
    params = SamplingParams(temperature=1.0, max_tokens=1500)
    p_t = transition_probs(target, params)
    mx.random.seed(21)
    earlier = [int(t) for t, _ in generate_step(mx.array([1, 2, 3]), target, max_tokens=400,
                                                  sampler=make_sampler(1.0))]
    provider = SuffixProvider(lengths=(4, 3, 2, 1), min_score=0.0)
    provider.learn(earlier)
    spec_tokens, stats = [], None
    for seed in range(2):
        mx.random.seed(seed)
        stream = SpecStream(target, [1, 2, 3], 0, make_prompt_cache(target), params, provider.open(None, params),
                            LengthController(4, 4, adaptive=False), kind="suffix")
        spec_tokens.append([3] + [t for t, _ in stream])
        stats = stream.summary()
    assert 0 < stats["accepted"] < stats["drafted"]
    spec = sum((_chain_counts(t) for t in spec_tokens), np.zeros((V, V)))
    assert spec.sum() >= 2990
    assert chi2_pvalue(spec, spec.sum(1, keepdims=True) * p_t) > 0.01


def test_ragged_rows_stop_at_their_own_length():
    # Right-padded rows: a row keeps at most its own drafts, then gets the bonus token
    # from p at its length (the padding is never accepted, whatever it holds).
    k = 3
    drafts = mx.array([[1, 2, 3], [4, 5, 6], [7, 0, 0]])
    one_hot = mx.eye(V)
    p = mx.stack([one_hot[mx.array([1, 2, 3, 5])], one_hot[mx.array([4, 5, 6, 2])],
                  one_hot[mx.array([7, 6, 0, 0])]])  # row 2: p puts 6 after its one draft
    q = p[:, :k]
    accepted, nxt = rejection_walk_rows(p, q, drafts, mx.array([3, 1, 1]))
    assert accepted.tolist() == [3, 1, 1]
    assert nxt.tolist() == [5, 5, 6]
