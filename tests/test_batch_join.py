"""How a request that decodes alone moves into a batch, measured in model passes on a real
tiny model: the moved row shares the prefill pass of the request that joins with it (and
then its first batched step), instead of running a pass of its own; its output stays the
one it has alone."""

import random

import engine  # noqa: F401  (loads the BLAS before mlx)
from engine.engine import Engine, Request, TokenEvent
from engine.generate import SamplingParams

T = 120  # seconds any wait in these tests may take before it fails


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0,
                          repetition_penalty=1.0, max_tokens=max_tokens)


def passes_of(model, monkeypatch) -> list[tuple[int, int]]:
    """Records the (rows, tokens) shape of every forward pass of ``model``'s class."""
    shapes: list[tuple[int, int]] = []
    cls = type(model)
    forward = cls.__call__

    def recorded(self, inputs, *args, **kwargs):
        shapes.append((int(inputs.shape[0]), int(inputs.shape[1])))
        return forward(self, inputs, *args, **kwargs)
    monkeypatch.setattr(cls, "__call__", recorded)
    return shapes


def test_the_moved_row_shares_the_joining_prefill_pass(tiny_qwen3, monkeypatch):
    rng = random.Random(7)
    a = [rng.randrange(3, 500) for _ in range(30)]
    b = [rng.randrange(3, 500) for _ in range(20)]
    req_a, req_b = (Request(prompt_tokens=a, params=greedy(12)),
                    Request(prompt_tokens=b, params=greedy(8)))
    with Engine(str(tiny_qwen3), max_batch=1).start(timeout=T) as alone:
        ref = [alone.submit(r).result(timeout=T).tokens for r in (req_a, req_b)]
    with Engine(str(tiny_qwen3), max_batch=8).start(timeout=T) as e:
        shapes = passes_of(e.loaded.model, monkeypatch)
        handles = []

        def after_a(ev):  # on the engine thread: B waits when A's next token is due
            if isinstance(ev, TokenEvent) and len(handles[0].tokens) == 2 and len(handles) == 1:
                handles.append(e.submit(req_b))
        handles.append(e.submit(req_a, callback=after_a))
        handles[0].result(timeout=T)
        assert len(handles) == 2
        results = [h.result(timeout=T) for h in handles]
    assert [r.tokens for r in results] == ref
    assert all(r.stats.batched for r in results)
    prefills = [s for s in shapes if s[1] > 1]
    # A's own prefill alone, then B's prefill with A's last two known tokens in the same pass
    assert prefills[0] == (1, len(a) - 1)
    assert prefills[1] == (2, len(b) - 1)
    after = shapes[shapes.index(prefills[1]) + 1:]
    # no pass runs a row alone until the shorter row has ended
    assert after[:8] == [(2, 1)] * 8
