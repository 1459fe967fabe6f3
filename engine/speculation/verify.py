"""The verifier: speculative decoding of one request, token for token what plain decoding
of the same request produces (greedy), or the same distribution (sampling).

Each round feeds the target ``[pending] + proposed`` in one forward pass, samples the target
at every position through the request's processors and sampler, and walks the window:
greedy and exact-match sources (n-gram, constraints) keep proposed tokens while they equal the
target's token; sources that give their distribution go through rejection sampling. The
first disagreement yields the target's own token (the correction); a fully accepted window
yields one more (the bonus). Rejected positions leave the target's cache: trimmable layers
are trimmed, recurrent layers (SSM, linear attention) are restored from a snapshot taken
before the round and the kept tokens fed again, and a sliding window that could wrap
during a round turns that round into a plain step. So no layer ever holds a rejected token.

The stream yields ``(token, logprobs)`` pairs like ``mlx_lm.generate_step``;
``engine.generate.Generation`` turns them into steps (EOS, stop strings, detokenization).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Collection, Generator, Iterator, Sequence
from typing import Any

import mlx.core as mx

from mlxkv.engine.arrays import int_item, int_list
from mlxkv.engine.decoding import decode_step
from mlxkv.engine.sampling import SamplingParams
from mlxkv.engine.speculation.base import Proposal, ProposalSource
from mlxkv.engine.speculation.policy import LengthController
from mlxkv.engine.speculation.sampling import TargetSampler, rejection_walk_rows


def trace_enabled() -> bool:
    """Whether MLXKV_SPEC_TRACE asks speculation to print every round on stderr."""
    return os.environ.get("MLXKV_SPEC_TRACE", "").lower() in ("1", "true", "yes", "on")


class _CacheRollback:
    """How each layer of the target's cache gives back rejected positions."""

    def __init__(self, cache: list):
        self.cache = cache
        self.trim: list[Any] = []
        self.snap: list[Any] = []  # recurrent layers: restored from a snapshot
        self.windows: list[Any] = []  # sliding windows: trimmable until they wrap
        self.blocked = False  # a layer that can neither trim nor be restored
        for c in cache:
            name = type(c).__name__
            if name == "RotatingKVCache":
                self.windows.append(c)
            elif hasattr(c, "cache") and isinstance(c.cache, list) and not c.is_trimmable():
                self.snap.append(c)
            elif hasattr(c, "trim") and c.is_trimmable():
                self.trim.append(c)
            else:
                self.blocked = True

    def room(self) -> int | None:
        """Most tokens a round may feed without a window wrapping (None: no limit); 1 means
        plain steps only."""
        if self.blocked:
            return 1
        room = None
        for c in self.windows:
            left = c.max_size - c.offset
            room = left if room is None else min(room, left)
        if room is not None:
            room = max(room, 1)
        return room

    def snapshot(self) -> list[list]:
        return [list(c.cache) for c in self.snap]

    def rollback(self, fed: int, keep: int, snapshot: list[list], replay: Callable[[int], None]) -> None:
        """``fed`` tokens went in; only the first ``keep`` stay."""
        drop = fed - keep
        if drop <= 0:
            return
        if not self.snap:
            for c in self.trim + self.windows:
                c.trim(drop)
            return
        for c, saved in zip(self.snap, snapshot):
            c.cache = list(saved)
        for c in self.trim + self.windows:
            c.trim(fed)  # everything of the round goes; the kept tokens are fed again
        replay(keep)


class SpecStats:
    """Per-request figures: what was proposed and kept, by position, and where time went."""

    def __init__(self, source: str):
        self.source = source
        self.rounds = 0
        self.forwards = 0  # target forward passes after the prefill (verify + replay)
        self.drafted = 0
        self.accepted = 0
        self.by_position_drafted: list[int] = []
        self.by_position_accepted: list[int] = []
        self.draft_s = self.verify_s = self.other_s = 0.0
        self.tokens = 0
        self.plain_steps = 0
        self.proposal_length = 0

    def record(self, drafted: int, accepted: int) -> None:
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        if drafted == 0:
            self.plain_steps += 1
        while len(self.by_position_drafted) < drafted:
            self.by_position_drafted.append(0)
            self.by_position_accepted.append(0)
        for i in range(drafted):
            self.by_position_drafted[i] += 1
            if i < accepted:
                self.by_position_accepted[i] += 1

    def as_dict(self) -> dict:
        acc = [round(a / d, 4) if d else 0.0
               for a, d in zip(self.by_position_accepted, self.by_position_drafted)]
        return {
            "source": self.source, "rounds": self.rounds, "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance": round(self.accepted / self.drafted, 4) if self.drafted else 0.0,
            "acceptance_by_position": acc, "drafted_by_position": list(self.by_position_drafted),
            "plain_steps": self.plain_steps,
            "target_forwards": self.forwards,
            "tokens_per_forward": round(self.tokens / self.forwards, 4) if self.forwards else 0.0,
            "draft_s": round(self.draft_s, 6), "verify_s": round(self.verify_s, 6),
            "other_s": round(self.other_s, 6), "proposal_length": self.proposal_length,
        }


class SpecStream:
    """The (token, logprobs) stream of one speculative generation. ``kv_tokens`` is always
    exactly what the target's cache holds; ``on_progress(done, total)`` observes the
    prefill of the uncached suffix as ``generate_step``'s callback does (it may raise to
    cancel between chunks); ``between_layers`` is ``prefill``'s (it may raise to cancel
    inside a chunk)."""

    def __init__(self, model: Any, prompt_tokens: Sequence[int], n_cached: int, cache: list,
                 params: SamplingParams, source: ProposalSource, controller: LengthController, *,
                 kind: str, target_view: Any = None, needs_hidden: bool = False,
                 on_progress: Callable[[int, int], None] | None = None, constraint: Any = None,
                 eos: Collection[int] = (),
                 between_layers: Callable[[int, int, int, int], None] | None = None):
        self.model = model
        self.prompt = list(prompt_tokens)
        self.n_cached = n_cached
        self.cache = cache
        self.params = params
        self.source = source
        self.controller = controller
        self.view = target_view
        self.needs_hidden = needs_hidden
        self.constraint = constraint
        self.eos = frozenset(eos)
        self.on_progress = on_progress or (lambda done, total: None)
        self.between_layers = between_layers
        self.kv_tokens: list[int] = list(self.prompt[:n_cached])
        self.stats = SpecStats(kind)
        self.trace = trace_enabled()
        self._gen: Generator[tuple[int, mx.array], None, None] | None = None
        self._pending: int | None = None  # the last token yielded, when it is not in the cache

    # forward passes ------------------------------------------------------------------
    def _forward(self, tokens: Sequence[int]) -> tuple[mx.array, mx.array | None]:
        x = mx.array([list(tokens)])
        if self.needs_hidden:
            logits, hidden = self.view.forward(x, self.cache)
            return logits[0], hidden[0]
        return self.model(x, cache=self.cache)[0], None

    def _replay(self, tokens: Sequence[int]) -> None:
        self.stats.forwards += 1
        self._forward(tokens)
        mx.eval([c.state for c in self.cache])

    def _prefill(self) -> tuple[mx.array, mx.array | None]:
        """Feed the uncached prompt as plain decoding does (``engine.generate.prefill``: the
        same chunks, the first token's logits from the last one); returns the last
        position's logits and the hidden rows."""
        from mlxkv.engine.generate import prefill

        rest = self.prompt[self.n_cached:]
        self.on_progress(0, len(rest))

        def fed(done: int) -> None:
            self.kv_tokens.extend(rest[len(self.kv_tokens) - self.n_cached: done])
            self.on_progress(done, len(rest))

        logits, hidden = prefill(self.model, rest, self.cache, self.params.prefill_step_size, fed,
                                 view=self.view if self.needs_hidden else None,
                                 between_layers=self.between_layers)
        self.kv_tokens.extend(rest[len(self.kv_tokens) - self.n_cached:])
        return logits, hidden

    # the stream -----------------------------------------------------------------------
    def __iter__(self) -> Iterator[tuple[int, mx.array]]:
        self._gen = self._run()
        return self._gen

    def close(self) -> None:
        if self._gen is not None:
            self._gen.close()

    def _run(self) -> Generator[tuple[int, mx.array], None, None]:
        try:
            yield from self._rounds()
        except GeneratorExit:
            # The consumer stopped right after the pending token: feed it, as plain decoding
            # has fed every token it yielded, so the cache holds prompt + output.
            if self._pending is not None:
                self._replay([self._pending])
                self.kv_tokens.append(self._pending)
            raise

    def _rounds(self) -> Iterator[tuple[int, mx.array]]:
        p = self.params
        sampler = TargetSampler(p, self.prompt, self.constraint)
        logits, hidden = self._prefill()
        lp = sampler.logprobs(logits, [])
        first = sampler.sample(lp)
        mx.eval(first, lp)
        pending = int_item(first)
        self.on_progress(len(self.prompt) - self.n_cached, len(self.prompt) - self.n_cached)
        t = time.perf_counter()
        self.source.prefill(self.prompt, self.n_cached, hidden)
        self.stats.draft_s += time.perf_counter() - t
        rollback = _CacheRollback(self.cache)
        emitted = 1
        self.stats.tokens = 0
        self._pending = pending
        yield pending, lp[0]
        pipelined = not sampler.processors and self.constraint is None and not self.needs_hidden
        while True:
            t_round = time.perf_counter()
            left = p.max_tokens - emitted  # tokens still wanted after the pending one
            if left <= 0:
                return
            off = self.controller.take_off_steps() if pipelined else 0
            proposal = None
            if off == 0:
                k = self.controller.next_length()
                if k > 0 and self.source.sizes_itself:
                    k = self.controller.maximum
                k = min(k, left - 1 if left > 1 else 0)
                room = rollback.room()
                if room is not None:
                    k = min(k, room - 1)
                proposal = self.source.propose(pending, k) if k > 0 else Proposal([])
                if pipelined and not proposal.tokens and (proposal.lazy is None or proposal.lazy.shape[0] == 0):
                    # Nothing to verify: one plain step, through the compiled step as plain
                    # decoding's (a forward pass of the pending token alone is slower, and a
                    # source with nothing to say asks for it a few rounds in a row).
                    if k > 0:
                        self.controller.empty()
                    off = 1
            if off > 0:
                fed = pending
                pending, ran = yield from self._plain_block(sampler, pending, min(off, left))
                emitted += ran
                if ran < off:  # the source saw a long earlier run: probe now
                    self.controller.cut_off_steps(off - ran)
                self.controller.record(0, 0, (time.perf_counter() - t_round) / ran)
                if self.trace and proposal is not None:
                    print(f"mlxkv spec: fed=[{fed}] drafts=[] (a plain step) next={pending}", file=sys.stderr,
                          flush=True)
                continue
            assert proposal is not None  # off == 0 here: a proposal was asked for
            t_proposed = time.perf_counter()
            if proposal.lazy is not None and proposal.lazy.shape[0] > 0 and k > 0 and pipelined:
                accepted, nxt, proposed, window, lp, hidden, snapshot = self._lazy_round(
                    sampler, proposal, pending, k, rollback)
            else:
                if proposal.lazy is not None:
                    proposal.tokens = int_list(proposal.lazy)
                proposed = [int(x) for x in proposal.tokens[:max(k, 0)]]
                if k > 0 and not proposed:
                    self.controller.empty()
                window = [pending] + proposed
                snapshot = rollback.snapshot() if proposed and rollback.snap else []
                logits, hidden = self._forward(window)
                lp = sampler.logprobs(logits, window)
                accepted, nxt = self._walk(sampler, lp, proposal, proposed)
            t_verified = time.perf_counter()
            self.stats.forwards += 1
            keep = 1 + accepted
            if keep < len(window):
                def replay(n: int, w: list[int] = window) -> None:
                    self._replay(w[:n])

                rollback.rollback(len(window), keep, snapshot, replay)
            kept = window[:keep]
            self.kv_tokens.extend(kept)
            sampler.advance(kept)
            t_c = time.perf_counter()
            self.source.commit(kept, hidden[:keep] if hidden is not None else None)
            t_done = time.perf_counter()
            # Proposed tokens after an end-of-sequence token could never be emitted: not counted
            # as proposed, so a reply's last round does not read as a run of rejections.
            counted = next((j + 1 for j, d in enumerate(proposed) if d in self.eos), len(proposed))
            self.stats.record(counted, min(accepted, counted))
            self.stats.tokens += keep
            self.stats.draft_s += (t_proposed - t_round) + (t_done - t_c)
            self.stats.verify_s += t_verified - t_proposed
            self.stats.other_s += t_c - t_verified
            self.controller.record(counted, min(accepted, counted), t_done - t_round)
            if self.trace:
                print(f"mlxkv spec: fed={window} drafts={proposed} accepted={accepted} next={nxt}",
                      file=sys.stderr, flush=True)
            self._pending = None  # the consumer may stop among tokens already in the cache
            for j in range(accepted):
                yield proposed[j], lp[j]
            emitted += accepted + 1
            pending = self._pending = nxt
            yield pending, lp[accepted]

    def _plain_block(self, sampler: TargetSampler, pending: int, steps: int
                     ) -> Generator[tuple[int, mx.array], None, tuple[int, int]]:
        """Up to ``steps`` plain tokens after ``pending``, pipelined as ``generate_step`` does
        (the next forward is queued before the current token is read), through the model's
        compiled step as plain decoding's (``engine.decoding``). The block ends early, one
        token later, when the source says a long earlier run is being repeated
        (``ProposalSource.worth_probing``). Returns the new pending token (sampled, yielded, not
        fed) and the tokens it yielded."""
        forward = decode_step(self.model)

        def step(y: mx.array) -> tuple[mx.array, mx.array]:
            logits = forward(y.reshape(1, 1), self.cache)
            lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            return sampler.sample(lp), lp
        self._feed_plain(sampler, pending)
        t, lp = step(mx.array([pending]))
        mx.async_eval(t, lp)
        i = 0
        while True:
            last = i + 1 >= steps
            if not last:
                nt, nlp = step(t)
                mx.async_eval(nt, nlp)
            tok = int_item(t)
            if last:
                self._pending = tok
            else:
                self._pending = None
                self._feed_plain(sampler, tok)
                if self.source.worth_probing():
                    steps = i + 2  # the token already queued is the block's last
            yield tok, lp[0]
            i += 1
            if last:
                return tok, i
            t, lp = nt, nlp

    def _feed_plain(self, sampler: TargetSampler, token: int) -> None:
        """Bookkeeping of a token fed alone (its forward is queued by the caller)."""
        self.kv_tokens.append(token)
        sampler.advance([token])
        self.source.commit([token])
        self.stats.record(0, 0)
        self.stats.forwards += 1
        self.stats.tokens += 1

    def _lazy_round(self, sampler: TargetSampler, proposal: Proposal, pending: int, k: int,
                    rollback: _CacheRollback
                    ) -> tuple[int, int, list[int], list[int], mx.array, mx.array | None, list[list]]:
        """The source's steps, the target's forward over [pending] + proposed and the walk as one
        graph, evaluated once (no processors or constraint need the proposed tokens' values)."""
        assert proposal.lazy is not None  # the caller checked
        lazy = proposal.lazy[:k].astype(mx.int32)
        n = lazy.shape[0]
        snapshot = rollback.snapshot() if rollback.snap else []
        x = mx.concatenate([mx.array([pending], dtype=mx.int32), lazy])[None]
        if self.needs_hidden:
            logits, hidden = self.view.forward(x, self.cache)
            logits, hidden = logits[0], hidden[0]
        else:
            logits, hidden = self.model(x, cache=self.cache)[0], None
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if sampler.greedy or proposal.probs is None:
            targets = sampler.sample(lp)
            mx.eval(targets, lazy, lp)
            proposed, got = int_list(lazy), int_list(targets)
            accepted = next((j for j, d in enumerate(proposed) if got[j] != d), n)
            nxt = got[accepted]
        else:
            p = sampler.probs(lp)[None]
            q = proposal.probs.astype(mx.float32)[None, :n]
            acc, nx = rejection_walk_rows(p, q, lazy[None])
            mx.eval(acc, nx, lazy, lp)
            proposed, accepted, nxt = int_list(lazy), int_item(acc), int_item(nx)
        proposal.tokens = proposed
        return accepted, nxt, proposed, [pending] + proposed, lp, hidden, snapshot

    def _walk(self, sampler: TargetSampler, lp: mx.array, proposal: Proposal,
              proposed: list[int]) -> tuple[int, int]:
        """(accepted proposed tokens, the token that follows them)."""
        if sampler.greedy or proposal.probs is None or not proposed:
            targets = sampler.sample(lp)
            mx.eval(targets)
            got = int_list(targets)
            for j, d in enumerate(proposed):
                if got[j] != d:
                    return j, got[j]
            return len(proposed), got[len(proposed)]
        p = sampler.probs(lp)[None]
        q = proposal.probs.astype(mx.float32)[None, : len(proposed)]
        accepted, nxt = rejection_walk_rows(p, q, mx.array([proposed]))
        mx.eval(accepted, nxt)
        return int_item(accepted), int_item(nxt)

    def summary(self) -> dict:
        d = self.stats.as_dict()
        d["proposal_length"] = self.controller.current()
        return d
