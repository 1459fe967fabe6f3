"""One prefill chunk evaluated one layer's cache at a time, so that a request can stop
inside a chunk: between two layers a callback may raise (a cancelled request), and the
cache then goes back to what it held before the chunk, with every earlier chunk kept.

MLX builds a chunk's forward pass as a lazy graph; evaluating layer ``i``'s cache state
computes that layer's keys and values and what they depend on (the layers below), and
no more. Evaluating the states in layer order and then the chunk's output runs the very
same operations on the very same inputs as one evaluation of everything, so the KV rows
and the logits are bit for bit the same (``tests/test_prefill_cancel.py`` checks it on
dense, sliding-window, hybrid and SSM models); only the evaluation order changes.

Rolling back a layer: the chunk's graph was built before anything of it ran, and
``KVCache``/``QuantizedKVCache`` write a chunk's rows in place into the buffer they
already hold (MLX reuses a buffer nobody else holds). So before the graph is built each
layer's state is kept as new array handles over its current buffers: an unevaluated
layer gets them back (its half-built update is dropped unrun). A layer that writes in
place lets go of its kept handles just before it is evaluated, so its write still reuses
the buffer; once evaluated, it gives the chunk back by trimming its offset. Every other
kind of layer (rotating windows, SSM state: small, or copied by their own update
anyway) keeps its handles and is restored from them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

# Layers whose chunk update writes in place and whose trim drops exactly the last rows
# (a batch's: the pass's rows of every batch row, its right padding included).
TRIM_IN_PLACE = ("KVCache", "QuantizedKVCache", "BatchKVCache")


def _handles(state: Any) -> Any:
    """``state`` with every array replaced by a new handle over the same buffer (no copy),
    lists and tuples rebuilt: what an in-place write to the live state cannot change."""
    import mlx.core as mx

    if isinstance(state, mx.array):
        return copy.copy(state)
    if isinstance(state, (list, tuple)):
        return type(state)(_handles(s) for s in state)
    return state


class LayerSteps:
    """The layer-by-layer evaluation of one chunk of ``tokens`` new tokens into ``cache``:
    make it before the chunk's forward pass is built, then :meth:`run`."""

    def __init__(self, cache: Sequence[Any], tokens: int):
        self.cache = list(cache)
        self.tokens = tokens
        self.in_place = [type(c).__name__ in TRIM_IN_PLACE for c in self.cache]
        self.kept: list[Any] = [_handles(c.state) for c in self.cache]

    def run(self, between: Callable[[int, int], None]) -> None:
        """Evaluate each layer's cache state in order, calling ``between(done, layers)``
        after each; if it (or an evaluation) raises, put the cache back as it was before
        the chunk and re-raise."""
        import mlx.core as mx

        layers = len(self.cache)
        done = 0
        try:
            for i, c in enumerate(self.cache):
                if self.in_place[i]:
                    self.kept[i] = None  # its write reuses the buffer (trimmed on rollback)
                mx.eval(c.state)
                done = i + 1
                between(done, layers)
        except BaseException:
            self.rollback(done)
            raise
        self.kept = []

    def rollback(self, evaluated: int) -> None:
        """The first ``evaluated`` layers hold the chunk: every layer goes back to before it."""
        for i, c in enumerate(self.cache):
            kept = self.kept[i]
            if kept is None:  # written in place: evaluated (or failing while it was)
                c.trim(self.tokens)
            else:
                c.state = kept
        self.kept = []
