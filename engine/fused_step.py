"""One pass for a batch step's decoding rows and the next chunk of a prompt beside them.

A batch step with a prompt prefilling beside decoding rows ran the model twice: the rows'
decode step, then the chunk. Each pass reads every weight, and on a CPU a decode pass is
bound by that read (plus its per-op overhead), so every such step cost a whole decode step
on top of the chunk, and the rows' next token waited for both. :class:`FusedStep` runs the
two as one forward over ``[1, rows + chunk]`` tokens, the scheme of Sarathi-Serve's fused
batches: the linear layers multiply the rows' tokens with the chunk's in one product
(the chunk's is compute-bound, so the rows ride along almost free), and each attention
layer splits the queries again. A :class:`FusedKV` layer writes the rows' new keys into the
batch's ``BatchKVCache`` and the chunk's into the prompt's, then attends the rows over their
slots (``native_ops.slot_attention``, or mlx-lm's attention with the batch's mask) and the
chunk causally over its prompt (``engine.cpu_attention`` or mlx-lm's).

The model's code runs unchanged, with two things it reaches shadowed for good on each module
(instance attributes over the module's children, so the parameter tree is untouched; a plain
call passes straight through):

- each attention module's ``rope`` (:class:`_SplitRope`): a fused pass hands it a
  :class:`Positions` as its offset, and it rotates the rows' queries and keys at each row's
  own position (the batch's per-row offsets) and the chunk's from the prompt's position;
- the inner model's final ``norm`` (:class:`_RowsNorm`): in a fused pass it keeps only the rows'
  positions, so the head (49,152 x 576 on the real model) multiplies the rows alone.

It applies to one prompt row without left padding beside rows of plain ``BatchKVCache`` layers
(the case a stream meets while another request prefills); anything else runs the two passes.
The first fused pass of each model is checked against the two passes from the same caches
(log-probabilities and the chunk's keys within :data:`~engine.compiled_step.TOLERANCE`, the
same greedy tokens); an architecture that differs or does not run keeps the two passes, with
one debug line. ``MLXKV_FUSED_STEP=0`` switches it off.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np

from mlxkv.engine import cpu_attention
from mlxkv.engine.compiled_step import TOLERANCE, agrees
from mlxkv.engine.native_ops import slot_attention

log = logging.getLogger("mlxkv.engine")

ENABLED = os.environ.get("MLXKV_FUSED_STEP", "1") != "0"


class Unfusable(Exception):
    """The model does something a fused pass cannot split (a sliding window, attention
    sinks): the step runs as two passes."""


class Positions:
    """What a fused pass's layers hand their ``rope`` as the offset: the first ``rows`` tokens
    are the decoding rows, the rest the chunk; ``at`` ([rows + n], int32) is each token's
    position (each row's own, then the chunk's from its prompt's)."""

    __slots__ = ("rows", "at")

    def __init__(self, rows: int, rows_at: mx.array, chunk_at: mx.array, n: int):
        self.rows = rows
        self.at = mx.concatenate([rows_at.astype(mx.int32),
                                  chunk_at.astype(mx.int32) + mx.arange(n, dtype=mx.int32)])


def _rows_first(x: mx.array, rows: int) -> mx.array:
    """[1, H, rows + n, D] -> the rows as a batch: [rows, H, 1, D]."""
    return x[0, :, :rows, :].transpose(1, 0, 2)[:, :, None, :]


def _rows_back(x: mx.array) -> mx.array:
    """[rows, H, 1, D] -> [1, H, rows, D]."""
    return x[:, :, 0, :].transpose(1, 0, 2)[None]


class _SplitRope:
    """An attention module's ``rope``, shadowed: with a :class:`Positions` offset every token
    is rotated at its own position (the tokens made a batch of one-token rows, which the
    rope takes an offset per row for); any other call is the rope's own."""

    def __init__(self, rope: Any):
        self.rope = rope

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        if not isinstance(offset, Positions):
            return self.rope(x, offset=offset)
        return _rows_back(self.rope(_rows_first(x, x.shape[2]), offset=offset.at))


class _RowsNorm:
    """The inner model's final ``norm``, shadowed: while ``rows`` is set (a fused pass) it
    normalizes only the first ``rows`` positions, the decoding rows', so the head runs on
    those alone."""

    def __init__(self, norm: Any):
        self.norm = norm
        self.rows: int | None = None

    def __call__(self, x: mx.array) -> mx.array:
        if self.rows is not None:
            x = x[:, :self.rows]
        return self.norm(x)


class FusedKV:
    """One attention layer of a fused pass: ``rows`` one-token decoding rows over ``batch``
    (a ``BatchKVCache``) and the chunk after them over ``prompt`` (a one-row ``BatchKVCache``
    without left padding)."""

    def __init__(self, batch: Any, prompt: Any, positions: Positions):
        self.batch, self.prompt = batch, prompt
        self.offset = positions
        self.rows = positions.rows
        self._written: tuple | None = None

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> None:
        if window_size is not None:
            raise Unfusable("a sliding-window layer")
        return None  # each half attends with its own (see attend)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        rows, batch = self.rows, self.batch
        at = batch.state[4]  # the rows' new slot (the write index)
        mask = batch.make_mask(1)  # (unevaluated unless the fallback attention takes it)
        row_keys, row_values = batch.update_and_fetch(_rows_first(keys, rows), _rows_first(values, rows))
        chunk_keys, chunk_values = self.prompt.update_and_fetch(keys[:, :, rows:, :], values[:, :, rows:, :])
        self._written = (at, mask, row_keys, row_values, chunk_keys, chunk_values)
        return keys, values  # the model hands these to its attention, which calls attend

    def attend(self, queries: mx.array, scale: float, sinks: Any = None) -> mx.array:
        """The layer's attention: the rows over their batch slots, the chunk causally over its
        prompt, side by side as [1, H, rows + n, D]."""
        if sinks is not None:
            raise Unfusable("attention sinks")
        assert self._written is not None, "attend before update_and_fetch"
        at, mask, row_keys, row_values, chunk_keys, chunk_values = self._written
        rows, batch = self.rows, self.batch
        q = _rows_first(queries, rows)
        out = slot_attention(q, batch.keys, batch.values, mx.array([at], dtype=mx.int32), scale,
                             start=batch.left_padding.astype(mx.int32))
        if out is None:
            out = _attention(q, row_keys, row_values, batch, scale, mask)
        chunk = _attention(queries[:, :, rows:, :], chunk_keys, chunk_values, self.prompt, scale, "causal")
        return mx.concatenate([_rows_back(out), chunk], axis=2)


def _attention(queries: mx.array, keys: mx.array, values: mx.array, cache: Any, scale: float,
               mask: Any) -> mx.array:
    """One half's attention: the engine's CPU attention where it applies, else mlx-lm's."""
    from mlx_lm.models.base import scaled_dot_product_attention

    if cpu_attention.applies(queries, keys, mask):
        return cpu_attention.attention(queries, keys, values, scale, mask)
    return scaled_dot_product_attention(queries, keys, values, cache=cache, scale=scale, mask=mask)


def fusable(batch: list, prompt: list) -> bool:
    """Whether a fused pass takes these layers: plain ``BatchKVCache`` layers on both sides,
    the prompt one row without left padding."""
    from mlx_lm.models.cache import BatchKVCache

    if not batch or len(batch) != len(prompt):
        return False
    if any(type(c) is not BatchKVCache or c.keys is None for c in batch):
        return False
    if any(type(c) is not BatchKVCache for c in prompt):
        return False
    padding = prompt[0].left_padding
    return padding.size == 1 and padding.item() == 0


def _routed(attention: Any) -> bool:
    """Whether an attention module's architecture calls the engine's attention
    (``mlx_lm_compat.install_attention``), which hands a :class:`FusedKV` layer to
    :meth:`FusedKV.attend`; mlx-lm's own would attend over the keys it is given."""
    import sys

    from mlx_lm.models import base

    module = sys.modules.get(type(attention).__module__)
    found = getattr(module, "scaled_dot_product_attention", None)
    return found is not None and found is not base.scaled_dot_product_attention


def _shadow(module: Any, name: str, make: Callable[[Any], Any]) -> Any:
    """``module.name`` shadowed by ``make(original)`` (once: a second call finds it)."""
    current = module.__dict__.get(name)
    if current is not None:
        return current
    wrapped = make(getattr(module, name))
    object.__setattr__(module, name, wrapped)
    return wrapped


class FusedStep:
    """A model's fused passes (one per model, kept beside its batch step). ``enabled`` is
    None until the first fused pass was checked against the two passes, then whether it
    matched; False from the start for a model whose modules do not fit."""

    def __init__(self, model: Any, label: str = "the model"):
        self.model = model
        self.label = label
        self.enabled: bool | None = None if ENABLED else False
        self.norm: _RowsNorm | None = None
        if self.enabled is None and not self._install(model):
            self.enabled = False

    def _install(self, model: Any) -> bool:
        inner = getattr(model, "model", None)
        layers = getattr(inner, "layers", None)
        if inner is None or not layers or getattr(inner, "norm", None) is None:
            log.debug("%s: no inner model with layers and a final norm: no fused steps", self.label)
            return False
        attentions = [m for _, m in model.named_modules() if "rope" in m and callable(m["rope"])]
        if not attentions or not _routed(attentions[0]):
            log.debug("%s: its attention is mlx-lm's own (the engine's CPU attention is off): "
                      "no fused steps", self.label)
            return False
        if len(attentions) < len(layers):
            log.debug("%s: %d of %d layers have a rope module: no fused steps", self.label,
                      len(attentions), len(layers))
            return False
        for m in attentions:
            _shadow(m, "rope", _SplitRope)
        self.norm = _shadow(inner, "norm", _RowsNorm)
        return True

    def forward(self, tokens: mx.array, chunk: list[int], batch: list, prompt: list) -> mx.array:
        """The rows' logits ([rows, 1, V], unevaluated) for their ``tokens`` ([rows, 1]) over
        the ``batch`` layers, with ``chunk`` fed into the ``prompt`` layers in the same pass."""
        rows = tokens.shape[0]
        positions = Positions(rows, batch[0].offset, prompt[0].offset, len(chunk))
        layers = [FusedKV(b, p, positions) for b, p in zip(batch, prompt)]
        x = mx.concatenate([tokens.reshape(1, rows), mx.array(chunk, dtype=tokens.dtype)[None]], axis=1)
        assert self.norm is not None
        self.norm.rows = rows
        try:
            logits = self.model(x, cache=layers)
        finally:
            self.norm.rows = None
        return logits[0][:, None, :]

    def check(self, tokens: mx.array, chunk: list[int], batch: list, prompt: list,
              two_passes: Callable[[], mx.array]) -> mx.array:
        """The first fused pass, checked: run fused, undo it, run ``two_passes()`` (the rows'
        step, then the chunk) from the same caches; ``enabled`` says whether the two agreed.
        Returns the two passes' logits, which the caches now hold the state of."""
        at, n = prompt[0].state[4], len(chunk)
        marks = [(c, c.state[4]) for c in (*batch, *prompt)]

        def undo() -> None:
            for c, idx in marks:
                c.trim(c.state[4] - idx)

        try:
            got = self.forward(tokens, chunk, batch, prompt)
            mx.eval(got, [c.state for c in batch], [c.state for c in prompt])
            got_keys = [np.array(c.keys[..., at:at + n, :].astype(mx.float32)) for c in prompt]
        except Exception as e:  # an architecture the fused layers cannot run
            log.debug("%s: no fused steps (%s: %s)", self.label, type(e).__name__, e)
            self.enabled = False
            undo()
            return two_passes()
        undo()
        want = two_passes()
        mx.eval(want, [c.state for c in prompt])
        agreed, diff, same = agrees([got[:, 0]], [want[:, 0]])
        key_diff = max(float(np.abs(g - np.array(c.keys[..., at:at + n, :].astype(mx.float32))).max())
                       for g, c in zip(got_keys, prompt))
        self.enabled = ok = agreed and key_diff <= TOLERANCE
        if not ok:
            log.debug("%s: the fused step differs from two passes (log-probabilities by %g, keys by %g, "
                      "greedy tokens %s); steps with prefill run two passes", self.label, diff, key_diff,
                      "the same" if same else "differ")
        return want
