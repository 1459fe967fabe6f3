"""How rows enter a batch, measured in model passes on a real tiny model: a lone request
is a batch of one from its first pass, which the requests after it join; a row with
nothing left to prefill (a request that moves in from decoding alone, as one whose
speculation only the lone path runs does; here ``MLXKV_ONE_PATH=0`` serves every request
that way) waits for the last prefill pass of the rows joining with it, and all of them then
decode from one pass on, instead of each running passes of its own; every row's output
stays the one it has alone."""

import random

from common import T, greedy

from mlxkv.engine.batch_step import BatchStepModel
from mlxkv.engine.engine import Engine, ProgressEvent, Request, TokenEvent


def passes_of(cls, monkeypatch, method: str = "__call__") -> list[tuple[int, int]]:
    """Records the (rows, tokens) shape of every call of ``cls`` instances: a model's
    decoder stack (a single stream's prefill runs the stack and the LM head apart), or the
    model a batch runs (``BatchStepModel``: its decode steps are compiled, so the decoder
    stack is called only while a step is traced; its ``last_logits`` is a lone prompt's last
    prefill pass, which gives the first token)."""
    shapes: list[tuple[int, int]] = []
    forward = getattr(cls, method)

    def recorded(self, inputs, *args, **kwargs):
        shapes.append((int(inputs.shape[0]), int(inputs.shape[1])))
        return forward(self, inputs, *args, **kwargs)
    monkeypatch.setattr(cls, method, recorded)
    return shapes


def prompts(seed: int, *lengths: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in lengths]


def three_requests(tiny_qwen3) -> tuple[list[int], list[Request], list[list[int]]]:
    """A's prompt, requests A, B and C, and each one's tokens alone."""
    a, b, c = prompts(7, 30, 20, 25)
    reqs = [Request(prompt_tokens=a, params=greedy(max_tokens=12), spec="off"),
            Request(prompt_tokens=b, params=greedy(max_tokens=8), spec="off"),
            Request(prompt_tokens=c, params=greedy(max_tokens=9), spec="off")]
    with Engine(str(tiny_qwen3), max_batch=1).start(timeout=T) as alone:
        ref = [alone.submit(r).result(timeout=T).tokens for r in reqs]
    return a, reqs, ref


def a_then_b_and_c(e: Engine, reqs: list[Request]) -> list:
    """A runs; B and C wait when A's token after its second is due; every result."""
    handles = []

    def after_a(ev):  # on the engine thread
        if isinstance(ev, TokenEvent) and len(handles[0].tokens) == 2 and len(handles) == 1:
            handles.extend(e.submit(r) for r in reqs[1:])
    handles.append(e.submit(reqs[0], callback=after_a))
    handles[0].result(timeout=T)
    assert len(handles) == 3
    return [h.result(timeout=T) for h in handles]


def test_a_lone_request_is_a_batch_of_one_that_others_join(tiny_qwen3, monkeypatch):
    a, reqs, ref = three_requests(tiny_qwen3)
    with Engine(str(tiny_qwen3), max_batch=8).start(timeout=T) as e:
        lone = e.submit(reqs[1]).result(timeout=T)  # nobody beside it: not batched
        assert lone.tokens == ref[1] and not lone.stats.batched
        assert e.stats(timeout=T)["batched"] == 0
        stack_passes = passes_of(type(e.loaded.model.model), monkeypatch)
        shapes = passes_of(BatchStepModel, monkeypatch)
        last_passes = passes_of(BatchStepModel, monkeypatch, "last_logits")
        results = a_then_b_and_c(e, reqs)
        assert e.stats(timeout=T)["batched"] == 3
    assert [r.tokens for r in results] == ref
    assert all(r.stats.batched for r in results)
    # A's prefill is the batch's pass from the start: one pass of its whole prompt, last
    # token included, which gives its first token; no single-stream prefill, and no move
    assert last_passes == [(1, len(a))] and stack_passes[0] == (1, len(a))
    # B and C join the batch A decodes in: their prompts go in together, beside A's steps
    # (two prompt rows: each enters decoding from its last token's pass, as in mlx-lm)
    assert (2, len(reqs[2].prompt_tokens) - 1) in shapes


def test_a_moved_row_and_its_joiners_decode_from_one_pass(tiny_qwen3, monkeypatch):
    monkeypatch.setenv("MLXKV_ONE_PATH", "0")
    a, reqs, ref = three_requests(tiny_qwen3)
    c = reqs[2].prompt_tokens
    with Engine(str(tiny_qwen3), max_batch=8).start(timeout=T) as e:
        alone_passes = passes_of(type(e.loaded.model.model), monkeypatch)
        shapes = passes_of(BatchStepModel, monkeypatch)
        results = a_then_b_and_c(e, reqs)
    assert [r.tokens for r in results] == ref
    assert all(r.stats.batched for r in results)
    # A's own prefill alone (its last token in the same pass), then B's and C's together
    # (padded to the longer)
    assert alone_passes[0] == (1, len(a))
    prefills = [s for s in shapes if s[1] > 1]
    assert prefills == [(2, len(c) - 1)] and shapes[0] == prefills[0]
    after = shapes[1:]
    # A enters decoding with them: no pass runs a row alone until the shortest has ended
    assert after[:8] == [(3, 1)] * 8


def test_a_cancelled_row_waiting_to_enter_ends_and_the_others_go_on(tiny_qwen3, monkeypatch):
    monkeypatch.setenv("MLXKV_ONE_PATH", "0")
    a, b = prompts(9, 30, 20)
    reqs = [Request(prompt_tokens=a, params=greedy(max_tokens=40), spec="off"),
            Request(prompt_tokens=b, params=greedy(max_tokens=8), spec="off")]
    with Engine(str(tiny_qwen3), max_batch=1).start(timeout=T) as alone:
        ref_a, ref_b = (alone.submit(r).result(timeout=T).tokens for r in reqs)
    with Engine(str(tiny_qwen3), max_batch=8).start(timeout=T) as e:
        handles = []

        def after_b(ev):  # B joins; A, moved in and held while B prefills, is cancelled
            if isinstance(ev, ProgressEvent):
                handles[0].cancel()

        def after_a(ev):
            if isinstance(ev, TokenEvent) and len(handles[0].tokens) == 2 and len(handles) == 1:
                handles.append(e.submit(reqs[1], callback=after_b))
        handles.append(e.submit(reqs[0], callback=after_a))
        ra = handles[0].result(timeout=T)
        assert len(handles) == 2
        rb = handles[1].result(timeout=T)
        assert ra.tokens == ref_a[:len(ra.tokens)] and len(ra.tokens) < 6  # none after the move
        assert ra.finish_reason == "cancelled"
        assert rb.tokens == ref_b and rb.stats.batched
        assert e.stats(timeout=T)["active"] == 0
