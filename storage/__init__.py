"""mlxkv storage: block format, block store, writer/reader threads, Cython kernels.

Knows nothing of mlx: it moves bytes described by buffers, shapes, dtypes and token ids.
Names are loaded on first use so ``import mlxkv.storage`` stays cheap.
"""

from __future__ import annotations

if __name__ != "mlxkv.storage":  # this checkout's folder, imported by its folder name
    raise ImportError(f"import mlxkv.storage, not {__name__}: the folder storage/ is the subpackage "
                      "mlxkv.storage, and a second copy under another name would not share its state")

import importlib
from typing import Any

_EXPORTS = {
    "BlockStore": "mlxkv.storage.store", "Match": "mlxkv.storage.store", "PutResult": "mlxkv.storage.store",
    "Restore": "mlxkv.storage.store", "StoreWriteError": "mlxkv.storage.store",
    "CacheFolderError": "mlxkv.storage.keys",
    "SegmentSpec": "mlxkv.storage.format", "make_layout": "mlxkv.storage.format",
    "FormatError": "mlxkv.storage.format", "UnknownVersion": "mlxkv.storage.format",
    "Manifest": "mlxkv.storage.format",
    "StorageIO": "mlxkv.storage.io", "WriteRequest": "mlxkv.storage.io", "ReadRequest": "mlxkv.storage.io",
    "WriteQueueFull": "mlxkv.storage.io", "StorageClosed": "mlxkv.storage.io",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'storage' has no attribute {name!r}")
    return getattr(importlib.import_module(mod), name)
