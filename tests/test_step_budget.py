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


def test_the_line_is_fitted_and_the_chunk_keeps_the_step_within_the_factor():
    b = StepBudget(3.0)
    b.observe(0, 0.05)  # a decode step alone: 50 ms
    for n in (16, 64, 32, 128, 48):
        b.observe(n, 0.1 + 0.002 * n)  # a step with prefill: 100 ms + 2 ms a token
    c0, c1 = b.line()
    assert c0 == pytest.approx(0.1, rel=1e-6) and c1 == pytest.approx(0.002, rel=1e-6)
    n = b.chunk(decoding=1, limit=2048)
    assert n == int((3.0 * 0.05 - 0.1) / 0.002) == 25
    assert 0.1 + 0.002 * n <= 3.0 * 0.05
    assert b.chunk(decoding=1, limit=10) == 10  # never past the request's own chunk
    assert b.chunk(decoding=0, limit=2048) == 2048  # nothing decoding: a lone prompt's chunk


def test_before_any_cost_it_probes_then_explores_two_sizes():
    b = StepBudget(2.0)
    assert b.chunk(1, 4096) == PROBE_CHUNK
    b.observe(0, 0.05)
    b.observe(PROBE_CHUNK, 0.5)  # one size seen: fixed part two decode steps, the rest per token
    c0, c1 = b.line()
    assert c0 == pytest.approx(0.1) and c1 == pytest.approx(0.4 / PROBE_CHUNK)
    sizes = {b.chunk(1, 4096) for _ in range(2)}
    assert len(sizes) == 2  # every other step a larger chunk, so that a line can be fitted


def test_a_prompt_always_advances_and_slow_outliers_are_bounded():
    b = StepBudget(1.01)
    b.observe(0, 0.05)
    for n in (16, 32):
        b.observe(n, 0.2 + 0.01 * n)
    assert b.chunk(1, 4096) == MIN_CHUNK  # no chunk fits 1.01 decode steps: the floor
    b.observe(0, 100.0)  # one slow step (a trace) moves the decode time by a bounded amount
    assert b.decode_s < 0.05 * 3


def test_the_factor_is_a_setting_above_one():
    assert Settings.defaults().batch_itl_factor == 3.0
    with pytest.raises(SettingsError, match="above 1"):
        Settings.defaults(batch_itl_factor="1")
    with pytest.raises(ValueError):
        StepBudget(0.5)


def test_a_stream_keeps_decoding_while_a_long_prompt_prefills_beside_it(tiny_qwen3):
    rng = random.Random(5)
    short = [rng.randrange(3, 500) for _ in range(20)]
    long = [rng.randrange(3, 500) for _ in range(700)]
    a_req = Request(prompt_tokens=short, params=greedy(max_tokens=300), spec="off")
    b_req = Request(prompt_tokens=long, params=greedy(max_tokens=2, prefill_step_size=2048), spec="off")
    settings = Settings.load({"model": str(tiny_qwen3), "prefix_cache": False, "batch_itl_factor": 1.01})
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
    assert b.stats.batched and b.stats.prompt_tokens == len(long) and len(b.tokens) == 2
    # B's prompt went in steps: the probe (again while A itself still joins), then chunks
    # of MIN_CHUNK (no chunk fits 1.01 decode steps; a larger one now and then while the
    # line is fitted), and A got a token in each of them.
    steps = [y - x for x, y in zip(b_progress, b_progress[1:]) if y > x]
    assert steps[0] == PROBE_CHUNK and max(steps[2:]) <= MIN_CHUNK * 3 // 2, steps
    assert steps.count(MIN_CHUNK) >= len(steps) // 2, steps
    assert len(steps) >= (len(long) - 2 * PROBE_CHUNK) // (MIN_CHUNK * 3 // 2)
    assert len(a_tokens_before_b) >= len(steps) - 2
