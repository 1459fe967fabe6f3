"""Compiled MLX functions whose traces are counted and bounded."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Hashable
from typing import Any

import mlx.core as mx

MAX_TRACES = 64  # input shapes one compiled function keeps traces for before it starts afresh


class Traced:
    """``mx.compile(fn)`` with its traces counted and bounded. MLX keeps one trace per
    input shape for as long as the compiled function lives (a step of the real model holds
    megabytes) and cannot be asked how many it holds; a server that sees every context
    length would pile them up. Each call names its shape (``key``); when one more shape
    would pass ``limit``, the compiled function is made anew, which frees every trace, and
    the shapes in use are traced again as they come."""

    def __init__(self, fn: Callable[..., Any], name: str, limit: int = MAX_TRACES):
        self.name, self.limit = name, limit
        self._source = fn
        self._fn = mx.compile(fn)
        self.shapes: set[Hashable] = set()
        self.resets = 0
        with _LOCK:
            _TRACED.add(self)

    def __call__(self, key: Hashable, *args: mx.array) -> Any:
        if key not in self.shapes:
            if len(self.shapes) >= self.limit:
                self._fn = mx.compile(self._source)
                self.shapes.clear()
                self.resets += 1
            self.shapes.add(key)
        return self._fn(*args)


_TRACED: weakref.WeakSet[Traced] = weakref.WeakSet()
_LOCK = threading.Lock()  # compiled functions are made on engine threads, counted on others


def trace_figures() -> dict[str, dict[str, int]]:
    """This process's compiled functions by name: how many there are, the traces they hold
    (at most ``limit`` each) and how often one started afresh."""
    out: dict[str, dict[str, int]] = {}
    with _LOCK:
        traced = list(_TRACED)
    for t in traced:
        f = out.setdefault(t.name, {"functions": 0, "traces": 0, "limit": t.limit, "resets": 0})
        f["functions"] += 1
        f["traces"] += len(t.shapes)
        f["resets"] += t.resets
    return out
