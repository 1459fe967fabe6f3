"""Suffix speculation: the index's longest match, most frequent continuation, path score
and re-anchoring after a paraphrase; the global index learning finished outputs within its
bound and forgetting exactly what it added; and through the engine, output token for token
equal to plain decoding, single-stream and batched, with a repeated request proposed from
what the first one wrote. (Learning from every request and the saved index:
``test_spec_suffix_learned.py``; sampling: ``test_spec_sampling.py``.)"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from common import T, greedy

from mlxkv.engine.engine import Engine, Request
from mlxkv.engine.generate import SamplingParams
from mlxkv.engine.settings import Settings
from mlxkv.engine.speculation.base import Proposal, ProposalSource
from mlxkv.engine.speculation.policy import NEW_REQUEST_PROBE_AFTER, LengthController, SourceMemory
from mlxkv.engine.speculation.suffix import SuffixProvider
from mlxkv.engine.speculation.suffix_index import SuffixIndex, propose_path
from mlxkv.engine.speculation.verify import SpecStream
from support.modelgen import tiny_model


def propose(indexes, context, n, *, alpha, min_score):
    return propose_path(indexes, context, n, alpha=alpha, min_score=min_score)[0]


def index_of(*seqs: list[int], lengths=(8, 4, 2, 1)) -> SuffixIndex:
    ix = SuffixIndex(lengths)
    for s in seqs:
        ix.extend(s)
        ix.end_sequence()
    return ix


def test_the_longest_match_decides_the_continuation():
    # "5 6" was followed by 7 once and by 9 once; "4 5 6" only by 9
    ix = index_of([1, 5, 6, 7, 0, 4, 5, 6, 9, 10, 11], lengths=(4, 3, 2, 1))
    assert ix.match([3, 4, 5, 6]) == (3, {9: 1})
    assert ix.match([3, 5, 6]) == (2, {7: 1, 9: 1})
    assert propose([ix], [3, 4, 5, 6], 3, alpha=8, min_score=0.0) == [9, 10, 11]


def test_the_most_frequent_continuation_wins():
    ix = index_of([1, 2, 3], [1, 2, 3], [1, 2, 4], lengths=(2, 1))
    assert propose([ix], [0, 1, 2], 1, alpha=8, min_score=0.0) == [3]
    # a continuation with too small a share of what followed stops the proposal
    assert propose([ix], [0, 1, 2], 1, alpha=8, min_score=0.7) == []


def test_a_proposal_reanchors_after_a_changed_token():
    text = list(range(10, 40))
    ix = index_of(text, lengths=(8, 4, 2, 1))
    context = text[:12] + [99] + text[13:16]  # one token paraphrased, then the text goes on
    assert propose([ix], context, 8, alpha=8, min_score=0.0) == text[16:24]


def test_a_short_match_proposes_little():
    ix = index_of(list(range(100, 140)), lengths=(16, 8, 4, 2, 1))
    assert len(propose([ix], [7, 100], 16, alpha=2, min_score=0.0)) == 2  # 1-token match
    assert len(propose([ix], list(range(100, 116)), 16, alpha=2, min_score=0.0)) == 16


def test_a_one_token_match_proposes_nothing_by_default():
    ix = index_of(list(range(100, 140)), lengths=(16, 8, 4, 2, 1))
    source = SuffixProvider(lengths=(16, 8, 4, 2, 1)).open(None, None)
    source.prefill(list(range(100, 140)) + [7])
    assert source.propose(100, 8).tokens == []  # "100" alone matched: no proposal
    source.commit([100])
    assert source.propose(101, 8).tokens == list(range(102, 106))  # "100 101" matched: 2 x 2
    assert propose_path([ix], [7, 100], 8, alpha=2, min_score=0.0, min_match=2)[0] == []
    assert propose_path([ix], [100, 101], 8, alpha=2, min_score=0.0, min_match=2)[0] == [102, 103, 104, 105]


def test_forgetting_a_sequence_removes_what_it_added():
    ix = SuffixIndex((4, 2, 1))
    ix.extend([5, 6, 7, 8])
    seq = ix.end_sequence()
    ix.extend([1, 2, 3])
    other = ix.end_sequence()
    ix.forget(seq)
    assert ix.match([5, 6])[1] is None and ix.match([1, 2])[1] == {3: 1}
    ix.forget(other)
    assert len(ix) == 0


def test_the_path_stops_where_its_probability_falls_below_the_score():
    # after 2: 3 three times, 4 once (3/4); after 3: 5 twice, 6 once (2/3)
    ix = index_of([1, 2, 3, 5], [1, 2, 3, 5], [1, 2, 4], [9, 2, 3, 6], lengths=(1,))
    assert propose([ix], [0, 2], 4, alpha=8, min_score=0.55) == [3]  # 3/4, then 1/2 < 0.55
    assert propose([ix], [0, 2], 4, alpha=8, min_score=0.45) == [3, 5]


def test_equally_long_matches_of_the_request_and_the_global_index_add_up():
    local = index_of([7, 1, 2, 3], lengths=(2, 1))  # the request: "1 2" -> 3 once
    learned = index_of([1, 2, 4], [1, 2, 4], lengths=(2, 1))  # earlier outputs: -> 4 twice
    assert propose([local, learned], [0, 1, 2], 1, alpha=8, min_score=0.0) == [4]
    longer = index_of([5, 1, 2, 3], lengths=(3, 2, 1))  # a longer match wins outright
    assert propose([longer, learned], [5, 1, 2], 1, alpha=8, min_score=0.0) == [3]


def test_adding_and_forgetting_random_sequences_leaves_nothing_behind():
    rng = np.random.default_rng(0)
    ix = SuffixIndex()
    seqs = []
    for _ in range(40):  # a small vocabulary: many contexts with several followers
        ix.extend(rng.integers(0, 6, size=int(rng.integers(1, 80))).tolist())
        seqs.append(ix.end_sequence())
    for seq in seqs[::2]:
        ix.forget(seq)
    rest = SuffixIndex()
    for seq in seqs[1::2]:
        rest.extend(seq)
        rest.end_sequence()
    probe = rng.integers(0, 6, size=40).tolist()
    for end in range(1, len(probe)):
        assert ix.match(probe[:end]) == rest.match(probe[:end])
    assert len(ix) == len(rest)
    for seq in seqs[1::2]:
        ix.forget(seq)
    assert len(ix) == 0


def test_the_global_index_keeps_the_newest_outputs_within_its_bound():
    p = SuffixProvider(lengths=(4, 2, 1), global_tokens=10)
    p.learn([1, 2, 3, 4, 5, 6])
    p.learn([7, 8, 9, 10, 11, 12])
    assert p.learned_tokens == 6  # the first output was forgotten to stay within 10 tokens
    assert p.global_index.match([1, 2])[1] is None
    assert propose([p.global_index], [8, 9], 2, alpha=8, min_score=0.0) == [10, 11]


class _ProbeAfter(ProposalSource):
    """Proposes nothing; after ``n`` committed tokens it sees a run worth probing."""

    def __init__(self, n: int):
        self.n, self.seen, self.asked_at = n, 0, []

    def commit(self, accepted, hidden=None):
        self.seen += len(accepted)

    def worth_probing(self) -> bool:
        return self.seen == self.n

    def propose(self, pending, n):
        self.asked_at.append(self.seen)
        return Proposal([])


def test_a_long_earlier_run_ends_a_pause_in_speculation_early():
    # The source lost in the last request, so this one starts with a block of plain steps
    # (pipelined); the block ends one token after the source sees a repeated run, and the
    # output is plain decoding's either way.
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from mlxkv.engine.models import load_model

    model = load_model(str(tiny_model("llama"))).model
    prompt, params = [5, 6, 7, 8, 9] * 4, greedy(max_tokens=40)
    memory = SourceMemory()
    memory.requests, memory.stopped, memory.due = 1, True, 200  # the block: NEW_REQUEST_PROBE_AFTER
    runs = {}
    for n in (5, None):
        source = _ProbeAfter(n if n is not None else -1)
        stream = SpecStream(model, prompt, 0, make_prompt_cache(model), params, source,
                            LengthController(4, 12, memory=memory), kind="suffix")
        runs[n] = ([t for t, _ in stream], source.asked_at)
    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)[0, -1]
    plain = []
    for _ in range(40):
        plain.append(int(mx.argmax(logits).item()))
        logits = model(mx.array([[plain[-1]]]), cache=cache)[0, -1]
    assert runs[5][0] == runs[None][0] == plain
    assert runs[5][1][0] <= 5 + 3 < NEW_REQUEST_PROBE_AFTER <= runs[None][1][0]


def settings(tmp_path: Path, **values) -> Settings:
    base = {"model": str(tiny_model("llama")), "cache_dir": str(tmp_path / "cache"), "block_tokens": 16,
            "ram_cache_bytes": 256 << 20}
    return Settings.load({**base, **values}, env={})


CODE = [{"role": "user", "content": "def area(r):\n    return 3.14 * r * r\n" * 3}]


def test_suffix_speculation_is_lossless_and_proposes_what_earlier_requests_wrote(tmp_path):
    params = SamplingParams(max_tokens=32, temperature=0.0)
    # without a global index: the request's own prompt and output only
    with Engine.from_settings(settings(tmp_path, prefix_cache=False, spec_suffix_tokens=0)).start(timeout=T) as e:
        plain = e.submit(Request(messages=CODE, params=params, spec="off")).result(timeout=T)
        alone = e.submit(Request(messages=CODE, params=params, spec="suffix")).result(timeout=T)
    assert alone.tokens == plain.tokens and alone.stats.spec["source"] == "suffix"
    with Engine.from_settings(settings(tmp_path, prefix_cache=False)).start(timeout=T) as e:
        # the plain request's output is learned, whatever its speculation was
        assert e.submit(Request(messages=CODE, params=params, spec="off")).result(timeout=T).tokens == plain.tokens
        again = e.submit(Request(messages=CODE, params=params, spec="suffix")).result(timeout=T)
    assert again.tokens == plain.tokens
    assert again.stats.spec["accepted"] > alone.stats.spec["accepted"]
    assert again.stats.spec["accepted"] >= len(plain.tokens) // 2


def test_batched_rows_use_suffix_speculation_and_decode_as_alone(tmp_path):
    prompts = [[5, 6, 7, 8, 9] * 6, [11, 12, 13] * 9, [20 + i for i in range(30)]]
    with Engine.from_settings(settings(tmp_path, prefix_cache=False)).start(timeout=T) as e:
        alone = [e.submit(Request(prompt_tokens=p, params=greedy(max_tokens=16), spec="off")).result(timeout=T)
                 for p in prompts]
        handles = [e.submit(Request(prompt_tokens=p, params=greedy(max_tokens=16), spec="suffix")) for p in prompts]
        together = [h.result(timeout=T) for h in handles]
    assert [r.tokens for r in together] == [r.tokens for r in alone]


def test_a_reply_repeated_whole_is_proposed_in_rounds_longer_than_a_draft_models(tmp_path):
    # Suffix proposals cost nothing to make: by default a round proposes up to 32 tokens
    # (a draft model's up to 12); --spec-tokens bounds every source alike.
    params = SamplingParams(max_tokens=64, temperature=0.0)
    longest = {}
    for spec_tokens in (None, 8):
        with Engine.from_settings(settings(tmp_path, prefix_cache=False, spec_tokens=spec_tokens)
                                  ).start(timeout=T) as e:
            plain = e.submit(Request(messages=CODE, params=params, spec="off")).result(timeout=T)
            again = e.submit(Request(messages=CODE, params=params, spec="suffix")).result(timeout=T)
        assert again.tokens == plain.tokens
        longest[spec_tokens] = len(again.stats.spec["drafted_by_position"])
    assert 12 < longest[None] <= 32 and longest[8] == 8
