"""Continuous batching on real tiny models: every row of a batch gets exactly the events it
would have got alone (tokens, text, log-probabilities, stop strings, max tokens, progress),
whenever it joins and whatever the prefix cache supplied; cancelling one row leaves the
others alone; a full queue refuses at once; a model whose caches cannot be batched is
served one request at a time; batched rows store their state for later requests."""

import dataclasses
import random
import threading

import pytest
from common import T, greedy

from mlxkv.engine.engine import (
    Engine,
    FinishedEvent,
    ProgressEvent,
    QueueFull,
    Request,
    StatsEvent,
    TokenEvent,
)
from mlxkv.engine.generate import SamplingParams
from support.modelgen import TEST_MODELS, build_random_model


def ram_cache():
    from mlxkv.engine.cache.prefix_cache import PrefixCache

    return PrefixCache(ram_bytes=64 << 20, cache_dir=None, block_tokens=16)


def token_prompts(n: int, seed: int, longest: int = 90) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(1, longest))] for _ in range(n)]


@pytest.fixture(scope="module")
def alone_engine(tiny_qwen3):
    """The reference: one request at a time, nothing cached."""
    with Engine(str(tiny_qwen3), max_batch=1).start(timeout=T) as e:
        yield e


@pytest.fixture(scope="module")
def eng(tiny_qwen3):
    with Engine(str(tiny_qwen3), prefix_cache=ram_cache(), max_batch=8).start(timeout=T) as e:
        yield e


class Recorder:
    """Submits requests and records every event each one gets (on the engine thread)."""

    def __init__(self, e: Engine):
        self.e = e
        self.events: dict[int, list] = {}
        self.handles: list = []

    def submit(self, req: Request, on_event=None):
        log: list = []

        def callback(ev):
            log.append(ev)
            if on_event is not None:
                on_event(ev, log)
        h = self.e.submit(req, callback=callback)
        self.events[h.id] = log
        self.handles.append(h)
        return h


def held(e: Engine):
    """A context that keeps the engine thread busy until it exits, so that everything
    submitted inside is waiting together when it is served."""
    class Gate:
        def __enter__(self):
            self.gate = threading.Event()
            self.busy = e.call(self.gate.wait, T)
            return self

        def __exit__(self, *exc):
            self.gate.set()
            self.busy.result(timeout=T)
    return Gate()


def tokens_of(events) -> list[tuple]:
    return [(ev.token, ev.text) for ev in events if isinstance(ev, TokenEvent)]


def check_shape(events, batched: bool) -> None:
    """ProgressEvents (ending at total/total), TokenEvents, one StatsEvent, FinishedEvent."""
    kinds = [type(ev) for ev in events]
    assert kinds[-1] is FinishedEvent and kinds[-2] is StatsEvent
    assert kinds.count(StatsEvent) == 1 and kinds.count(FinishedEvent) == 1
    progress = [ev for ev in events if isinstance(ev, ProgressEvent)]
    assert progress and progress[-1].done == progress[-1].total
    pairs = [(p.done, p.total) for p in progress]
    assert pairs == sorted(set(pairs))  # rising, none sent twice
    first_token = next((i for i, k in enumerate(kinds) if k is TokenEvent), len(kinds) - 2)
    assert all(k is ProgressEvent for k in kinds[:first_token])
    assert all(k is TokenEvent for k in kinds[first_token:-2])
    assert events[-2].batched is batched


def same_as_alone(alone_engine, req: Request, events) -> None:
    ref = []
    alone_engine.submit(req, callback=ref.append).result(timeout=T)
    assert tokens_of(events) == tokens_of(ref)
    assert (events[-1].reason, events[-1].detail) == (ref[-1].reason, ref[-1].detail)
    assert events[-2].generated_tokens == ref[-2].generated_tokens
    assert events[-2].prompt_tokens == ref[-2].prompt_tokens


def test_rows_decoded_together_equal_each_request_alone(eng, alone_engine):
    prompts = token_prompts(6, seed=3)
    prompts[4] = prompts[4][:1]  # a one-token prompt: straight to decoding
    # Two of them continue prompts the cache has seen: they join with a cached prefix.
    for p in prompts[:2]:
        eng.submit(Request(prompt_tokens=p, params=greedy(max_tokens=5))).result(timeout=T)
    reqs = [Request(prompt_tokens=p + ([7, 8, 9] if i < 2 else []),
                    params=greedy(max_tokens=8 + 5 * i)) for i, p in enumerate(prompts)]
    # a repetition penalty sees the cached prefix too, as alone
    reqs[0].params = dataclasses.replace(reqs[0].params, repetition_penalty=1.5)
    rec = Recorder(eng)
    with held(eng):
        for r in reqs:
            rec.submit(r)
    results = [h.result(timeout=T) for h in rec.handles]
    for i, (req, h) in enumerate(zip(reqs, rec.handles)):
        events = rec.events[h.id]
        check_shape(events, batched=True)
        same_as_alone(alone_engine, req, events)
        if i < 2:
            assert results[i].stats.cached_tokens > 0
    assert eng.stats(timeout=T)["active"] == 0


@pytest.mark.parametrize("spec", ["off", "ngram"])
def test_rows_join_at_different_steps(eng, alone_engine, spec):
    """A request decoding alone (speculating or not) moves into a batch when the second
    arrives (after its third token); a third joins the running batch later; all equal
    their alone output."""
    a, b, c = token_prompts(3, seed=11, longest=40)
    a = a + a  # something for prompt lookup to propose
    rec = Recorder(eng)
    req_a = Request(prompt_tokens=a, params=greedy(max_tokens=30), spec=spec, logprobs=2)
    req_b = Request(prompt_tokens=b, params=greedy(max_tokens=20))
    req_c = Request(prompt_tokens=c, params=greedy(max_tokens=12))
    active = []

    def after_a(ev, log):
        if isinstance(ev, TokenEvent) and sum(isinstance(x, TokenEvent) for x in log) == 3:
            rec.submit(req_b, on_event=after_b)

    def after_b(ev, log):
        if isinstance(ev, TokenEvent) and sum(isinstance(x, TokenEvent) for x in log) == 4:
            rec.submit(req_c)
            active.append(eng.stats(timeout=T)["active"])  # a quick call, between steps

    rec.submit(req_a, on_event=after_a)
    for h in rec.handles[:1]:
        h.result(timeout=T)
    for h in list(rec.handles):
        h.result(timeout=T)
    assert len(rec.handles) == 3
    assert active == [2]
    for req, h in zip((req_a, req_b, req_c), rec.handles):
        events = rec.events[h.id]
        check_shape(events, batched=True)
        same_as_alone(alone_engine, req, events)
    # log-probabilities go on across the move, as alone
    ref = []
    alone_engine.submit(req_a, callback=ref.append).result(timeout=T)
    def sent(events):
        return [ev for ev in events if isinstance(ev, TokenEvent) and ev.token is not None]
    pairs = list(zip(sent(rec.events[rec.handles[0].id]), sent(ref)))
    assert len(pairs) == 30
    for x, y in pairs:
        assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
        assert [t for t, _ in x.top_logprobs] == [t for t, _ in y.top_logprobs]


def test_a_lone_request_stays_single_stream(eng):
    r = eng.submit(Request(prompt_tokens=token_prompts(1, seed=5)[0],
                           params=greedy(max_tokens=6))).result(timeout=T)
    assert not r.stats.batched and len(r.tokens) == 6


@pytest.mark.parametrize("fold", [True, False], ids=["fold", "mlx-lm-hand-over"])
def test_a_lone_prompts_first_token_comes_from_its_last_prefill_pass(tiny_qwen3, alone_engine, fold,
                                                                      monkeypatch):
    """A batch of one feeds its prompt's last token in the last prefill pass and samples the
    first token from it: no pass between that pass and the first token
    (``MLXKV_FOLD_FIRST=0``: mlx-lm's hand-over, where the last token has a pass of its
    own). Either way each request gets the events it gets alone: one token, a stop string
    in the first token, log-probabilities, a seeded draw; a first token that is EOS ends it
    with nothing sent and its prompt stored."""
    from mlxkv.engine import batch
    from mlxkv.engine.batch_step import BatchStepModel

    monkeypatch.setattr(batch, "FOLD_FIRST", fold)
    prompts = token_prompts(8, seed=91, longest=40)  # (none cached: each has a prefill pass)
    first_texts = [alone_engine.submit(Request(prompt_tokens=p, params=greedy(max_tokens=1))).result(timeout=T).text
                   for p in prompts]
    stop_at = next(i for i in (4, 5, 6) if first_texts[i].strip())
    reqs = [Request(prompt_tokens=prompts[0], params=greedy(max_tokens=1)),
            Request(prompt_tokens=prompts[1], params=greedy(max_tokens=4), logprobs=3),
            Request(prompt_tokens=prompts[2], params=SamplingParams(temperature=0.9, seed=3, max_tokens=8)),
            Request(prompt_tokens=prompts[3], params=greedy(max_tokens=5), spec="ngram"),
            Request(prompt_tokens=prompts[stop_at], params=greedy(max_tokens=9, stop=(first_texts[stop_at].strip(),)))]
    order: list = []  # passes of the batch's model and the requests' tokens, as they come
    step = BatchStepModel.__call__

    def recorded(self, tokens, *args, **kwargs):
        order.append(("pass", int(tokens.shape[1])))
        return step(self, tokens, *args, **kwargs)
    monkeypatch.setattr(BatchStepModel, "__call__", recorded)
    with Engine(str(tiny_qwen3), prefix_cache=ram_cache(), max_batch=8).start(timeout=T) as e:
        for req in reqs:
            order.clear()
            events: list = []

            def on_event(ev, events=events):
                events.append(ev)
                if isinstance(ev, TokenEvent) and ev.token is not None:
                    order.append(("token", ev.token))
            r = e.submit(req, callback=on_event).result(timeout=T)
            check_shape(events, batched=False)
            same_as_alone(alone_engine, req, events)
            passes_before = order.index(next(o for o in order if o[0] == "token"))
            # with the fold the prompt's pass is the batch's last_logits, not its model call
            assert (passes_before == 0) if fold else (passes_before >= 1)
            if req.logprobs:
                tops = [ev.top_logprobs for ev in events if isinstance(ev, TokenEvent) and ev.token is not None]
                assert len(tops) == 4 and tops[0][0][0] == r.tokens[0]
        assert r.finish_reason == "stop" and r.finish_detail == first_texts[stop_at].strip()
        # a first token that is EOS: nothing sent, and the prompt's state stored
        first = alone_engine.submit(Request(prompt_tokens=prompts[7], params=greedy(max_tokens=1))).result(timeout=T)
        e.call(lambda: e.loaded.tokenizer.eos_token_ids.add(first.tokens[0])).result(timeout=T)
        r = e.submit(Request(prompt_tokens=prompts[7], params=greedy(max_tokens=6))).result(timeout=T)
        assert (r.tokens, r.finish_reason, r.finish_detail) == ([], "stop", "eos")
        assert r.stats.stored_tokens == len(prompts[7])


def test_stop_strings_max_tokens_and_logprobs_per_row(eng, alone_engine):
    prompts = token_prompts(4, seed=21, longest=30)
    # a stop string each row's own greedy text really contains, a few tokens in
    texts = [alone_engine.submit(Request(prompt_tokens=p, params=greedy(max_tokens=24))
                                 ).result(timeout=T).text for p in prompts]
    stops = [t[len(t) // 2: len(t) // 2 + 3] for t in texts]
    reqs = [Request(prompt_tokens=prompts[0], params=greedy(max_tokens=24, stop=(stops[0],))),
            Request(prompt_tokens=prompts[1], params=greedy(max_tokens=3)),
            Request(prompt_tokens=prompts[2], params=greedy(max_tokens=24, stop=(stops[2],)),
                    logprobs=3),
            Request(prompt_tokens=prompts[3], params=greedy(max_tokens=17), logprobs=0)]
    rec = Recorder(eng)
    with held(eng):
        for r in reqs:
            rec.submit(r)
    got = [h.result(timeout=T) for h in rec.handles]
    assert got[0].finish_reason == "stop" and got[0].finish_detail == stops[0]
    assert stops[0] not in got[0].text
    assert got[1].finish_reason == "length" and len(got[1].tokens) == 3
    assert got[2].finish_detail == stops[2]
    assert got[3].finish_reason == "length" and len(got[3].tokens) == 17
    for req, h in zip(reqs, rec.handles):
        same_as_alone(alone_engine, req, rec.events[h.id])
    for i in (2, 3):
        batched = [ev for ev in rec.events[rec.handles[i].id] if isinstance(ev, TokenEvent)
                   and ev.token is not None]
        ref = []
        alone_engine.submit(reqs[i], callback=ref.append).result(timeout=T)
        ref = [ev for ev in ref if isinstance(ev, TokenEvent) and ev.token is not None]
        for x, y in zip(batched, ref):
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
            if reqs[i].logprobs:
                assert [t for t, _ in x.top_logprobs] == [t for t, _ in y.top_logprobs]
                assert x.top_logprobs[0][0] == x.token  # greedy: the most likely one
            else:
                assert x.top_logprobs is None and y.top_logprobs is None


def test_cancel_one_row_mid_batch(eng, alone_engine):
    prompts = token_prompts(3, seed=31, longest=30)
    reqs = [Request(prompt_tokens=p, params=greedy(max_tokens=25)) for p in prompts]
    rec = Recorder(eng)

    def cancel_after_three(ev, log):
        if isinstance(ev, TokenEvent) and sum(isinstance(x, TokenEvent) for x in log) == 3:
            rec.handles[1].cancel()

    with held(eng):
        rec.submit(reqs[0])
        rec.submit(reqs[1], on_event=cancel_after_three)
        rec.submit(reqs[2])
    got = [h.result(timeout=T) for h in rec.handles]
    # cancelled right after its third token: the next step no longer decodes it
    assert got[1].finish_reason == "cancelled" and len(got[1].tokens) == 3
    ref = alone_engine.submit(reqs[1]).result(timeout=T)
    assert got[1].tokens == ref.tokens[:3]
    for i in (0, 2):
        assert got[i].finish_reason == "length" and got[i].stats.batched
        same_as_alone(alone_engine, reqs[i], rec.events[rec.handles[i].id])
    assert eng.stats(timeout=T)["cancelled"] >= 1


def test_cancel_from_another_thread_ends_the_row(eng):
    prompts = token_prompts(2, seed=41, longest=20)
    started = threading.Event()
    with held(eng):
        hs = [eng.submit(Request(prompt_tokens=p, params=greedy(max_tokens=2000)),
                         callback=lambda ev: started.set() if isinstance(ev, TokenEvent) else None)
              for p in prompts]
    assert started.wait(T)
    hs[0].cancel()
    assert hs[0].result(timeout=T).finish_reason == "cancelled"
    hs[1].cancel()
    assert hs[1].result(timeout=T).finish_reason == "cancelled"


def test_a_full_queue_refuses_at_once(tiny_qwen3):
    with Engine(str(tiny_qwen3), max_queue=2).start(timeout=T) as e:
        with held(e):
            hs = [e.submit(Request(prompt="hello there", params=greedy(max_tokens=3)))
                  for _ in range(2)]
            with pytest.raises(QueueFull, match="max_queue is 2"):
                e.submit(Request(prompt="one too many", params=greedy(max_tokens=3)))
        assert all(h.result(timeout=T).finish_reason == "length" for h in hs)
        assert e.submit(Request(prompt="room again", params=greedy(max_tokens=3))
                        ).result(timeout=T).tokens
        assert e.stats(timeout=T)["queued"] == 0
    with pytest.raises(ValueError, match="at least 1"):
        Engine(str(tiny_qwen3), max_queue=0)


@pytest.fixture(scope="module")
def sliding_model():
    # A sliding-window layer (a rotating cache) beside a full-attention one.
    return build_random_model(TEST_MODELS / "llama-tiny-sliding16", arch="llama",
                              sliding_window=16,
                              layer_types=["sliding_attention", "full_attention"])


@pytest.mark.parametrize("spec", ["off", "ngram"])
@pytest.mark.parametrize("one_path", [True, False], ids=["batch-of-one", "moves-in"])
def test_sliding_window_rows_batch_and_equal_alone(sliding_model, spec, one_path, monkeypatch):
    """Rotating caches batch too: prompts longer than the window, a follow-up that starts
    from a stored state; each row equals its alone output. The first request starts in a
    batch of one and the others join it mid-decode, whether it speculates or not. Served
    alone first (``MLXKV_ONE_PATH=0``, as a request whose speculation only the lone path
    runs is), it moves in mid-decode only while its window can give back the token the
    batch feeds again: never once it has wrapped (plain decoding), always while
    speculating (the pending token is not in the cache yet)."""
    if not one_path:
        monkeypatch.setenv("MLXKV_ONE_PATH", "0")
    prompts = token_prompts(4, seed=53, longest=50)
    with Engine(str(sliding_model), max_batch=1).start(timeout=T) as ref, \
            Engine(str(sliding_model), prefix_cache=ram_cache()).start(timeout=T) as e:
        assert e.stats(timeout=T)["batching"] is True
        first = e.submit(Request(prompt_tokens=prompts[0], params=greedy(max_tokens=6))
                         ).result(timeout=T)
        follow = prompts[0] + first.tokens + [11, 12, 13]
        reqs = [Request(prompt_tokens=follow, params=greedy(max_tokens=30), spec=spec)]
        reqs += [Request(prompt_tokens=p, params=greedy(max_tokens=12 + 4 * i))
                 for i, p in enumerate(prompts[1:])]
        rec = Recorder(e)

        def after_two(ev, log):  # the first row runs alone, then the others arrive
            if isinstance(ev, TokenEvent) and sum(isinstance(x, TokenEvent) for x in log) == 2:
                for r in reqs[1:]:
                    rec.submit(r)

        rec.submit(reqs[0], on_event=after_two)
        rec.handles[0].result(timeout=T)
        got = [h.result(timeout=T) for h in list(rec.handles)]
        assert len(got) == 4 and got[0].stats.cached_tokens > 0
        for i, (req, h) in enumerate(zip(reqs, rec.handles)):
            check_shape(rec.events[h.id], batched=one_path or i > 0 or spec == "ngram")
            same_as_alone(ref, req, rec.events[h.id])


def test_which_caches_batch_and_which_run_speculative_rounds():
    from mlx_lm.models.cache import ArraysCache, CacheList, ChunkedKVCache, KVCache, RotatingKVCache, make_prompt_cache
    from test_prefix_cache import MAMBA, QWEN3_NEXT

    from mlxkv.engine.batch import batchable_cache, movable, rounds_cache
    from support.modelgen import init_model

    hybrid, mamba = init_model(QWEN3_NEXT), init_model(MAMBA)
    assert batchable_cache(make_prompt_cache(hybrid), hybrid)  # its module masks padding out of the scan
    assert not batchable_cache(make_prompt_cache(mamba), mamba)  # Mamba scans it into the state
    assert not batchable_cache([KVCache(), ArraysCache(2)])  # whose recurrent state: not known
    assert not movable(make_prompt_cache(mamba), 10)  # a state that counts no tokens never moves
    assert batchable_cache([KVCache(), RotatingKVCache(16)])
    assert not batchable_cache([KVCache(), RotatingKVCache(16, keep=4)])  # attention sinks
    assert not batchable_cache([ChunkedKVCache(8), KVCache()])
    assert not batchable_cache([CacheList(ArraysCache(2), KVCache())])
    assert not batchable_cache([])
    assert rounds_cache([KVCache(), RotatingKVCache(16)])
    assert not rounds_cache([KVCache(), ArraysCache(2)])  # a recurrent state cannot be trimmed


def test_a_hybrid_models_rows_batch_as_each_alone_and_their_states_are_found_again():
    """A model whose linear-attention layers keep recurrent state (ArraysCache) beside its
    attention layers' KV decodes its requests together: greedy rows of different lengths
    answer as each alone (mlx-lm masks a row's left padding out of the recurrent scan),
    none speculates in a batch round (its batch state cannot give back rejected positions;
    alone it may), and the state each batched row leaves is stored: the next turn finds it."""
    from support.modelgen import mtp_model

    hybrid = mtp_model()
    prompts = [p + [5] * 70 for p in token_prompts(3, seed=51, longest=50)]
    reqs = [Request(prompt_tokens=p, spec="ngram", params=greedy(max_tokens=12)) for p in prompts]
    with Engine(str(hybrid), max_batch=1).start(timeout=T) as ref:
        alone = [ref.submit(r).result(timeout=T) for r in reqs]
        follow = [Request(prompt_tokens=p + a.tokens + [9, 10, 11], params=greedy(max_tokens=6))
                  for p, a in zip(prompts, alone)]
        alone_follow = [ref.submit(r).result(timeout=T) for r in follow]
    with Engine(str(hybrid), prefix_cache=ram_cache()).start(timeout=T) as e:
        assert e.stats(timeout=T)["batching"] is True
        with held(e):
            hs = [e.submit(r) for r in reqs]
        got = [h.result(timeout=T) for h in hs]
        later = [e.submit(r).result(timeout=T) for r in follow]
    for a, b in zip(alone, got):
        assert (b.tokens, b.text, b.finish_reason) == (a.tokens, a.text, a.finish_reason)
        assert b.stats.batched and b.stats.spec is None
    for p, a, b in zip(prompts, alone_follow, later):
        assert b.tokens == a.tokens
        assert b.stats.cached_tokens >= len(p)


@pytest.mark.parametrize("spec", ["off", "mtp"])
def test_a_hybrid_request_decoding_alone_moves_into_a_batch_mid_answer(spec):
    """A hybrid model's request decoding alone holds the token its pipelined step fed, which
    its recurrent layers cannot trim: when a newcomer arrives mid-answer, plainly decoding
    those layers get back their state from before that token (kept as it decoded) and the
    rest are trimmed; speculating (MTP alone), whose stream feeds that step as it closes,
    the batch computes the row's state again. Either way it moves into a batch and both
    answer as each alone."""
    from support.modelgen import mtp_model

    hybrid = mtp_model()
    prompts = token_prompts(2, seed=59, longest=40)  # the first answers 30 tokens alone
    first = Request(prompt_tokens=prompts[0] * 4, spec=spec, logprobs=0, params=greedy(max_tokens=30))
    later = Request(prompt_tokens=prompts[1], spec=spec, params=greedy(max_tokens=8))

    def logprobs(events) -> list[float]:
        return [ev.logprob for ev in events if isinstance(ev, TokenEvent) and ev.token is not None]
    with Engine(str(hybrid), max_batch=1).start(timeout=T) as ref:
        alone_events: list = []
        alone = [ref.submit(first, callback=alone_events.append).result(timeout=T),
                 ref.submit(later).result(timeout=T)]
    with Engine(str(hybrid)).start(timeout=T) as e:
        seen: list = []
        hs: list = []

        def on_token(ev) -> None:
            seen.append(ev)
            if isinstance(ev, TokenEvent) and ev.token is not None and len(logprobs(seen)) == 5:
                hs.append(e.submit(later))
        moved = e.submit(first, callback=on_token).result(timeout=T)
        assert hs
        joined = hs[0].result(timeout=T)
    assert moved.stats.batched and joined.stats.batched and len(alone[0].tokens) == 30
    assert moved.tokens == alone[0].tokens and joined.tokens == alone[1].tokens
    # the state it went on from is the one alone had, not one that saw a token twice
    assert logprobs(seen) == pytest.approx(logprobs(alone_events), abs=1e-4)


def test_batched_rows_are_stored_and_hit_later(tiny_qwen3, alone_engine):
    prompts = token_prompts(3, seed=61, longest=60)
    prompts = [p + [5] * 20 for p in prompts]  # long enough for a whole cache block
    with Engine(str(tiny_qwen3), prefix_cache=ram_cache()).start(timeout=T) as e:
        with held(e):
            hs = [e.submit(Request(prompt_tokens=p, params=greedy(max_tokens=10)))
                  for p in prompts]
        first = [h.result(timeout=T) for h in hs]
        assert all(r.stats.batched and r.stats.cached_tokens == 0 for r in first)
        for p, r in zip(prompts, first):
            # the next turn: the prompt, the reply, and more
            follow = p + r.tokens + [9, 10, 11]
            again = e.submit(Request(prompt_tokens=follow, params=greedy(max_tokens=6))
                             ).result(timeout=T)
            assert again.stats.cached_tokens >= len(p)
            ref = alone_engine.submit(Request(prompt_tokens=follow, params=greedy(max_tokens=6))
                                      ).result(timeout=T)
            assert again.tokens == ref.tokens
        assert e.stats(timeout=T)["cache"]["ram_entries"] >= 3


def test_requests_that_must_run_alone_wait_for_the_batch(eng, alone_engine):
    """A seeded sampled request that speculates draws its verify's positions from MLX's
    global key: it is served alone, after the batch ahead of it, and answers as it does on
    an idle engine."""
    prompts = token_prompts(3, seed=71, longest=20)
    seeded = Request(prompt_tokens=prompts[2], spec="ngram",
                     params=SamplingParams(temperature=0.9, top_p=1.0, top_k=0, min_p=0.0,
                                           repetition_penalty=1.0, seed=123, max_tokens=12))
    with held(eng):
        hs = [eng.submit(Request(prompt_tokens=p, params=greedy(max_tokens=10)))
              for p in prompts[:2]]
        hs.append(eng.submit(seeded))
    got = [h.result(timeout=T) for h in hs]
    assert got[0].stats.batched and got[1].stats.batched and not got[2].stats.batched
    assert got[2].tokens == alone_engine.submit(seeded).result(timeout=T).tokens


def test_seeded_sampled_rows_batch_and_draw_as_each_alone(eng, alone_engine):
    """A seeded sampled request draws from a key sequence of its own: it decodes in a batch
    (beside greedy rows, and beside a row with the same seed, settings and prompt, which
    is not one draw of a shared call) with the tokens it has alone; and one that decoded
    alone and moved into a batch mid-answer goes on with the draws it had alone."""
    prompts = token_prompts(3, seed=73, longest=20)

    def sampled(seed: int, max_tokens: int = 16) -> SamplingParams:
        return SamplingParams(temperature=0.9, top_p=0.95, seed=seed, max_tokens=max_tokens)
    reqs = [Request(prompt_tokens=prompts[0], params=sampled(5)),
            Request(prompt_tokens=prompts[0], params=sampled(5)),
            Request(prompt_tokens=prompts[1], params=sampled(6)),
            Request(prompt_tokens=prompts[2], params=greedy(max_tokens=12))]
    with held(eng):
        hs = [eng.submit(r) for r in reqs]
    got = [h.result(timeout=T) for h in hs]
    assert all(g.stats.batched for g in got)
    alone = [alone_engine.submit(r).result(timeout=T) for r in reqs]
    assert [g.tokens for g in got] == [a.tokens for a in alone]
    assert len(set(alone[0].tokens)) > 3  # really sampled
    # alone first, then joined by a request that arrives after its fifth token
    first = Request(prompt_tokens=prompts[1], params=sampled(9, max_tokens=40))
    later = Request(prompt_tokens=prompts[2], params=sampled(10, max_tokens=8))
    joined: list = []

    def on_token(ev) -> None:
        if isinstance(ev, TokenEvent) and ev.token is not None:
            joined.append(ev.token)
            if len(joined) == 5:
                hs.append(eng.submit(later))
    hs = []
    moved = eng.submit(first, callback=on_token).result(timeout=T)
    assert moved.stats.batched and hs and hs[0].result(timeout=T).stats.batched
    assert moved.tokens == alone_engine.submit(first).result(timeout=T).tokens
    assert hs[0].result(timeout=T).tokens == alone_engine.submit(later).result(timeout=T).tokens


def test_a_batch_step_that_fails_is_answered_again_row_by_row(tiny_qwen3, alone_engine,
                                                                monkeypatch):
    """A cached state of the wrong shape breaks the batch it joins: every row is answered
    again on its own, from scratch, with the same output, and the bad state is dropped."""
    import mlxkv.engine.logs

    monkeypatch.setattr(mlxkv.engine.logs, "_warned", set())  # warnings of this test only
    pc = ram_cache()
    prompts = token_prompts(3, seed=81, longest=40)
    prompts[0] = [4] * 40 + prompts[0]
    reqs = [Request(prompt_tokens=p, params=greedy(max_tokens=8)) for p in prompts]
    with Engine(str(tiny_qwen3), prefix_cache=pc).start(timeout=T) as e:
        heads = e.loaded.config["num_key_value_heads"]

        def plant():
            import mlx.core as mx
            from mlx_lm.models.cache import KVCache

            layers = []
            for _ in range(e.loaded.config["num_hidden_layers"]):
                c = KVCache()
                bad = mx.ones((1, heads, 32, 3))  # head_dim is 16
                c.update_and_fetch(bad, bad)
                layers.append(c)
            pc.store(prompts[0][:32], layers, e.namespace)

        e.call(plant).result(timeout=T)
        with held(e):
            hs = [e.submit(r) for r in reqs]
        got = [h.result(timeout=T) for h in hs]
        assert e.stats(timeout=T)["retries"] >= 1
        again = e.submit(reqs[0]).result(timeout=T)
        assert not again.stats.retried
    for r, req in zip(got, reqs):
        ref = alone_engine.submit(req).result(timeout=T)
        assert (r.tokens, r.text) == (ref.tokens, ref.text)
    assert all(r.stats.retried for r in got)  # the whole batch was answered again


def test_sampled_rows_with_their_own_settings_decode_together(eng):
    prompts = token_prompts(3, seed=91, longest=30)
    settings = [dict(temperature=0.8, top_p=0.9, top_k=0, min_p=0.0),
                dict(temperature=1.2, top_p=1.0, top_k=20, min_p=0.0),
                dict(temperature=0.7, top_p=1.0, top_k=0, min_p=0.1)]
    with held(eng):
        hs = [eng.submit(Request(prompt_tokens=p, logprobs=2,
                                 params=SamplingParams(max_tokens=15, repetition_penalty=1.0,
                                                       **kw)))
              for p, kw in zip(prompts, settings)]
    for h in hs:
        r = h.result(timeout=T)
        assert r.finish_reason in ("length", "stop") and r.stats.batched
        assert r.finish_reason == "stop" or len(r.tokens) == 15
        tokens = [ev for ev in h.events(timeout=T) if isinstance(ev, TokenEvent) and ev.token is not None]
        assert all(ev.logprob <= 0.0 and len(ev.top_logprobs) == 2 for ev in tokens)


def test_a_call_queued_behind_a_batch_runs_after_it(eng):
    """call() runs between requests: behind a batch it waits until every row queued before
    it has ended (no request queued after it joins that batch meanwhile)."""
    prompts = token_prompts(4, seed=101, longest=20)
    with held(eng):
        first = [eng.submit(Request(prompt_tokens=p, params=greedy(max_tokens=12)))
                 for p in prompts[:2]]
        seen = eng.call(lambda: [h.done.is_set() for h in first])
        later = eng.submit(Request(prompt_tokens=prompts[2], params=greedy(max_tokens=4)))
    assert seen.result(timeout=T) == [True, True]
    assert not later.result(timeout=T).stats.batched  # alone: nothing else was in flight


def test_shutdown_ends_every_row_and_what_waits(tiny_qwen3):
    prompts = token_prompts(4, seed=111, longest=20)
    e = Engine(str(tiny_qwen3), max_batch=2).start(timeout=T)
    decoding = threading.Event()
    with held(e):
        hs = [e.submit(Request(prompt_tokens=p, params=greedy(max_tokens=5000)),
                       callback=lambda ev: decoding.set() if isinstance(ev, TokenEvent) else None)
              for p in prompts]
    assert decoding.wait(T)
    e.shutdown(timeout=T)
    got = [h.result(timeout=T) for h in hs]
    assert [(r.finish_reason, r.finish_detail) for r in got] == [("cancelled", "shutdown")] * 4
    assert got[0].stats.batched and got[1].stats.batched  # two rows (max_batch), two waited
    assert not got[2].tokens and not got[3].tokens


def test_the_prefix_cache_is_told_busy_while_rows_decode(tiny_qwen3):
    from mlxkv.engine.cache.prefix_cache import PrefixCache

    class Recording(PrefixCache):
        def __init__(self):
            super().__init__(ram_bytes=64 << 20, cache_dir=None, block_tokens=16)
            self.told: list[bool] = []

        def busy(self, active: bool) -> None:
            self.told.append(active)
            super().busy(active)

    pc = Recording()
    prompts = token_prompts(3, seed=121, longest=20)
    with Engine(str(tiny_qwen3), prefix_cache=pc).start(timeout=T) as e:
        seen = []
        with held(e):
            hs = [e.submit(Request(prompt_tokens=p, params=greedy(max_tokens=6)),
                           callback=lambda ev: seen.append(pc.told[-1:]) if isinstance(
                               ev, TokenEvent) else None)
                  for p in prompts]
            # served alone after the batch, then one cancelled before it starts: the
            # cache is told idle after that one too
            hs.append(e.submit(Request(prompt="x", spec="ngram", params=SamplingParams(
                temperature=0.5, seed=1, max_tokens=2))))
            hs.append(e.submit(Request(prompt="y", params=greedy(max_tokens=2))))
            hs[-1].cancel()
        for h in hs:
            h.wait(T)
        e.sync(timeout=T)
        assert all(s == [True] for s in seen)
        assert pc.told == [True, False]


def test_guided_choice_rows_batch_and_answer_as_alone(eng, alone_engine):
    prompts = token_prompts(3, seed=131, longest=25)
    choices = ("yes", "no", "maybe later")
    reqs = [Request(prompt_tokens=prompts[0], params=greedy(max_tokens=10),
                    guided_choice=choices),
            Request(prompt_tokens=prompts[1], params=greedy(max_tokens=10)),
            Request(prompt_tokens=prompts[2], params=greedy(max_tokens=10),
                    guided_choice=("maybe", "maybe later"))]
    rec = Recorder(eng)
    with held(eng):
        for r in reqs:
            rec.submit(r)
    got = [h.result(timeout=T) for h in rec.handles]
    assert all(r.stats.batched for r in got)
    assert got[0].text in choices and got[2].text in ("maybe", "maybe later")
    for req, h in zip(reqs, rec.handles):
        same_as_alone(alone_engine, req, rec.events[h.id])


def test_a_full_batch_takes_waiting_requests_as_rows_leave(tiny_qwen3, alone_engine):
    prompts = token_prompts(5, seed=141, longest=40)
    reqs = [Request(prompt_tokens=p, params=greedy(max_tokens=4 + 7 * (i % 3)))
            for i, p in enumerate(prompts)]
    most = []
    with Engine(str(tiny_qwen3), max_batch=2).start(timeout=T) as e:
        rec = Recorder(e)

        def watch(ev, log):  # on the engine thread: how many rows decode now
            if isinstance(ev, TokenEvent):
                most.append(e.stats(timeout=T)["active"])

        with held(e):
            for r in reqs:
                rec.submit(r, on_event=watch)
        for h in rec.handles:
            h.result(timeout=T)
        for i, (req, h) in enumerate(zip(reqs, rec.handles)):
            events = rec.events[h.id]
            # Each request joins beside a row still decoding or beside the one after it,
            # except the last, which finds the batch empty when every other row ended in
            # the step it joined after: a batch of one is not batched.
            last = i == len(reqs) - 1
            check_shape(events, batched=events[-2].batched if last else True)
            same_as_alone(alone_engine, req, events)
    assert max(most) == 2


@pytest.mark.parametrize("max_batch", [1, 8])
def test_a_waiting_request_cancelled_frees_its_place_at_once(tiny_qwen3, max_batch):
    """A client that goes away while its request waits (behind a request served alone, or
    a full batch) gets its answer within a step, and its place in the queue is free."""
    with Engine(str(tiny_qwen3), max_batch=max_batch, max_queue=2).start(timeout=T) as e:
        decoding = threading.Event()
        seeded = SamplingParams(temperature=0.7, seed=3, max_tokens=100000)
        running = e.submit(Request(prompt="a long answer", params=seeded, spec="ngram"),  # served alone
                           callback=lambda ev: decoding.set() if isinstance(ev, TokenEvent)
                           else None)
        assert decoding.wait(T)
        waiting = [e.submit(Request(prompt=f"wait {i}", params=greedy(max_tokens=3)))
                   for i in range(2)]
        with pytest.raises(QueueFull):
            e.submit(Request(prompt="no room", params=greedy(max_tokens=3)))
        waiting[0].cancel()
        assert waiting[0].result(timeout=T).finish_reason == "cancelled"
        assert not running.done.is_set()  # answered while the other still decodes
        late = e.submit(Request(prompt="room again", params=greedy(max_tokens=3)))
        running.cancel()
        assert running.result(timeout=T).finish_reason == "cancelled"
        assert waiting[1].result(timeout=T).finish_reason == "length"
        assert late.result(timeout=T).finish_reason == "length"


def test_mixed_traffic_from_several_clients(tiny_qwen3, alone_engine):
    """Clients on their own threads send requests of every kind (cached prefixes, short
    prefill chunks, penalties, log-probabilities, speculation asked for, cancels after a
    few tokens), some waiting for each answer: every reply equals the same request alone
    (a cancelled one, the start of it)."""
    rng = random.Random(7)
    base = token_prompts(4, seed=151, longest=100)
    reqs, cancel_at = [], {}
    for i in range(24):
        prompt = rng.choice(base)[:rng.randint(1, 100)] + [rng.randrange(3, 500)
                                                            for _ in range(rng.randint(0, 20))]
        params = dataclasses.replace(greedy(max_tokens=rng.randint(1, 40)),
                                     prefill_step_size=rng.choice([7, 2048]),
                                     repetition_penalty=rng.choice([1.0, 1.3]))
        reqs.append(Request(prompt_tokens=prompt, params=params,
                            logprobs=rng.choice([None, 2]), spec=rng.choice([None, "off"])))
        if rng.random() < 0.2:
            cancel_at[i] = rng.randint(1, 8)
    handles: dict[int, object] = {}
    with Engine(str(tiny_qwen3), prefix_cache=ram_cache(), max_batch=4).start(timeout=T) as e:
        def client(ids):
            for i in ids:
                count = [0]

                def cut(ev, i=i, count=count):
                    if isinstance(ev, TokenEvent) and ev.token is not None:
                        count[0] += 1
                        if count[0] == cancel_at.get(i):
                            handles[i].cancel()
                handles[i] = e.submit(reqs[i], callback=cut)
                if i % 2:
                    handles[i].wait(T)
        threads = [threading.Thread(target=client, args=(list(range(k, 24, 3)),))
                   for k in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(T)
        got = {i: h.result(timeout=T) for i, h in handles.items()}
        assert e.stats(timeout=T)["errors"] == 0
    assert len(got) == 24
    for i, req in enumerate(reqs):
        ref = alone_engine.submit(req).result(timeout=T)
        if got[i].finish_reason == "cancelled":
            assert got[i].tokens == ref.tokens[:len(got[i].tokens)]
        else:
            assert (got[i].tokens, got[i].text, got[i].finish_detail) == (
                ref.tokens, ref.text, ref.finish_detail)


def test_only_an_engine_that_batched_recently_waits_for_company(tiny_qwen3):
    # A request that starts alone waits briefly for others sent with it (so a burst
    # prefills together) only once requests have decoded together: a lone user never waits.
    with Engine(str(tiny_qwen3), prefix_cache=ram_cache(), max_batch=8).start(timeout=T) as e:
        e.submit(Request(prompt_tokens=[5, 6, 7], params=greedy(max_tokens=3))).result(timeout=T)
        assert e.call(e.scheduler.admission.recently_batched).result(timeout=T) is False
        rec = Recorder(e)
        with held(e):
            hs = [rec.submit(Request(prompt_tokens=p, params=greedy(max_tokens=6)))
                  for p in token_prompts(2, seed=3)]
        for h in hs:
            h.result(timeout=T)
        assert all(rec.events[h.id][-2].batched for h in hs)
        assert e.call(e.scheduler.admission.recently_batched).result(timeout=T) is True
