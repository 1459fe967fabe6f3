"""Batched rows speculate (engine.speculation.batch_verify): every speculating row of a batch sends
exactly what the same request sends alone without speculation (greedy), for prompt lookup,
the demo draft model and guided_choice; rows end inside a round (max tokens, EOS forced by a
constraint, stop strings, cancel) as alone, and what they store is what their cache holds;
rows join while others speculate; sampled rows still decode. Each test checks that drafts
were accepted in the batch, so the speculative path really ran."""

import dataclasses
import random

import pytest

from mlxkv.engine.engine import Engine, Request, StatsEvent, TokenEvent
from mlxkv.engine.generate import SamplingParams
from support.modelgen import tiny_model
from tests.test_batch import T, greedy, held, ram_cache
from tests.test_batch import tokens_of as texts


def repetitive(n: int, seed: int) -> list[list[int]]:
    """Prompts that repeat themselves, so prompt lookup has something to propose."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        base = [rng.randrange(3, 500) for _ in range(rng.randint(8, 20))]
        out.append(base * 3)
    return out


def submit_all(e: Engine, reqs, callbacks=None, handles=None):
    """Submit ``reqs`` so they are served together; (results, each one's events, handles)."""
    logs = [[] for _ in reqs]
    callbacks = callbacks or [None] * len(reqs)
    handles = [] if handles is None else handles
    with held(e):
        for log, req, cb in zip(logs, reqs, callbacks):
            def callback(ev, log=log, cb=cb):
                log.append(ev)
                if cb is not None:
                    cb(ev, log)
            handles.append(e.submit(req, callback=callback))
    return [h.result(timeout=T) for h in handles], logs, handles


def alone(e: Engine, req: Request):
    """The same request alone, without speculation."""
    plain = Request(prompt_tokens=req.prompt_tokens, messages=req.messages, params=req.params,
                    spec="off", logprobs=req.logprobs, guided_choice=req.guided_choice)
    events = []
    r = e.submit(plain, callback=events.append).result(timeout=T)
    return r, events


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def ref_llama(llama):
    with Engine(str(llama), max_batch=1).start(timeout=T) as e:
        yield e


@pytest.fixture(scope="module")
def eng_llama(llama):
    with Engine(str(llama), prefix_cache=ram_cache(), max_batch=8).start(timeout=T) as e:
        yield e


def test_ngram_rows_equal_alone_and_accept_drafts(eng_llama, ref_llama):
    prompts = repetitive(5, seed=5)
    reqs = [Request(prompt_tokens=p, params=greedy(max_tokens=40 + 3 * i), spec="ngram")
            for i, p in enumerate(prompts)]
    reqs[1].logprobs = 2
    reqs[2].params = dataclasses.replace(greedy(max_tokens=30), repetition_penalty=1.3)  # processors per position
    # a row that does not speculate rides along (it keeps one position per round)
    reqs.append(Request(prompt_tokens=repetitive(1, seed=99)[0], params=greedy(max_tokens=35), spec="off"))
    got, logs, _ = submit_all(eng_llama, reqs)
    accepted = 0
    for req, r, log in zip(reqs, got, logs):
        ref, ref_events = alone(ref_llama, req)
        assert r.stats.batched
        assert r.tokens == ref.tokens and texts(log) == texts(ref_events)
        assert (r.finish_reason, r.stats.generated_tokens) == (ref.finish_reason, ref.stats.generated_tokens)
        if req.spec == "ngram":
            assert r.stats.spec["source"] == "ngram"
            accepted += r.stats.spec["accepted"]
        else:
            assert r.stats.spec is None
        if req.logprobs:
            sent = [ev for ev in log if isinstance(ev, TokenEvent) and ev.token is not None]
            want = [ev for ev in ref_events if isinstance(ev, TokenEvent) and ev.token is not None]
            for x, y in zip(sent, want):
                assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
                assert [t for t, _ in x.top_logprobs] == [t for t, _ in y.top_logprobs]
    assert accepted > 0
    kinds = [type(ev) for ev in logs[0]]
    assert kinds.count(StatsEvent) == 1 and kinds[-2] is StatsEvent


def follow_up_hits_the_cache(eng, ref, req: Request, r) -> None:
    """What the row stored is its conversation: continuing it hits the cache past the
    prompt and answers as alone."""
    more = Request(prompt_tokens=req.prompt_tokens + r.tokens + [7, 8, 9], params=greedy(max_tokens=8), spec="off")
    again = eng.submit(more).result(timeout=T)
    assert again.stats.cached_tokens > len(req.prompt_tokens)
    assert again.tokens == alone(ref, more)[0].tokens


def test_ngram_rows_ending_at_max_tokens_or_a_stop_string_equal_alone(eng_llama, ref_llama):
    prompts = repetitive(4, seed=5)
    texts_alone = [alone(ref_llama, Request(prompt_tokens=p, params=greedy(max_tokens=40)))[0].text
                   for p in prompts]
    reqs = []
    for i, p in enumerate(prompts):
        params = greedy(max_tokens=21 + 5 * i)  # max tokens cap the drafts of the last round
        if i == 2:  # a stop string its own text really contains, well in
            t = texts_alone[2]
            params = greedy(max_tokens=40, stop=(t[2 * len(t) // 3: 2 * len(t) // 3 + 3],))
        reqs.append(Request(prompt_tokens=p, params=params, spec="ngram"))
    got, logs, _ = submit_all(eng_llama, reqs)
    assert sum(r.stats.spec["accepted"] for r in got) > 0
    for req, r, log in zip(reqs, got, logs):
        ref, ref_events = alone(ref_llama, req)
        assert r.tokens == ref.tokens and texts(log) == texts(ref_events)
        assert (r.finish_reason, r.finish_detail) == (ref.finish_reason, ref.finish_detail)
        follow_up_hits_the_cache(eng_llama, ref_llama, req, r)
    assert got[2].finish_reason == "stop" and got[2].finish_detail == reqs[2].params.stop[0]


def test_rows_end_inside_a_round_as_alone_and_store_what_they_hold(eng_llama, ref_llama):
    # Only guided_choice rows: each drafts the rest of its choice and EOS in one round (a
    # fixed length), so a stop string, max tokens and EOS all land inside a round's tokens.
    prompts = repetitive(4, seed=7)
    choice = "the prefix cache keeps every conversation in RAM and on the SSD"
    reqs = [Request(prompt_tokens=prompts[0], params=greedy(max_tokens=40, stop=("conversation",)),
                    guided_choice=(choice,)),
            Request(prompt_tokens=prompts[1], params=greedy(max_tokens=5), guided_choice=(choice,)),
            Request(prompt_tokens=prompts[2], params=greedy(max_tokens=40), guided_choice=(choice, "no")),
            Request(prompt_tokens=prompts[3], params=greedy(max_tokens=40), guided_choice=("maybe", "maybe later"))]
    got, logs, _ = submit_all(eng_llama, reqs)
    assert (got[0].finish_reason, got[0].finish_detail) == ("stop", "conversation")
    assert got[0].text == choice[:choice.index("conversation")]
    assert (got[1].finish_reason, len(got[1].tokens)) == ("length", 5)
    assert (got[2].finish_reason, got[2].finish_detail) == ("stop", "eos")
    for req, r, log in zip(reqs, got, logs):
        ref, ref_events = alone(ref_llama, req)
        assert r.tokens == ref.tokens and texts(log) == texts(ref_events)
        assert (r.finish_reason, r.finish_detail) == (ref.finish_reason, ref.finish_detail)
        assert r.stats.spec["source"] == "constraint"
        follow_up_hits_the_cache(eng_llama, ref_llama, req, r)
    assert got[0].stats.spec["accepted"] > 3 and got[2].stats.spec["accepted"] > 3


def test_a_row_cancelled_inside_a_round_stops_after_that_token(eng_llama, ref_llama):
    # guided_choice rows draft their whole choice in one round (a fixed proposal length), so
    # the cancel after the third token lands inside a round's tokens
    prompts = repetitive(3, seed=5)
    choice = ("the prefix cache keeps every conversation in RAM and on the SSD",)
    reqs = [Request(prompt_tokens=p, params=greedy(max_tokens=40), guided_choice=choice) for p in prompts]
    handles: list = []

    def cancel_after_three(ev, log):
        if isinstance(ev, TokenEvent) and sum(isinstance(x, TokenEvent) for x in log) == 3:
            handles[1].cancel()

    got, _, _ = submit_all(eng_llama, reqs, [None, cancel_after_three, None], handles)
    assert got[1].finish_reason == "cancelled" and len(got[1].tokens) == 3
    assert got[1].tokens == alone(ref_llama, reqs[1])[0].tokens[:3]
    for i in (0, 2):
        assert got[i].tokens == alone(ref_llama, reqs[i])[0].tokens
        assert got[i].stats.spec["accepted"] > 3


def test_rows_join_while_others_speculate(eng_llama, ref_llama):
    a, b, c = repetitive(3, seed=5)
    req_a = Request(prompt_tokens=a, params=greedy(max_tokens=40), spec="ngram")
    req_b = Request(prompt_tokens=b, params=greedy(max_tokens=30), spec="ngram")
    req_c = Request(prompt_tokens=c, params=greedy(max_tokens=20), spec="ngram")
    handles, logs = [], []

    def submit(req, after=None, at=0):
        log = []

        def cb(ev):
            log.append(ev)
            if after is not None and isinstance(ev, TokenEvent) and \
                    sum(isinstance(x, TokenEvent) for x in log) == at:
                after()
        logs.append(log)
        handles.append(eng_llama.submit(req, callback=cb))

    submit(req_a, lambda: submit(req_b, lambda: submit(req_c), 6), 3)
    handles[0].result(timeout=T)  # A reached its 3rd token: B was sent
    handles[1].result(timeout=T)  # B reached its 6th: C was sent (A, speculating, may end first)
    got = [h.result(timeout=T) for h in list(handles)]
    assert len(got) == 3 and all(r.stats.batched for r in got)
    for req, r in zip((req_a, req_b, req_c), got):
        assert r.tokens == alone(ref_llama, req)[0].tokens
    assert sum(r.stats.spec["accepted"] for r in got) > 0


def test_guided_choice_rows_draft_their_choice_and_eos(eng_llama, ref_llama):
    prompts = repetitive(3, seed=51)
    long_choices = ("the prefix cache keeps every conversation in RAM and on the SSD",
                    "the prefix cache forgets everything when the engine stops")
    reqs = [Request(prompt_tokens=prompts[0], params=greedy(max_tokens=60), guided_choice=long_choices),
            Request(prompt_tokens=prompts[1], params=greedy(max_tokens=30), spec="ngram"),
            Request(prompt_tokens=prompts[2], params=greedy(max_tokens=60), guided_choice=("maybe", "maybe later"))]
    got, logs, _ = submit_all(eng_llama, reqs)
    assert got[0].text in long_choices and got[2].text in ("maybe", "maybe later")
    # the choice's EOS is proposed and accepted inside the span: the row ends there, as alone
    assert got[0].finish_reason == "stop" and got[0].finish_detail == "eos"
    assert got[0].stats.spec["source"] == "constraint" and got[0].stats.spec["accepted"] > 0
    for req, r, log in zip(reqs, got, logs):
        ref, ref_events = alone(ref_llama, req)
        assert r.tokens == ref.tokens and texts(log) == texts(ref_events)
        assert (r.finish_reason, r.finish_detail) == (ref.finish_reason, ref.finish_detail)


def check_sampled(e: Engine, got, logs) -> None:
    """Sampled batched rows: valid token ids, ended as a row ends, and sent as they came."""
    vocab = e.loaded.tokenizer.vocab_size
    for r, log in zip(got, logs):
        assert r.stats.batched and r.finish_reason in ("length", "stop")
        assert all(0 <= t < vocab for t in r.tokens)
        assert [ev.token for ev in log if isinstance(ev, TokenEvent) and ev.token is not None] == r.tokens


def test_sampled_rows_speculate_and_give_valid_tokens(eng_llama):
    prompts = repetitive(4, seed=5)
    reqs = [Request(prompt_tokens=p, params=SamplingParams(max_tokens=30, temperature=0.05, top_p=0.9),
                    spec="ngram") for p in prompts]
    got, logs, _ = submit_all(eng_llama, reqs)
    check_sampled(eng_llama, got, logs)


@pytest.fixture(scope="module")
def demo():
    from mlxkv.engine.settings import DEMO_MODEL

    with Engine(str(DEMO_MODEL), max_batch=8).start(timeout=T) as e:
        assert "draft" in e.spec_providers
        yield e


def test_draft_model_rows_equal_alone(demo):
    from support.demo.facts import FACTS

    reqs = [Request(messages=[{"role": "user", "content": FACTS[i]["q"][0]}],
                    params=greedy(max_tokens=40 + 4 * i), spec="draft") for i in range(4)]
    refs = [alone(demo, r) for r in reqs]
    got, logs, _ = submit_all(demo, reqs)
    for r, log, (ref, ref_events) in zip(got, logs, refs):
        assert r.stats.batched and r.stats.spec["source"] == "draft"
        assert r.tokens == ref.tokens and texts(log) == texts(ref_events)
        assert (r.finish_reason, r.finish_detail) == (ref.finish_reason, ref.finish_detail)
    assert sum(r.stats.spec["accepted"] for r in got) > 0


def test_a_lone_draft_model_request_is_a_batch_of_one_until_another_joins(demo, monkeypatch):
    """Under ``auto`` the demo model drafts with its draft model: a request alone starts in
    a batch of one and drafts there as alone (no lone path: no single-stream prefill of its
    prompt); when another request joins, its draft model makes way (a plain batched step
    beats row-by-row drafts), and both outputs stay plain decoding's."""
    from mlxkv.engine import single
    from support.demo.facts import FACTS

    lone_runs: list = []
    run = single.SingleStream.run
    monkeypatch.setattr(single.SingleStream, "run", lambda self, job: lone_runs.append(job) or run(self, job))
    ask = [Request(messages=[{"role": "user", "content": FACTS[i]["q"][0]}],
                   params=greedy(max_tokens=60), spec="auto") for i in range(2)]
    refs = [alone(demo, r)[0] for r in ask]
    lone_runs.clear()
    first = demo.submit(ask[0]).result(timeout=T)
    assert first.tokens == refs[0].tokens and not first.stats.batched
    assert first.stats.spec["source"] == "draft" and not lone_runs
    # B arrives once A has sent a few tokens: A goes on beside it, without its draft model
    handles: list = []

    def on_a(ev):
        if isinstance(ev, TokenEvent) and ev.token is not None and len(handles) == 1 \
                and len(handles[0].tokens) == 4:
            handles.append(demo.submit(ask[1]))
    handles.append(demo.submit(ask[0], callback=on_a))
    a = handles[0].result(timeout=T)
    assert len(handles) == 2
    b = handles[1].result(timeout=T)
    assert [a.tokens, b.tokens] == [refs[0].tokens, refs[1].tokens]
    assert a.stats.batched and b.stats.batched and not lone_runs
    assert (a.stats.spec or {}).get("source") != "draft" and (b.stats.spec or {}).get("source") != "draft"


def test_sampled_rows_of_the_demo_pair_draft_and_decode(demo):
    # temperature > 0: the draft model's rows go through rejection sampling, prompt
    # lookup's through exact match; both draft on the trained demo model
    from support.demo.facts import FACTS

    doc = "\n".join(f["a"][0] for f in FACTS)
    quote = [{"role": "system", "content": "Answer with quotes from this document:\n" + doc},
             {"role": "user", "content": FACTS[3]["q"][0]}]
    sampled = SamplingParams(max_tokens=40, temperature=0.7)
    reqs = [Request(messages=[{"role": "user", "content": FACTS[i]["q"][0]}], params=sampled, spec="draft")
            for i in range(2)]
    reqs += [Request(messages=quote, params=sampled, spec="ngram") for _ in range(2)]
    got, logs, _ = submit_all(demo, reqs)
    check_sampled(demo, got, logs)
    assert sum(r.stats.spec["accepted"] for r in got[:2]) > 0
    assert sum(r.stats.spec["drafted"] for r in got[2:]) > 0


def test_rounds_cut_to_the_shortest_row_stay_lossless(eng_llama, ref_llama, monkeypatch):
    # When padding would outgrow the rows, a round keeps only the shortest row's count: a row
    # that accepted more emits fewer and takes the verified draft at that position as its
    # next token. Forced here for every round.
    from mlxkv.engine.speculation.batch_verify import BatchVerifier

    monkeypatch.setattr(BatchVerifier, "_common_length", staticmethod(lambda cache, keep: min(keep)))
    prompts = repetitive(4, seed=5)
    reqs = [Request(prompt_tokens=p, params=greedy(max_tokens=36), spec="ngram") for p in prompts]
    reqs[3].guided_choice = ("the prefix cache keeps every conversation in RAM and on the SSD",)
    got, logs, _ = submit_all(eng_llama, reqs)
    for req, r, log in zip(reqs, got, logs):
        ref, ref_events = alone(ref_llama, req)
        assert r.tokens == ref.tokens and texts(log) == texts(ref_events)
    assert sum(r.stats.spec["drafted"] for r in got) > 0  # rounds ran (a row without drafts keeps them to 1)
