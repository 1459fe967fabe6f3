"""The engine's public surface for front ends, on real tiny models: stats, the cache
wrappers, engine-wide events, prefill progress, honest timings, the context limit, the
retry without a cached prefix that failed, and no event lost to Ctrl-C."""

import contextlib
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from common import T, greedy

from mlxkv.engine.engine import (
    CacheEvent,
    Engine,
    EngineError,
    FinishedEvent,
    LoadEvent,
    ProgressEvent,
    Request,
    RequestRefused,
    StatsEvent,
    TokenEvent,
)
from mlxkv.engine.generate import SamplingParams
from support.modelgen import tiny_model


def ram_cache():
    from mlxkv.engine.cache.prefix_cache import PrefixCache

    return PrefixCache(ram_bytes=64 << 20, cache_dir=None, block_tokens=16)


@pytest.fixture(scope="module")
def eng(tiny_qwen3):
    with Engine(str(tiny_qwen3)).start(timeout=T) as e:
        yield e


TEXT = ("the cache keeps every block of the conversation on disk so that a restart returns "
        "instantly; import os, sys; def main(argv): return 0 # mlx engine ")


def test_stats_and_info(eng):
    before = eng.stats(timeout=T)
    eng.submit(Request(prompt=TEXT, params=greedy(max_tokens=3))).result(timeout=T)
    s = eng.stats(timeout=T)
    assert s["requests"] == before["requests"] + 1
    assert s["load_s"] > 0 and s["model"]["load_s"] == s["load_s"]
    assert s["model"]["fingerprint"] == eng.loaded.fingerprint
    assert s["model"]["context_tokens"] == 32768
    assert s["namespace"] == eng.namespace and s["busy"] is False
    assert s["cache"] == {"enabled": False}  # no prefix cache on this engine


def test_stats_answer_between_tokens_of_a_running_generation(eng):
    """A front end polling stats while a long reply streams is answered at once, not
    after the reply."""
    first = threading.Event()
    h = eng.submit(Request(prompt="go on", params=SamplingParams(
        max_tokens=100_000, temperature=1.0, seed=1)),
        callback=lambda ev: isinstance(ev, TokenEvent) and first.set())
    try:
        assert first.wait(T)
        s = eng.stats(timeout=T)
        assert s["busy"] is True
        assert s["queued"] == 0  # the call's own wake-up marker is not a queued request
        assert eng.encode("abc", timeout=T)
    finally:
        h.cancel()
    r = h.result(timeout=T)
    assert r.finish_reason == "cancelled" and len(r.tokens) < 100_000


def test_public_methods_without_call(eng):
    tokens = eng.encode(TEXT, timeout=T)
    assert tokens and eng.decode(tokens, timeout=T) == TEXT
    chat = eng.encode_chat([{"role": "user", "content": "hi"}], timeout=T)
    assert eng.decode(chat, timeout=T).startswith("<|im_start|>user\nhi")
    # Without a prefix cache every wrapper answers like the null cache.
    assert eng.cache_entries(timeout=T) == []
    assert eng.cache_entry("0" * 32, timeout=T) is None
    assert eng.cache_pin("0" * 32, timeout=T) is False
    assert eng.cache_evict("0" * 32, timeout=T) is False
    assert eng.cache_delete("0" * 32, timeout=T) is False
    assert eng.cache_verify(timeout=T)["checked"] == 0
    assert isinstance(eng.cache_flush(timeout=10), dict)
    eng.open_session("s", timeout=T)
    eng.close_session("s", timeout=T)


def test_a_busy_engine_times_out_with_engine_error(tiny_qwen3):
    with Engine(str(tiny_qwen3)).start(timeout=T) as e:
        gate = threading.Event()
        e.call(gate.wait, T)  # occupy the engine thread (not a generation)
        try:
            with pytest.raises(EngineError, match="did not answer"):
                e.stats(timeout=0.2)
        finally:
            gate.set()
        assert e.stats(timeout=T)["requests"] == 0
    with pytest.raises(EngineError, match="not running"):
        e.stats(timeout=T)


def test_progress_events_per_prefill_chunk(eng):
    tokens = eng.encode(TEXT * 2, timeout=T)
    n = len(tokens)
    seen = []
    h = eng.submit(Request(prompt_tokens=tokens, params=greedy(max_tokens=4, prefill_step_size=7)),
                   callback=seen.append)
    r = h.result(timeout=T)
    progress = [(e.done, e.total) for e in seen if isinstance(e, ProgressEvent)]
    # The prompt but its last token goes in chunks of 7; the last token enters decoding (the
    # batch's first step), which gives the first token with the final (n, n).
    chunks = sorted(set(range(7, n - 1, 7)) | {n - 1})
    assert progress == [(0, n)] + [(d, n) for d in chunks] + [(n, n)]
    first_token = next(i for i, e in enumerate(seen) if isinstance(e, TokenEvent))
    assert all(isinstance(e, ProgressEvent) for e in seen[:first_token])
    assert h.progress == ProgressEvent(n, n)
    # The progress hook observes only: same tokens as without small chunks.
    plain = eng.submit(Request(prompt_tokens=tokens, params=greedy(max_tokens=4))).result(
        timeout=T)
    assert r.tokens == plain.tokens


def test_cache_events_and_load_events(tiny_qwen3):
    got = []
    e = Engine(str(tiny_qwen3), prefix_cache=ram_cache())
    unsubscribe = e.subscribe(got.append)
    with e.start(timeout=T):
        loads = [ev for ev in got if isinstance(ev, LoadEvent)]
        assert [ev.stage for ev in loads] == ["model", "prefix cache", "ready"]
        assert loads[-1].done == loads[-1].total
        e.submit(Request(prompt=TEXT, params=greedy(max_tokens=3))).result(timeout=T)
        e.sync(timeout=T)  # the store runs after the finished event
        kinds = [ev.kind for ev in got if isinstance(ev, CacheEvent)]
        assert "store" in kinds and all(":" not in k and "." not in k for k in kinds)
        store = next(ev for ev in got if isinstance(ev, CacheEvent) and ev.kind == "store")
        assert store.data["tokens"] > 0 and "type" not in store.data
        assert e.stats(timeout=T)["cache"]["enabled"] is True
        unsubscribe()
        n = len(got)
        e.submit(Request(prompt=TEXT + " more", params=greedy(max_tokens=3))).result(timeout=T)
        e.sync(timeout=T)
        assert len(got) == n


def test_cache_wrappers_reach_the_facade(tiny_qwen3):
    pc = ram_cache()
    with Engine(str(tiny_qwen3), prefix_cache=pc).start(timeout=T) as e:
        e.submit(Request(prompt=TEXT, params=greedy(max_tokens=3))).result(timeout=T)
        e.sync(timeout=T)
        entries = e.cache_entries(timeout=T)
        assert len(entries) == 1 and entries[0].ns == e.namespace
        assert e.cache_entries(namespace="other", timeout=T) == []
        detail = e.cache_entry(entries[0].id, timeout=T)
        assert detail is not None and detail.info.id == entries[0].id
        assert e.cache_pin(entries[0].id, timeout=T) is True
        assert e.cache_entries(timeout=T)[0].pinned
        assert e.cache_delete(entries[0].id, timeout=T) is True
        assert e.cache_entries(timeout=T) == []


def test_ttft_counts_from_serving_and_load_is_reported(tiny_qwen3):
    """A request queued while the model loads: load_s is the part of queue_s spent on
    the load, and ttft_s starts when the request starts being served."""
    first = []
    t0 = time.perf_counter()
    e = Engine(str(tiny_qwen3)).start(wait=False)
    try:
        early = e.stats(timeout=T)  # answered at once, loaded or not
        assert early["loading"] in (True, False) and early["requests"] == 0
        h = e.submit(Request(prompt=TEXT, params=greedy(max_tokens=3)), callback=lambda ev: (
            isinstance(ev, TokenEvent) and not first and first.append(time.perf_counter())))
        s = h.result(timeout=T).stats
        wall = first[0] - t0  # from before submit to the first token's callback
        assert 0 < s.load_s <= s.queue_s
        assert s.queue_s + s.ttft_s <= wall  # ttft does not count the queue (or the load)
        later = e.submit(Request(prompt=TEXT, params=greedy(max_tokens=3))).result(timeout=T)
        assert later.stats.load_s == 0.0
    finally:
        e.shutdown()


@pytest.fixture(scope="module")
def small_context_engine():
    with Engine(str(tiny_model("qwen3", max_position_embeddings=64))).start(timeout=T) as e:
        yield e


def test_prompt_longer_than_the_context_is_refused(small_context_engine):
    e = small_context_engine
    tokens = e.encode(TEXT * 4, timeout=T)[:100]
    h = e.submit(Request(prompt_tokens=tokens, params=greedy(max_tokens=8)))
    with pytest.raises(RequestRefused) as err:
        h.result(timeout=T)
    assert str(err.value) == ("the prompt is 100 tokens; the model's context is 64 tokens "
                              "(use --truncate to keep the last 56)")
    assert isinstance(err.value, ValueError) and isinstance(err.value, EngineError)
    # truncate: the last 56 tokens, exactly as if only they had been given
    r = e.submit(Request(prompt_tokens=tokens, params=greedy(max_tokens=8), truncate=True)
                 ).result(timeout=T)
    ref = e.submit(Request(prompt_tokens=tokens[-56:], params=greedy(max_tokens=8))
                   ).result(timeout=T)
    assert r.stats.prompt_tokens == 56 and r.tokens == ref.tokens


def test_the_context_tokens_setting_replaces_the_models_context():
    """An agent's prompt longer than the model's own context runs with --context-tokens above
    it; below it, the setting is the limit a prompt is refused by."""
    from mlxkv.engine.settings import Settings

    model = str(tiny_model("qwen3", max_position_embeddings=64))
    with Engine(model, settings=Settings.defaults(model=model, context_tokens=128)).start(timeout=T) as e:
        tokens = e.encode(TEXT * 4, timeout=T)[:100]
        r = e.submit(Request(prompt_tokens=tokens, params=greedy(max_tokens=8))).result(timeout=T)
        assert r.stats.prompt_tokens == 100 and len(r.tokens) == 8
        assert e.stats()["model"]["context_tokens"] == 128
    with Engine(model, settings=Settings.defaults(model=model, context_tokens=32)).start(timeout=T) as e:
        h = e.submit(Request(prompt_tokens=tokens[:40], params=greedy(max_tokens=8)))
        with pytest.raises(RequestRefused, match=r"the prompt is 40 tokens; the context \(--context-tokens\) is 32"):
            h.result(timeout=T)


def test_generation_stops_at_the_end_of_the_context(small_context_engine):
    e = small_context_engine
    tokens = e.encode(TEXT * 4, timeout=T)[:60]
    e.call(lambda: setattr(e.loaded.tokenizer, "eos_token_ids", set())).result(timeout=T)
    r = e.submit(Request(prompt_tokens=tokens, params=SamplingParams(
        max_tokens=20, temperature=1.0, seed=0))).result(timeout=T)
    assert (r.finish_reason, r.finish_detail, len(r.tokens)) == ("length", "context", 4)


def test_a_huge_text_prompt_is_refused_before_any_prefill(eng):
    text = (TEXT * 1000)[:100_000]
    h = eng.submit(Request(prompt=text, params=greedy(max_tokens=8)))
    with pytest.raises(RequestRefused, match=r"the model's context is 32768 tokens"):
        h.result(timeout=T)
    assert not any(isinstance(ev, ProgressEvent) for ev in h._log)


def test_blank_prompts_are_refused(eng):
    for bad in (dict(prompt="   "), dict(messages=[{"role": "system", "content": ""},
                                                   {"role": "user", "content": "\n"}])):
        with pytest.raises(ValueError, match="the prompt is empty"):
            Request(**bad)
    # content given as parts (multimodal chat templates) is not blank
    Request(messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    req = Request(prompt="x")
    req.prompt = " "  # changed after it was checked
    with pytest.raises(RequestRefused, match="the prompt is empty"):
        eng.submit(req).result(timeout=T)


def test_a_failing_cached_prefix_is_dropped_and_the_request_answered_without_it(
        tiny_qwen3, caplog):
    """A state with the wrong shape is stored through the cache's public store; the request
    it seeds fails in the prefill, and the caller gets the answer computed from scratch."""
    pc = ram_cache()
    with Engine(str(tiny_qwen3), prefix_cache=pc).start(timeout=T) as e:
        tokens = e.encode(TEXT, timeout=T)
        prefix = tokens[:32]
        heads = e.loaded.config["num_key_value_heads"]

        def plant():
            import mlx.core as mx
            from mlx_lm.models.cache import KVCache

            layers = []
            for _ in range(e.loaded.config["num_hidden_layers"]):
                c = KVCache()
                bad = mx.ones((1, heads, len(prefix), 3))  # head_dim is 16
                c.update_and_fetch(bad, bad)
                layers.append(c)
            pc.store(prefix, layers, e.namespace)

        e.call(plant).result(timeout=T)
        with caplog.at_level(logging.WARNING, logger="mlxkv.engine"):
            seen = []
            r = e.submit(Request(prompt_tokens=tokens, params=greedy(max_tokens=6)),
                         callback=seen.append).result(timeout=T)
        assert r.stats.retried and r.stats.cached_tokens == 0
        warnings = [m for m in caplog.messages if "cached prompt prefix could not be used" in m]
        assert len(warnings) == 1
        assert sum(isinstance(ev, FinishedEvent) for ev in seen) == 1
        assert sum(isinstance(ev, StatsEvent) for ev in seen) == 1
        e.sync(timeout=T)
        again = e.submit(Request(prompt_tokens=tokens, params=greedy(max_tokens=6))
                         ).result(timeout=T)
        if hasattr(pc, "invalidate"):
            assert not again.stats.retried  # the bad state is gone
        assert e.stats(timeout=T)["retries"] >= 1
    with Engine(str(tiny_qwen3)).start(timeout=T) as plain:
        ref = plain.submit(Request(prompt_tokens=tokens, params=greedy(max_tokens=6))
                           ).result(timeout=T)
    assert r.tokens == ref.tokens and r.text == ref.text
    assert again.tokens == ref.tokens


def test_ctrl_c_while_waiting_loses_no_event(eng):
    """An interrupt (as Ctrl-C: KeyboardInterrupt) delivered to the waiting thread just as
    the request ends: waiting again always gets the whole result. It used to block forever
    when the interrupt landed between taking the final event off the queue and recording
    it. A tiny thread switch interval lets the interrupt land at many different points."""
    main = threading.get_ident()
    tokens = eng.encode(TEXT, timeout=T)
    ref = eng.submit(Request(prompt_tokens=tokens, params=greedy(max_tokens=2))).result(
        timeout=T)
    fired = []

    def interrupt(signum, frame):
        fired.append(signum)
        raise KeyboardInterrupt

    # The signal also writes to a pipe: waiting on it cannot miss a signal that lands just
    # before the wait starts (a blocked lock acquire would sleep through it).
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    previous = signal.signal(signal.SIGUSR1, interrupt)
    previous_fd = signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for i in range(40):
            box, go = [], threading.Event()

            def kick(box=box, go=go):
                # once the final event is out, interrupt the waiter
                if go.wait(T) and box[0].done.wait(T):
                    signal.pthread_kill(main, signal.SIGUSR1)

            threading.Thread(target=kick, daemon=True).start()
            h = eng.submit(Request(prompt_tokens=tokens, params=greedy(max_tokens=2)))
            box.append(h)
            result, interrupts = None, 0
            while True:
                try:
                    go.set()  # here, so that the interrupt always lands inside this try
                    if result is None:
                        result = h.result(timeout=20)
                    if len(fired) == i:  # not handled yet: wait for it to arrive
                        assert select.select([wake_r], [], [], T)[0], "no signal came"
                        signal.pthread_kill(main, 0)  # runs the pending handler here
                    break
                except KeyboardInterrupt:
                    interrupts += 1
            with contextlib.suppress(BlockingIOError):
                os.read(wake_r, 4096)
            assert len(fired) == i + 1 and interrupts == 1
            assert result.tokens == ref.tokens and result.finish_reason == ref.finish_reason
            events = list(h.events(timeout=20))
            assert isinstance(events[-1], FinishedEvent)
            assert [ev.token for ev in events if isinstance(ev, TokenEvent)
                    and ev.token is not None] == ref.tokens
    finally:
        sys.setswitchinterval(interval)
        signal.set_wakeup_fd(previous_fd)
        signal.signal(signal.SIGUSR1, previous)
        os.close(wake_r)
        os.close(wake_w)


SWEEP = r'''
import os, signal, sys, threading
from mlxkv.engine.blas import preload
preload()
from mlxkv.engine.engine import Engine, Request, FinishedEvent
from mlxkv.engine.generate import SamplingParams

def interrupt(signum, frame):
    raise KeyboardInterrupt

signal.signal(signal.SIGUSR1, interrupt)

def at_point(k, active):
    """A profile hook that sends SIGUSR1 to this process at the k-th point of this thread
    where the interpreter checks for signals (a function starts or resumes, a C call
    returns): the handler runs, and raises, right there."""
    seen = [0]
    def hook(frame, event, arg):
        if active[0] and event in ("call", "c_return"):
            seen[0] += 1
            if seen[0] == k:
                os.kill(os.getpid(), signal.SIGUSR1)
    return hook, seen

def consume(how, h, k):
    """Read request h by `how`, with an interrupt at the k-th point; then read again."""
    got, active = [], [True]
    hook, seen = at_point(k, active)
    sys.setprofile(hook)
    try:
        if how == "result":
            got.append(h.result(timeout=5))
        else:
            got.extend(h.events(timeout=5))
        active[0] = False
    except KeyboardInterrupt:
        active[0] = False
    sys.setprofile(None)
    if how == "result":
        return h.result(timeout=5), seen[0] >= k
    if not got or not isinstance(got[-1], FinishedEvent):
        got.extend(h.events(timeout=5))
    return got, seen[0] >= k

params = SamplingParams(max_tokens=3, temperature=0.0, top_p=1.0)
with Engine(sys.argv[1]).start(timeout=60) as eng:
    tokens = eng.call(lambda: list(eng.loaded.tokenizer.encode("the cache keeps"))).result(60)
    for how in ("result", "events"):
        ref = eng.submit(Request(prompt_tokens=tokens, params=params))
        assert ref.done.wait(60)
        full = list(ref.events(timeout=5)) if how == "events" else ref.result(timeout=5)
        k, hit = 0, True
        while hit:  # every landing point along the read path, until none is left
            k += 1
            h = eng.submit(Request(prompt_tokens=tokens, params=params))
            assert h.done.wait(60)  # all events are out: the read path never waits
            got, hit = consume(how, h, k)
            if how == "events":
                assert [type(e) for e in got] == [type(e) for e in full], (k, got)
                assert isinstance(got[-1], FinishedEvent)
            else:
                assert got.tokens == full.tokens and got.finish_reason == full.finish_reason
        print(how, k, flush=True)
print("ok", flush=True)
'''


def test_an_interrupt_at_any_point_of_reading_loses_nothing(tiny_qwen3):
    """A real signal whose handler raises KeyboardInterrupt, delivered at each call/return
    of the thread reading a finished request (result() or events()), one point per
    request: reading again gets every event. Run in a child process with a deadline, as
    the old handle could hang (a queue lock left held, an event taken but not recorded)."""
    r = subprocess.run([sys.executable, "-c", SWEEP, str(tiny_qwen3)], capture_output=True,
                       text=True, timeout=120, cwd=Path(__file__).resolve().parent.parent)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr[-3000:]
    counts = dict(line.split() for line in r.stdout.split("\n")[:2])
    assert int(counts["result"]) > 5 and int(counts["events"]) > 5


# ----------------------------------------------------------------------------- cache tiers
CHAT = [{"role": "user", "content": TEXT + TEXT}]


def disk_cache(root, **kw):
    from mlxkv.engine.cache.prefix_cache import PrefixCache

    return PrefixCache(ram_bytes=64 << 20, cache_dir=str(root), block_tokens=16, **kw)


def ask(e, messages, session=None):
    return e.submit(Request(messages=messages, session=session, params=greedy(max_tokens=4))
                    ).result(timeout=T)


def test_stats_event_says_which_tier_served_the_cached_tokens(tiny_qwen3, tmp_path):
    with Engine(str(tiny_qwen3), prefix_cache=disk_cache(tmp_path)).start(timeout=T) as e:
        first = ask(e, CHAT)
        assert (first.stats.cached_ram_tokens, first.stats.cached_ssd_tokens) == (0, 0)
        again = ask(e, CHAT).stats  # the state the first request stored, in RAM
        assert again.cached_tokens > 0 and again.cached_ram_tokens == again.cached_tokens
        assert again.cached_ssd_tokens == 0
    # a restart: the same folder, nothing in RAM
    with Engine(str(tiny_qwen3), prefix_cache=disk_cache(tmp_path)).start(timeout=T) as e:
        s = ask(e, CHAT).stats
        assert s.cached_tokens > 0 and s.cached_ssd_tokens == s.cached_tokens
        assert s.cached_ram_tokens == 0


def test_stats_event_says_how_many_prompt_tokens_the_request_stored(tiny_qwen3):
    longer = [*CHAT, {"role": "assistant", "content": "ok"}, {"role": "user", "content": TEXT}]
    with Engine(str(tiny_qwen3), prefix_cache=ram_cache()).start(timeout=T) as e:
        first = ask(e, CHAT).stats
        assert first.cached_tokens == 0 and first.stored_tokens == first.prompt_tokens
        again = ask(e, CHAT).stats  # all but its last token read: that one is stored
        assert (again.cached_tokens, again.stored_tokens) == (again.prompt_tokens - 1, 1)
        more = ask(e, longer).stats
        assert more.cached_tokens > 0 and more.stored_tokens == more.prompt_tokens - more.cached_tokens
        # decoded in a batch: the same count
        handles = [e.submit(Request(messages=[{"role": "user", "content": f"{i} {TEXT}"}],
                                    params=greedy(max_tokens=24))) for i in range(3)]
        for stats in (h.result(timeout=T).stats for h in handles):
            assert stats.stored_tokens == stats.prompt_tokens - stats.cached_tokens > 0
        assert any(h.result(timeout=T).stats.batched for h in handles)
    with Engine(str(tiny_qwen3)).start(timeout=T) as e:  # no prefix cache: nothing stored
        assert ask(e, CHAT).stats.stored_tokens == 0


def test_prefetch_after_a_restart_warms_the_conversation_into_ram(tiny_qwen3, tmp_path):
    with Engine(str(tiny_qwen3), prefix_cache=disk_cache(tmp_path)).start(timeout=T) as e:
        reply = ask(e, CHAT, session="chat")
    follow_up = [*CHAT, {"role": "assistant", "content": reply.text},
                 {"role": "user", "content": "and then?"}]
    got = []
    with Engine(str(tiny_qwen3), prefix_cache=disk_cache(tmp_path)).start(timeout=T) as e:
        e.subscribe(got.append)
        warm = e.prefetch(follow_up, session="chat").result(timeout=T)
        assert warm > 0
        assert e.stats(timeout=T)["cache"]["ram_entries"] == 1
        s = ask(e, follow_up, session="chat").stats
        assert s.cached_tokens >= warm and s.cached_ram_tokens == s.cached_tokens
        assert s.cached_ssd_tokens == 0
        assert e.prefetch([], session="chat").result(timeout=T) == 0
    assert any(isinstance(ev, CacheEvent) and ev.kind == "prefetch" and ev.data["restored"] == warm
               for ev in got)
    with Engine(str(tiny_qwen3)).start(timeout=T) as plain:  # no prefix cache: nothing warm
        assert plain.prefetch(CHAT).result(timeout=T) == 0


def test_cache_gc_verify_progress_and_queue_figures(tiny_qwen3, tmp_path):
    got = []
    pc = disk_cache(tmp_path, ssd_bytes=64 << 20)
    with Engine(str(tiny_qwen3), prefix_cache=pc).start(timeout=T) as e:
        e.subscribe(got.append)
        ask(e, CHAT)
        ask(e, [{"role": "user", "content": TEXT[::-1]}])
        e.cache_flush(timeout=T)
        c = e.stats(timeout=T)["cache"]
        assert c["queues"]["storage_pending_reads"] == 0 and c["ssd_max_bytes"] == 64 << 20
        assert e.cache_verify(timeout=T)["ok"] == 2
        progress = [(ev.data["done"], ev.data["total"]) for ev in got
                    if isinstance(ev, CacheEvent) and ev.kind == "verify"]
        assert progress == [(1, 2), (2, 2)]
        assert e.cache_gc(timeout=T)["removed"] == 0  # every block is named by a saved state
        for man in tmp_path.glob("*/manifests/*.man"):  # the saved states' names are lost
            man.unlink()
        rep = e.cache_gc(timeout=T)
        assert rep["removed"] > 0 and rep["bytes"] > 0
        assert e.cache_gc(timeout=T)["removed"] == 0
    with Engine(str(tiny_qwen3)).start(timeout=T) as plain:
        assert plain.cache_gc(timeout=T) == {"removed": 0, "bytes": 0, "live_keys": 0,
                                             "manifests_removed": 0, "unreadable_manifests": {}}
