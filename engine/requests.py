"""What callers hand the engine and get back: :class:`Request`, the events of a request and
of the engine, and :class:`RequestHandle`, the thread-safe view of one request.

A handle records every event on the engine thread before it wakes anyone: ``result()``
and ``events()`` only read that record. So an exception raised in the consumer's thread
while it waits (Ctrl-C: KeyboardInterrupt) can interrupt the wait, but can never swallow
an event or stall the engine; waiting again picks up where it was.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from mlxkv.engine.sampling import SamplingParams
from mlxkv.engine.settings import SPEC_CHOICES

log = logging.getLogger("mlxkv.engine")


# ----------------------------------------------------------------------------- events
@dataclass(frozen=True)
class TokenEvent:
    token: int | None  # None: a final flush of held-back text
    text: str
    # With Request.logprobs set: the token's log-probability under the target model, and
    # the ``logprobs`` most likely (token, log-probability) pairs at that position.
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None


@dataclass(frozen=True)
class ProgressEvent:
    """Prompt tokens processed so far (cached ones included) out of ``total``: sent when the
    prefill starts, after each prefill chunk, and when the first token is ready."""

    done: int
    total: int


@dataclass(frozen=True)
class StatsEvent:
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    ttft_s: float  # start of serving (tokenize, cache lookup, prefill) -> first token
    prefill_tps: float  # uncached prompt tokens per second of prefill
    decode_tps: float  # tokens after the first per second
    queue_s: float = 0.0  # submit -> start of serving (includes load_s)
    load_s: float = 0.0  # part of queue_s spent waiting for the model to load
    retried: bool = False  # a cached prefix failed; the answer was computed without it
    cached_ram_tokens: int = 0  # of cached_tokens, those the RAM tier held
    cached_ssd_tokens: int = 0  # of cached_tokens, those restored from the SSD tier
    # Speculative decoding figures of this request (None when it did not speculate):
    # source, drafted (proposed), accepted, acceptance by position, tokens per target forward, and
    # the time split proposing (draft_s) / verify / other.
    spec: dict | None = None
    batched: bool = False  # decoded in a batch with other requests
    # Prompt tokens this request hands to the prefix cache beyond the cached ones it read
    # (its state is stored once it is answered; 0 without a cache)
    stored_tokens: int = 0


def stored_prompt_tokens(prompt_tokens: int, cached_tokens: int, tokens_in_cache: int,
                         stores: bool) -> int:
    """:attr:`StatsEvent.stored_tokens` of a request whose state holding ``tokens_in_cache``
    tokens (its prompt, then its reply) goes to the cache when ``stores``."""
    if not stores:
        return 0
    return max(0, min(tokens_in_cache, prompt_tokens) - cached_tokens)


@dataclass(frozen=True)
class FinishedEvent:
    reason: str  # "stop", "length", "cancelled"
    detail: str | None = None  # "eos", the matched stop string, "shutdown", "context"


@dataclass(frozen=True)
class ErrorEvent:
    message: str
    exception: BaseException | None = None


Event = TokenEvent | ProgressEvent | StatsEvent | FinishedEvent | ErrorEvent


@dataclass(frozen=True)
class CacheEvent:
    """Engine-wide: something the prefix cache did (``kind``: hit, store, evict, persisted,
    delete, warning, lookup, ...); ``data`` as the cache reported it."""

    kind: str
    data: dict


@dataclass(frozen=True)
class LoadEvent:
    """Engine-wide: model loading reached ``stage`` (``done`` of ``total`` stages)."""

    stage: str
    done: float
    total: float


EngineEvent = CacheEvent | LoadEvent


class EngineError(RuntimeError):
    """A request failed, or the engine could not start, or did not answer in time."""


class RequestRefused(EngineError, ValueError):
    """The request cannot be served as given (empty prompt, longer than the model's
    context, token ids out of range); the message says what was wrong."""


class QueueFull(EngineError):
    """Too many requests are already waiting to be served (the engine's ``max_queue``);
    nothing was queued. Try again once some have finished."""


class WaitTimeout(TimeoutError, queue.Empty):
    """A wait on a request's events passed its timeout (the request goes on)."""


# ---------------------------------------------------------------------------- requests
def blank(content: Any) -> bool:
    """None or whitespace; other content (a list of parts, for multimodal templates) counts."""
    return content is None or (isinstance(content, str) and not content.strip())


@dataclass
class Request:
    """Exactly one of ``messages`` (chat template applied), ``prompt`` (raw text) or
    ``prompt_tokens``. ``session`` groups requests of one conversation for the cache.
    A prompt longer than the model's context is refused, unless ``truncate`` is set: then
    only its last tokens are kept."""

    messages: list[dict[str, str]] | None = None
    prompt: str | None = None
    prompt_tokens: list[int] | None = None
    params: SamplingParams = field(default_factory=SamplingParams)
    session: str | None = None
    truncate: bool = False
    # Tool definitions (OpenAI function-tool JSON) handed to the chat template.
    tools: list[dict[str, Any]] | None = None
    # Extra variables for the chat template (``enable_thinking``, ``reasoning_effort``, ...).
    template_kwargs: dict[str, Any] | None = None
    # Report log-probabilities with each token: 0 = the token's own, N = also the N most
    # likely alternatives (at most 20). None = none.
    logprobs: int | None = None
    # Speculation for this request: None = the engine's setting; one of SPEC_CHOICES
    # overrides it.
    spec: str | None = None
    # Request constraints: the output must be exactly one of these strings.
    guided_choice: tuple[str, ...] | None = None
    # The literal parts of a JSON document whose values the model writes, e.g.
    # ('{"name": "', '", "age": ', '}'): speculation proposes them as they come due; they
    # never force a token (the model decides every one).
    json_skeleton: tuple[str, ...] | None = None
    # A grammar the output must follow token by token: llguidance's Lark syntax, which may
    # embed JSON schemas (``%json {...}``); checked when the request runs
    # (``engine.speculation.grammar.check_grammar`` checks one beforehand).
    grammar: str | None = None
    # A retention hint (Anthropic cache_control, OpenAI prompt_cache_key): the state this
    # request leaves in the prefix cache (its whole prompt and reply) is evicted only after
    # every state without one, for this many seconds. None: no hint.
    retain_s: float | None = None
    # The cache scope (a tenant): the states of requests of one scope are kept and found
    # apart from every other scope's and the unscoped ones' (``cache.layout.scoped_namespace``),
    # and their outputs teach no speculation source that proposes for other requests. None:
    # the model's own namespace, shared by every unscoped request.
    cache_scope: str | None = None

    def __post_init__(self) -> None:
        given = [x is not None for x in (self.messages, self.prompt, self.prompt_tokens)]
        if sum(given) != 1:
            raise ValueError("a request needs exactly one of messages, prompt, prompt_tokens")
        if self.prompt is not None and blank(self.prompt):
            raise ValueError("the prompt is empty")
        if self.messages is not None and all(blank(m.get("content")) for m in self.messages):
            raise ValueError("the prompt is empty" if self.messages
                             else "the prompt is empty (no messages)")
        if self.prompt_tokens is not None and len(self.prompt_tokens) == 0:
            raise ValueError("the prompt is empty (no tokens)")
        if self.cache_scope is not None and not (isinstance(self.cache_scope, str)
                                                 and 0 < len(self.cache_scope) <= 1024):
            raise ValueError("cache_scope must be a string of 1 to 1024 characters")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be between 0 and 20, got {self.logprobs}")
        if self.spec is not None and self.spec not in SPEC_CHOICES:
            raise ValueError(f"spec must be one of {', '.join(SPEC_CHOICES)}; got {self.spec!r}")
        if self.guided_choice is not None:
            choices = tuple(self.guided_choice)
            if not choices or any(not isinstance(c, str) or not c for c in choices):
                raise ValueError("guided_choice needs one or more non-empty strings")
            self.guided_choice = choices
        if self.json_skeleton is not None:
            parts = tuple(self.json_skeleton)
            if not parts or any(not isinstance(p, str) for p in parts) or not any(parts):
                raise ValueError("json_skeleton needs one or more strings, not all empty")
            if self.guided_choice is not None:
                raise ValueError("a request takes guided_choice or json_skeleton, not both")
            self.json_skeleton = parts
        if self.grammar is not None:
            if not isinstance(self.grammar, str) or not self.grammar.strip():
                raise ValueError("grammar must be a non-empty string")
            if self.guided_choice is not None or self.json_skeleton is not None:
                raise ValueError("a request takes one of guided_choice, json_skeleton, grammar")
        if self.retain_s is not None and not (isinstance(self.retain_s, (int, float))
                                              and 0 < self.retain_s < float("inf")):
            raise ValueError(f"retain_s must be a positive number of seconds, got {self.retain_s!r}")


@dataclass
class Counts:
    """The engine's request counts (``Engine.stats()``); the engine thread writes them."""

    requests: int = 0
    errors: int = 0
    refused: int = 0
    cancelled: int = 0
    retries: int = 0
    batched: int = 0

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


@dataclass
class Result:
    text: str
    tokens: list[int]
    finish_reason: str
    finish_detail: str | None
    stats: StatsEvent | None


_FINAL = (FinishedEvent, ErrorEvent)


class RequestHandle:
    """Thread-safe view of one request: iterate its events (once), or ``result()``.

    Only the engine thread writes: it appends each event to the record, then wakes the
    waiters through queues whose ``put`` never blocks. A waiter takes no lock the engine
    needs, so an exception raised in it at any point (Ctrl-C) cannot stall the engine, and
    it reads the record (not a queue) so nothing is lost when it stops waiting halfway."""

    _ids = itertools.count(1)

    def __init__(self, request: Request, callback: Callable[[Event], None] | None = None):
        self.id = next(self._ids)
        self.request = request
        self.submitted = time.perf_counter()
        self._cancel = threading.Event()
        self.done = threading.Event()  # set once the final event is recorded
        self._log: list[Event] = []  # every event, in order (appended on the engine thread)
        self._final = False  # the last event of the log is FinishedEvent or ErrorEvent
        self._read = 0  # how many of them events() has handed out
        self._waiters: list[queue.SimpleQueue] = []
        self._callback = callback
        self.tokens: list[int] = []
        self.progress: ProgressEvent | None = None
        self.stats: StatsEvent | None = None
        self.finished: FinishedEvent | None = None
        self.error: ErrorEvent | None = None
        # What its prefix-cache lookup found (an engine.lookups.LookupReport), set on the
        # engine thread before its first ProgressEvent: a caller that saw that event reads it.
        self.cache_report: Any = None

    # engine side
    def emit(self, event: Event) -> None:
        """Record ``event`` and wake the waiters (the engine thread only)."""
        if self._callback is not None:
            try:
                self._callback(event)
            except Exception:  # a front end's bug must not kill the engine thread
                log.exception("event callback failed")
        if isinstance(event, TokenEvent) and event.token is not None:
            self.tokens.append(event.token)
        elif isinstance(event, ProgressEvent):
            self.progress = event
        elif isinstance(event, StatsEvent):
            self.stats = event
        elif isinstance(event, FinishedEvent):
            self.finished = event
        elif isinstance(event, ErrorEvent):
            self.error = event
        self._log.append(event)
        if isinstance(event, _FINAL):
            self._final = True
        for waiter in list(self._waiters):
            waiter.put(None)
        if isinstance(event, _FINAL):
            self.done.set()

    # caller side
    def cancel(self) -> None:
        """Ask the engine to stop this request (between tokens); safe from any thread."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def _wait_for(self, ready: Callable[[], bool], timeout: float | None, what: str) -> None:
        if ready():
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        waiter: queue.SimpleQueue = queue.SimpleQueue()
        self._waiters.append(waiter)
        try:
            while not ready():  # checked after registering: no wake-up is missed
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise WaitTimeout(f"request {self.id}: {what} within {timeout} s")
                try:
                    waiter.get(timeout=left)
                except queue.Empty:
                    pass
        finally:
            self._waiters.remove(waiter)

    def events(self, timeout: float | None = None) -> Iterator[Event]:
        """Events until (and including) FinishedEvent or ErrorEvent, each once across calls.
        ``timeout`` bounds the wait for each event (:class:`WaitTimeout`, a
        ``queue.Empty``, is raised when it passes)."""
        while True:
            self._wait_for(lambda: self._read < len(self._log), timeout, "no event")
            # one statement: an interrupt cannot land between taking and counting it
            self._read, event = self._read + 1, self._log[self._read]
            yield event
            if isinstance(event, _FINAL):
                return

    def __iter__(self) -> Iterator[Event]:
        return self.events()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the request has ended; False if ``timeout`` passed first."""
        try:
            self._wait_for(lambda: self._final, timeout, "not finished")
        except WaitTimeout:
            return False
        return True

    def result(self, timeout: float | None = None) -> Result:
        """Wait for the end (:class:`WaitTimeout` after ``timeout`` s); raise
        :class:`EngineError` (:class:`RequestRefused` for bad input) if it failed."""
        self._wait_for(lambda: self._final, timeout, "did not finish")
        events = self._log[:]
        last = events[-1]
        if isinstance(last, ErrorEvent):
            if isinstance(last.exception, EngineError):
                raise last.exception
            raise EngineError(last.message) from last.exception
        assert isinstance(last, FinishedEvent)
        tokens = [e for e in events if isinstance(e, TokenEvent)]
        stats = [e for e in events if isinstance(e, StatsEvent)]
        return Result("".join(e.text for e in tokens), [e.token for e in tokens if e.token is not None],
                      last.reason, last.detail, stats[-1] if stats else None)

    def text(self, timeout: float | None = None) -> str:
        return self.result(timeout).text
