"""The generation loop: mlx-lm's ``generate_step`` (chunked prefill, samplers, logits
processors) plus what a chat engine needs around it: a reused prompt cache, EOS, stop
strings matched on text, streaming detokenization, max tokens, cancellation and per-token
log-probabilities.

Token for token this is ``mlx_lm.stream_generate``: ``generate_step``'s loop (its step
compiled where the model allows, ``engine.decoding``), the same EOS and max-token rules,
so greedy output is identical (tests/test_engine.py checks it).
With ``speculation`` the tokens come from the speculative verifier (``engine.speculation``)
instead; everything after the token (EOS, stop strings, text) is this same loop.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mlxkv.engine.arrays import float_item
from mlxkv.engine.detokenize import stream_detokenizer
from mlxkv.engine.layer_steps import LayerSteps
from mlxkv.engine.sampling import (  # noqa: F401  (re-exported: where callers look for them)
    SamplingParams,
    request_processors,
    request_sampler,
    with_history,
)
from mlxkv.engine.side_table import SideTable

if TYPE_CHECKING:
    import mlx.core as mx

    from mlxkv.engine.speculation.base import TargetView


@dataclass
class Step:
    """One generated token and the text it releases (held back while it might be the start
    of a stop string). ``token`` is None for the final flush of held-back text."""

    token: int | None
    text: str
    logprob: float | None = None  # with Generation(logprobs=...): the token's log-probability
    top_logprobs: tuple[tuple[int, float], ...] | None = None


@dataclass
class Outcome:
    """What a finished generation did."""

    finish_reason: str = "length"  # "stop" (EOS or stop string), "length", "cancelled"
    stop_detail: str | None = None  # "eos" or the stop string that matched
    tokens: list[int] = field(default_factory=list)  # emitted tokens (no EOS)
    text: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    tokens_in_cache: list[int] = field(default_factory=list)
    spec: dict | None = None  # speculation figures (None: plain decoding)

    @property
    def prefill_tps(self) -> float:
        n = self.prompt_tokens - self.cached_tokens
        return n / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        # Tokens after the first, over the time after the first arrived.
        n = len(self.tokens) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0


class StopMatcher:
    """Text-level stop strings: holds back text that may begin a stop string, finds stops
    that span tokens, and never releases the stop text itself."""

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(stops)
        self.pending = ""
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        """Add ``text``; return what can be released now."""
        if not self.stops:
            return text
        buf = self.pending + text
        first, which = -1, None
        for s in self.stops:
            i = buf.find(s)
            if i >= 0 and (first < 0 or i < first):
                first, which = i, s
        if which is not None:
            self.matched, self.pending = which, ""
            return buf[:first]
        hold = 0  # longest suffix of buf that is a proper prefix of some stop string
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:k]):
                    hold = k
                    break
        self.pending = buf[len(buf) - hold:] if hold else ""
        return buf[: len(buf) - hold]

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class Cancelled(Exception):
    """Raised inside the prefill to stop it between chunks."""


def cache_length(cache: Sequence[Any]) -> int | None:
    """Tokens held by an mlx-lm prompt cache (None if no layer tracks an offset)."""
    for c in cache:
        offset = getattr(c, "offset", None)
        if isinstance(offset, int):
            return offset
    return None




_HEAD_SPLITS: SideTable[bool] = SideTable()  # whether each probed model's head splits off exactly


def head_view(model: Any) -> TargetView | None:
    """The model as its decoder stack and LM head (an ``engine.speculation.base.TargetView``), when
    ``model(x)`` is exactly the head applied to the stack's last hidden state; else None
    (e.g. a model that caps or scales its logits after the head). Decided once per model,
    by :func:`probe_model`."""
    split = _HEAD_SPLITS.get(model)
    if split is None:
        try:
            probe_model(model)
        except Exception:  # a model that cannot take the probe: the model as a whole
            _HEAD_SPLITS.put(model, False)
        split = _HEAD_SPLITS.get(model)
    if not split:
        return None
    from mlxkv.engine.speculation.base import TargetView

    return TargetView(model, None)


class _StackRecorder:
    """Stands in for a model's decoder stack during the probe: calls it and keeps each call's
    arguments and output (attributes read through it reach the stack)."""

    def __init__(self, stack: Any):
        object.__setattr__(self, "stack", stack)
        object.__setattr__(self, "calls", [])

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self.stack(*args, **kwargs)
        self.calls.append((args, kwargs, out))
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stack, name)


def _plain_call(stack: Any, args: tuple, kwargs: dict, x: Any, cache: list) -> bool:
    """Whether the stack was called as ``stack(x, cache=cache)`` is: the tokens, the cache,
    every other argument at its default."""
    import inspect

    try:
        signature = inspect.signature(stack.__call__)
        bound = signature.bind(*args, **kwargs)
    except (TypeError, ValueError):
        return False
    params = signature.parameters
    names = list(bound.arguments)
    if not names or bound.arguments[names[0]] is not x:
        return False
    for name in names[1:]:
        value = bound.arguments[name]
        if name == "cache":
            if value is not cache:
                return False
        elif value is not params[name].default:
            return False
    return "cache" in bound.arguments


def probe_model(model: Any) -> list:
    """One token through ``model`` with a fresh prompt cache, which it returns evaluated (what
    the model's caches look like: ``engine.cache.template``). The same pass decides
    :func:`head_view`: the decoder stack's output is recorded on its way to the head, and
    the split is taken when the stack was called plainly (tokens and cache) and the head
    on its output gives the model's logits bit for bit."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    view: TargetView | None = None
    holder: Any = None  # the mlx-lm module that holds the decoder stack as "model"
    recorder: _StackRecorder | None = None
    try:
        from mlxkv.engine.speculation.base import TargetView

        view = TargetView(model, None)
        holder = getattr(model, "language_model", model) if getattr(model, "model", None) is None \
            else model
    except Exception:  # no decoder with embed_tokens, an odd head: the model as a whole
        view = None
    try:
        if view is not None:
            recorder = _StackRecorder(holder["model"])
            holder["model"] = recorder
    except Exception:  # a stack the model does not hold by name: nothing recorded
        recorder = None
    x = mx.array([[0]])
    cache = make_prompt_cache(model)
    try:
        whole = model(x, cache=cache)
    finally:
        if recorder is not None:
            holder["model"] = recorder.stack
    mx.eval(whole, [c.state for c in cache])
    if view is not None:
        try:
            if recorder is None:
                raise ValueError("the stack was not recorded")
            (args, kwargs, hidden), = recorder.calls
            plain = _plain_call(recorder.stack, args, kwargs, x, cache)
        except Exception:  # called twice or not at all: checked with a pass of its own
            plain = False
        try:
            split = (view.logits(hidden) if plain else
                     view.forward(x, make_prompt_cache(model))[0])
            if not (whole.shape == split.shape and bool(mx.array_equal(whole, split))):
                view = None
        except Exception:  # a head that does not apply to the stack's output
            view = None
    _HEAD_SPLITS.put(model, view is not None)
    return cache


LayerHook = Callable[[int, int, int, int], None]  # (done, chunk, layer, layers) -> None


def prefill(model: Any, tokens: Sequence[int], cache: list, step: int,
            on_chunk: Callable[[int], None], view: Any = None,
            between_layers: LayerHook | None = None) -> tuple[Any, Any]:
    """Feed ``tokens`` (non-empty) into ``cache`` in chunks of at most ``step``; returns the
    last position's logits ([1, V], not evaluated) and, with ``view`` (a TargetView whose
    source reads them), the hidden states of every position ([T, D]), else None.
    ``on_chunk(done)`` follows each chunk but the last (it may raise to cancel).
    ``between_layers(done, chunk, layer, layers)``, when given, follows the evaluation of
    each layer's cache inside every chunk (``done`` tokens before this ``chunk``-token
    chunk, ``layer`` of ``layers`` evaluated): it may raise to stop inside the chunk, which
    then leaves the cache holding the ``done`` tokens before it (``engine.layer_steps``;
    the arithmetic is unchanged).

    The last chunk gives the first token's logits too, the LM head applied to its last
    position only: no pass of its own for the prompt's last token (a pass costs a fixed
    part, the weights read once, besides its per-token part). A model whose logits are not
    its head on the last hidden state (:func:`head_view`) feeds that token alone, as mlx-lm's
    generate_step does. Plain decoding and the speculative verifier both prefill here, so
    their caches and first tokens are bit for bit the same."""
    import mlx.core as mx

    split = head_view(model)
    fused = split is not None
    total, done = len(tokens), 0
    rows = []

    def forward(x: Any) -> tuple[Any, Any]:  # (logits or None, hidden [T, D] or None)
        if view is not None:
            logits, h = view.forward(x, cache)
            return logits, h[0]
        if split is not None:
            return None, split.forward(x, cache)[1][0]
        return model(x, cache=cache), None

    def chunk(n: int) -> tuple[Any, Any]:
        """The forward pass of the next ``n`` tokens, its cache evaluated layer by layer
        when ``between_layers`` is given."""
        hook = between_layers
        steps = LayerSteps(cache, n) if hook is not None else None
        out = forward(mx.array([list(tokens[done: done + n])]))
        if steps is not None and hook is not None:
            steps.run(lambda layer, layers: hook(done, n, layer, layers))
        return out

    while total - done > (step if fused else 1):
        n = min(step, total - done - (0 if fused else 1))
        _, h = chunk(n)
        keep = [h] if view is not None else []
        mx.eval([c.state for c in cache] + keep)
        rows += keep
        done += n
        on_chunk(done)
        mx.clear_cache()
    logits, h = chunk(total - done)
    if view is not None:
        rows.append(h)
    logits = split.logits(h[-1:]) if split is not None else logits[0, -1:]
    return logits, (mx.concatenate(rows, axis=0) if view is not None else None)


class Generation:
    """One generation. Iterate for :class:`Step` s; ``outcome`` is set when it ends.

    ``cache`` must hold exactly ``prompt_tokens[:n_cached]`` (None when n_cached is 0) and
    is updated in place. ``should_stop`` is polled between tokens and prefill chunks.
    ``on_progress(done, total)`` is called when the prefill starts, after each prefill chunk
    and when the first token is ready, with prompt tokens processed so far (cached ones
    included) out of the whole prompt; it only observes, so outputs do not change.
    ``logprobs``: None, or how many alternatives each step reports beside its own
    log-probability (0..20). ``speculation``: an ``engine.speculation.Speculation`` (or None).
    ``constraint``: an ``engine.speculation.constraints`` mask the output must satisfy.
    ``on_layer(done, chunk, layer, layers)``: inside each prefill chunk, after each layer
    (``done`` prompt tokens, cached ones included, before a ``chunk``-token chunk);
    ``should_stop`` is polled there too, so a cancel stops inside a chunk, keeping the
    chunks before it (see :func:`prefill`)."""

    def __init__(self, model: Any, tokenizer: Any, prompt_tokens: Sequence[int],
                 params: SamplingParams, cache: list | None = None, n_cached: int = 0,
                 should_stop: Callable[[], bool] | None = None,
                 on_progress: Callable[[int, int], None] | None = None,
                 logprobs: int | None = None, speculation: Any = None, constraint: Any = None,
                 on_layer: Callable[[int, int, int, int], None] | None = None):
        if not prompt_tokens:
            raise ValueError("empty prompt")
        if not 0 <= n_cached < len(prompt_tokens):
            raise ValueError(f"n_cached={n_cached} must be < prompt length {len(prompt_tokens)}")
        if n_cached > 0 and cache is None:
            raise ValueError("n_cached > 0 needs the cache that holds those tokens")
        self.model, self.tokenizer, self.params = model, tokenizer, params
        self.prompt_tokens = list(prompt_tokens)
        self.n_cached = n_cached
        self.cache = cache
        self.should_stop = should_stop or (lambda: False)
        self.on_progress = on_progress
        self.outcome: Outcome | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        # the times between its last few tokens (a batch formed around it aims at them)
        self.token_gaps: deque[float] = deque(maxlen=16)
        if logprobs is not None and not 0 <= logprobs <= 20:
            raise ValueError(f"logprobs must be between 0 and 20, got {logprobs}")
        self.logprobs = logprobs
        self.speculation = speculation
        self.constraint = constraint
        self.on_layer = on_layer
        self.sampler: Any = None  # the sampler it draws with, once it runs
        # Layers of recurrent state (SSM, linear attention) beside trimmable ones: plain
        # decoding keeps their state from before the last token it fed (give_back_last).
        self._recurrent: list = []
        self._before_last: tuple[int, list] | None = None

    def _keep_recurrent(self) -> None:
        held = cache_length(self.cache or [])
        if held is not None:
            self._before_last = (held, [list(c.cache) for c in self._recurrent])

    def can_give_back_last(self, known: int) -> bool:
        """Whether :meth:`give_back_last` would."""
        cache = self.cache or []
        kept = self._before_last
        return (bool(self._recurrent) and kept is not None and kept[0] == known - 1
                and cache_length(cache) == known
                and all(c.is_trimmable() for c in cache if not is_recurrent(c)))

    def give_back_last(self, known: int) -> bool:
        """Take the last of the ``known`` tokens (prompt and output) back out of the cache,
        when it holds all of them and plain decoding kept its recurrent layers' state from
        before that token was fed (a request moving into a batch, which feeds it again):
        the recurrent layers get that state back, every other layer is trimmed. False,
        changing nothing, when it cannot."""
        if not self.can_give_back_last(known):
            return False
        assert self._before_last is not None  # (checked)
        others = [c for c in self.cache or [] if not is_recurrent(c)]
        for c, state in zip(self._recurrent, self._before_last[1]):
            c.cache = list(state)
        for c in others:
            c.trim(1)
        self._before_last = None
        return True

    def between_layers(self, done: int, chunk: int, layer: int, layers: int) -> None:
        """:func:`prefill`'s ``between_layers`` (``done``: of the uncached suffix): report,
        then stop the prefill here when asked (it keeps the chunks before this one)."""
        if self.on_layer is not None:
            self.on_layer(self.n_cached + done, chunk, layer, layers)
        if layer < layers and self.should_stop():  # a finished chunk is kept as it is
            raise Cancelled

    def __iter__(self) -> Generator[Step, None, None]:
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        p = self.params
        if self.cache is None:
            self.cache = make_prompt_cache(self.model)
        self._recurrent = [c for c in self.cache if is_recurrent(c)]
        if p.seed is not None and self.speculation is not None:
            mx.random.seed(p.seed)  # a verify's draws (plain decoding's come from its own key)
        sampler = self.sampler = request_sampler(p)
        processors = request_processors(p, self.prompt_tokens[: self.n_cached])

        reported = [-1]

        def progress(done: int, total: int) -> None:
            # generate_step counts only the uncached suffix it was given.
            if self.on_progress is not None and done != reported[0]:
                reported[0] = done
                self.on_progress(self.n_cached + done, self.n_cached + total)
            if done < total and self.should_stop():
                raise Cancelled

        out = Outcome(prompt_tokens=len(self.prompt_tokens), cached_tokens=self.n_cached)
        self.outcome = None
        fed = list(self.prompt_tokens)  # every token whose KV may be in the cache
        detok = stream_detokenizer(self.tokenizer)
        eos = self.tokenizer.eos_token_ids
        stopper = StopMatcher(p.stop)
        text_parts: list[str] = []
        t0 = time.perf_counter()
        t_first = t_last = None
        stream = None
        if self.speculation is not None:
            stream = self.speculation.stream(self, progress)
            steps = iter(stream)
        else:
            if self.constraint is not None:
                processors = (processors or []) + [
                    self.constraint.processor(len(self.prompt_tokens) - self.n_cached)]
            steps = _plain_steps(self.model, self.prompt_tokens[self.n_cached:], self.cache, p,
                                 sampler, processors, progress, self.between_layers,
                                 self._keep_recurrent if self._recurrent else None)
        try:
            for n, (token, token_logprobs) in enumerate(steps):
                now = time.perf_counter()
                if t_last is not None:
                    self.token_gaps.append(now - t_last)
                t_last = self.last_token_time = now
                if t_first is None:
                    t_first = self.first_token_time = t_last
                fed.append(token)
                if token in eos:
                    out.finish_reason, out.stop_detail = "stop", "eos"
                    break
                detok.add_token(token)
                out.tokens.append(token)
                text = stopper.feed(detok.last_segment)
                text_parts.append(text)
                if self.logprobs is None:
                    yield Step(token, text)
                else:
                    yield Step(token, text, *_logprob_of(token_logprobs, token, self.logprobs))
                if stopper.matched is not None:
                    out.finish_reason, out.stop_detail = "stop", stopper.matched
                    break
                if n + 1 == p.max_tokens:
                    out.finish_reason = "length"
                    break
                if self.should_stop():
                    out.finish_reason = "cancelled"
                    break
        except Cancelled:
            out.finish_reason = "cancelled"
        finally:
            (stream if stream is not None else steps).close()
        if stopper.matched is None:
            detok.finalize()
            tail = stopper.feed(detok.last_segment)
            tail += stopper.flush() if stopper.matched is None else ""
            if stopper.matched is not None:
                out.finish_reason, out.stop_detail = "stop", stopper.matched
            if tail:
                text_parts.append(tail)
                yield Step(None, tail)
        out.text = "".join(text_parts)
        if t_first is not None:
            out.prefill_s = t_first - t0
            out.decode_s = (t_last or t_first) - t_first
        if stream is not None:
            out.tokens_in_cache = list(stream.kv_tokens)
            out.spec = self.speculation.finish(stream, out.tokens_in_cache)
        else:
            length = cache_length(self.cache)
            out.tokens_in_cache = fed[:length] if length is not None else fed
        self.outcome = out


def is_recurrent(c: Any) -> bool:
    """Whether a cache layer is recurrent state (an ``ArraysCache``: SSM, linear attention)."""
    return type(c).__name__ in ("ArraysCache", "MambaCache")


def _plain_steps(model: Any, tokens: Sequence[int], cache: list, p: SamplingParams, sampler: Callable,
                 processors: list[Callable], progress: Callable[[int, int], None],
                 between_layers: LayerHook, before_feed: Callable[[], None] | None = None
                 ) -> Iterator[tuple[int, Any]]:
    """Plain decoding of the uncached prompt suffix ``tokens``: :func:`prefill`, the first
    token sampled from its logits as mlx-lm's generate_step samples (processors, then
    log-probabilities, then the sampler), then generate_step's loop from that token on
    (``engine.decoding.plain_decode``: its step compiled where the model allows). The
    processors see the same context as before: ``tokens``, then the generated ones."""
    import mlx.core as mx
    from mlx_lm.generate import generation_stream

    from mlxkv.engine.decoding import plain_decode

    total = len(tokens)
    with mx.stream(generation_stream):
        progress(0, total)
        logits, _ = prefill(model, tokens, cache, p.prefill_step_size, lambda done: progress(done, total),
                            between_layers=between_layers)
        context = mx.array(list(tokens))
        for processor in processors:
            logits = processor(context, logits)
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        first = sampler(logprobs)
        mx.eval(first, logprobs)
    progress(total, total)
    yield first.item(), logprobs.squeeze(0)
    if p.max_tokens <= 1:
        return
    rest = plain_decode(model, first, cache, sampler,
                        [with_history(proc, context) for proc in processors] or None, p.max_tokens - 1,
                        before_feed)
    try:
        yield from rest
    finally:
        rest.close()


def _logprob_of(logprobs: mx.array, token: int, top: int) -> tuple[float, tuple[tuple[int, float], ...] | None]:
    """(the token's log-probability, its ``top`` most likely alternatives or None for 0)."""
    from mlxkv.engine.speculation.sampling import top_logprobs

    return float_item(logprobs[token]), (top_logprobs(logprobs, top) if top else None)
