"""Request preparation, on the engine thread: the prompt's tokens (chat template, raw text or
token ids), fitted to the model's context, and what the prefix cache holds of them. The
result is a :class:`Job`, or the request is refused with a clear message.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from mlxkv.engine.cache_use import CacheUse
from mlxkv.engine.lookups import LookupHistory, report
from mlxkv.engine.requests import Counts, ErrorEvent, Request, RequestHandle, RequestRefused, blank
from mlxkv.engine.sampling import SamplingParams

if TYPE_CHECKING:
    from collections.abc import Callable

    from mlxkv.engine.generate import Generation
    from mlxkv.engine.models import LoadedModel
    from mlxkv.engine.speculation.providers import Speculation


@dataclasses.dataclass
class Job:
    """A request ready to generate: its prompt, its parameters (max_tokens cut to the
    context) and what the prefix cache supplied."""

    handle: RequestHandle
    start: float
    tokens: list[int]
    params: SamplingParams
    n_cached: int
    cache: list | None
    ram_tokens: int
    ssd_tokens: int


StreamT = TypeVar("StreamT")


class Decoding(Protocol[StreamT]):
    """What a :class:`~engine.generate.Generation` takes its tokens from instead of plain
    decoding (``engine.speculation.providers.Speculation``, or a sharded engine's
    ``Lockstep``)."""

    def stream(self, gen: Generation, progress: Callable[[int, int], None]) -> StreamT:
        """The generation's token stream (after the prefill ``progress`` reports): an
        iterator of (token, logprobs)."""

    def finish(self, stream: StreamT, tokens_in_cache: list[int]) -> dict | None:
        """The stream ended: its figures (None: none)."""


class TokenSource(Protocol):
    """Where a generation's tokens come from, beyond the model itself: plain decoding with
    the request's speculation, or (a sharded engine) every rank in lock-step."""

    def prepared(self, job: Job) -> Job:
        """``job`` is ready to generate: the source may change what the cache supplied
        (a sharded engine agrees on it with every rank)."""

    def decoding(self, handle: RequestHandle, speculation: Speculation | None
                 ) -> Decoding[Any] | None:
        """The speculation (token source) the generation of ``handle`` uses, given the one
        the request would use on its own (None: plain decoding)."""

    def failed(self, exc: BaseException) -> None:
        """A generation failed with ``exc`` (before it is answered again or reported)."""


class LocalTokens:
    """Plain decoding in this process: the request's own speculation."""

    def prepared(self, job: Job) -> Job:
        return job

    def decoding(self, handle: RequestHandle, speculation: Speculation | None
                 ) -> Decoding[Any] | None:
        return speculation

    def failed(self, exc: BaseException) -> None:
        return None


class Preparer:
    """Tokenizing, context fit and cache lookup for one loaded model; ``lookups`` keeps
    what the last lookups found (each request's handle gets its own ``cache_report``)."""

    def __init__(self, loaded: LoadedModel, cache: CacheUse, counts: Counts, tokens: TokenSource,
                 lookups: LookupHistory):
        self.loaded = loaded
        self.cache = cache
        self.counts = counts
        self.tokens = tokens
        self.lookups = lookups

    def encode_text(self, text: str) -> list[int]:
        """Token ids of raw ``text``. As mlx_lm.stream_generate: special tokens are added
        unless the text starts with BOS."""
        tok = self.loaded.tokenizer
        bos = tok.bos_token
        return list(tok.encode(text, add_special_tokens=bos is None or not text.startswith(bos)))

    def chat_tokens(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Token ids of the chat template applied to ``messages`` (and ``tools``)."""
        from mlxkv.engine.models import chat_prompt_tokens

        return chat_prompt_tokens(self.loaded.tokenizer, messages, tools=tools,
                                  template_kwargs=template_kwargs)

    def prompt_tokens(self, req: Request) -> list[int]:
        if req.prompt_tokens is not None:
            tokens = [int(t) for t in req.prompt_tokens]
            vocab = self.loaded.config.get("vocab_size")
            bad = [t for t in tokens if t < 0 or (vocab and t >= vocab)]
            if bad:  # mlx would index out of range silently
                raise RequestRefused(f"token ids out of range [0, {vocab}): {bad[:5]}")
        elif req.messages is not None:
            if all(blank(m.get("content")) for m in req.messages):
                raise RequestRefused("the prompt is empty")
            tokens = self.chat_tokens(req.messages, req.tools, req.template_kwargs)
        else:
            prompt = req.prompt or ""
            if not prompt.strip():
                raise RequestRefused("the prompt is empty")
            tokens = self.encode_text(prompt)
        if not tokens:
            raise RequestRefused("the prompt is empty")
        return tokens

    def fit_context(self, tokens: list[int], req: Request) -> tuple[list[int], int]:
        """The prompt to run and how many tokens may follow it within the model's context:
        a prompt that leaves no room is refused, or (``truncate``) cut to its last tokens."""
        context = self.loaded.context_tokens
        max_tokens = req.params.max_tokens
        if context is None:
            return tokens, max_tokens
        if len(tokens) >= context:
            keep = max(context - max_tokens, context // 2, 1)
            if not req.truncate:
                whose = "the model's context" if self.loaded.context_limit is None else \
                    "the context (--context-tokens)"
                raise RequestRefused(
                    f"the prompt is {len(tokens)} tokens; {whose} is {context} "
                    f"tokens (use --truncate to keep the last {keep})")
            tokens = tokens[-keep:]
        return tokens, min(max_tokens, context - len(tokens))

    def prepare(self, handle: RequestHandle, start: float) -> Job | None:
        """Tokenize, fit the context and look up the prefix cache; None when the request
        was refused (its ErrorEvent is sent)."""
        req = handle.request
        try:
            tokens, max_tokens = self.fit_context(self.prompt_tokens(req), req)
        except Exception as e:
            refused = isinstance(e, RequestRefused)
            if refused:
                self.counts.refused += 1
            else:
                self.counts.errors += 1
            handle.emit(ErrorEvent(str(e) if refused else f"{type(e).__name__}: {e}", e))
            return None
        params = req.params
        if max_tokens != params.max_tokens:
            params = dataclasses.replace(params, max_tokens=max_tokens)
        n_cached, cache = self.cache.lookup(tokens, req.session, req.cache_scope)
        ram_tokens, ssd_tokens = self.cache.tier_split(n_cached)
        job = self.tokens.prepared(
            Job(handle, start, tokens, params, n_cached, cache, ram_tokens, ssd_tokens))
        self.record(job)
        return job

    def record(self, job: Job) -> None:
        """What the lookup found, and why no more (before the request's first event)."""
        n, total = job.n_cached, len(job.tokens)
        scope = job.handle.request.cache_scope
        near = self.cache.explain(job.tokens, scope) if self.cache.enabled and n < total - 1 else None
        tier = "ram" if job.ram_tokens else "ssd" if job.ssd_tokens else None
        r = report(job.handle.id, job.tokens, n, tier, near, self.loaded.tokenizer,
                   enabled=self.cache.enabled)
        job.handle.cache_report = r
        self.lookups.add(r)
