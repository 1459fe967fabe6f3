"""Stall-free batching: the prefill chunk of a batch step with decoding rows comes from the
measured cost of the steps (engine.step_budget), and on a real tiny model a stream keeps
getting tokens, one per step, while another request's long prompt prefills beside it, with
the same tokens it gets alone."""

from __future__ import annotations

import random
import threading

import pytest
from common import T, greedy

from mlxkv.engine.engine import Engine, ProgressEvent, Request, TokenEvent
from mlxkv.engine.settings import Settings, SettingsError
from mlxkv.engine.step_budget import MIN_CHUNK, PROBE_CHUNK, StepBudget


def test_the_chunk_follows_the_cost_of_the_steps():
    b = StepBudget(3.0)
    assert b.chunk(1, 4096) == PROBE_CHUNK  # nothing measured yet
    b.observe(PROBE_CHUNK, 1.0)
    assert b.chunk(1, 4096) == PROBE_CHUNK  # no decode step known: nothing to aim at
    for _ in range(5):
        b.observe(0, 0.05)  # decode steps alone: 50 ms
    b.observe(0, 9.0)  # one slow one (a trace) does not move the median
    assert b.decode_s == pytest.approx(0.05)
    # a step 100 ms + 2 ms a token: the chunk settles where the step is 3 decode steps
    for _ in range(30):
        n = b.chunk(1, 4096)
        b.observe(n, 0.1 + 0.002 * n)
    n = b.chunk(1, 4096)
    assert 20 <= n <= 28 and 0.1 + 0.002 * n <= 3.0 * 0.05 * 1.1
    # the context grew: every pass costs more, the chunk follows down to the floor
    for _ in range(10):
        n = b.chunk(1, 4096)
        b.observe(n, 0.3 + 0.002 * n)
    assert b.chunk(1, 4096) == MIN_CHUNK
    assert b.chunk(1, 10) == 10  # never past the request's own chunk
    assert b.chunk(0, 2048) == 2048  # nothing decoding: a lone prompt's chunk


def test_one_step_moves_the_chunk_by_a_bounded_factor():
    b = StepBudget(3.0)
    b.observe(0, 0.1)
    b.observe(100, 0.01)  # far cheaper than the aim: grows, by 1.5 at most
    assert b.chunk(1, 4096) == 150
    b.observe(150, 0.6)  # twice the aim: halves
    assert b.chunk(1, 4096) == 75
    b.observe(300, 100.0)  # far dearer: shrinks, to a tenth at most
    assert b.chunk(1, 4096) == 30


def test_the_factor_is_a_setting_above_one():
    assert Settings.defaults().batch_itl_factor == 3.0
    with pytest.raises(SettingsError, match="above 1"):
        Settings.defaults(batch_itl_factor="1")
    with pytest.raises(ValueError):
        StepBudget(0.5)


def a_stream_and_a_long_prompt(model, seed: int, a_tokens: int, prompt: int, b_tokens: int,
                               prefill_step: int, factor: float) -> tuple[Request, Request, Settings]:
    """A (a 20-token prompt, ``a_tokens`` to decode), B (a ``prompt``-token prompt fed in
    steps of at most ``prefill_step``, ``b_tokens`` to decode), both plain, and the settings
    of an engine on ``model`` without a prefix cache whose budget has ``factor``."""
    rng = random.Random(seed)
    short = [rng.randrange(3, 500) for _ in range(20)]
    long = [rng.randrange(3, 500) for _ in range(prompt)]
    a_req = Request(prompt_tokens=short, params=greedy(max_tokens=a_tokens), spec="off")
    b_req = Request(prompt_tokens=long, params=greedy(max_tokens=b_tokens, prefill_step_size=prefill_step),
                    spec="off")
    settings = Settings.load({"model": str(model), "prefix_cache": False, "batch_itl_factor": factor})
    return a_req, b_req, settings


def test_a_stream_keeps_decoding_while_a_long_prompt_prefills_beside_it(tiny_qwen3):
    a_req, b_req, settings = a_stream_and_a_long_prompt(tiny_qwen3, 5, 300, 700, 2, 2048, 1.01)
    with Engine(str(tiny_qwen3), max_batch=1).start(timeout=T) as alone:
        ref = alone.submit(a_req).result(timeout=T).tokens
    with Engine(str(tiny_qwen3), settings=settings).start(timeout=T) as e:
        handles: list = []
        a_tokens_before_b = []  # A's tokens sent while B had not sent its first
        b_progress: list[int] = []
        b_started = threading.Event()

        def on_b(ev):
            if isinstance(ev, ProgressEvent):
                b_progress.append(ev.done)
            elif isinstance(ev, TokenEvent) and ev.token is not None:
                b_started.set()

        def on_a(ev):  # on the engine thread: B arrives once A decodes
            if isinstance(ev, TokenEvent) and ev.token is not None:
                if len(handles) == 1 and len(handles[0].tokens) == 3:
                    handles.append(e.submit(b_req, callback=on_b))
                elif len(handles) == 2 and not b_started.is_set():
                    a_tokens_before_b.append(ev.token)
        handles.append(e.submit(a_req, callback=on_a))
        a, b = handles[0].result(timeout=T), None
        assert len(handles) == 2
        b = handles[1].result(timeout=T)
    assert a.tokens == ref  # decoding beside a prefill changes nothing in its output
    assert b.stats.batched and b.stats.prompt_tokens == len(b_req.prompt_tokens) and len(b.tokens) == 2
    # B's prompt went in steps, where a lone prompt's chunk (2,048) would have taken it in
    # one: the probe (again while A itself still joins), then chunks steered by the steps'
    # times (on a tiny model a prefill pass costs little more than a decode step, so how
    # small they get depends on the machine's noise), and A got a token in each.
    steps = [y - x for x, y in zip(b_progress, b_progress[1:]) if y > x]
    assert steps[0] == PROBE_CHUNK and len(steps) >= 4, steps
    assert len(a_tokens_before_b) >= len(steps) - 2


def test_a_chunk_longer_than_mlx_lms_prefill_step_is_fed_whole_beside_a_stream(tiny_qwen3):
    """A request whose ``prefill_step_size`` is above mlx-lm's default (2,048), prefilling
    beside a decoding stream with a budget that lets its chunks grow past 2,048: each
    chunk fed inside the stream's step is the prompt pass that follows it (mlx-lm's prompt
    batch cut it at 2,048 and the step failed, every row answered again alone)."""
    # a factor that lets the chunk grow every step: 128, 192, ... 2,187 after 7 steps
    a_req, b_req, settings = a_stream_and_a_long_prompt(tiny_qwen3, 6, 400, 9000, 3, 4096, 1000.0)
    with Engine(str(tiny_qwen3), max_batch=1).start(timeout=T) as alone:
        ref = [alone.submit(r).result(timeout=T).tokens for r in (a_req, b_req)]
    with Engine(str(tiny_qwen3), settings=settings).start(timeout=T) as e:
        handles: list = []
        b_progress: list[int] = []

        def on_b(ev):
            if isinstance(ev, ProgressEvent):
                b_progress.append(ev.done)

        def on_a(ev):  # on the engine thread: B arrives once A decodes
            if isinstance(ev, TokenEvent) and len(handles) == 1 and len(handles[0].tokens) == 3:
                handles.append(e.submit(b_req, callback=on_b))
        handles.append(e.submit(a_req, callback=on_a))
        a = handles[0].result(timeout=T)
        assert len(handles) == 2
        got = [a, handles[1].result(timeout=T)]
        assert e.stats(timeout=T)["retries"] == 0
    assert [g.tokens for g in got] == ref
    assert got[1].stats.batched
    steps = [y - x for x, y in zip(b_progress, b_progress[1:]) if y > x]
    assert max(steps) > 2048, steps
