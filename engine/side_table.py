"""Values kept for objects of other code (a model's compiled steps, its weight layout, how its
head splits off; an engine's measured weights), held beside the object instead of as
attributes set on it."""

from __future__ import annotations

import weakref
from typing import Generic, TypeVar

T = TypeVar("T")


class SideTable(Generic[T]):
    """One value per object, for as long as the object lives. Keyed by identity (an mlx
    ``nn.Module`` is a dict, so not hashable) and dropped by a weak reference's callback when
    the object goes; a value must therefore not hold its object strongly, or the object
    would never go."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref[object], T]] = {}

    def get(self, obj: object) -> T | None:
        """The value kept for ``obj``, or None."""
        entry = self._entries.get(id(obj))
        if entry is None or entry[0]() is not obj:
            return None
        return entry[1]

    def put(self, obj: object, value: T) -> None:
        """Keep ``value`` for ``obj`` until the object is collected."""
        key = id(obj)
        entries = self._entries

        def drop(ref: weakref.ref[object]) -> None:
            entry = entries.get(key)
            if entry is not None and entry[0] is ref:
                del entries[key]

        entries[key] = (weakref.ref(obj, drop), value)
