"""Token ids and the keys both tiers index them by.

The chain keys are the block store's own (``storage.keys.block_key`` / ``tail_key``: one
definition), so a prompt hashed for the RAM tier names exactly the blocks the SSD tier
holds. The RAM tier's indices keyed by parent (partial-block matches, checkpoints) use
:func:`index_root` as the parent of a namespace's first block, so no such index is shared
between namespaces (the store's key chain starts from the all-zero key instead).
"""

from __future__ import annotations

import re

import numpy as np
import xxhash
from numpy.typing import ArrayLike

from mlxkv.storage.keys import ZERO_KEY, block_key, ckpt_key, namespace_id, tail_key

__all__ = ["ZERO_KEY", "as_tokens", "chain_keys", "ckpt_key_of", "common_prefix", "entry_id",
           "index_root", "manifest_name", "store_namespace", "tail_key_of"]

_STORE_NS = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def as_tokens(tokens: ArrayLike) -> np.ndarray:
    """Token ids as a contiguous little-endian uint32 array; ValueError naming the problem
    otherwise."""
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be a flat sequence of ids, got shape {arr.shape}")
    if arr.size and (arr.dtype.kind not in "iu"):
        raise ValueError(f"token ids must be integers, got dtype {arr.dtype}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > 0xFFFFFFFF):
        raise ValueError("token ids must be in [0, 2**32)")
    return np.ascontiguousarray(arr, dtype="<u4")


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two token arrays."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def store_namespace(ns: str) -> str:
    """The block store's folder name for an engine namespace (readable, collision-free)."""
    if not isinstance(ns, str) or not ns:
        raise ValueError(f"namespace must be a non-empty string, got {ns!r}")
    if _STORE_NS.match(ns):
        return ns
    clean = re.sub(r"[^A-Za-z0-9._-]", "_", ns).lstrip("._-")[:100] or "ns"
    return f"{clean}-{xxhash.xxh3_64_hexdigest(ns.encode())}"


def index_root(store_ns: str) -> bytes:
    """Parent of a namespace's first block in the RAM tier's parent-keyed indices."""
    return namespace_id(store_ns)


def chain_keys(store_ns: str, tokens: np.ndarray, block_tokens: int) -> list[bytes]:
    """Chain keys of every full block of ``tokens`` in store namespace ``store_ns`` (the same
    keys ``storage.store.BlockStore.chain_keys`` gives)."""
    nsid = namespace_id(store_ns)
    keys: list[bytes] = []
    parent = ZERO_KEY
    for i in range(len(tokens) // block_tokens):
        parent = block_key(parent, nsid, tokens[i * block_tokens : (i + 1) * block_tokens])
        keys.append(parent)
    return keys


def tail_key_of(store_ns: str, parent: bytes, tokens: np.ndarray) -> bytes:
    """Key of a partial block (``parent``: the chain key before it, ZERO_KEY for none)."""
    return tail_key(parent, namespace_id(store_ns), tokens)


def ckpt_key_of(store_ns: str, tokens: np.ndarray, block_tokens: int) -> bytes:
    """Key of the checkpoint of exactly ``tokens`` (as the block store names it)."""
    keys = chain_keys(store_ns, tokens, block_tokens)
    return ckpt_key(keys[-1] if keys else ZERO_KEY, namespace_id(store_ns),
                    tokens[len(keys) * block_tokens :])


def entry_id(store_ns: str, tokens: np.ndarray) -> str:
    """Stable id of a stored state: the same (namespace, tokens) in every process."""
    return xxhash.xxh3_64_hexdigest(namespace_id(store_ns) + tokens.tobytes())


def manifest_name(entry_id: str) -> str:
    """The manifest that names a stored state on disk (so GC keeps what it needs)."""
    return f"c-{entry_id}"
