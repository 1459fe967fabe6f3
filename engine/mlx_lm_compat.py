"""Every use of mlx-lm's private state, in one module, checked against named versions.

Speculation over a batch (``engine.speculation.batch_verify``) works on mlx-lm's
``BatchGenerator`` between two of its steps, and its public API cannot read or replace what
a round needs: the decoding rows and whether any still prefill, each row's pending token and
log-probabilities, its generated count and EOS matcher, and the token history its logits
processors see. :class:`DecodingRows` reaches them (and the wrapped Hugging Face tokenizer
is read here too). The batch's own steps reach three more: the prompt chunk a step feeds
next (:func:`next_prompt_chunk`, for the fused pass), the hand-over of rows from the prompt
batch to the generation batch without a copy (:func:`move_whole_prompt_batch`), and a lone
prompt's last pass giving its first token (:func:`fold_first_token`). Those names were
checked in mlx-lm's source and by the batch tests on every version in
:data:`CHECKED_VERSIONS`; on any other, :func:`batch_speculation_available` is False with
one warning and batched rows decode plainly, the three steps above run as mlx-lm runs
them, and reaching the internals anyway raises :class:`UnverifiedMlxLm`. Everything else
uses mlx-lm's public API only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from mlxkv.engine import cpu_attention
from mlxkv.engine.batch_step import FixedBatchKV
from mlxkv.engine.compiled_step import FixedKV
from mlxkv.engine.fused_step import FusedKV
from mlxkv.engine.logs import warn_once

if TYPE_CHECKING:
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator

log = logging.getLogger("mlxkv.engine")

# The mlx-lm releases whose private state below was read and tested. A new release goes in
# only after the same check (the source of GenerationBatch, BatchGenerator and TokenBuffer,
# and tests/test_batch_spec*.py passing on it); pyproject.toml bounds mlx-lm to these.
CHECKED_VERSIONS: tuple[str, ...] = ("0.32.0", "0.32.1", "0.32.2")


class UnverifiedMlxLm(RuntimeError):
    """mlx-lm's private state was reached on a version it was not checked against."""


def hf_tokenizer(tokenizer: Any) -> Any:
    """The Hugging Face tokenizer an mlx-lm ``TokenizerWrapper`` wraps (its private
    ``_tokenizer``: the wrapper has no public way to it), or ``tokenizer`` when not wrapped."""
    return getattr(tokenizer, "_tokenizer", tokenizer)


def installed_version() -> str:
    """The version of the mlx-lm that is imported."""
    import mlx_lm

    return str(getattr(mlx_lm, "__version__", "unknown"))


def version_problem(version: str | None = None) -> str | None:
    """None when ``version`` (default: the installed mlx-lm's) is one the internals were
    checked against; else why batched speculation cannot run on it."""
    version = installed_version() if version is None else version
    if version in CHECKED_VERSIONS:
        return None
    return (f"mlx-lm {version} is not a version mlxkv's batched speculation was checked against "
            f"({', '.join(CHECKED_VERSIONS)}): it reads BatchGenerator's private state, which may "
            "differ there. Requests decoded together decode plainly (same output, no speculation); "
            "a request alone still speculates. Install a checked version "
            f"(pip install 'mlx-lm>={CHECKED_VERSIONS[0]},<={CHECKED_VERSIONS[-1]}') to speculate in batches.")


def require_checked(version: str | None = None) -> None:
    """Raise :class:`UnverifiedMlxLm` unless ``version`` (default: installed) was checked."""
    problem = version_problem(version)
    if problem is not None:
        raise UnverifiedMlxLm(problem)


def batch_speculation_available(version: str | None = None) -> bool:
    """Whether rows of a batch may speculate on this mlx-lm; on an unchecked version, warns
    once (per version) why not."""
    version = installed_version() if version is None else version
    problem = version_problem(version)
    if problem is None:
        return True
    warn_once(log, f"mlx-lm-unchecked:{version}", "%s", problem)
    return False


def move_whole_prompt_batch(gen: BatchGenerator) -> None:
    """Make ``gen`` hand its whole prompt batch to decoding without a copy. When a step's
    rows all finish their prefill (a lone request's always do), ``BatchGenerator`` splits
    them off its prompt batch with ``split``, which deep-copies every row's KV state and
    then drops the original: a 3,000-token prompt of the real model, 138 MB copied, ~75 ms
    of its first token. Here, a split of every row moves the state instead (the same
    objects; the prompt batch is left empty, as the split leaves it); a split of some rows
    is mlx-lm's. Nothing changes on a version whose internals were not checked."""
    if version_problem() is not None:
        return
    batch = gen._prompt_batch
    split_some = type(batch).split

    def split(indices: list[int]) -> Any:
        if sorted(indices) != list(range(len(batch.uids))):
            return split_some(batch, indices)
        moved = object.__new__(type(batch))
        moved.__dict__.update({k: v for k, v in batch.__dict__.items() if k not in ("split", "prompt")})
        batch.uids, batch.prompt_cache, batch.tokens = [], [], []
        batch.samplers, batch.logits_processors = [], []
        batch.max_tokens, batch.stop_sequences = [], []
        return moved

    batch.split = split


def fold_first_token(gen: BatchGenerator, last_logits: Callable[[mx.array, list], mx.array],
                     taken: Callable[[int, int, mx.array], None]) -> bool:
    """Make ``gen``'s prompt pass that ends a lone prompt row's prefill feed the prompt's last
    token too, sample the row's first token from it, and move the row into decoding with
    that token pending; False (nothing changed) on a version whose internals were not
    checked.

    mlx-lm feeds a prompt's last token in a pass of its own as the row enters decoding, and
    reads the token it samples one step later: two passes (each reads every weight) between
    the prompt's last chunk and its first token. Here, when the pass feeds the only prompt
    row and leaves it its last token alone, the pass takes that token too:
    ``last_logits(tokens, cache)`` runs it ([1, T] over the prompt batch's layers) and gives
    the last position's logits ([1, V]); the row's logits processors (with every token it
    holds as history) and sampler pick the first token, as a decode step would, and
    ``taken(uid, token, logprobs)`` hands it over. The row then joins the generation batch
    as a row that entered it in an earlier step would be: its KV holding the prompt, its
    first token sampled and pending. The next decode step feeds that token with the other
    rows' and reports it once more (counted against its max tokens as any step's token),
    and a speculative round starts from it. A pass that raises (a cancel between layers)
    leaves the row as mlx-lm's own pass would have, its last token still to feed."""
    if version_problem() is not None:
        return False
    import mlx.core as mx
    from mlx_lm.generate import GenerationBatch

    batch = gen._prompt_batch
    prompt_all = type(batch).prompt

    def prompt(tokens: list[list[int]]) -> None:
        processing = gen._currently_processing
        if len(tokens) != 1 or len(batch.uids) != 1 or len(processing) != 1 or not tokens[0]:
            return prompt_all(batch, tokens)
        segments = processing[0][0]
        if len(segments) != 1 or len(segments[0]) != 1:
            return prompt_all(batch, tokens)  # more of the prompt after this pass
        (last,) = segments[0]
        held = batch.tokens[0]
        held += tokens[0]  # (counted before the pass, as mlx-lm's pass counts them)
        logits = last_logits(mx.array([[*tokens[0], last]]), batch.prompt_cache)
        held.append(last)
        processors = batch.logits_processors[0] or ()
        if processors:
            context = mx.array(held, dtype=mx.int32)
            for processor in processors:
                logits = processor(context, logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        token = (batch.samplers[0] or batch.fallback_sampler)(logprobs)
        mx.eval(token, logprobs, [c.state for c in batch.prompt_cache])
        mx.clear_cache()  # (as mlx-lm's pass)
        # Into decoding: a generation batch made empty (no step runs), then given the row
        # with its first token pending, as its own first step would have left it.
        processing.pop(0)
        row = batch.split([0])
        entering = GenerationBatch(row.model, [], token, row.prompt_cache, row.tokens, [],
                                   row.fallback_sampler, [], row.stop_sequences, row.max_tokens)
        entering.uids, entering.samplers = row.uids, row.samplers
        entering.logits_processors = row.logits_processors
        entering._next_logprobs = [logprobs[0]]
        entering._num_tokens = [0]
        gen._generation_batch.extend(entering)
        taken(row.uids[0], int(token.item()), logprobs[0])

    batch.prompt = prompt
    return True


def admitting(gen: BatchGenerator) -> bool:
    """Whether ``gen`` (a BatchGenerator) holds rows that wait for or are in their prefill."""
    require_checked()
    return bool(len(gen._prompt_batch) or gen._unprocessed_sequences)


def next_prompt_chunk(gen: BatchGenerator, final: bool = True) -> tuple[list[int], list] | None:
    """What ``gen``'s next step feeds after its decode step, when that is one prompt row going
    on with its prefill (no row waiting to start one, none about to enter decoding): the
    chunk's tokens and the prompt batch's cache layers; else None (also on an mlx-lm whose
    internals were not checked). ``engine.fused_step`` feeds that chunk inside the decode
    step's pass, and the prompt pass that follows then finds it fed. ``final=False``: not
    the prompt's last chunk (a pass of its own feeds it, with the first token: see
    :func:`fold_first_token`)."""
    if version_problem() is not None:
        return None
    if gen._unprocessed_sequences or len(gen._prompt_batch) != 1 or len(gen._currently_processing) != 1:
        return None
    if len(gen._generation_batch) >= gen.completion_batch_size:
        return None  # a full batch runs no prompt pass
    segments = gen._currently_processing[0][0]
    if not segments or (len(segments) == 1 and len(segments[0]) == 1):
        return None  # its last token: it enters decoding instead
    n = min(len(segments[0]), gen.prefill_step_size)
    if not final and len(segments) == 2 and n == len(segments[0]):
        return None
    return list(segments[0][:n]), gen._prompt_batch.prompt_cache


class DecodingRows:
    """The decoding rows of a ``BatchGenerator`` between two of its steps, in its order:
    each row's KV holds ``tokens[i]``, its pending token is sampled and not fed yet. What a
    speculative round reads and rewrites goes through here, nowhere else."""

    def __init__(self, gen: BatchGenerator):
        require_checked()
        self._batch = gen._generation_batch

    def __len__(self) -> int:
        return len(self._batch.uids)

    @property
    def uids(self) -> list[int]:
        return self._batch.uids

    @property
    def tokens(self) -> list[list[int]]:
        """Per row, every token its KV holds (a round extends them with what it fed)."""
        return self._batch.tokens

    @property
    def max_tokens(self) -> list[int]:
        return self._batch.max_tokens

    @property
    def cache(self) -> list:
        """The batch's cache, one ``BatchKVCache`` (or other batch cache) per layer."""
        return self._batch.prompt_cache

    @property
    def processors(self) -> list[list]:
        """Per row, its logits processors (an empty list: none)."""
        return self._batch.logits_processors

    def samplers(self) -> list[Callable[[mx.array], mx.array]]:
        """Per row, the sampler a plain step uses (the generator's default for rows without one)."""
        b = self._batch
        return [s if s is not None else b.fallback_sampler for s in (b.samplers or [None] * len(b.uids))]

    @property
    def pending(self) -> mx.array:
        """The rows' pending tokens ([B], maybe not evaluated yet)."""
        return self._batch._next_tokens

    @property
    def pending_logprobs(self) -> list[mx.array]:
        """Per row, the log-probabilities ([V]) its pending token was sampled from."""
        return self._batch._next_logprobs

    def set_pending(self, tokens: Sequence[int], logprobs: list[mx.array]) -> None:
        """Make ``tokens`` the rows' pending tokens (the next plain step feeds them)."""
        import mlx.core as mx

        b = self._batch
        b._next_tokens = mx.array(list(tokens), dtype=b._next_tokens.dtype)
        b._next_logprobs = list(logprobs)

    def generated(self, i: int) -> int:
        """Tokens row ``i`` has emitted in the batch."""
        return self._batch._num_tokens[i]

    def count(self, i: int, token: int) -> str | None:
        """Count ``token`` as emitted by row ``i``, as a plain step does: "stop" when it ends
        the row's stop sequence (EOS), "length" when it is the row's last, else None."""
        b = self._batch
        b._num_tokens[i] += 1
        reason = "length" if b._num_tokens[i] >= b.max_tokens[i] else None
        if b._matchers[i].advance(token):
            reason = "stop"
        return reason

    def history(self, i: int) -> mx.array:
        """The token history row ``i``'s logits processors see."""
        return self._batch._token_context[i].tokens

    def extend_history(self, i: int, tokens: Sequence[int]) -> None:
        """Add ``tokens`` (fed by a round) to row ``i``'s processors' history, as plain steps do
        for rows that have processors."""
        import mlx.core as mx

        if self._batch.logits_processors[i]:
            self._batch._token_context[i].update_and_fetch(mx.array(list(tokens), dtype=mx.int32))


# --------------------------------------------------------------------------- attention
def install_attention(model: Any) -> int:
    """Route ``model``'s attention through :func:`engine.cpu_attention.attention` on the
    threads that opted in (``cpu_attention.use_on_this_thread``); the number of modules
    rebound (0 when done before, or when no module of the model calls mlx-lm's shared
    ``scaled_dot_product_attention``).

    mlx-lm's architectures import ``scaled_dot_product_attention`` from
    ``mlx_lm.models.base`` into their own module, and call it with the layer's cache. That
    module-level name is the only place a model's attention can be reached without copying
    the architecture; it is rebound, in each module of ``model``'s classes that holds
    mlx-lm's own function, to :func:`_attention`, which is mlx-lm's function itself on every
    thread that did not opt in and for every call :func:`engine.cpu_attention.applies` does
    not cover (one query, a quantized cache, sinks, another dtype or device). So another
    thread, library or benchmark peer in the process computes exactly what it did before."""
    from mlx_lm.models import base

    global _mlx_lm_attention
    _mlx_lm_attention = base.scaled_dot_product_attention
    return _rebind(model, "scaled_dot_product_attention", base.scaled_dot_product_attention, _attention)


def _rebind(model: Any, name: str, theirs: Any, ours: Any) -> int:
    """Set ``name`` to ``ours`` in every module of ``model``'s classes where it is mlx-lm's
    ``theirs``; the number of modules changed."""
    import sys

    rebound = 0
    for module in {type(m).__module__ for _, m in model.named_modules()} | {type(model).__module__}:
        namespace = sys.modules.get(module)
        if namespace is not None and getattr(namespace, name, None) is theirs:
            setattr(namespace, name, ours)
            rebound += 1
    return rebound


_mlx_lm_attention: Any = None  # mlx-lm's own, kept by install_attention (a call per layer: no imports here)


def _attention(queries: Any, keys: Any, values: Any, cache: Any, scale: float, mask: Any,
               sinks: Any = None) -> Any:
    if type(cache) is FusedKV:  # a fused pass's layer: the rows and the chunk apart
        return cache.attend(queries, scale, sinks)
    if type(cache) in (FixedKV, FixedBatchKV) and sinks is None:  # the compiled steps' layers
        out = cache.attend(queries, keys, values, scale)
        if out is not None:
            return out
    if not hasattr(cache, "bits") and cpu_attention.applies(queries, keys, mask, sinks):
        return cpu_attention.attention(queries, keys, values, scale, mask)
    return _mlx_lm_attention(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


def install_swiglu(model: Any) -> int:
    """Route ``model``'s ``silu(gate) * up`` through :func:`engine.cpu_attention.swiglu` on
    the threads that opted in, as :func:`install_attention` does for attention: the
    architectures import ``swiglu`` from ``mlx_lm.models.activations`` into their module,
    and that name is rebound, where it is mlx-lm's own, to :func:`_swiglu` (mlx-lm's on
    every other thread and for every call the kernel does not cover). The number of
    modules rebound."""
    from mlx_lm.models import activations

    global _mlx_lm_swiglu
    _mlx_lm_swiglu = activations.swiglu
    return _rebind(model, "swiglu", activations.swiglu, _swiglu)


_mlx_lm_swiglu: Any = None  # mlx-lm's own, kept by install_swiglu


def _swiglu(gate: Any, up: Any) -> Any:
    if cpu_attention.swiglu_applies(gate, up):
        out = cpu_attention.swiglu(gate, up)
        if out is not None:
            return out
    return _mlx_lm_swiglu(gate, up)
