"""Speculation from a checkpoint's own multi-token-prediction (MTP) layer (Qwen3-Next,
Qwen3.5): the proposal source is the MTP module, sharing the target's embeddings and LM head and
reading the target's last hidden state (after the final norm).

The MTP module takes the pair (h_{p-1}, x_p) (the target's hidden at position p - 1 and
the token at p; embedding first in the concatenation) and predicts x_{p+1}. Its own KV
cache holds one entry per target position, entry p for pair p, so it is stored in the
prefix cache as a plain :class:`KVState` (offset == tokens). Where the target's hidden is
not known (position 0, the first position after a restored state, positions the target
took from its own cache without this source's state) the entry has a zero hidden: the
cache stays aligned, the proposal is only less informed there.

``prefill`` runs the prompt's entries. A round: ``propose(pending, n)`` runs the entries
the target committed since the last proposal (plain steps queue theirs: a request whose
policy stopped speculating pays nothing per token) plus (h_last, pending) in one forward,
then feeds its own output hidden (after ``mtp.norm``) and the proposed token back for depth
2..n (greedy, or sampled at the request's temperature with q returned).
``commit(accepted, hidden)`` trims the speculative entries and queues the real ones, with
the target's real hidden rows. Every proposed token is checked by the verifier, so the MTP can only
make decoding faster or slower, never different.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from mlxkv.engine.arrays import int_item, named_parameters
from mlxkv.engine.sampling import SamplingParams
from mlxkv.engine.speculation.base import KVState, Proposal, ProposalProvider, ProposalSource, TargetView
from mlxkv.engine.speculation.mtp_weights import (
    MTP_SCHEMA,
    MTPModule,
    MTPWeights,
    MTPWeightsError,
    build_mtp_module,
    read_mtp_weights,
)

if TYPE_CHECKING:
    from mlxkv.engine.models import LoadedModel

log = logging.getLogger("mlxkv.spec")

# Pairs run through the MTP layer per forward when a long prompt (or a long run of plain
# steps) is taken in at once: bounds the attention scores' memory like prefill_step_size.
CHUNK = 512
# Queued entries (target hidden rows held until the next proposal) before they run anyway.
QUEUE_MAX = 4 * CHUNK

__all__ = ["MTPCacheModel", "MTPProvider", "MTPSource", "MTPWeightsError", "load_mtp_provider"]


def _new_cache() -> list:
    from mlx_lm.models.cache import KVCache

    return [KVCache()]


def _copy_cache(cache: list, entries: int | None = None) -> list:
    """New KVCache objects over copies of the first ``entries`` rows (a cache's arrays are
    written in place as it grows, so two sources never share them)."""
    from mlx_lm.models.cache import KVCache

    out = []
    for c in cache:
        copy = KVCache()
        n = c.offset if entries is None else min(entries, c.offset)
        if c.keys is not None and n:
            keys = mx.contiguous(c.keys[..., :n, :])
            values = mx.contiguous(c.values[..., :n, :])
            mx.eval(keys, values)
            copy.keys, copy.values, copy.offset = keys, values, n
        out.append(copy)
    return out


class MTPSource(ProposalSource):
    """One request's MTP source. Entry p of its KV cache is the pair (h_{p-1}, x_p) of
    target position p, with a zero hidden where the target's is not known (position 0, the
    first position after a restored state, positions the target took from its own cache
    without this source's state): so the cache always holds exactly the target's tokens
    and is stored as a :class:`KVState`."""

    def __init__(self, provider: MTPProvider, target: TargetView, sampling: SamplingParams | None):
        self._mtp: MTPModule = provider.module
        self._embed = target.embed
        self._head = target.logits
        self._hidden_size = target.hidden_size
        self._cache = _new_cache()
        self._history: list[int] = []  # target tokens taken in (one per real entry, run or queued)
        self._last: mx.array | None = None  # [1, D]: target hidden of the last position
        self._real = 0  # cache entries that are real (the rest are this round's proposals)
        self._queue_h: list[mx.array] = []  # real entries not yet run: hidden rows ...
        self._queue_t: list[int] = []  # ... and their tokens
        self._proposed_for: int | None = None  # pending token whose entry follows the real ones
        sampling = sampling or SamplingParams()
        self._temperature = float(sampling.temperature)
        seed = sampling.seed
        self._key = mx.random.key(seed if seed is not None else int.from_bytes(os.urandom(4), "little"))

    # -- bookkeeping -------------------------------------------------------------------
    def _zeros(self, rows: int) -> mx.array:
        return mx.zeros((rows, self._hidden_size), dtype=self._mtp.fc.weight.dtype)

    def _rows(self, hidden: mx.array | None, count: int) -> mx.array | None:
        if hidden is None:
            return None
        rows = hidden.reshape(-1, hidden.shape[-1])
        if rows.shape[0] != count or rows.shape[1] != self._hidden_size:
            raise ValueError(f"MTP needs {count} target hidden rows of size {self._hidden_size}, "
                             f"got shape {tuple(hidden.shape)}")
        return rows

    def _take(self, tokens: list[int], rows: mx.array | None, first_done: bool = False) -> None:
        """The target's next positions hold ``tokens`` with hidden ``rows`` (None: unknown):
        queue their entries (h_{p-1}, x_p); the first is in the cache already when
        ``first_done``."""
        if not tokens:
            return
        if not first_done:
            self._queue_h.append(self._last if self._last is not None else self._zeros(1))
            self._queue_t.append(tokens[0])
        if len(tokens) > 1:
            self._queue_h.append(rows[:-1] if rows is not None else self._zeros(len(tokens) - 1))
            self._queue_t.extend(tokens[1:])
        self._last = rows[-1:] if rows is not None else None
        self._history.extend(tokens)

    def _trim_to(self, entries: int) -> None:
        cache = self._cache[0]
        if cache.offset > entries:
            cache.trim(cache.offset - entries)

    def _run(self, hidden: mx.array, tokens: list[int]) -> mx.array:
        """Entries through the MTP layer, CHUNK at a time; the output hidden [1, t, D] of the last chunk."""
        out: mx.array | None = None
        for start in range(0, len(tokens), CHUNK):
            e = self._embed(mx.array([tokens[start:start + CHUNK]]))
            out = self._mtp(e, hidden[None, start:start + CHUNK], self._cache)
            if start + CHUNK < len(tokens):
                mx.eval(out, self._cache[0].keys, self._cache[0].values)
        assert out is not None  # never called without tokens
        return out

    def _drain(self) -> tuple[mx.array | None, list[int]]:
        if not self._queue_t:
            return None, []
        hidden = mx.concatenate(self._queue_h, axis=0) if len(self._queue_h) > 1 else self._queue_h[0]
        tokens = self._queue_t
        self._queue_h, self._queue_t = [], []
        return hidden, tokens

    def _flush(self) -> None:
        """Run the queued real entries now (prefill, capture)."""
        self._trim_to(self._real)
        self._proposed_for = None
        hidden, tokens = self._drain()
        if hidden is not None:  # (tokens were queued)
            out = self._run(hidden, tokens)
            mx.eval(out, self._cache[0].keys, self._cache[0].values)
            self._real += len(tokens)

    def _bound_queue(self) -> None:
        # Plain steps between proposals queue one entry each; a long prompt queues many.
        # Past QUEUE_MAX they run now, so the hidden rows held stay bounded.
        if len(self._queue_t) >= QUEUE_MAX:
            self._flush()

    def _rewind(self, keep: int) -> None:
        """Keep the entries of the first ``keep`` positions only (their hidden rows are gone)."""
        self._flush()
        self._trim_to(keep)
        self._real = self._cache[0].offset
        del self._history[keep:]
        self._last = None

    # -- the seam ----------------------------------------------------------------------
    def prefill(self, prompt_tokens: list[int], processed: int = 0, hidden: mx.array | None = None) -> None:
        prompt = [int(t) for t in prompt_tokens]
        rows = self._rows(hidden, len(prompt) - processed)
        same = 0
        for a, b in zip(self._history, prompt):
            if a != b:
                break
            same += 1
        if same < len(self._history):
            self._rewind(same)  # a restored state longer than (or not a prefix of) this prompt
        start = len(self._history)
        if start < processed:
            # Positions the target had from its own cache but this source has no entries
            # for: their tokens are known, their hidden rows are not.
            self._take(prompt[start:processed], None)
        elif start > processed and rows is not None:
            # Restored entries reach past what the target had cached (its recurrent layers
            # restore only at exact positions): keep them, and go on from the hidden row
            # the target just computed for the last of them.
            self._last = rows[start - 1 - processed:start - processed]
        first = max(start, processed)
        self._take(prompt[first:], None if rows is None else rows[first - processed:])
        # The prompt's entries run now, as part of the prefill: run with the first proposal
        # instead, they would count as that round's proposing cost (and decode time), and the
        # length policy would take MTP for slower than it is.
        self._flush()

    def propose(self, pending: int, n: int) -> Proposal:
        self._trim_to(self._real)
        self._proposed_for = None
        if n <= 0:
            return Proposal([])
        hidden, tokens = self._drain()
        last = self._last if self._last is not None else self._zeros(1)
        hidden = last if hidden is None else mx.concatenate([hidden, last], axis=0)
        tokens = tokens + [int(pending)]
        g = self._run(hidden, tokens)[:, -1:, :]
        self._real += len(tokens) - 1
        self._proposed_for = int(pending)
        proposed, probs = [], []
        for depth in range(n):
            logits = self._head(g)[0, -1].astype(mx.float32)
            if self._temperature > 0:
                self._key, sub = mx.random.split(self._key)
                scaled = logits / self._temperature
                token = mx.random.categorical(scaled, key=sub)
                probs.append(mx.softmax(scaled, axis=-1))
            else:
                token = mx.argmax(logits, axis=-1)
            proposed.append(token)
            if depth + 1 < n:  # feed back the MTP's own output hidden with the proposed token
                g = self._mtp(self._embed(token.reshape(1, 1)), g, self._cache)
        mx.eval(proposed, probs)
        return Proposal([int_item(t) for t in proposed], mx.stack(probs) if probs else None)

    def commit(self, accepted: list[int], hidden: mx.array | None = None) -> None:
        if not accepted:
            return
        accepted = [int(t) for t in accepted]
        rows = self._rows(hidden, len(accepted))
        first_done = self._proposed_for is not None and accepted[0] == self._proposed_for
        if first_done:
            self._real += 1  # (h_last, pending) was a real entry: the target took pending
        self._trim_to(self._real)
        self._proposed_for = None
        self._take(accepted, rows, first_done=first_done)
        self._bound_queue()

    def consume(self, tokens: list[int], hidden: mx.array | None = None) -> None:
        """Target inputs this source did not propose (constraint-forced tokens, a new user
        turn of a kept conversation), at a committed round boundary: their entries use the
        target's hidden rows when given, else a zero hidden (no re-prefill needed)."""
        self.commit(tokens, hidden)

    def capture(self) -> KVState:
        self._flush()
        return KVState(tokens=list(self._history), cache=_copy_cache(self._cache, self._real))

    def restore(self, state: Any) -> None:
        if not isinstance(state, KVState) or len(state.cache) != 1:
            raise ValueError(f"not an MTP state: {type(state).__name__}")
        offset = state.cache[0].offset
        if offset != len(state.tokens):
            raise ValueError(f"MTP state holds {offset} entries for {len(state.tokens)} tokens")
        self._cache = _copy_cache(state.cache)
        self._real = offset
        self._history = [int(t) for t in state.tokens]
        self._last, self._queue_h, self._queue_t, self._proposed_for = None, [], [], None

    def close(self) -> None:
        self._cache, self._queue_h, self._queue_t, self._last = _new_cache(), [], [], None
        self._history, self._real = [], 0

    # -- introspection (tests, stats) ---------------------------------------------------
    @property
    def kv_entries(self) -> int:
        """Entries in the MTP layer's KV cache (real and speculative)."""
        return self._cache[0].offset

    @property
    def tokens(self) -> int:
        """Target positions this source has taken in."""
        return len(self._history)


class MTPCacheModel:
    """The MTP layer as the prefix cache probes a model for the layout of the KV it stores
    (``make_cache`` and a call on token ids; the hidden input is zeros)."""

    def __init__(self, module: MTPModule, embed_tokens: Any):
        self.module = module
        self.embed_tokens = embed_tokens
        self.layers = module.layers

    def make_cache(self) -> list:
        return _new_cache()

    def __call__(self, inputs: mx.array, cache: list | None = None) -> mx.array:
        e = self.embed_tokens(inputs)
        return self.module(e, mx.zeros(e.shape, dtype=e.dtype), cache if cache is not None else _new_cache())


class MTPProvider(ProposalProvider):
    """The MTP layer of one loaded target."""

    kind = "mtp"
    supports_external_tokens = True  # MTPSource.consume
    needs_hidden = True

    def __init__(self, module: MTPModule, weights: MTPWeights, embed_tokens: Any):

        self.module = module
        self.model = MTPCacheModel(module, embed_tokens)
        self.fingerprint = weights.fingerprint
        self.files = weights.files
        self.weights_bytes = sum(p.nbytes for _, p in named_parameters(module))

    def checkpoint_namespace(self) -> str:
        return f"{MTP_SCHEMA}-{self.fingerprint}"

    def open(self, target: TargetView, sampling: SamplingParams, constraints: Any = None) -> MTPSource:
        return MTPSource(self, target, sampling)


def _declared_layers(config: dict) -> int:
    for cfg in (config, config.get("text_config") or {}):
        for key in ("mtp_num_hidden_layers", "num_nextn_predict_layers"):
            value = cfg.get(key)
            if isinstance(value, int) and value > 0:
                return value
    return 0


def load_mtp_provider(loaded: LoadedModel) -> MTPProvider | None:
    """The MTP provider of ``loaded`` (an ``engine.models.LoadedModel``), or None when its
    checkpoint has no ``mtp.*`` weights. Raises :class:`MTPWeightsError` (a ValueError)
    when they are there but cannot be used. Call on the engine thread."""
    try:
        weights = read_mtp_weights(loaded.path)
    except OSError as e:
        raise MTPWeightsError(f"cannot read the MTP weights in {loaded.path}: {e}") from None
    if weights is None:
        if _declared_layers(loaded.config):
            log.info("%s declares MTP layers but carries no mtp.* weights (a converted checkpoint "
                     "drops them): no MTP drafting", loaded.path)
        return None
    compute = getattr(mx, str(loaded.compute_dtype), None)
    dtype = compute if isinstance(compute, mx.Dtype) and mx.issubdtype(compute, mx.floating) else mx.float32
    model_type = str(loaded.config.get("model_type", ""))
    try:
        module = build_mtp_module(loaded.model, model_type, weights, dtype)
    except MTPWeightsError as e:
        raise MTPWeightsError(f"{loaded.path / weights.files[0]}: {e}") from None
    owner = getattr(loaded.model, "language_model", loaded.model)
    return MTPProvider(module, weights, owner.model.embed_tokens)
