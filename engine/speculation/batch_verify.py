"""Speculation for rows decoded together: one target forward verifies every row's proposals.

A round starts and ends in the state mlx-lm's ``BatchGenerator`` keeps between its steps
(each row's KV holds what it was fed, its pending token is sampled and not fed), so plain
steps and rounds mix freely; that private state is reached only through
``engine.mlx_lm_compat.DecodingRows``. Each row's source proposes after its pending token,
one forward checks every row's window, each row keeps what exact match or rejection
sampling accepts, and the shared ``BatchKVCache`` is settled to one length (a row that
kept fewer tokens is rolled right: its rejected tail becomes left padding).
:class:`BatchLength` sets a round's length and goes back to plain steps while rounds do
not pay.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from mlxkv.engine.arrays import int_list, int_rows
from mlxkv.engine.mlx_lm_compat import DecodingRows, admitting
from mlxkv.engine.speculation.base import ProposalSource
from mlxkv.engine.speculation.rows import SourceRowGroup
from mlxkv.engine.speculation.sampling import TargetSampler, process_window, rejection_walk_rows
from mlxkv.engine.speculation.verify import SpecStats, trace_enabled

if TYPE_CHECKING:
    from mlx_lm.generate import BatchGenerator

    from mlxkv.engine.sampling import SamplingParams
    from mlxkv.engine.speculation.policy import LengthController
    from mlxkv.engine.speculation.providers import Speculation


def spec_round_cache(cache: list) -> bool:
    """Whether a round may run on this batch cache: every layer a plain ``BatchKVCache``
    (sliding windows and the other kinds take plain steps only)."""
    from mlx_lm.models.cache import BatchKVCache

    return bool(cache) and all(type(c) is BatchKVCache for c in cache)


@dataclass
class RowSpec:
    """One batched row's speculation: its ``engine.speculation.providers.Speculation`` (source,
    source state stored with the conversation), figures, and how far its source has followed
    the row's tokens."""

    speculation: Speculation
    prompt: list[int]
    stats: SpecStats
    sampler: TargetSampler | None = None  # the target's p for rejection sampling (temperature > 0)
    fed: int = -1  # tokens of the row the source knows (-1: not prefilled yet)
    done: bool = field(default=False)

    @property
    def source(self) -> ProposalSource:
        return self.speculation.source

    def summary(self, proposal_length: int) -> dict:
        d = self.stats.as_dict()
        d["proposal_length"] = proposal_length
        d["restored_draft_tokens"] = self.speculation.restored_tokens
        return d


class _Summary:
    """What ``Speculation.finish`` reads of a stream."""

    def __init__(self, summary: dict):
        self._summary = summary

    def summary(self) -> dict:
        return self._summary


@dataclass
class RoundRow:
    """What one row got from a round: the tokens it emits now (its old pending token and
    the proposed tokens it kept, each with its log-probabilities)."""

    emitted: list[tuple[int, mx.array]]  # (token, its log-probabilities)


class BatchLength:
    """How many tokens a batch round asks each source for (0: a plain step), from running estimates of
    the acceptance a per proposed token, the share f of rows that propose, the time t1 of a
    plain batched step and the cost m of each window position past the first. A round of
    width 1 + k yields per row f * (1 - a^(k+1)) / (1 - a) + (1 - f) tokens in t1 + m*k,
    a plain step 1 in t1; it asks for the k that gives the most tokens per second. When that
    is 0 and it ``may_stop``, it takes plain steps for a back-off (8, doubling to 256 while
    probes lose), as :class:`engine.speculation.policy.LengthController` does for a lone request.
    ``adaptive`` False: always ``initial`` (constraint rows: the whole forced span)."""

    def __init__(self, initial: int = 4, maximum: int = 12):
        self.initial = max(1, int(initial))
        self.maximum = max(self.initial, int(maximum))
        self.adaptive = True
        self.may_stop = True
        self.acceptance = 0.7
        self.share = 1.0
        self.plain_s: float | None = None
        self.per_position_s: float | None = None
        self._k = self.initial
        self._rounds = 0
        self._off_left = 0
        self._backoff = 8
        self._empty_run = 0
        self._empty_backoff = 8

    def current(self) -> int:
        return self._k

    def take_off_steps(self) -> int:
        off, self._off_left = self._off_left, 0
        return off

    def give_back_off_steps(self, steps: int) -> None:
        self._off_left += max(int(steps), 0)

    def next_length(self) -> int:
        if not self.adaptive:
            return self.initial
        if self.plain_s is None and self._rounds > 0 and self.per_position_s is not None:
            return 0  # one plain step to measure against
        return min(self._k, self.maximum)  # (the rows of an earlier batch may have taken more)

    def empty(self) -> None:
        """No row had anything to propose: after 4 such rounds in a row (1 once it has backed
        off: a probe that finds nothing), plain steps (they run pipelined) for a back-off that
        doubles up to 64."""
        self._empty_run += 1
        if self._empty_run >= (4 if self._empty_backoff == 8 else 1):
            self._empty_run = 0
            self._off_left = self._empty_backoff
            self._empty_backoff = min(self._empty_backoff * 2, 64)

    def record_plain(self, seconds: float) -> None:
        self.plain_s = seconds if self.plain_s is None else 0.8 * self.plain_s + 0.2 * seconds

    def record_round(self, width: int, proposed: int, accepted: int, share: float, seconds: float) -> None:
        """A round of ``width`` positions; the rows that proposed offered ``proposed`` tokens
        in all and kept ``accepted``; ``share`` of the rows proposed; it took ``seconds``."""
        self._rounds += 1
        self._empty_run = 0
        if accepted:
            self._empty_backoff = 8
        if proposed:
            self.acceptance = 0.7 * self.acceptance + 0.3 * (accepted / proposed)
        self.share = 0.7 * self.share + 0.3 * share
        k = max(width - 1, 1)
        m = max(seconds - self.plain_s, 0.0) / k if self.plain_s is not None else seconds / (k + 1)
        self.per_position_s = m if self.per_position_s is None else 0.7 * self.per_position_s + 0.3 * m
        if not self.adaptive or self.plain_s is None:
            return
        best = self._best()
        if best == 0 and self.may_stop:
            self._off_left = self._backoff
            self._backoff = min(self._backoff * 2, 256)
            self._k = max(1, min(self.initial, 2))
            return
        if best > 0 and self._backoff > 8:
            self._backoff = max(8, self._backoff // 2)
        self._k = max(best, 1)
        if accepted == proposed and proposed and width - 1 >= self._k:
            # A fully accepted window says little about longer ones: grow geometrically.
            self._k = min(self.maximum, max(self._k, 2 * (width - 1)))

    def _best(self) -> int:
        a = min(max(self.acceptance, 0.0), 0.995)
        f = min(max(self.share, 0.0), 1.0)
        t1 = self.plain_s or 1e-3
        m = self.per_position_s if self.per_position_s is not None else t1 / 4
        best_k, best_rate = 0, 1.0 / t1
        gain = expected = 1.0
        for k in range(1, self.maximum + 1):
            gain *= a
            expected += gain
            rate = (f * expected + 1.0 - f) / (t1 + m * k)
            if rate > best_rate * 1.0001:
                best_k, best_rate = k, rate
        return best_k


class BatchVerifier:
    """The speculative rounds of one batch (engine thread only)."""

    def __init__(self, model: Any, maximum: int = 12, controller: BatchLength | None = None):
        self.model = model
        self.group = SourceRowGroup()
        self.uids: list[int] = []  # the group's rows, in the batch's order
        # The engine hands every batch of a loaded model the same controller, so what one
        # batch learned (acceptance, costs, a back-off) holds in the next instead of each
        # batch probing from an optimistic start.
        self.controller = controller or BatchLength(initial=min(4, maximum), maximum=maximum)
        self.specs: dict[int, RowSpec] = {}
        self._off = 0  # plain steps left in a back-off
        self._plain_timed = False  # the last step was plain: the next plain one can be timed
        self.trace = trace_enabled()
        self.rounds = 0
        # A batch that decodes one row, a speculating one (a lone request is a batch of
        # one), runs that row's own LengthController as the request alone does: its memory
        # of the source, a self-sizing source asked for its maximum, back-offs that a
        # repeated earlier run ends. ``_solo_off``: plain steps left in its back-off.
        self._solo_off = 0
        self._solo_in_block = False  # the plain step running now is one of a back-off's

    # rows ---------------------------------------------------------------------------
    def add(self, uid: int, speculation: Speculation, prompt: list[int], params: SamplingParams) -> RowSpec:
        sampler = TargetSampler(params, []) if params.temperature > 0 else None
        spec = RowSpec(speculation, list(prompt), SpecStats(speculation.provider.kind), sampler)
        self.specs[uid] = spec
        # The longest any row's source takes (``--spec-tokens`` bounds them all).
        self.controller.maximum = max(s.speculation.controller.maximum for s in self.specs.values())
        return spec

    def drop(self, uid: int) -> RowSpec | None:
        """Forget row ``uid`` (its source leaves the group now: a row that speculates again
        from here brings a new one)."""
        if uid in self.uids:
            at = self.uids.index(uid)
            self.group.filter_rows([i for i in range(len(self.uids)) if i != at])
            del self.uids[at]
        return self.specs.pop(uid, None)

    def close(self) -> None:
        """The batch ended: plain steps still due in a back-off go back to the controller, so
        the next batch serves them."""
        self.controller.give_back_off_steps(self._off)
        self._off = 0

    def finish(self, spec: RowSpec, tokens_in_cache: list[int]) -> None:
        """Count the row's figures with its provider and store its source state."""
        spec.speculation.finish(_Summary(spec.summary(self.controller.current())), tokens_in_cache)

    def summary(self, spec: RowSpec) -> dict:
        return spec.summary(self.controller.current())

    def _solo(self, rows: DecodingRows) -> RowSpec | None:
        """The row's speculation when the batch decodes that one row alone, and it speculates."""
        return self.specs.get(rows.uids[0]) if len(rows) == 1 else None

    def _solo_length(self, rows: DecodingRows, solo: RowSpec) -> int:
        """:meth:`length` for a batch of one speculating row: its own controller decides, as
        ``engine.speculation.verify`` does alone."""
        c = solo.speculation.controller
        if self._solo_off > 0:
            self._solo_off -= 1
            if solo.fed >= 0:
                self._sync(rows)  # the plain steps' tokens: does the text repeat an earlier run?
                if solo.source.worth_probing():
                    c.cut_off_steps(self._solo_off + 1)
                    self._solo_off, self._solo_in_block = 0, False
                    return self._solo_ask(c, solo)
            return 0
        self._solo_in_block = False
        off = c.take_off_steps()
        if off > 0:
            self._solo_off, self._solo_in_block = off - 1, True
            return 0
        return self._solo_ask(c, solo)

    @staticmethod
    def _solo_ask(c: LengthController, solo: RowSpec) -> int:
        k = c.next_length()
        if k > 0 and solo.source.sizes_itself:
            k = c.maximum  # it ends its proposal where it turns unlikely
        return k

    def _sync(self, rows: DecodingRows) -> None:
        """Keep the group's rows in the batch's order, prefill the sources of rows that
        entered the generation batch, and tell every source the tokens fed by plain steps."""
        order = [u for u in rows.uids if u in self.specs]
        if order != self.uids:
            at = {u: i for i, u in enumerate(self.uids)}
            kept = [u for u in order if u in at]
            self.group.filter_rows([at[u] for u in kept])
            new = [u for u in order if u not in at]
            tail = kept + new
            if tail != order:  # a row came back in another place: rebuild in order
                self.group.filter_rows([])
                new = order
            self.group.append([self.specs[u].source for u in new])
            self.uids = list(order)
        pos = {u: i for i, u in enumerate(rows.uids)}
        commits = []
        for u in self.uids:
            spec, tokens = self.specs[u], rows.tokens[pos[u]]
            if spec.fed < 0:
                t = time.perf_counter()
                spec.source.prefill(spec.prompt, 0)
                spec.stats.draft_s += time.perf_counter() - t
                spec.fed = len(spec.prompt)
                commits.append(list(tokens[spec.fed:]))
                spec.fed = len(tokens)
                continue
            new_tokens = list(tokens[spec.fed:])
            for _ in new_tokens:  # plain batched steps
                spec.stats.record(0, 0)
                spec.stats.forwards += 1
                spec.stats.tokens += 1
            spec.fed = len(tokens)
            commits.append(new_tokens)
        if any(commits):
            t = time.perf_counter()
            self.group.commit(commits)
            dt = time.perf_counter() - t
            for u in self.uids:
                self.specs[u].stats.draft_s += dt

    # policy -------------------------------------------------------------------------
    def length(self, gen: BatchGenerator) -> int:
        """Tokens to ask the sources for this step (0: a plain step)."""
        if not self.specs:
            return 0
        if admitting(gen):
            return 0
        rows = DecodingRows(gen)
        if not len(rows) or not any(u in self.specs for u in rows.uids) or not spec_round_cache(rows.cache):
            return 0
        # As alone: only ``auto`` stops speculating when it is slower; a source the request
        # named keeps proposing (one such row keeps the rounds going for the batch).
        controllers = [s.speculation.controller for s in self.specs.values()]
        self.controller.may_stop = all(c.may_stop for c in controllers)
        # Rows that all ask for a fixed length (constraints: the whole forced span) get it.
        self.controller.adaptive = any(c.adaptive for c in controllers)
        if not self.controller.adaptive:
            self.controller.initial = max(c.initial for c in controllers)
        solo = self._solo(rows)
        if solo is not None:
            return self._solo_length(rows, solo)
        self._solo_off, self._solo_in_block = 0, False
        if self._off > 0:
            self._off -= 1
            return 0
        off = self.controller.take_off_steps()
        if off > 0:
            self._off = off - 1
            return 0
        return self.controller.next_length()

    def plain_step(self, gen: BatchGenerator, started: float, decoding_only: bool) -> None:
        """A plain batched step (``BatchGenerator.next``) began at ``started``. Steps run
        pipelined: each waits for the previous one's forward and only queues its own, so a
        step after another plain step is timed as it returns; the first after a round waits
        for its own forward here (once) to be timed whole. Steps that also prefilled
        joining rows are not timed."""
        if not self.specs:
            return
        if decoding_only:
            rows = DecodingRows(gen)
            if not self._plain_timed and len(rows):
                mx.eval(rows.pending)
            seconds = time.perf_counter() - started
            solo = self._solo(rows) if len(rows) else None
            if solo is None:
                self.controller.record_plain(seconds)
            elif not self._solo_in_block or solo.speculation.controller.in_block:
                # (a back-off's steps were counted when it was handed out: its first is
                # timed, the others are not counted again)
                solo.speculation.controller.record(0, 0, seconds)
        self._plain_timed = decoding_only

    # the round ----------------------------------------------------------------------
    def round(self, gen: BatchGenerator, k: int) -> list[RoundRow] | None:
        """One speculative round over the generation batch of ``gen`` (a BatchGenerator):
        per row of that batch (in its order) what it emits; None when no row had anything
        to propose (nothing was fed: take a plain step)."""
        rows = DecodingRows(gen)
        with mx.stream(gen.stream):
            mx.eval(rows.pending, rows.pending_logprobs)
            t0 = time.perf_counter()
            self._sync(rows)
            pending = [int(t) for t in int_list(rows.pending)]
            n = len(rows)
            pos = {u: i for i, u in enumerate(rows.uids)}
            limits = [max(0, min(k, rows.max_tokens[pos[u]] - rows.generated(pos[u]) - 1)) for u in self.uids]
            proposals = self.group.proposals([pending[pos[u]] for u in self.uids], k, limits)
            proposed: list[list[int]] = [[] for _ in range(n)]
            probs: list[mx.array | None] = [None] * n
            for u, p, lim in zip(self.uids, proposals, limits):
                proposed[pos[u]] = [int(x) for x in p.tokens[:lim]]
                probs[pos[u]] = p.probs
            width = 1 + max(len(d) for d in proposed)
            solo = self._solo(rows)
            if width == 1:
                if solo is not None:
                    solo.speculation.controller.empty()
                else:
                    self.controller.empty()
                self._plain_timed = False
                if self.trace:
                    print(f"mlxkv spec batch: rows={list(rows.uids)} drafts=[] (a plain step)",
                          file=sys.stderr, flush=True)
                return None
            t_proposed = time.perf_counter()
            windows = [[pending[i]] + proposed[i] + [pending[i]] * (width - 1 - len(proposed[i])) for i in range(n)]
            logits = self.model(mx.array(windows), cache=rows.cache)
            lp = self._logprobs(rows, logits, windows)
            targets = self._sample(rows, lp)
            rej = [i for i in range(n) if probs[i] is not None and proposed[i]
                   and self._sampler_at(rows, i) is not None]
            if rej:
                acc, nxt = self._rejection(rows, lp, rej, proposed, probs, width)
                mx.eval(targets, acc, nxt)
                walked = dict(zip(rej, zip(int_list(acc), int_list(nxt))))
            else:
                mx.eval(targets)
                walked = {}
            got = int_rows(targets)
            keep, follow = [], []
            for i in range(n):
                d = proposed[i]
                if i in walked:
                    a, nx = walked[i]
                else:
                    a = 0
                    while a < len(d) and got[i][a] == d[a]:
                        a += 1
                    nx = got[i][a]
                keep.append(a + 1)
                follow.append(int(nx))
            t_verified = time.perf_counter()
            common = self._common_length(rows.cache, keep)
            kept = [min(c, common) for c in keep]
            nxt_tokens = [follow[i] if keep[i] <= common else proposed[i][common - 1] for i in range(n)]
            self._settle_cache(rows.cache, width, common, kept)
            old_lp = list(rows.pending_logprobs)
            out = []
            for i in range(n):
                fed = windows[i][:kept[i]]
                rows.tokens[i].extend(fed)
                rows.extend_history(i, fed)
                out.append(RoundRow([(pending[i], old_lp[i])]
                                    + [(proposed[i][j], lp[i, j]) for j in range(kept[i] - 1)]))
            rows.set_pending(nxt_tokens, [lp[i, kept[i] - 1] for i in range(n)])
            for u in self.uids:  # the sources take what their row kept
                spec = self.specs[u]
                spec.fed = len(rows.tokens[pos[u]])
            t_c = time.perf_counter()
            self.group.commit([windows[pos[u]][:kept[pos[u]]] for u in self.uids])
            t_done = time.perf_counter()
            for u in self.uids:
                i = pos[u]
                s = self.specs[u].stats
                s.record(len(proposed[i]), kept[i] - 1)
                s.forwards += 1
                s.tokens += kept[i]
                s.draft_s += (t_proposed - t0) + (t_done - t_c)
                s.verify_s += t_verified - t_proposed
                s.other_s += t_c - t_verified
            proposing = [i for i in range(n) if proposed[i]]
            if solo is not None:
                solo.speculation.controller.record(len(proposed[0]), kept[0] - 1, t_done - t0)
            else:
                self.controller.record_round(width, sum(len(proposed[i]) for i in proposing),
                                             sum(kept[i] - 1 for i in proposing), len(proposing) / n,
                                             t_done - t0)
            if self.trace:
                for i, uid in enumerate(rows.uids):
                    print(f"mlxkv spec batch: row={uid} fed={windows[i][:1 + len(proposed[i])]} drafts={proposed[i]} "
                          f"accepted={keep[i] - 1} kept={kept[i]} next={nxt_tokens[i]}", file=sys.stderr, flush=True)
            self._plain_timed = False
            self.rounds += 1
            return out

    def _spec_at(self, rows: DecodingRows, i: int) -> RowSpec | None:
        return self.specs.get(rows.uids[i])

    def _sampler_at(self, rows: DecodingRows, i: int) -> TargetSampler | None:
        """Row ``i``'s sampler for rejection sampling (None: it decodes greedily or plainly)."""
        spec = self._spec_at(rows, i)
        return spec.sampler if spec is not None else None

    @staticmethod
    def _logprobs(rows: DecodingRows, logits: mx.array, windows: list[list[int]]) -> mx.array:
        """logits [B, W, V] -> each row's processed, normalised log-probabilities, position j
        seeing the row's history plus its window up to j (as a plain step would)."""
        if any(rows.processors):
            logits = mx.stack([
                process_window(procs, rows.history(i), windows[i], logits[i]) if procs else logits[i]
                for i, procs in enumerate(rows.processors)])
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    @staticmethod
    def _sample(rows: DecodingRows, lp: mx.array) -> mx.array:
        """Each row's own sampler at every position: [B, W]."""
        b, w, v = lp.shape
        samplers = rows.samplers()
        if all(s is samplers[0] for s in samplers):
            return samplers[0](lp.reshape(b * w, v)).reshape(b, w)
        return mx.stack([s(lp[i]) for i, s in enumerate(samplers)])

    def _rejection(self, batch: DecodingRows, lp: mx.array, rows: list[int], proposed: list[list[int]],
                   probs: list[mx.array | None], width: int) -> tuple[mx.array, mx.array]:
        k = width - 1
        samplers = [self._sampler_at(batch, i) for i in rows]
        assert all(s is not None for s in samplers)  # the rows that sample, chosen on it
        p = mx.stack([s.probs(lp[i]) for s, i in zip(samplers, rows) if s is not None])
        qs, ds = [], []
        for i in rows:
            q_row = probs[i]
            assert q_row is not None  # the rows chosen for rejection sampling handed theirs
            q = q_row[: len(proposed[i])].astype(mx.float32)
            if q.shape[-1] != p.shape[-1]:
                q = q[:, : p.shape[-1]] if q.shape[-1] > p.shape[-1] else mx.pad(
                    q, [(0, 0), (0, p.shape[-1] - q.shape[-1])])
            if q.shape[0] < k:
                q = mx.pad(q, [(0, k - q.shape[0]), (0, 0)])
            qs.append(q)
            ds.append(proposed[i] + [0] * (k - len(proposed[i])))
        lengths = mx.array([len(proposed[i]) for i in rows], dtype=mx.int32)
        return rejection_walk_rows(p, mx.stack(qs), mx.array(ds, dtype=mx.int32), lengths)

    @staticmethod
    def _common_length(cache: list, keep: list[int]) -> int:
        """The positions every row holds after the round: the longest row's count, unless the
        padding that leaves the others would outgrow the longest row (then the shortest's)."""
        hi, lo = max(keep), min(keep)
        if hi == lo:
            return hi
        c = cache[0]
        pad = c.left_padding.tolist()
        size = c.offset.tolist()
        worst = max(p + hi - kp for p, kp in zip(pad, keep))
        return hi if worst <= max(256, max(size)) else lo

    @staticmethod
    def _settle_cache(cache: list, width: int, common: int, kept: list[int]) -> None:
        """Drop the rejected positions: trim every row to ``common``; a row that kept fewer
        is rolled right so its rejected tail becomes left padding. Public ``BatchKVCache``
        API only: its filled columns are ``keys_and_values()``, and ``filter`` keeping every
        row drops the columns all rows pad (as it does when a row leaves)."""
        from mlx_lm.models.cache import dynamic_roll

        shifts = [common - k for k in kept]
        roll = any(shifts)
        shift = mx.array(shifts, dtype=mx.int32)
        for c in cache:
            c.trim(width - common)
            if roll:
                keys, values = c.keys_and_values()
                end = keys.shape[2]
                c.keys[..., :end, :] = dynamic_roll(keys, shift[:, None], axis=2)
                c.values[..., :end, :] = dynamic_roll(values, shift[:, None], axis=2)
                c.left_padding = c.left_padding + shift
                c.offset = c.offset - shift
        if roll and min(cache[0].left_padding.tolist()) >= 64:  # every row padded that far
            every = list(range(len(kept)))
            for c in cache:
                c.filter(every)
