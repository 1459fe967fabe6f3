"""The batches of one loaded model share their round-length controller: what a batch learned
about speculation (acceptance, costs, a back-off still due) holds in the next batch instead
of every batch probing again from an optimistic start."""

from __future__ import annotations

from mlxkv.engine.engine import Engine, Request
from mlxkv.engine.speculation.batch_verify import BatchLength, BatchVerifier
from support.modelgen import tiny_model
from tests.test_batch_spec import T, greedy, ram_cache, repetitive, submit_all


def test_a_verifier_uses_the_controller_it_is_given_and_gives_back_its_back_off():
    policy = BatchLength()
    verifier = BatchVerifier(model=None, controller=policy)
    assert verifier.controller is policy
    verifier._off = 5  # plain steps of a back-off the batch had not served when it ended
    verifier.close()
    assert policy.take_off_steps() == 5
    assert BatchVerifier(model=None).controller is not policy  # none given: a fresh one


def test_the_next_batch_goes_on_from_what_the_last_one_learned():
    with Engine(str(tiny_model("llama")), prefix_cache=ram_cache(), max_batch=8).start(timeout=T) as e:
        def batch(seed: int) -> None:
            reqs = [Request(prompt_tokens=p, params=greedy(max_tokens=40 + 3 * i), spec="ngram")
                    for i, p in enumerate(repetitive(5, seed=seed))]
            results, _, _ = submit_all(e, reqs)
            assert all(r.tokens for r in results)

        def policy() -> tuple[BatchLength, int]:
            kept = e.scheduler.batching.spec_policy
            return kept, kept._rounds

        batch(5)
        first, rounds_first = e.call(policy).result(timeout=T)
        assert rounds_first > 0  # the rows speculated
        batch(6)
        second, rounds_second = e.call(policy).result(timeout=T)
        assert second is first  # the same controller, not a fresh one
        assert rounds_second > rounds_first  # counting on from the first batch
