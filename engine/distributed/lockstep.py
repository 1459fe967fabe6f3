"""Decoding in lock-step: every rank runs the same steps and stops at the same token.

It plugs into ``engine.generate.Generation`` as its token source (the seam speculation
uses: ``stream(gen, progress)`` / ``finish``), so EOS, stop strings, max tokens,
detokenisation and log-probabilities stay Generation's own code. Tokens come from
mlx-lm's ``generate_step`` with one change, the sampler:

* rank 0 samples (its processors, its random state, a guided choice's mask) and puts
  ``[token, stop]`` into an ``all_sum`` the other ranks feed zeros to, inside the step's
  own graph: every rank feeds rank 0's token to the next step, and the pipelined step
  ``generate_step`` runs ahead stays pipelined. The followers' zeros depend on their own
  logits, so their ``all_sum`` runs after the step's forward as rank 0's does: the
  collectives keep one order on every rank;
* ``stop`` is rank 0's cancel test, read when the step is built; Generation's
  ``should_stop`` becomes "the flag that came with this token", so every rank leaves
  after the same token (at most two tokens after rank 0 saw the cancel). During the
  prefill ``should_stop`` is one small collective per chunk instead.

Other stops (EOS, stop strings, max tokens, the end of the context) follow from the
tokens, which are the same everywhere. When the stream closes, the step computed ahead is
waited for, so the next collective never overtakes it.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, cast

from mlxkv.engine.distributed.protocol import Channel

if TYPE_CHECKING:
    from mlxkv.engine.generate import Generation


class Lockstep:
    """A Generation's token source on one rank (``leader``: rank 0)."""

    def __init__(self, channel: Channel):
        self.channel = channel

    def stream(self, gen: Generation, progress: Callable[[int, int], None]) -> LockstepStream:
        return LockstepStream(self.channel, gen, progress)

    def finish(self, stream: LockstepStream, tokens_in_cache: list[int]) -> None:
        return None  # plain decoding: no speculation figures


class LockstepStream:
    def __init__(self, channel: Channel, gen: Generation, progress: Callable[[int, int], None]):
        self.channel = channel
        self.leader = channel.leader
        self.gen = gen
        self.progress = progress
        self.local_stop = gen.should_stop  # rank 0: the request's cancel test
        gen.should_stop = self._agreed_stop
        self._flags: collections.deque = collections.deque()
        self._sampling = False  # the first token's step has been built
        self._last: Any = None  # the latest step's collective
        self._fed = list(gen.prompt_tokens)
        self._steps: Any = None
        self.kv_tokens: list[int] = []

    # what generate_step calls
    def _sample(self, logprobs: Any) -> Any:
        import mlx.core as mx

        if self.leader:
            token = self._sampler(logprobs).astype(mx.int32).reshape(1)
            stop = mx.array([1 if self.local_stop() else 0], dtype=mx.int32)
        else:  # zeros that depend on this step's logits: the all_sum waits for the forward
            token = mx.argmax(logprobs, axis=-1).astype(mx.int32).reshape(1) * 0
            stop = mx.zeros((1,), dtype=mx.int32)
        both = mx.distributed.all_sum(mx.concatenate([token, stop]), group=self.channel.world.group)
        self._flags.append(both[1:])
        self._last = both
        self._sampling = True
        return both[:1]

    def _agreed_stop(self) -> bool:
        if not self._sampling:  # prefill, between chunks
            return self.channel.any_rank(self.leader and self.local_stop(),
                                         "agreeing whether to stop the prefill")
        return bool(self._flags.popleft().item()) if self._flags else False

    def _progress(self, done: int, total: int) -> None:
        self.channel.world.watchdog.arm("computing the prompt with the other ranks")
        self.progress(done, total)

    def _build(self) -> Iterator[tuple[int, Any]]:
        import mlx.core as mx
        from mlx_lm.generate import generate_step

        from mlxkv.engine.sampling import request_processors, request_sampler

        gen, p = self.gen, self.gen.params
        processors: list = []
        if self.leader:
            self._sampler = request_sampler(p)
            processors = request_processors(p, gen.prompt_tokens[: gen.n_cached])
            if gen.constraint is not None:
                processors.append(gen.constraint.processor(len(gen.prompt_tokens) - gen.n_cached))
        steps = generate_step(
            mx.array(gen.prompt_tokens[gen.n_cached:]), gen.model, max_tokens=p.max_tokens,
            sampler=self._sample, logits_processors=processors or None, prompt_cache=gen.cache,
            prefill_step_size=p.prefill_step_size, prompt_progress_callback=self._progress)
        # mlx-lm annotates its yields as two arrays; the token is a Python int (``y.item()``)
        return cast("Iterator[tuple[int, Any]]", steps)

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        dog = self.channel.world.watchdog
        dog.arm("computing the prompt with the other ranks")
        self._steps = self._build()
        for token, logprobs in self._steps:
            self._fed.append(token)
            dog.arm("decoding with the other ranks")
            yield token, logprobs

    def close(self) -> None:
        import mlx.core as mx

        from mlxkv.engine.generate import cache_length

        if self._steps is not None:
            self._steps.close()
        try:
            if self._last is not None:  # the step computed ahead: let its collective finish
                mx.eval(self._last)
        except RuntimeError as e:
            self.channel.fail(f"lost the other ranks while decoding ({e})")
        finally:
            self.channel.world.watchdog.disarm()
        assert self.gen.cache is not None  # made by the generation before its stream
        length = cache_length(self.gen.cache)
        self.kv_tokens = self._fed[:length] if length is not None else list(self._fed)

