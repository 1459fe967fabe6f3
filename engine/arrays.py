"""Python values out of MLX arrays, typed: mlx types ``item()`` and ``tolist()`` as any
scalar or nested list, where the engine knows the dtype and the shape it reads."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:  # no mlx import at run time: importing this module stays light
    import mlx.core as mx


def int_item(a: mx.array) -> int:
    """The integer a one-element array holds (a token id, a count)."""
    return int(cast(float, a.item()))


def float_item(a: mx.array) -> float:
    """The number a one-element float array holds."""
    return cast(float, a.item())


def int_list(a: mx.array) -> list[int]:
    """The values of a 1-D integer array."""
    return cast("list[int]", a.tolist())


def int_rows(a: mx.array) -> list[list[int]]:
    """The rows of a 2-D integer array."""
    return cast("list[list[int]]", a.tolist())


def float_list(a: mx.array) -> list[float]:
    """The values of a 1-D float array."""
    return cast("list[float]", a.tolist())


def named_parameters(module: Any) -> list[tuple[str, mx.array]]:
    """A module's parameters as (dotted name, array) pairs (``mlx.utils.tree_flatten``, typed
    as a list or a dict: a list for a module's parameters)."""
    from mlx.utils import tree_flatten

    return cast("list[tuple[str, mx.array]]", tree_flatten(module.parameters()))
