"""Continuous batching, on the engine thread: a request starts in a batch of one (or, when
its speculation only the lone path runs, decodes alone and moves into a batch with its KV
state when another waits), the waiting ones join it between steps, what a row leaves
behind (its state) is stored in the prefix cache, and a batch step that fails has every
row answered again alone. The rows themselves are :mod:`engine.batch`; which requests may
join, and when, is :mod:`engine.admission`.

Interface: :meth:`Batching.takes` (whether a request starts in a batch),
:meth:`Batching.run` (the engine's scheduler calls it with a prepared request, or with the
one that was running alone and its :class:`~engine.single.Join`),
:meth:`Batching.prefill_at` and :meth:`Batching.active_rows`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

from mlxkv.engine.admission import Admission, guided, row_batchable
from mlxkv.engine.batch import Batch, Ending, Row
from mlxkv.engine.commands import CommandQueue
from mlxkv.engine.generate import cache_length
from mlxkv.engine.loading import Runtime
from mlxkv.engine.logs import warn_once
from mlxkv.engine.preparing import Job, Preparer
from mlxkv.engine.requests import Counts, ErrorEvent, Request, RequestHandle
from mlxkv.engine.sampling import SeededSampler
from mlxkv.engine.settings import Settings
from mlxkv.engine.single import Join, PrefillAt, SingleStream
from mlxkv.engine.speculation.batch_verify import BatchLength
from mlxkv.engine.speculation.providers import Speculation, learn_finished
from mlxkv.engine.step_budget import StepBudget

log = logging.getLogger("mlxkv.engine")


class Batching:
    """Batches of up to ``max_batch`` rows for one loaded model."""

    def __init__(self, runtime: Runtime, settings: Settings, commands: CommandQueue,
                 counts: Counts, admission: Admission, preparer: Preparer, single: SingleStream,
                 load_wait: Callable[[float], float], between: Callable[..., None]):
        self.runtime = runtime
        self.settings = settings
        self.commands = commands
        self.counts = counts
        self.admission = admission
        self.preparer = preparer
        self.single = single
        self.load_wait = load_wait
        self.between = between  # quick calls and the published figures, between steps
        self.max_batch = admission.max_batch
        self.batch: Batch | None = None  # the batch decoding now
        # The batches' round-length controller: one, kept from batch to batch.
        self.spec_policy = BatchLength()
        # The prefill chunk beside decoding rows, learned from this model's steps: one, too.
        self.budget = StepBudget(settings.batch_itl_factor)
        # A lone request starts in a batch of one (``takes``); MLXKV_ONE_PATH=0 serves it
        # alone until another waits, as before.
        self.enabled = os.environ.get("MLXKV_ONE_PATH", "1") != "0"
        self._rounds_cache: bool | None = None

    def takes(self, req: Request) -> bool:
        """Whether ``req`` starts in a batch (of one, until others join) rather than alone:
        the batch decodes it as the lone path would (a draft model's row included: a batch of
        one drafts as alone, see :meth:`_row_speculation`). A request whose speculation only
        the lone path runs is served alone, and moves into a batch when another waits: one
        that drafts with the model's MTP head (a batch has no hidden states for it), one
        that would speculate on a model with recurrent layers (a batch cannot give back a
        round's rejected positions of a recurrent state; alone, the verifier restores a
        snapshot), or one that would speculate where batched rounds are not available (an
        mlx-lm version they were not checked against)."""
        if not (self.enabled and self.admission.enabled and row_batchable(req, self.settings.spec)):
            return False
        from mlxkv.engine.speculation.providers import choose

        provider = choose(self.runtime.providers, req.spec or self.settings.spec, guided(req)) \
            if self.runtime.providers else None
        if provider is None:
            return True
        from mlxkv.engine.mlx_lm_compat import batch_speculation_available

        return provider.kind != "mtp" and self._rounds() and batch_speculation_available()

    def _rounds(self) -> bool:
        """Whether this model's batch caches run speculative rounds (decided once)."""
        if self._rounds_cache is None:
            from mlx_lm.models.cache import make_prompt_cache

            from mlxkv.engine.batch import rounds_cache

            self._rounds_cache = rounds_cache(make_prompt_cache(self.runtime.loaded.model))
        return self._rounds_cache

    def active_rows(self) -> int:
        """Rows decoding in a batch now (0: none)."""
        return len(self.batch) if self.batch is not None else 0

    def prefill_at(self, handle: RequestHandle) -> PrefillAt | None:
        """Where ``handle``'s prefill is inside a batch's pass (None: not inside one)."""
        at = self.batch.prefilling_at(handle) if self.batch is not None else None
        return PrefillAt(*at) if at is not None else None

    def active_handles(self) -> list[RequestHandle]:
        """The requests of the rows decoding in a batch now."""
        return [] if self.batch is None else self.batch.handles()

    def _row(self, job: Job) -> Row:
        handle = job.handle
        return Row(handle, job.tokens, job.params, job.n_cached, started=job.start,
                   queue_s=job.start - handle.submitted, load_s=self.load_wait(handle.submitted),
                   context_cut=job.params.max_tokens < handle.request.params.max_tokens,
                   cached_ram_tokens=job.ram_tokens, cached_ssd_tokens=job.ssd_tokens,
                   lent=job.cache)

    def run(self, job: Job, join: Join | None = None) -> None:
        """Decode ``job`` together with the requests that wait, admitting more between
        steps, until every row has ended. With ``join`` the request was running alone and
        its state moves over; without, it starts in the batch from its cached prefix."""
        row = self._row(job)
        if join is None:
            cache, in_cache, rest = job.cache, job.tokens[:job.n_cached], job.tokens[job.n_cached:]
        else:
            cache, in_cache, rest = self._moved(row, job, join)
        closed = self.commands.is_closed
        loaded = self.runtime.loaded
        batch = Batch(loaded.model, loaded.tokenizer, self.max_batch,
                      should_stop=lambda r: r.handle.cancelled or closed(),
                      stopping=closed, on_end=self._row_ended,
                      release=self.runtime.cache.release, speculation=self._row_speculation,
                      spec_policy=self.spec_policy, stores=self.runtime.cache.enabled,
                      budget=self.budget, between=self.between, on_finish=self._row_finished,
                      rounds=self._rounds())
        if join is not None and join.gen.speculation is not None:  # the row opens its own
            join.gen.speculation.source.close()
        self.batch = batch
        try:
            if self._add(batch, row, job, cache, in_cache, rest):
                self.between(True)  # the figures show it from now on
            while True:
                self._admit(batch)
                if not len(batch):
                    break
                try:
                    batch.step()
                except Exception as e:
                    self._failed(batch, e)
                    break
                self.between()
        finally:
            self.batch = None
            if self.admission.batching:
                self.admission.batching = False
                self.admission.batched_at = time.monotonic()
            batch.close()

    def _moved(self, row: Row, job: Job, join: Join) -> tuple[list | None, list[int], list[int]]:
        """The state of a request that decoded alone, moved over into ``row``: (its cache,
        the tokens that holds, the tokens still to feed)."""
        row.emitted, row.gen_start = list(join.sent), join.started
        row.first_time = join.gen.first_token_time
        if isinstance(join.gen.sampler, SeededSampler):  # its draws go on where they were
            join.gen.sampler.rewind(len(join.sent))  # (not the one its pipelined step drew ahead)
            row.sampler = join.gen.sampler
        row.last_time = time.perf_counter() if join.sent else None
        # Its time per token alone is what the budget aims at while the newcomers prefill:
        # the gaps between its last tokens (not the first, which may have waited for the
        # compiled step's first trace, nor the wait for the join since); a request that
        # speculated emits a round's tokens at once, so its average per token instead.
        last = join.gen.last_token_time
        if join.gen.speculation is None:
            for gap in list(join.gen.token_gaps)[1:]:
                self.budget.observe(0, gap)
        elif row.first_time is not None and last is not None and len(join.sent) > 2:
            self.budget.observe(0, (last - row.first_time) / (len(join.sent) - 1))
        seen = job.handle.progress  # not sent twice when it moves during the prefill
        row.progress = (seen.done, seen.total) if seen is not None else None
        # The KV state must hold all but the last known token, which is fed next.
        history = job.tokens + list(join.sent)
        cache = join.gen.cache
        assert cache is not None  # the generation ran: it made its cache
        held = cache_length(cache) or 0
        keep = min(held, len(history) - 1)
        if held > keep and not join.gen.give_back_last(len(history)):  # (recurrent layers)
            if all(c.is_trimmable() for c in cache):
                for c in cache:
                    c.trim(held - keep)
            else:
                # A recurrent state past the last token (a speculative stream's close fed
                # its pipelined step): nothing gives that token back, so the batch
                # computes the row's state again from its prompt and what it sent.
                log.debug("request %d moves into the batch without its state", row.handle.id)
                cache, keep = None, 0
        return cache, history[:keep], history[keep:]

    def _row_speculation(self, row: Row, alone: bool) -> Speculation | None:
        """A batched row's speculation, opened as for the request alone (None: plain). Under
        ``auto`` a row beside others drafts only with prompt lookup and constraints: a draft
        model proposes row by row (k small forwards per row and round), which a plain
        batched step beats. A row ``alone`` in its batch (a batch of one) drafts as the
        request alone would, its draft model included; the batch opens its speculation again
        without it once another row joins (``Batch.add``)."""
        req = row.request
        providers = self.runtime.providers
        if (req.spec or self.settings.spec) == "auto" and not alone:
            providers = {k: v for k, v in providers.items() if k not in ("draft", "mtp")}
        spec, _ = self.single.speculation(req, row.params, providers)
        if spec is not None:
            spec.restore(row.prompt)
        return spec

    def _admit(self, batch: Batch) -> None:
        """Let the requests next in line join ``batch`` while it has room. A call, a
        shutdown or a request that must be served alone stops this: it waits until the
        batch has ended, as it would behind a single request."""
        if self.commands.waiting > 0:
            self.admission.sweep_cancelled()
        while batch.room > 0:
            if not len(batch):  # nothing left to join: the request starts as the scheduler would
                waiting = self.commands.peek()
                if isinstance(waiting, RequestHandle) and not waiting.cancelled \
                        and not self.takes(waiting.request):
                    return
            head = self.admission.next_row()
            if head is None:
                return
            self.counts.requests += 1
            job = self.preparer.prepare(head, time.perf_counter())
            if job is None:
                continue
            if self._add(batch, self._row(job), job, job.cache, job.tokens[:job.n_cached],
                         job.tokens[job.n_cached:]):
                self.between(True)

    def _add(self, batch: Batch, row: Row, job: Job, cache: list | None, in_cache: list[int],
             rest: list[int]) -> bool:
        """Let ``row`` join ``batch`` (False: it could not, and was answered with an error).
        A cached state that does not fit fails in the step that merges it, not here: the
        batch's retry (:meth:`_failed`) answers it again without the cache."""
        try:
            batch.add(row, cache, in_cache, rest)
        except Exception as e:
            log.debug("request %d could not join the batch", row.handle.id, exc_info=True)
            self.runtime.cache.release(job.cache)
            self.counts.errors += 1
            row.handle.emit(ErrorEvent(f"{type(e).__name__}: {e}", e))
            return False
        return self._shared(batch)

    def _shared(self, batch: Batch) -> bool:
        """A row joined ``batch``: count the rows that now decode beside another (a batch of
        one is not batching: admission then waits for company as it does behind a request
        alone). True."""
        if batch.newly_shared:
            self.admission.batching = True
            self.counts.batched += batch.newly_shared
            batch.newly_shared = 0
        return True

    def _row_finished(self, reason: str) -> None:
        """A batched row is about to send its FinishedEvent: count it."""
        if reason == "cancelled":
            self.counts.cancelled += 1

    def _row_ended(self, row: Row, ending: Ending) -> None:
        """A batched row sent its last event: store its state, and let the speculation
        sources that learn from earlier outputs take its output."""
        cache = self.runtime.cache
        if not (cache.enabled and ending.tokens_in_cache and ending.cache):
            cache.release(ending.cache)
        else:
            cache.store(ending.tokens_in_cache, ending.cache, row.request.session,
                        row.request.retain_s, row.request.cache_scope)
        if row.request.cache_scope is None:  # a scope's text never reaches another request's proposals
            learn_finished(self.runtime.providers, list(row.emitted))

    def _failed(self, batch: Batch, exc: BaseException) -> None:
        """A batch step failed (a cached state that does not fit, say): every row is
        answered again alone, from scratch; what it already sent is checked, not sent
        again. Cached states that seeded a row are dropped."""
        log.debug("a batch step failed", exc_info=True)
        warn_once(log, f"batch:{type(exc).__name__}", "decoding %d requests together failed "
                   "(%s: %s); each is answered again on its own", len(batch),
                   type(exc).__name__, (str(exc).splitlines() or [""])[0][:200])
        for row in batch.abort():
            self.counts.retries += 1
            if row.n_cached > 0:
                self.runtime.cache.drop(row.prompt, exc, row.request.cache_scope)
            handle, sent = row.handle, list(row.emitted)
            try:
                gen = self.single.generate(handle, row.prompt, row.params, None, 0, [], sent)
            except Exception as e:
                log.debug("request %d failed", handle.id, exc_info=True)
                self.counts.errors += 1
                handle.emit(ErrorEvent(f"{type(e).__name__}: {e}", e))
                continue
            self.single.answered(handle, row.request, gen, row.started, row.params.max_tokens,
                                 0, 0, 0, True)
