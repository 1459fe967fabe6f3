"""mlxkv storage: block format, block store, writer/reader threads, Cython kernels.

Knows nothing of mlx: it moves bytes described by buffers, shapes, dtypes and token ids.
Names are loaded on first use so ``import storage`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "BlockStore": "storage.store", "Match": "storage.store", "PutResult": "storage.store",
    "Restore": "storage.store", "StoreWriteError": "storage.store",
    "CacheFolderError": "storage.keys",
    "SegmentSpec": "storage.format", "make_layout": "storage.format",
    "FormatError": "storage.format", "UnknownVersion": "storage.format",
    "Manifest": "storage.format",
    "StorageIO": "storage.io", "Snapshot": "storage.io", "ReadRequest": "storage.io",
    "WriteQueueFull": "storage.io", "StorageClosed": "storage.io",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'storage' has no attribute {name!r}")
    return getattr(importlib.import_module(mod), name)
