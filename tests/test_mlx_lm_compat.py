"""The one module that reaches into mlx-lm's private state (``engine.mlx_lm_compat``): it
names the versions it was checked against, refuses any other with a message that says what
to do, and on such a version the engine still decodes (alone, speculating alone, and in a
batch, plainly) with one warning that says why batched rows do not draft."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import mlx_lm
import pytest

from mlxkv.engine import mlx_lm_compat as compat
from mlxkv.engine.engine import Engine, Request
from support.modelgen import tiny_model
from tests.test_batch import T, greedy, ram_cache
from tests.test_batch_spec import alone, repetitive, submit_all

ROOT = Path(__file__).resolve().parents[1]


def test_the_installed_mlx_lm_is_a_checked_one():
    # A new mlx-lm in the environment fails here first: check its internals, then add it.
    assert compat.version_problem() is None, compat.version_problem()
    for v in compat.CHECKED_VERSIONS:
        assert compat.version_problem(v) is None
        compat.require_checked(v)


def test_the_dependency_bound_is_the_checked_versions():
    text = (ROOT / "pyproject.toml").read_text()
    (bound,) = re.findall(r'"mlx-lm([^"]*)"', text)
    assert bound == f">={compat.CHECKED_VERSIONS[0]},<={compat.CHECKED_VERSIONS[-1]}"


def test_an_unchecked_version_is_refused_clearly(caplog):
    problem = compat.version_problem("0.33.0")
    assert problem is not None
    assert "mlx-lm 0.33.0" in problem and all(v in problem for v in compat.CHECKED_VERSIONS)
    assert "decode plainly" in problem and "pip install" in problem
    with pytest.raises(compat.UnverifiedMlxLm, match=r"mlx-lm 0\.33\.0 is not a version"):
        compat.require_checked("0.33.0")
    with caplog.at_level(logging.WARNING, logger="mlxkv.engine"):
        assert compat.batch_speculation_available("0.33.0") is False
        assert compat.batch_speculation_available("0.33.0") is False
        assert compat.batch_speculation_available(compat.CHECKED_VERSIONS[-1]) is True
    warned = [r for r in caplog.records if r.name == "mlxkv.engine"]
    assert [r.getMessage() for r in warned] == [problem]  # once


def test_on_an_unchecked_version_plain_decoding_and_batches_still_work(monkeypatch, caplog):
    # Only the version number is changed: everything else is the installed mlx-lm.
    monkeypatch.setattr(mlx_lm, "__version__", "0.99.1")
    assert compat.installed_version() == "0.99.1"
    with pytest.raises(compat.UnverifiedMlxLm):
        compat.DecodingRows(object())  # the internals themselves refuse
    prompts = repetitive(4, seed=11)
    with Engine(str(tiny_model("llama")), max_batch=1).start(timeout=T) as ref, \
            Engine(str(tiny_model("llama")), prefix_cache=ram_cache(), max_batch=8).start(timeout=T) as e, \
            caplog.at_level(logging.WARNING, logger="mlxkv.engine"):
        # alone: plain, and speculating (no private state involved), as on a checked version
        req = Request(prompt_tokens=prompts[0], params=greedy(max_tokens=30), spec="ngram")
        lone = e.submit(req).result(timeout=T)
        assert not lone.stats.batched and lone.stats.spec is not None
        assert lone.tokens == alone(ref, req)[0].tokens
        # together: batched, no drafts, the same tokens as alone
        reqs = [Request(prompt_tokens=p, params=greedy(max_tokens=30 + 2 * i), spec="ngram")
                for i, p in enumerate(prompts)]
        got, _, _ = submit_all(e, reqs)
        for req, r in zip(reqs, got):
            assert r.stats.batched and r.stats.spec is None
            assert r.tokens == alone(ref, req)[0].tokens
    warned = [r.getMessage() for r in caplog.records if "0.99.1" in r.getMessage()]
    assert warned == [compat.version_problem("0.99.1")]


def test_rows_entering_decoding_together_move_their_state_without_a_copy():
    """``move_whole_prompt_batch``: when every prompt row enters decoding in one step (a
    lone request always does), the generation batch takes the prompt batch's cache layers
    themselves (mlx-lm's split deep-copies them, then drops the originals), and the tokens
    are those of mlx-lm's own split."""
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.utils import load

    model, _ = load(str(tiny_model("qwen3")))
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17, 18]]

    def run(moved: bool) -> tuple[list[list[int]], bool]:
        gen = BatchGenerator(model, completion_batch_size=4, prefill_batch_size=4)
        if moved:
            compat.move_whole_prompt_batch(gen)
        gen.insert(prompts, max_tokens=[6, 6])
        layers: list = []
        out: dict[int, list[int]] = {0: [], 1: []}
        same = False
        while True:
            if len(gen._prompt_batch) and not layers:
                layers = list(gen._prompt_batch.prompt_cache)
            _, responses = gen.next()
            if len(gen._generation_batch) and layers and not same:
                same = all(a is b for a, b in zip(gen._generation_batch.prompt_cache, layers))
            for r in responses:
                out[r.uid].append(r.token)
            if all(len(v) == 6 for v in out.values()):
                break
        mx.clear_cache()
        return [out[0], out[1]], same

    theirs, copied_same = run(False)
    ours, moved_same = run(True)
    assert ours == theirs
    assert moved_same and not copied_same


def test_a_lone_prompts_last_pass_gives_its_first_token_and_it_decodes_as_in_mlx_lm():
    """``fold_first_token``: the pass that ends a lone prompt's prefill takes its last token
    too and samples the first token there (mlx-lm reads it two steps later, after a pass of
    the last token alone); the row then decodes from that token pending, whose first step
    reports it once more, and every token is mlx-lm's own."""
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.utils import load

    from mlxkv.engine.speculation.base import TargetView

    model, _ = load(str(tiny_model("llama")))
    view = TargetView(model, None)
    prompt = [101, 7, 350, 12, 499, 23, 61, 240, 3]

    def run(fold: bool) -> tuple[list[tuple[int, int]], list[int]]:
        """Each step's tokens out ((step, token): the fold's first, then what the steps
        report), and what the steps report."""
        gen = BatchGenerator(model, completion_batch_size=4, prefill_batch_size=4)
        out: list[tuple[int, int]] = []
        step = 0
        if fold:
            assert compat.fold_first_token(
                gen, lambda x, cache: view.logits(view.forward_hidden(x, cache)[:, -1, :]),
                lambda uid, token, logprobs: out.append((step, token)))
        gen.insert([prompt], max_tokens=[8])
        reported: list[int] = []
        while len(reported) < 8:
            step += 1
            _, responses = gen.next()
            for r in responses:
                reported.append(r.token)
                out.append((step, r.token))
        mx.clear_cache()
        return out, reported

    theirs, theirs_reported = run(False)
    ours, ours_reported = run(True)
    assert len(set(theirs_reported)) > 2  # (tokens that tell a shift apart)
    assert ours_reported == theirs_reported
    # the first token in the prompt's own step, two steps before mlx-lm's; the row's first
    # decode step reports it again, then each step the token mlx-lm's does
    assert ours[0] == (1, theirs_reported[0]) and theirs[0] == (3, theirs_reported[0])
    assert ours[1] == (2, theirs_reported[0])
    assert [t for _, t in ours[1:]] == theirs_reported
