"""The speculation policy remembers, per loaded source and sampling regime, what requests
learned (acceptance, costs, proposal length, back-off), and a new request starts from it.
The controller is driven here with recorded round outcomes, as the verifier drives it (a
block of plain steps when it hands one out, one round at a time otherwise): no timings
are measured or asserted."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from mlxkv.engine.generate import Generation, SamplingParams
from mlxkv.engine.models import load_model
from mlxkv.engine.speculation.base import TargetView
from mlxkv.engine.speculation.ngram import NgramProvider
from mlxkv.engine.speculation.policy import NEW_REQUEST_PROBE_AFTER, LengthController, SourceMemory
from mlxkv.engine.speculation.providers import Speculation, source_memory, spec_stats
from support.modelgen import tiny_model

PLAIN_S = 0.010  # a plain step
PER_DRAFT_S = 0.002  # each drafted token's share of a round


def _request(memory: SourceMemory | None, tokens: int, accepted: Callable[[int], int], *,
             may_stop: bool = True, proposes: bool = True) -> dict:
    """One request of ``tokens`` tokens, its rounds run as the verifier runs them; returns
    what happened: the speculative rounds (``probes``), the rounds that asked a source with
    nothing to propose (``empty``: each a plain step that is not pipelined), the plain
    tokens decoded before the first probe, and the tokens per target forward."""
    c = LengthController(4, 12, may_stop=may_stop, memory=memory)
    emitted, forwards, probes, plain_before, empty = 1, 0, 0, 0, 0
    while emitted < tokens:
        left = tokens - emitted
        off = c.take_off_steps()
        if off:
            steps = min(off, left)
            emitted += steps
            forwards += steps
            plain_before += steps if probes == 0 else 0
            c.record(0, 0, PLAIN_S)
            continue
        k = min(c.next_length(), left - 1)
        forwards += 1
        if k > 0 and not proposes:
            empty += 1
            c.empty()
            c.record(0, 0, PLAIN_S)
            emitted += 1
        elif k > 0:
            probes += 1
            a = accepted(k)
            c.record(k, a, PLAIN_S + PER_DRAFT_S * k)
            emitted += a + 1
        else:
            plain_before += 1 if probes == 0 else 0
            c.record(0, 0, PLAIN_S)
            emitted += 1
    c.remember(emitted - 1)
    return {"probes": probes, "empty": empty, "plain_before": plain_before,
            "per_forward": (emitted - 1) / max(forwards, 1), "controller": c}


def never(k: int) -> int:
    return 0


def always(k: int) -> int:
    return k


def test_a_request_starts_at_the_length_that_paid_without_measuring_again():
    memory = SourceMemory()
    first = _request(memory, 200, always)["controller"]
    assert first.current() == 12 and memory.length == 12 and memory.acceptance > 0.9
    assert memory.plain_s == pytest.approx(PLAIN_S) and not memory.stopped

    learned = LengthController(4, 12, memory=memory)
    assert learned.next_length() == 12
    learned.record(12, 12, PLAIN_S + 12 * PER_DRAFT_S)
    assert learned.next_length() == 12  # no plain step to measure: the cost is known

    fresh = LengthController(4, 12, memory=SourceMemory())  # what every request did before
    assert fresh.next_length() == 4
    fresh.record(4, 4, PLAIN_S + 4 * PER_DRAFT_S)
    assert fresh.next_length() == 0


def test_a_source_that_never_pays_starts_the_next_request_off():
    memory = SourceMemory()
    run = _request(memory, 48, never)  # it ends during a back-off
    assert run["probes"] >= 1 and memory.stopped and memory.due > 0

    nxt = LengthController(4, 12, memory=memory)
    off = nxt.take_off_steps()
    assert 0 < off <= NEW_REQUEST_PROBE_AFTER  # plain steps first, pipelined
    assert LengthController(4, 12).take_off_steps() == 0  # without memory: speculate first


def test_short_requests_probe_now_and_then_not_each_time():
    """Forty 12-token requests on a source that never pays: without memory each one
    probes (40 losing rounds at least); with it the back-off carries over from request to
    request and grows, and the source is still probed again later."""
    memory = SourceMemory()
    probes = [_request(memory, 12, never)["probes"] for _ in range(40)]
    assert 2 <= sum(probes[1:]) <= 8, probes  # the first request learns from its prior
    assert sum(probes[20:]) >= 1  # it did not give up for good
    alone = [_request(None, 12, never)["probes"] for _ in range(40)]
    assert sum(alone) >= 40


def test_a_prompt_it_pays_on_is_found_soon_after_the_source_lost():
    """After many losing requests (a long back-off carried over), a long request on which
    the source pays is probed within NEW_REQUEST_PROBE_AFTER plain tokens and speculates."""
    memory = SourceMemory()
    for _ in range(30):
        _request(memory, 40, never)
    assert memory.stopped and memory.due > NEW_REQUEST_PROBE_AFTER
    run = _request(memory, 300, always)
    assert run["plain_before"] <= NEW_REQUEST_PROBE_AFTER
    assert run["per_forward"] > 4 and not memory.stopped


def test_a_named_source_leaves_the_back_off_alone():
    """``--spec ngram`` never stops; its requests update what is known of acceptance and
    cost but neither read nor clear the back-off ``auto`` requests carry."""
    memory = SourceMemory()
    _request(memory, 64, never)
    stopped, due = memory.stopped, memory.due
    named = _request(memory, 30, never, may_stop=False)
    assert named["plain_before"] == 0 and named["probes"] > 0  # it speculated from the start
    assert (memory.stopped, memory.due) == (stopped, due)
    assert memory.requests == 2


def test_fixed_length_controllers_neither_read_nor_write_memory():
    memory = SourceMemory()
    _request(memory, 64, never)
    before = memory.as_dict()
    fixed = LengthController(6, 6, adaptive=False, memory=memory)
    assert fixed.next_length() == 6 and fixed.take_off_steps() == 0
    fixed.record(6, 0, 0.1)
    fixed.remember(7)
    assert memory.as_dict() == before


def test_speculation_keeps_one_memory_per_provider_and_sampling_regime():
    loaded = load_model(str(tiny_model("llama")))
    provider = NgramProvider(1, 3)
    view = TargetView(loaded.model, loaded.tokenizer)
    greedy, sampled = SamplingParams(max_tokens=24), SamplingParams(max_tokens=24, temperature=1.0)
    assert source_memory(provider, False) is source_memory(provider, False)
    assert source_memory(provider, True) is not source_memory(provider, False)
    assert source_memory(NgramProvider(1, 3), False) is not source_memory(provider, False)

    prompt = [5, 6, 7, 8, 9, 10] * 4
    spec = Speculation(provider, view, greedy, mode="auto", max_tokens=6)
    assert spec.controller.memory is source_memory(provider, False)
    list(Generation(loaded.model, loaded.tokenizer, prompt, greedy, speculation=spec))
    memory = source_memory(provider, False)
    assert memory.requests == 1 and memory.acceptance is not None and memory.plain_s is not None

    again = Speculation(provider, view, greedy, mode="auto", max_tokens=6)
    assert again.controller.acceptance == memory.acceptance and again.controller.plain_s == memory.plain_s
    assert Speculation(provider, view, sampled, mode="auto", max_tokens=6).controller.plain_s is None
    learned = spec_stats({"ngram": provider})["ngram"]["learned"]
    assert learned["greedy"]["requests"] == 1


def test_a_source_with_nothing_to_propose_is_asked_less_in_the_next_requests():
    """Prompt lookup on text that never repeats: each round that asks it runs a plain step
    that is not pipelined. A fresh request asks 4 times before backing off, each time; the
    next requests ask once (a new prompt may repeat) and back off after that empty round."""
    memory = SourceMemory()
    first = _request(memory, 48, never, proposes=False)
    assert first["empty"] >= 8 and memory.empty
    later = [_request(memory, 48, never, proposes=False)["empty"] for _ in range(10)]
    assert max(later) <= 1, later
    alone = [_request(None, 48, never, proposes=False)["empty"] for _ in range(10)]
    assert min(alone) >= 8
    # A prompt that does repeat is still found at once.
    run = _request(memory, 200, always)
    assert run["plain_before"] == 0 and run["per_forward"] > 4 and not memory.empty
