"""The engine thread's side of continuous batching, mixed into :class:`engine.engine.Engine`:
when a request decoding alone moves into a batch, which waiting requests join it between
steps, what a row leaves behind (its state, stored in the prefix cache), and what happens
when a batch step fails. The rows themselves are :mod:`engine.batch`.

Policy: a lone request decodes single-stream (with speculation). While it runs, the
engine looks, between tokens and prefill chunks, at the next command in line; when that is
a request that may be batched, the running one raises :class:`Join` out of its
generation, its KV state moves into a batch (trimmed so the last known token is fed
again) and the waiting requests join, each after its own prefix-cache lookup, up to
``max_batch`` rows. A call, a shutdown or a request that must be served alone (seeded
sampling) is not overtaken: the batch stops admitting and runs out first.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import time
from typing import Any

from mlxkv.engine.generate import Generation
from mlxkv.engine.logs import warn_once
from mlxkv.engine.requests import ErrorEvent, Request, RequestHandle

log = logging.getLogger("mlxkv.engine")


# How long a request that starts alone waits for others sent with it (see Batching._gather),
# and for how long after requests last decoded together the engine expects such bursts.
GATHER_S = 0.01
GATHER_RECENT_S = 60.0


class Join(BaseException):
    """Raised on the engine thread out of a single-stream generation (between tokens or
    prefill chunks) so that it moves into a batch. A BaseException, so that no
    ``except Exception`` on its way (the generation loop's, a speculation source's)
    mistakes it for a failure."""

    def __init__(self, gen: Generation, sent: list[int], started: float):
        super().__init__("join a batch")
        self.gen, self.sent, self.started = gen, sent, started


@dataclasses.dataclass
class Job:
    """A request ready to generate: its prompt, its parameters (max_tokens cut to the
    context) and what the prefix cache supplied."""

    handle: RequestHandle
    start: float
    tokens: list[int]
    params: Any
    n_cached: int
    cache: Any
    ram_tokens: int
    ssd_tokens: int


class Batching:
    """Continuous batching for :class:`engine.engine.Engine` (engine thread only). Uses the
    engine's queue look-ahead (``_peek``, ``_backlog``), its request steps (``_prepare``,
    ``_generate``, ``_answered``, ``_serve``) and its prefix-cache helpers."""

    @staticmethod
    def _row_batchable(req: Request) -> bool:
        # A seeded sampled request keeps its own random stream: it is served alone.
        p = req.params
        return not (p.seed is not None and p.temperature > 0)

    def _gather(self, handle: RequestHandle) -> None:
        """A batchable request that starts while nothing else waits gives the requests sent
        with it (clients that send at once) up to ``GATHER_S`` to arrive before its prefill:
        they then prefill together in one batch, as mlx_lm.server's do, instead of this one
        alone and the others after its first token (its prefill is one pass: nothing to join
        between). It waits that long once, on the queue, not in a sleep, and only while
        requests have decoded together within ``GATHER_RECENT_S``: a lone user (the chat, one
        agent) never waits; a server that sees concurrent clients does."""
        if (self._waiting > 0 or self._backlog or self.max_batch < 2 or not self._batchable
                or not self._recently_batched() or handle.cancelled
                or not self._row_batchable(handle.request)):
            return
        try:
            self._backlog.append(self._queue.get(timeout=GATHER_S))
        except queue.Empty:
            pass

    def _recently_batched(self) -> bool:
        """Whether requests decoded together within the last ``GATHER_RECENT_S``."""
        last = self._batched_at
        return self._batch is not None or (last is not None and time.monotonic() - last < GATHER_RECENT_S)

    def _join_wanted(self, handle: RequestHandle, gen: Generation, sent: list[int]) -> bool:
        """Should the single-stream request ``handle`` move into a batch now: another
        request that may decode with it is next in line, and its state can move."""
        if self._waiting > 0:
            self._sweep_cancelled()
        if (self._waiting <= 0 or self.max_batch < 2 or not self._batchable
                or handle.cancelled or self._stopping.is_set()
                or not self._row_batchable(handle.request)):
            return False
        head = self._peek()
        if not (isinstance(head, RequestHandle) and not head.cancelled
                and self._row_batchable(head.request)):
            return False
        from mlxkv.engine.batch import movable

        return gen.cache is not None and movable(gen.cache, len(gen.prompt_tokens) + len(sent))

    def _row(self, job: Job) -> Any:
        from mlxkv.engine.batch import Row

        handle = job.handle
        return Row(handle, job.tokens, job.params, job.n_cached, started=job.start,
                   queue_s=job.start - handle.submitted, load_s=self._load_wait(handle.submitted),
                   context_cut=job.params.max_tokens < handle.request.params.max_tokens,
                   cached_ram_tokens=job.ram_tokens, cached_ssd_tokens=job.ssd_tokens,
                   lent=job.cache)

    def _run_batch(self, job: Job, join: Join) -> None:
        """Decode the request that was running alone (its state moved over from ``join``)
        together with the requests that wait, admitting more between steps, until every
        row has ended."""
        from mlxkv.engine.batch import Batch
        from mlxkv.engine.generate import cache_length

        row = self._row(job)
        row.emitted, row.gen_start = list(join.sent), join.started
        row.first_time = join.gen.first_token_time
        row.last_time = time.perf_counter() if join.sent else None
        seen = job.handle.progress  # not sent twice when it moves during the prefill
        row.progress = (seen.done, seen.total) if seen is not None else None
        # The KV state must hold all but the last known token, which is fed next.
        history = job.tokens + list(join.sent)
        cache = join.gen.cache
        held = cache_length(cache) or 0
        keep = min(held, len(history) - 1)
        if held > keep:
            for c in cache:
                c.trim(held - keep)
        batch = Batch(self.loaded.model, self.loaded.tokenizer, self.max_batch,
                      should_stop=lambda r: r.handle.cancelled or self._stopping.is_set(),
                      stopping=self._stopping.is_set, on_end=self._row_ended,
                      release=self._release, speculation=self._row_speculation,
                      spec_policy=self._batch_spec_policy())
        if join.gen.speculation is not None:  # the row opens its own in the batch
            join.gen.speculation.source.close()
        self._batch = batch
        self._serving = None
        self._counts["batched"] += 1
        try:
            try:
                batch.add(row, cache, history[:keep], history[keep:])
            except Exception as e:
                log.debug("request %d could not move into a batch", row.handle.id, exc_info=True)
                self._release(job.cache)
                self._counts["errors"] += 1
                row.handle._emit(ErrorEvent(f"{type(e).__name__}: {e}", e))
            while True:
                self._admit(batch)
                if not len(batch):
                    break
                try:
                    batch.step()
                except Exception as e:
                    self._batch_failed(batch, e)
                    break
                self._run_quick()
        finally:
            self._batch = None
            self._batched_at = time.monotonic()
            batch.close()

    def _batch_spec_policy(self) -> Any:
        """The batches' round-length controller for the loaded model: one, kept from batch
        to batch (a new model gets a new one)."""
        from mlxkv.engine.speculation.batch_verify import BatchLength

        kept = getattr(self, "_spec_policy", None)
        if kept is None or kept[0] is not self.loaded:
            kept = self._spec_policy = (self.loaded, BatchLength())
        return kept[1]

    def _row_speculation(self, row: Any) -> Any:
        """A batched row's speculation, opened as for the request alone (None: plain). Under
        ``auto`` a batch drafts only with prompt lookup and constraints: a draft model still
        drafts row by row there (k small forwards per row and round), which a plain batched
        step beats."""
        from mlxkv.engine.speculation.providers import open_speculation

        req = row.request
        providers = self.spec_providers
        if (req.spec or getattr(self.settings, "spec", "auto")) == "auto":
            providers = {k: v for k, v in providers.items() if k not in ("draft", "mtp")}
        spec, _ = open_speculation(
            providers, self.loaded, row.params, mode=req.spec,
            settings_mode=getattr(self.settings, "spec", "auto"), guided_choice=req.guided_choice,
            json_skeleton=req.json_skeleton, max_tokens=getattr(self.settings, "spec_tokens", 12),
            prefix_cache=self.prefix_cache if self._caching else None, namespace=self.namespace,
            session=req.session)
        if spec is not None:
            spec._restore(row.prompt)
        return spec

    def _admit(self, batch: Any) -> None:
        """Let the requests next in line join ``batch`` while it has room. A call, a
        shutdown or a request that must be served alone stops this: it waits until the
        batch has ended, as it would behind a single request."""
        if self._waiting > 0:
            self._sweep_cancelled()
        while batch.room > 0 and not self._stopping.is_set():
            head = self._peek()
            if not isinstance(head, RequestHandle):
                return
            if head.cancelled:  # answered at once, as _serve does
                self._backlog.popleft()
                self._serve(head)
                continue
            if not self._row_batchable(head.request):
                return
            self._backlog.popleft()
            self._take(head)
            self._counts["requests"] += 1
            self._counts["batched"] += 1
            job = self._prepare(head, time.perf_counter())
            if job is None:
                continue
            try:
                batch.add(self._row(job), job.cache, job.tokens[:job.n_cached],
                          job.tokens[job.n_cached:])
            except Exception as e:
                log.debug("request %d could not join the batch", head.id, exc_info=True)
                self._release(job.cache)
                self._counts["errors"] += 1
                head._emit(ErrorEvent(f"{type(e).__name__}: {e}", e))

    def _row_ended(self, row: Any, ending: Any) -> None:
        """A batched row sent its last event: count it and store its state."""
        if ending.reason == "cancelled":
            self._counts["cancelled"] += 1
        if not (self._caching and ending.tokens_in_cache and ending.cache):
            self._release(ending.cache)
            return
        self._store_state(ending.tokens_in_cache, ending.cache, row.request.session)

    def _batch_failed(self, batch: Any, exc: BaseException) -> None:
        """A batch step failed (a cached state that does not fit, say): every row is
        answered again alone, from scratch; what it already sent is checked, not sent
        again. Cached states that seeded a row are dropped."""
        log.debug("a batch step failed", exc_info=True)
        warn_once(log, f"batch:{type(exc).__name__}", "decoding %d requests together failed "
                   "(%s: %s); each is answered again on its own", len(batch),
                   type(exc).__name__, (str(exc).splitlines() or [""])[0][:200])
        for row in batch.abort():
            self._counts["retries"] += 1
            if row.n_cached > 0:
                self._drop_cached(row.prompt, row.lent, row.n_cached, exc)
            handle, sent = row.handle, list(row.emitted)
            self._serving = handle
            try:
                gen = self._generate(handle, row.prompt, row.params, None, 0, [], sent)
            except Exception as e:
                log.debug("request %d failed", handle.id, exc_info=True)
                self._counts["errors"] += 1
                handle._emit(ErrorEvent(f"{type(e).__name__}: {e}", e))
                continue
            finally:
                self._serving = None
            self._answered(handle, row.request, gen, row.started, row.params.max_tokens, 0,
                           0, 0, True)
