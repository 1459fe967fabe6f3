"""The single-stream loop, on the engine thread: one request decodes alone (with its
speculation), sending its events as it goes; between tokens and prefill chunks it serves
quick calls and asks :class:`~engine.admission.Admission` whether to move into a batch
(it then raises :class:`Join`). A generation that fails after starting from a cached prefix
is answered again without it (:class:`Retry`); what it already sent is checked, not sent
twice.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mlxkv.engine.admission import Admission
from mlxkv.engine.commands import CommandQueue
from mlxkv.engine.generate import Generation
from mlxkv.engine.loading import Runtime
from mlxkv.engine.preparing import Job, TokenSource
from mlxkv.engine.requests import (
    Counts,
    EngineError,
    ErrorEvent,
    FinishedEvent,
    ProgressEvent,
    Request,
    RequestHandle,
    StatsEvent,
    TokenEvent,
    stored_prompt_tokens,
)
from mlxkv.engine.sampling import SamplingParams
from mlxkv.engine.settings import Settings
from mlxkv.engine.speculation.providers import learn_finished

if TYPE_CHECKING:
    from mlxkv.engine.speculation.base import ProposalProvider
    from mlxkv.engine.speculation.providers import Speculation

import logging

log = logging.getLogger("mlxkv.engine")


class Retry(Exception):
    """A generation from a cached prefix failed with ``failure``: compute the request again
    without it."""

    def __init__(self, failure: Exception):
        super().__init__()
        self.failure = failure


class Join(BaseException):
    """Raised on the engine thread out of a single-stream generation (between tokens or
    prefill chunks) so that it moves into a batch. A BaseException, so that no
    ``except Exception`` on its way (the generation loop's, a speculation source's)
    mistakes it for a failure."""

    def __init__(self, gen: Generation, sent: list[int], started: float):
        super().__init__("join a batch")
        self.gen, self.sent, self.started = gen, sent, started


@dataclass(frozen=True)
class PrefillAt:
    """Where the prefill of the request generating now is: ``layer`` of ``layers`` layers
    of the ``chunk`` tokens after the first ``done`` prompt tokens (cached ones included)."""

    done: int
    chunk: int
    layer: int
    layers: int


class SingleStream:
    """Decodes one request at a time for one loaded model. ``between()`` is what the
    engine thread does where it looks up from a generation (quick calls, the published
    figures): between prefill layers and chunks and between tokens."""

    def __init__(self, runtime: Runtime, settings: Settings, commands: CommandQueue,
                 counts: Counts, admission: Admission, tokens: TokenSource,
                 load_wait: Callable[[float], float], between: Callable[..., None]):
        self.runtime = runtime
        self.settings = settings
        self.commands = commands
        self.counts = counts
        self.admission = admission
        self.tokens = tokens
        self.load_wait = load_wait
        self.between = between
        self.current: RequestHandle | None = None  # the request generating now
        self.prefill_at: PrefillAt | None = None  # inside its prefill: where

    def speculation(self, req: Request, params: SamplingParams,
                    providers: dict[str, ProposalProvider] | None = None
                    ) -> tuple[Speculation | None, Any]:
        """(the request's speculation or None, its constraint or None), from ``providers``
        (default: every provider of the model)."""
        from mlxkv.engine.speculation.grammar import logits_width, request_constraint
        from mlxkv.engine.speculation.providers import open_speculation

        rt = self.runtime
        constraint = request_constraint(rt.loaded.tokenizer, req, logits_width(rt.loaded.model))
        return open_speculation(
            rt.providers if providers is None else providers, rt.loaded, params, mode=req.spec,
            settings_mode=self.settings.spec, constraint=constraint,
            json_skeleton=req.json_skeleton, max_tokens=self.settings.spec_tokens,
            prefix_cache=rt.cache.client if rt.cache.enabled else None,
            namespace=rt.cache.namespace_of(req.cache_scope), session=req.session,
            private=req.cache_scope is not None)

    def run(self, job: Job) -> Join | None:
        """Generate ``job`` alone and answer it; the :class:`Join` when it must move into a
        batch instead (it has sent what it sent so far)."""
        handle, req = job.handle, job.handle.request
        tokens, params, n_cached, cache = job.tokens, job.params, job.n_cached, job.cache
        sent: list[int] = []  # tokens of the TokenEvents already sent
        retried = False
        try:
            try:
                gen = self.generate(handle, tokens, params, cache, n_cached, sent, None)
            except Retry as failed:
                self.counts.retries += 1
                retried = True
                self.runtime.cache.drop(tokens, failed.failure, req.cache_scope)
                gen = self.generate(handle, tokens, params, None, 0, [], sent)
        except Join as join:  # another request waits: go on decoding together
            return join
        except Exception as e:
            log.debug("request %d failed", handle.id, exc_info=True)
            if not retried:
                self.runtime.cache.release(cache)
            self.counts.errors += 1
            handle.emit(ErrorEvent(f"{type(e).__name__}: {e}", e))
            return None
        self.answered(handle, req, gen, job.start, params.max_tokens, n_cached, job.ram_tokens,
                      job.ssd_tokens, retried)
        return None

    def answered(self, handle: RequestHandle, req: Request, gen: Generation, start: float,
                 max_tokens: int, n_cached: int, ram_tokens: int, ssd_tokens: int,
                 retried: bool) -> None:
        """A single-stream generation ended: its StatsEvent and FinishedEvent, then the
        store of its state."""
        out = gen.outcome
        assert out is not None  # set when the generation ended
        ttft = (gen.first_token_time - start) if gen.first_token_time else 0.0
        submitted = handle.submitted
        whole = out.cached_tokens == n_cached and not retried
        stores = self.runtime.cache.enabled and bool(out.tokens_in_cache)
        handle.emit(StatsEvent(
            prompt_tokens=out.prompt_tokens, cached_tokens=out.cached_tokens,
            generated_tokens=len(out.tokens), ttft_s=ttft, prefill_tps=out.prefill_tps,
            decode_tps=out.decode_tps, queue_s=start - submitted,
            load_s=self.load_wait(submitted), retried=retried,
            cached_ram_tokens=ram_tokens if whole else 0,
            cached_ssd_tokens=ssd_tokens if whole else 0, spec=out.spec,
            stored_tokens=stored_prompt_tokens(out.prompt_tokens, out.cached_tokens,
                                               len(out.tokens_in_cache), stores)))
        detail = out.stop_detail
        if out.finish_reason == "cancelled":
            self.counts.cancelled += 1
            if self.commands.is_closed():
                detail = "shutdown"
        elif out.finish_reason == "length" and max_tokens < req.params.max_tokens:
            detail = "context"  # stopped at the end of the model's context
        handle.emit(FinishedEvent(out.finish_reason, detail))
        # After the caller has its answer: hand the KV state to the prefix cache, and the
        # output to the speculation sources that learn from earlier outputs.
        if stores:
            assert gen.cache is not None  # made by the generation when not given
            self.runtime.cache.store(out.tokens_in_cache, gen.cache, req.session, req.retain_s,
                                     req.cache_scope)
        if req.cache_scope is None:  # a scope's text never reaches another request's proposals
            learn_finished(self.runtime.providers, out.tokens)

    def generate(self, handle: RequestHandle, tokens: list[int], params: SamplingParams,
                 cache: list | None, n_cached: int, sent: list[int],
                 replay: list[int] | None) -> Generation:
        """Run one generation, sending its events to ``handle``; ``sent`` collects the
        tokens sent. A failure with a cached prefix raises :class:`Retry`. ``replay``: the
        tokens an earlier, failed attempt already sent, which are checked, not sent again."""
        self.current = handle
        try:
            return self._generate(handle, tokens, params, cache, n_cached, sent, replay)
        except Exception as e:
            self.tokens.failed(e.failure if isinstance(e, Retry) else e)
            raise
        finally:
            self.current = self.prefill_at = None

    def _generate(self, handle: RequestHandle, tokens: list[int], params: SamplingParams,
                  cache: list | None, n_cached: int, sent: list[int],
                  replay: list[int] | None) -> Generation:
        gather = [replay is None]  # before its prefill, once: see Admission.gather
        first = [True]  # the figures show the request from its first progress on
        commands, admission, between = self.commands, self.admission, self.between

        def progress(done: int, total: int) -> None:
            handle.emit(ProgressEvent(done, total))
            self.prefill_at = None
            between(first[0])
            first[0] = False
            if gather[0]:
                gather[0] = False
                admission.gather(handle)
            if done < total and replay is None and admission.wanted(handle, gen, sent):
                raise Join(gen, sent, started)

        def on_layer(done: int, chunk: int, layer: int, layers: int) -> None:
            self.prefill_at = PrefillAt(done, chunk, layer, layers)
            between()

        req = handle.request
        speculation, constraint = self.speculation(req, params)
        decoding = self.tokens.decoding(handle, speculation)
        started = time.perf_counter()
        loaded = self.runtime.loaded
        gen = Generation(loaded.model, loaded.tokenizer, tokens, params,
                         cache=cache, n_cached=n_cached, on_progress=progress,
                         should_stop=lambda: handle.cancelled or commands.is_closed(),
                         logprobs=req.logprobs, speculation=decoding, constraint=constraint,
                         on_layer=on_layer)
        skip = 0
        steps = iter(gen)
        try:
            for step in steps:
                if replay is not None and skip < len(replay) and step.token is not None:
                    if step.token != replay[skip]:
                        raise EngineError(
                            "computed again without the cache, the reply differs from the "
                            f"{len(replay)} tokens already sent; it cannot be continued")
                    skip += 1
                    continue
                handle.emit(TokenEvent(step.token, step.text, step.logprob, step.top_logprobs))
                if step.token is not None:
                    sent.append(step.token)
                between()
                if (step.token is not None and replay is None
                        and admission.wanted(handle, gen, sent)):
                    steps.close()  # ends its generate_step (and speculation) before the move
                    raise Join(gen, sent, started)
        except Exception as e:
            if n_cached > 0 and not isinstance(e, EngineError):
                raise Retry(e) from e
            raise
        return gen
