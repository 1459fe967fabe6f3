"""Continuous batching: requests that are in flight together decode together.

mlx-lm's ``BatchGenerator`` does the model work: a left-padded ``BatchKVCache``, the
prefill of joining rows in chunks between decode steps, per-row samplers and logits
processors, and the extraction of a finished row's cache. :class:`Batch` adds, per row,
what the single-stream :class:`engine.generate.Generation` does around ``generate_step``:
EOS, stop strings matched on text, streaming detokenization, max tokens, cancellation,
log-probabilities, and the request's events. A batched row therefore sends exactly the
events it would have sent alone, and greedy rows produce the same tokens.

A row joins with the KV state of the tokens it already has (a cached prefix, or the state
of a request that was decoding alone until now) and the tokens still to feed; it leaves
with its extracted cache, which the engine stores in the prefix cache. Engine thread only.

Rows whose request speculates (``speculation(row)`` opens it, as for a lone request) propose
through ``engine.speculation.batch_verify``: between plain steps a round verifies every row's
proposed tokens in one forward and each row emits its old pending token plus those it kept,
one TokenEvent at a time through the same checks as a plain step (EOS, stop strings, max
tokens). Without speculating rows a step is exactly ``BatchGenerator.next``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from mlxkv.engine.arrays import float_item, float_list, int_list
from mlxkv.engine.batch_step import BatchStepModel
from mlxkv.engine.generate import (
    Cancelled,
    SamplingParams,
    StopMatcher,
    head_view,
    request_processors,
    request_sampler,
    stream_detokenizer,
)
from mlxkv.engine.mlx_lm_compat import (
    DecodingRows,
    admitting,
    batch_speculation_available,
    fold_first_token,
    move_whole_prompt_batch,
    next_prompt_chunk,
)
from mlxkv.engine.requests import (
    FinishedEvent,
    ProgressEvent,
    Request,
    RequestHandle,
    StatsEvent,
    TokenEvent,
    stored_prompt_tokens,
)
from mlxkv.engine.step_budget import StepBudget

if TYPE_CHECKING:
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.generate import BatchGenerator

    from mlxkv.engine.speculation.batch_verify import BatchLength, BatchVerifier, RowSpec

# A lone prompt row's last prefill pass feeds its last token too and samples its first
# token (``mlx_lm_compat.fold_first_token``); ``MLXKV_FOLD_FIRST=0``: mlx-lm's own hand-over.
FOLD_FIRST = os.environ.get("MLXKV_FOLD_FIRST", "1") != "0"
NO_CUT = 1 << 30  # a prefill step longer than any prompt


def batchable_cache(cache: Sequence[Any], model: Any = None) -> bool:
    """Whether rows of ``model`` with this kind of prompt cache can decode in one batch:
    every layer a plain ``KVCache``, a sliding window (``RotatingKVCache`` keeping no sink
    tokens) or the recurrent state of an SSM or linear-attention layer (``ArraysCache``),
    which mlx-lm merges into its batch caches. A recurrent state batches only where the
    architecture masks a row's padding out of its scan: its module takes mlx-lm's
    ``create_ssm_mask`` (Mamba2, Qwen3-Next, Qwen3.5, Jamba, Kimi Linear, ...); Mamba, RWKV-7
    and RecurrentGemma scan the padding into the state. Attention sinks, chunked attention,
    nested cache lists and the other kinds are served one request at a time."""
    import sys

    from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

    if any(type(c) is ArraysCache for c in cache):
        module = sys.modules.get(type(model).__module__) if model is not None else None
        if module is None or not hasattr(module, "create_ssm_mask"):
            return False
    return bool(cache) and all(
        type(c) in (KVCache, ArraysCache) or (type(c) is RotatingKVCache and c.keep == 0)
        for c in cache)


def rounds_cache(cache: Sequence[Any]) -> bool:
    """Whether a batch of rows with this kind of prompt cache can run speculative rounds: a
    round gives back its rejected positions by trimming every layer's batch cache, which a
    recurrent state cannot do (alone, the verifier restores it from a snapshot instead)."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    return bool(cache) and all(type(c) in (KVCache, RotatingKVCache) for c in cache)


def movable(cache: Sequence[Any], known: int, gen: Any = None) -> bool:
    """Whether a single-stream cache can move into a batch now: the batch feeds the last of
    the ``known`` tokens (prompt and output) again, so the cache must hold at most
    ``known - 1`` of them or give the rest back (a sliding window that has not wrapped);
    a state that tracks no token count (all layers recurrent) never moves. A plain lone
    generation (``gen``) whose recurrent layers kept their state from before the last
    token gives that token back (``Generation.give_back_last``)."""
    from mlxkv.engine.generate import cache_length

    held = cache_length(cache)
    if held is None:  # every layer recurrent: how many tokens its state holds is not known
        return False
    return (held <= known - 1 or all(c.is_trimmable() for c in cache)
            or (gen is not None and gen.can_give_back_last(known)))


def token_logprobs(logprobs: mx.array, token: int, top: int | None
                   ) -> tuple[float | None, tuple[tuple[int, float], ...] | None]:
    """As a single-stream step reports them: the log-probability of ``token`` in the
    normalized vector ``logprobs`` ([V]) and its ``top`` most likely (token,
    log-probability) pairs, best first (None when ``top`` is 0); (None, None) when ``top``
    is None (none asked)."""
    if top is None:
        return None, None
    import mlx.core as mx

    own = float_item(logprobs[token])
    if top <= 0:
        return own, None
    k = min(top, logprobs.shape[-1])
    idx = mx.argpartition(-logprobs, kth=k - 1)[:k]
    vals = logprobs[idx]
    order = mx.argsort(-vals)
    ids, values = int_list(idx[order]), float_list(vals[order])
    return own, tuple((int(i), float(v)) for i, v in zip(ids, values))


@dataclass
class Row:
    """One request in the batch. ``prompt`` is what the model answers; ``emitted`` holds the
    tokens already sent (a request that decoded alone before it joined has some)."""

    handle: RequestHandle
    prompt: list[int]
    params: SamplingParams  # max_tokens already cut to the model's context
    n_cached: int  # prompt tokens a prefix-cache lookup supplied
    started: float  # start of serving: ttft counts from here
    queue_s: float
    load_s: float
    context_cut: bool = False  # max_tokens was cut so the reply fits the context
    cached_ram_tokens: int = 0
    cached_ssd_tokens: int = 0
    lent: Any = None  # the cache the lookup returned, given back once merged
    emitted: list[int] = field(default_factory=list)
    gen_start: float = 0.0  # when its prefill started
    first_time: float | None = None
    last_time: float | None = None
    uid: int = -1
    base: int = 0  # tokens already in the KV state it joined with
    progress: tuple[int, int] | None = None
    detok: Any = None
    stopper: StopMatcher = field(default_factory=lambda: StopMatcher(()))  # the request's, once it joins
    merged: bool = False
    spec: RowSpec | None = None  # a speculating row's
    sampler: Any = None  # the sampler it brings (a seeded row that decoded alone), else the batch's
    shared: bool = False  # it was in a step with another row (a batch of one is not batched)
    echo: int | None = None  # a first token sent from the prompt's pass, which its first step reports again

    @property
    def request(self) -> Request:
        return self.handle.request

    def prompt_left(self) -> int:
        """Prompt tokens still to feed before its last one (0 when none are being fed)."""
        return self.progress[1] - self.progress[0] - 1 if self.progress is not None else 0

    @property
    def prompt_tokens_new(self) -> int:
        return len(self.prompt) - self.n_cached


def _tokens_held(cache: list | None) -> int | None:
    """How many tokens every layer of ``cache`` holds (their common offset), or None when
    some layer does not say or they differ."""
    offsets = {getattr(c, "offset", None) for c in cache or []}
    if len(offsets) != 1:
        return None
    (n,) = offsets
    return n if isinstance(n, int) else None


@dataclass
class Ending:
    """How a row ended, and the state to store: ``cache`` holds ``tokens_in_cache``."""

    reason: str
    detail: str | None
    tokens_in_cache: list[int]
    cache: list | None


class Batch:
    """The rows decoding together. ``should_stop(row)`` is polled before each step (cancel);
    ``stopping()`` says a cancel is the engine's shutdown; ``on_end(row, ending)`` runs
    after the row's StatsEvent and FinishedEvent and the events of the other rows in the
    same step (the engine stores the state there);
    ``release(cache)`` gives back a cache a lookup lent, once the batch holds a copy;
    ``speculation(row)`` opens a row's ``engine.speculation.providers.Speculation`` (None: the row
    decodes plainly); ``spec_policy`` is the round-length controller the batch's rounds use
    (the engine keeps one per loaded model, so it carries from batch to batch); ``stores``:
    whether ``on_end`` hands a row's state to the prefix cache (its StatsEvent says so);
    ``budget``: the :class:`~engine.step_budget.StepBudget` that sizes the prefill chunk of a
    step with decoding rows (the engine keeps one per loaded model); ``between()``: what
    the engine does between the layers of a prefill pass that every row is in (quick calls,
    its figures), where a pass whose rows were all cancelled stops; ``on_finish(reason)``
    runs just before a row's FinishedEvent (the engine counts it there, so whoever has the
    answer finds it counted); ``rounds``: whether its rows may run speculative rounds (the
    model's caches allow them: :func:`rounds_cache`)."""

    def __init__(self, model: Any, tokenizer: Any, max_rows: int,
                 should_stop: Callable[[Row], bool], stopping: Callable[[], bool],
                 on_end: Callable[[Row, Ending], None], release: Callable[[Any], None],
                 speculation: Callable[[Row, bool], Any] | None = None,
                 spec_policy: BatchLength | None = None,
                 stores: bool = False, budget: StepBudget | None = None,
                 between: Callable[[], None] | None = None,
                 on_finish: Callable[[str], None] | None = None, *, rounds: bool):
        from mlx_lm.generate import BatchGenerator

        self.model, self.tokenizer = model, tokenizer
        self.max_rows = max_rows
        self.should_stop, self.stopping, self.on_end = should_stop, stopping, on_end
        self.release = release
        self.on_finish = on_finish
        self.stores = stores
        eos = sorted(int(t) for t in tokenizer.eos_token_ids)
        self._eos = set(eos)
        # EOS ends a row inside BatchGenerator, which then hands over the row's cache. Its
        # model runs the decode steps compiled (engine.batch_step).
        # (BatchGenerator annotates its model as nn.Module; it only calls it and reads its layers)
        self.stepper = BatchStepModel(model)
        self.rounds = rounds  # (decided once per model: Batching._rounds, from rounds_cache)
        self.between = between
        # Each step sets the generator's prefill step to the chunk it feeds; the prompt batch
        # keeps the one it was made with and cuts every pass by it, so that one is made too
        # large to cut any chunk (a fused pass's chunk must be the pass that follows it).
        self._gen: BatchGenerator | None = BatchGenerator(
            cast("nn.Module", self.stepper), stop_tokens=[[t] for t in eos] or None, completion_batch_size=max_rows,
            prefill_batch_size=max_rows, prefill_step_size=NO_CUT)
        move_whole_prompt_batch(self._gen)  # (rows entering decoding together: no copy)
        gen = self._gen
        # A prompt's first token comes from its last prefill pass (uid, token, logprobs),
        # taken in the step that ran the pass.
        self._firsts: list[tuple[int, int, mx.array]] = []
        view = head_view(model) if FOLD_FIRST else None
        folds = view is not None and fold_first_token(
            gen, lambda x, cache: self.stepper.last_logits(x, cache, view),
            lambda uid, token, logprobs: self._firsts.append((uid, token, logprobs)))
        # its decode steps feed a prompt's next chunk too (engine.fused_step), but for the
        # last one when that pass gives the first token
        self.stepper.upcoming = lambda: next_prompt_chunk(gen, final=not folds)
        self.rows: dict[int, Row] = {}
        self._samplers: dict[tuple, Any] = {}
        self._ended: list[tuple[Row, Ending]] = []  # rows whose on_end is still due
        self.steps = 0
        self.speculation = speculation
        self.verifier: BatchVerifier | None = None  # once a row speculates
        self.spec_policy = spec_policy  # a BatchLength carried from batch to batch (None: fresh)
        # The prefill chunk of a step with decoding rows (None: each request's prefill_step_size).
        self.budget = budget
        # Rows with nothing to prefill (a request moving in, a prompt cached but for its last
        # token), held back while the rows joining with them run their last prefill pass, so
        # that all enter decoding in one pass instead of each in a pass of its own.
        self._held: list[tuple[Row, dict, list[int], list | None]] = []
        self.newly_shared = 0  # rows that came to have company since the engine last counted
        # Inside a pass in which every row prefills: its chunk, and (layers evaluated,
        # layers) once its first layer is (``/stats``' ``running`` shows them).
        self.pass_chunk = 0
        self.layer_at: tuple[int, int] | None = None

    def prefilling_at(self, handle: RequestHandle) -> tuple[int, int, int, int] | None:
        """Where ``handle``'s row is inside a pass in which every row prefills: (prompt
        tokens done before the pass, its chunk, layers evaluated, layers); None elsewhere."""
        if self.layer_at is None:
            return None
        for row in self.rows.values():
            if row.handle is handle and row.progress is not None and row.first_time is None:
                return (row.progress[0], min(self.pass_chunk, row.prompt_left()), *self.layer_at)
        return None

    def __len__(self) -> int:
        return len(self.rows) + len(self._held)

    def handles(self) -> list[RequestHandle]:
        """The requests of every row (held ones too)."""
        return [r.handle for r in self.rows.values()] + [h[0].handle for h in self._held]

    @property
    def room(self) -> int:
        return self.max_rows - len(self)

    def _sampler(self, p: SamplingParams) -> Any:
        # One object per distinct setting: rows that share it are sampled in one call. A
        # seeded row draws from a key sequence of its own: an object of its own.
        if p.seed is not None and p.temperature > 0:
            return request_sampler(p)
        key = (p.temperature, p.top_p, p.min_p, p.top_k) if p.temperature > 0 else ("greedy",)
        if key not in self._samplers:
            self._samplers[key] = request_sampler(p)
        return self._samplers[key]

    def add(self, row: Row, cache: list | None, in_cache: list[int], rest: list[int]) -> None:
        """Let ``row`` join: ``cache`` holds ``in_cache`` (None when empty), ``rest`` are the
        tokens still to feed (at least one: the last is the input of its next token).
        Rows that already sent tokens bring them in ``row.emitted``; their detokenizer and
        stop matcher are rebuilt by replaying those tokens, as they were fed the first time."""
        if not rest:
            raise ValueError("a joining row needs at least one token to feed")
        p = row.params
        row.detok = stream_detokenizer(self.tokenizer)
        row.stopper = StopMatcher(p.stop)
        for t in row.emitted:
            row.detok.add_token(t)
            row.stopper.feed(row.detok.last_segment)
        if not row.gen_start:
            row.gen_start = time.perf_counter()
        left = p.max_tokens - len(row.emitted)
        if row.stopper.matched is not None or left <= 0:
            # Its last token (sent alone) already ended it.
            row.lent = None
            reason = "stop" if row.stopper.matched is not None else "length"
            self._finish(row, reason, row.stopper.matched,
                         Ending(reason, None, list(in_cache) if cache else [], cache))
            self._settle()
            return
        processors = request_processors(p)  # BatchGenerator gives them every token it knows
        from mlxkv.engine.speculation.grammar import logits_width, request_constraint

        constraint = request_constraint(self.tokenizer, row.request, logits_width(self.model))
        if constraint is not None:  # the mask alone decoding applies; a row's history is its whole prompt
            processors.append(constraint.processor(len(row.prompt)))
        from mlx_lm.models.cache import make_prompt_cache

        # An empty cache is made here: BatchGenerator's model is a step, not the model.
        args = dict(segments=[[list(rest)]], max_tokens=[left],
                    caches=[cache if cache is not None else make_prompt_cache(self.model)],
                    all_tokens=[list(in_cache)],
                    samplers=[row.sampler if row.sampler is not None else self._sampler(p)],
                    logits_processors=[processors])
        row.base = len(in_cache)
        if len(rest) == 1:
            self._held.append((row, args, list(in_cache), cache))
        else:
            self._insert(row, args)
        if len(self) > 1:  # it decodes beside others: each is batched from now on
            for r in [*self.rows.values(), *(h[0] for h in self._held)]:
                if not r.shared:
                    r.shared = True
                    self.newly_shared += 1
                    self._beside_others(r)
        if row.first_time is None:
            self._progress(row, row.base, len(in_cache) + len(rest))

    def _insert(self, row: Row, args: dict) -> None:
        (row.uid,) = self.gen.insert_segments(**args)
        self.rows[row.uid] = row
        self._open_spec(row)

    def _release_held(self, chunk: int) -> None:
        """Insert the held rows unless rows still prefilling finish in this step's pass of
        ``chunk`` tokens (then they split off together in the next); a longer prefill is not
        waited for."""
        if not self._held:
            return
        prefilling = self._prefilling()
        if prefilling and all(r.prompt_left() <= chunk for r in prefilling):
            return
        held, self._held = self._held, []
        for row, args, _, _ in held:
            self._insert(row, args)

    def _prefilling(self) -> list[Row]:
        """The rows with more than their last prompt token still to feed."""
        return [r for r in self.rows.values() if r.first_time is None and r.prompt_left() > 0]

    def _beside_others(self, row: Row) -> None:
        """``row`` speculated alone in the batch and now has company: its speculation is
        opened again as a row beside others' (``speculation(row, False)``), when that picks
        another source (under ``auto``, no draft model). The new source starts from the
        tokens the row holds, as a request moving in from decoding alone starts."""
        spec = row.spec
        if spec is None or self.speculation is None or self.verifier is None \
                or spec.speculation.provider.kind != "draft":
            return  # (only a draft model's row may have been opened as alone)
        again = self.speculation(row, False)
        if again is not None and again.provider is spec.speculation.provider:
            again.source.close()
            return
        self.verifier.drop(row.uid)
        spec.speculation.source.close()
        row.spec = None
        if again is not None:
            self._speculate(row, again)

    def _open_spec(self, row: Row) -> None:
        # A round rewrites BatchGenerator's private state: only on the mlx-lm versions that
        # was checked against (elsewhere the row decodes plainly, after one warning).
        if self.speculation is None or not batch_speculation_available():
            return
        self._speculate(row, self.speculation(row, len(self) == 1))

    def _speculate(self, row: Row, spec: Any) -> None:
        if spec is None:
            return
        if spec.provider.needs_hidden or not self.rounds:
            # MTP proposes from the target's hidden state: alone only; a recurrent layer's
            # batch state cannot give back a round's rejected positions
            spec.source.close()
            return
        if self.verifier is None:
            from mlxkv.engine.speculation.batch_verify import BatchVerifier

            self.verifier = BatchVerifier(self.model, controller=self.spec_policy)
        row.spec = self.verifier.add(row.uid, spec, row.prompt, row.params)

    def _progress(self, row: Row, done: int, total: int) -> None:
        if row.progress != (done, total):
            row.progress = (done, total)
            row.handle.emit(ProgressEvent(done, total))

    def step(self) -> None:
        """Cancel what was cancelled, then one decode step of the decoding rows plus one
        prefill chunk of the joining ones; send each row's events. The rows that ended are
        handed to ``on_end`` (which stores their state) once every row's events of the step
        are sent: a store never holds back the other rows' tokens."""
        try:
            self._step()
        finally:
            self._settle()

    def _settle(self) -> None:
        while self._ended:
            row, ending = self._ended.pop(0)
            if row.spec is not None:
                spec, row.spec = row.spec, None
                assert self.verifier is not None  # made with the row's spec
                self.verifier.drop(row.uid)
                self.verifier.finish(spec, ending.tokens_in_cache)
            self.on_end(row, ending)

    def _step(self) -> None:
        detail = "shutdown" if self.stopping() else None
        for held in [h for h in self._held if self.should_stop(h[0])]:
            self._held.remove(held)
            waiting, _, in_cache, cache = held
            waiting.lent = None
            self._finish(waiting, "cancelled", detail,
                         Ending("cancelled", detail, in_cache if cache else [], cache))
        gone = [r for r in self.rows.values() if self.should_stop(r)]
        if gone:
            self._remove(gone, "cancelled", detail)
        prefilling = self._prefilling()
        decoding = len(self.rows) + len(self._held) - len(prefilling)
        chunk = min((r.params.prefill_step_size for r in prefilling), default=0)
        if prefilling and self.budget is not None:
            # The rows prefilling share the step's budget: their pass is [rows, chunk].
            chunk = max(1, self.budget.chunk(decoding, chunk * len(prefilling)) // len(prefilling))
        self._release_held(chunk)
        if not self.rows:
            return
        verifier = self.verifier
        if verifier is not None and verifier.specs:
            k = verifier.length(self.gen)
            if k > 0 and self._spec_round(verifier, k):
                return
        if prefilling:
            self.gen.prefill_step_size = chunk
        fed = sum(min(chunk, r.prompt_left()) for r in prefilling)
        t = time.perf_counter()
        # A pass that only prefills runs a whole chunk: it stops between layers once every
        # row is cancelled (with a decoding row beside it the budget keeps the pass short).
        alone = bool(prefilling) and len(self._prefilling()) == len(self.rows)
        self.stepper.between_layers = self._between_layers if alone else None
        self.pass_chunk = chunk if alone else 0
        fused = self.stepper.fused_steps
        try:
            if verifier is not None and verifier.specs:
                decoding_only = not admitting(self.gen)
                prompt_out, gen_out = self.gen.next()
                verifier.plain_step(self.gen, t, decoding_only)
            else:
                prompt_out, gen_out = self.gen.next()
        except Cancelled:
            self._abandon("shutdown" if self.stopping() else None)
            return
        finally:
            self.stepper.between_layers = None
            self.layer_at, self.pass_chunk = None, 0
        if self.budget is not None:
            self.budget.fused_steps += self.stepper.fused_steps - fused
        if (self.budget is not None and decoding > 0 and gen_out and (fed > 0 or not prompt_out)
                and not self._firsts):
            # (a step where a row entered decoding or took its first token from its own
            # pass is neither: its merge, or its pass apart, costs what it costs)
            self.budget.observe(fed, time.perf_counter() - t)
        self.steps += 1
        self._take(prompt_out, gen_out)

    def _take(self, prompt_out: list, gen_out: list) -> None:
        """A step's outputs: prefill progress (a row's first pass gives its lent cached
        state back), then each decoding row's token, checked for its stops."""
        for pr in prompt_out:
            row = self.rows.get(pr.uid)
            if row is None:
                continue
            if not row.merged:  # the batch copied its cache: give a lent cached state back
                row.merged = True
                if row.lent is not None:
                    lent, row.lent = row.lent, None
                    self.release(lent)
            if row.first_time is None:
                done, total = pr.progress
                self._progress(row, row.base + done, row.base + total)
        stopped: list[Row] = []
        for r in gen_out:
            row = self.rows.get(r.uid)
            if row is None:
                continue
            if self._echoed(row, r.token):
                continue
            now = time.perf_counter()
            if row.first_time is None:
                row.first_time = now
            row.last_time = now
            if r.finish_reason == "stop":  # EOS: never sent, as alone
                self._end(row, "stop", "eos", r)
                continue
            self._token(row, r.token, r.logprobs)
            if row.stopper.matched is not None:
                if r.finish_reason is not None:  # it left the batch anyway
                    self._end(row, "stop", row.stopper.matched, r)
                else:
                    stopped.append(row)
            elif r.finish_reason == "length":
                self._end(row, "length", None, r)
        firsts, self._firsts = self._firsts, []
        for uid, token, logprobs in firsts:
            row = self.rows.get(uid)
            if row is not None and self._first(row, token, logprobs):
                stopped.append(row)
        if stopped:
            self._remove(stopped, "stop", None)

    def _first(self, row: Row, token: int, logprobs: mx.array) -> bool:
        """``row``'s first token, sampled in its last prefill pass while the row still waits
        to enter decoding; sent through the checks of a decode step. True: a stop string
        ended it (the caller removes it with the others); ended otherwise, it is removed here."""
        assert row.progress is not None  # (set when it joined)
        self._progress(row, row.progress[1], row.progress[1])
        now = time.perf_counter()
        if row.first_time is None:  # (a row that moved in and prefilled again had sent some)
            row.first_time = now
        row.last_time = now
        if token in self._eos:  # EOS: never sent, as alone
            self._remove([row], "stop", "eos")
            return False
        self._token(row, token, logprobs)
        if row.stopper.matched is not None:
            return True
        if len(row.emitted) >= row.params.max_tokens:
            self._remove([row], "length", None)
        else:
            row.echo = token
        return False

    @staticmethod
    def _echoed(row: Row, token: int) -> bool:
        """Whether ``token`` is ``row``'s first token reported again by the step that fed it
        (sent already: see :meth:`_first`)."""
        if row.echo is None:
            return False
        if token != row.echo:
            raise RuntimeError(f"a row's first step reported {token}, not its first token {row.echo}")
        row.echo = None
        return True

    def _between_layers(self, done: int, layers: int) -> None:
        """After each layer of a pass in which every row prefills: the engine's quick work,
        then :class:`Cancelled` once every row should stop, unless the pass is done (its
        last layer: the rows then leave after it, with it stored)."""
        self.layer_at = (done, layers)
        if self.between is not None:
            self.between()
        if done < layers and self.rows and all(self.should_stop(r) for r in self.rows.values()):
            raise Cancelled

    def _abandon(self, detail: str | None) -> None:
        """Every row was cancelled inside a prefill pass, which put the generator's caches
        back as they were before it (``BatchStepModel``): each row leaves with what the
        passes before computed, stored as a cancel between two passes stores it. mlx-lm's
        token list of a row in the pass already counts the pass's tokens: it is cut to what
        the row's cache holds. A row whose cache cannot say how many tokens it holds (a
        layer of recurrent state, after a pass) leaves without a state to store, and a lent
        cached prefix is given back as it was lent."""
        rows = list(self.rows.values())
        uids = [r.uid for r in rows]
        if self.stepper.rolled_back_empty:  # the pass was every row's first: nothing to keep
            self.gen.remove(uids)
            caches = {}
        else:
            caches = self.gen.remove(uids, return_prompt_caches=True)
        for row in rows:
            self.rows.pop(row.uid, None)
            cache, tokens = caches.get(row.uid, (None, []))
            held = _tokens_held(cache)
            if cache is not None and cache is not row.lent and held is None:
                cache = None  # the batch's copy, and no count of what it holds
            if row.lent is not None and cache is not row.lent:
                lent, row.lent = row.lent, None  # the batch's copy (or nothing) replaces it
                self.release(lent)
            tokens = [] if cache is None else list(tokens or [])[:held]  # (held None: all of them)
            self._finish(row, "cancelled", detail, Ending("cancelled", detail, tokens, cache))

    def _spec_round(self, verifier: BatchVerifier, k: int) -> bool:
        """One speculative round (False: no row proposed, nothing was fed). Each row's
        tokens go through the checks of a plain step, one at a time; a row that ends inside
        its tokens leaves with its cache cut back to the token that ended it."""
        out = verifier.round(self.gen, k)
        if out is None:
            return False
        self.steps += 1
        decoding = DecodingRows(self.gen)
        ended: list[tuple[Row, str, str | None, int]] = []
        for i, (uid, got) in enumerate(zip(list(decoding.uids), out)):
            row = self.rows.get(uid)
            if row is None:
                continue
            for n, (token, logprobs) in enumerate(got.emitted):
                if self._echoed(row, token):
                    decoding.count(i, token)  # (counted as a plain step counts it)
                    continue
                now = time.perf_counter()
                if row.first_time is None:
                    row.first_time = now
                row.last_time = now
                reason = decoding.count(i, token)  # as a plain step counts it
                if reason == "stop":  # EOS: never sent, as alone
                    ended.append((row, "stop", "eos", len(got.emitted) - n - 1))
                    break
                self._token(row, token, logprobs)
                if row.stopper.matched is not None:
                    ended.append((row, "stop", row.stopper.matched, len(got.emitted) - n - 1))
                    break
                if reason == "length":
                    ended.append((row, "length", None, len(got.emitted) - n - 1))
                    break
                if n + 1 < len(got.emitted) and self.should_stop(row):  # as alone: after each token
                    ended.append((row, "cancelled", "shutdown" if self.stopping() else None,
                                  len(got.emitted) - n - 1))
                    break
        if ended:
            caches = self.gen.remove([row.uid for row, *_ in ended], return_prompt_caches=True)
            for row, reason, detail, extra in ended:
                cache, tokens = caches.get(row.uid, (None, []))
                tokens = list(tokens or [])
                if extra and cache is not None:
                    for c in cache:
                        c.trim(extra)
                    tokens = tokens[:len(tokens) - extra]
                self.rows.pop(row.uid, None)
                self._finish(row, reason, detail, Ending(reason, detail, tokens, cache))
        return True

    def _token(self, row: Row, token: int, logprobs: mx.array) -> None:
        row.detok.add_token(token)
        row.emitted.append(token)
        text = row.stopper.feed(row.detok.last_segment)
        lp, top = token_logprobs(logprobs, token, row.request.logprobs)
        row.handle.emit(TokenEvent(token, text, lp, top))

    def _remove(self, rows: list[Row], reason: str, detail: str | None) -> None:
        caches = self.gen.remove([r.uid for r in rows], return_prompt_caches=True)
        for row in rows:
            cache, tokens = caches.get(row.uid, (None, []))
            self.rows.pop(row.uid, None)
            why = (row.stopper.matched or detail) if reason == "stop" else detail
            self._finish(row, reason, why, Ending(reason, why, list(tokens or []), cache))

    def _end(self, row: Row, reason: str, detail: str | None, r: Any) -> None:
        self.rows.pop(row.uid, None)
        self._finish(row, reason, detail,
                     Ending(reason, detail, list(r.all_tokens or []), r.prompt_cache))

    def _finish(self, row: Row, reason: str, detail: str | None, ending: Ending) -> None:
        if row.stopper.matched is None:
            row.detok.finalize()
            tail = row.stopper.feed(row.detok.last_segment)
            tail += row.stopper.flush() if row.stopper.matched is None else ""
            if row.stopper.matched is not None:
                reason, detail = "stop", row.stopper.matched
            if tail:
                row.handle.emit(TokenEvent(None, tail))
        if reason == "length" and row.context_cut:
            detail = "context"
        ending.reason, ending.detail = reason, detail
        first, last = row.first_time, row.last_time
        n_new = row.prompt_tokens_new
        prefill_s = (first - row.gen_start) if first is not None else 0.0
        decode_s = (last - first) if first is not None and last is not None else 0.0
        n = len(row.emitted)
        row.handle.emit(StatsEvent(
            prompt_tokens=len(row.prompt), cached_tokens=row.n_cached, generated_tokens=n,
            ttft_s=(first - row.started) if first is not None else 0.0,
            prefill_tps=n_new / prefill_s if prefill_s > 0 else 0.0,
            decode_tps=(n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0,
            queue_s=row.queue_s, load_s=row.load_s,
            cached_ram_tokens=row.cached_ram_tokens, cached_ssd_tokens=row.cached_ssd_tokens,
            batched=row.shared,
            spec=self.verifier.summary(row.spec) if row.spec is not None and self.verifier is not None else None,
            stored_tokens=stored_prompt_tokens(len(row.prompt), row.n_cached, len(ending.tokens_in_cache),
                                               self.stores and ending.cache is not None)))
        if self.on_finish is not None:
            self.on_finish(reason)
        row.handle.emit(FinishedEvent(reason, detail))
        row.lent = None  # unmerged, the lent cache is what ``ending`` holds: stored back
        self._ended.append((row, ending))

    def abort(self) -> list[Row]:
        """The rows, taken out after a failed step (nothing more is sent to them here)."""
        rows = list(self.rows.values()) + [h[0] for h in self._held]
        self.rows.clear()
        self._held.clear()
        for row in rows:
            if row.spec is not None:
                row.spec.source.close()
                row.spec = None
        self.close()
        return rows

    @property
    def gen(self) -> BatchGenerator:
        """mlx-lm's generator of the rows (until :meth:`close`)."""
        assert self._gen is not None, "the batch is closed"
        return self._gen

    def close(self) -> None:
        """Give back what the generator holds (on Apple silicon: the wired-memory limit it
        raised); on the engine thread, once no row is left."""
        if self.verifier is not None:
            self.verifier.close()
        gen, self._gen = self._gen, None
        self.stepper.upcoming = None
        if gen is not None:
            gen.close()
