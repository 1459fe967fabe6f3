"""Batched rows that sample keep the target's distribution: rows of mlx-lm's BatchGenerator
driven through engine.speculation.batch_verify rounds, each drafting with its own draft model
(rejection sampling), on the tiny-vocabulary Markov-chain model of test_spec_sampling (the
next token depends on the current one alone): the emitted transitions match the exact
ones (chi-square, p > 0.01), with rows keeping their own counts (rolled) and with every
round cut to the shortest row's count."""

from __future__ import annotations

import types

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.sample_utils import make_sampler
from test_spec_sampling import V, chi2_pvalue, markov_model, transition_probs

from mlxkv.engine.generate import SamplingParams
from mlxkv.engine.speculation.base import ProposalProvider
from mlxkv.engine.speculation.batch_verify import BatchVerifier
from mlxkv.engine.speculation.draft import DraftModelSource
from mlxkv.engine.speculation.draft_step import DraftModelStep
from mlxkv.engine.speculation.providers import Speculation


class MarkovDraft(ProposalProvider):
    kind = "draft"

    def __init__(self, model):
        self.draft = model
        self.step = DraftModelStep(model)

    def checkpoint_namespace(self) -> str:
        return "markov-test"

    def open(self, target, sampling, constraints=None):
        return DraftModelSource(types.SimpleNamespace(model=self.draft, step=self.step), sampling, V)


@pytest.mark.parametrize("cut", [False, True], ids=["own-counts", "cut-to-shortest"])
def test_batched_rejection_sampling_emits_the_target_distribution(cut, monkeypatch):
    if cut:
        monkeypatch.setattr(BatchVerifier, "_common_length", staticmethod(lambda cache, keep: min(keep)))
    target, draft = markov_model(1), markov_model(1, noise=0.05)
    params = SamplingParams(temperature=1.0, max_tokens=100_000)
    p_t = transition_probs(target, params)
    mx.random.seed(3)
    rows = 4
    gen = BatchGenerator(target, completion_batch_size=rows, prefill_batch_size=rows)
    uids = gen.insert([[1, 2, 3 + i] for i in range(rows)], max_tokens=[100_000] * rows,
                      samplers=[make_sampler(1.0)] * rows)
    verifier = BatchVerifier(target)
    provider = MarkovDraft(draft)
    for uid in uids:
        spec = Speculation(provider, None, params, mode="draft", max_tokens=4, timed=False)
        verifier.add(uid, spec, [1, 2, 3 + uid], params)
    streams: dict[int, list[int]] = {u: [] for u in uids}
    while len(gen._generation_batch) < rows:  # prefill: every row in the generation batch
        gen.next()
    counts = np.zeros((V, V))
    rounds = 0
    while counts.sum() < 4000:
        k = verifier.length(gen)
        assert k == 4  # a fixed length (not timed)
        out = verifier.round(gen, k)
        assert out is not None
        rounds += 1
        for uid, got in zip(gen._generation_batch.uids, out):
            for token, _ in got.emitted:
                s = streams[uid]
                if s:
                    counts[s[-1], token] += 1
                s.append(token)
    drafted = sum(s.stats.drafted for s in verifier.specs.values())
    accepted = sum(s.stats.accepted for s in verifier.specs.values())
    assert 0 < accepted < drafted
    if not cut:
        assert counts.sum() > 1.5 * rows * rounds  # rows kept drafts: more than a token a round
    assert chi2_pvalue(counts, counts.sum(1, keepdims=True) * p_t) > 0.01
