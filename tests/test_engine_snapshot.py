"""The figures the engine thread publishes (``engine.snapshot``): ``stats()`` and the cache
listing answer at once while a long prefill runs, and show it in progress; an idle engine
answers as of now; what each request's lookup found (``lookups``) is kept, the last N."""

from __future__ import annotations

import random
import time

import pytest
from common import T

from mlxkv.engine.engine import Engine, ProgressEvent, Request
from mlxkv.engine.generate import SamplingParams
from mlxkv.engine.settings import Settings
from support.modelgen import tiny_model

SLOW = dict(hidden_size=128, intermediate_size=512, num_hidden_layers=4)  # seconds per chunk


def prompt(n: int, seed: int = 5) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 500) for _ in range(n)]


def one(n: int = 2048) -> SamplingParams:
    return SamplingParams(max_tokens=1, temperature=0.0, prefill_step_size=n)


@pytest.fixture(scope="module")
def slow_engine(tmp_path_factory):
    settings = Settings.defaults(model=str(tiny_model("qwen3", **SLOW)), spec="off",
                                 cache_dir=str(tmp_path_factory.mktemp("cache")), lookup_history=3)
    with Engine.from_settings(settings).start(timeout=T) as eng:
        yield eng


def test_stats_and_listing_answer_during_a_long_prefill_and_show_it(slow_engine):
    eng = slow_engine
    eng.submit(Request(prompt_tokens=prompt(40, seed=1), params=one())).result(timeout=T)
    listed = [e.id for e in eng.cache_entries(timeout=T)]  # asked for: kept up from now on
    assert listed
    toks = prompt(2048)  # one chunk: before, nothing could answer until it was done
    h = eng.submit(Request(prompt_tokens=toks, params=one()))
    next(e for e in h.events(timeout=T) if isinstance(e, ProgressEvent))  # its prefill started
    answers, running = 0, []
    deadline = time.monotonic() + 10
    while not running and time.monotonic() < deadline:
        s = eng.stats(timeout=1.0)  # one layer of the chunk takes longer than this under load
        answers += 1
        running = [r for r in s["running"] if r["id"] == h.id]
        time.sleep(0.02)
    entries = eng.cache_entries(timeout=1.0)
    still = h.progress.done < h.progress.total and not h.tokens
    assert still, "the prefill ended before the figures were read: use a longer prompt"
    [r] = running
    assert r["phase"] == "prefill" and r["prompt_tokens"] == len(toks) and r["prefill_done"] < len(toks)
    assert s["busy"] and s["active"] == 1 and s["age_s"] >= 0 and s["as_of"] <= time.time()
    assert [e.id for e in entries] == listed  # the listing the engine published
    lookup = s["lookups"][-1]
    assert lookup["request"] == h.id and lookup["prompt_tokens"] == len(toks)
    assert h.result(timeout=T).finish_reason == "length"
    eng.sync(timeout=T)  # its state stored: the engine is idle (but for the sync itself)
    done = eng.stats(timeout=T)
    while done["busy"] and time.monotonic() < deadline + T:  # the sync's own end
        done = eng.stats(timeout=T)
    assert done["running"] == [] and done["age_s"] < 1.0  # idle: as of now
    assert len(eng.cache_entries(timeout=T)) == len(listed) + 1  # idle: listed again now
    snap = eng.snapshot()
    assert snap is not None and snap["requests"] == done["requests"]


def test_the_last_n_lookups_are_kept(slow_engine):
    eng = slow_engine
    ids = [eng.submit(Request(prompt_tokens=prompt(30, seed=s), params=one())) for s in range(4)]
    for h in ids:
        h.result(timeout=T)
    kept = eng.stats(timeout=T)["lookups"]
    assert [r["request"] for r in kept] == [h.id for h in ids[-3:]]  # lookup_history = 3
    assert all(h.cache_report is not None and h.cache_report.request == h.id for h in ids)
