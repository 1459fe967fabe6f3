"""The prefix cache: RAM tier, SSD tier (through ``storage``), write-behind durability,
the mapping of mlx-lm prompt caches onto blocks, and restore buffers.

    from mlxkv.engine.cache import PrefixCache, NullPrefixCache

The names are loaded on first use, so importing a light submodule (``tokens``, ``info``)
does not load mlx.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlxkv.engine.cache.prefix_cache import NullPrefixCache, PrefixCache

_EXPORTS = {"PrefixCache": "mlxkv.engine.cache.prefix_cache",
            "NullPrefixCache": "mlxkv.engine.cache.prefix_cache"}

__all__ = ["PrefixCache", "NullPrefixCache"]  # the keys of _EXPORTS


def __getattr__(name: str) -> object:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'mlxkv.engine.cache' has no attribute {name!r}")
    return getattr(importlib.import_module(mod), name)
