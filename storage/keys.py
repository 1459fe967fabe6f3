"""Vocabulary of the block store: chain keys, token and segment validation, and the
records its calls return. No I/O, no mlx."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt
import xxhash

from mlxkv.storage.format import KIND_BLOCK, KIND_CHECKPOINT, KIND_TAIL, Layout, TokenIds

ZERO_KEY = bytes(16)
NS_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
EXT = {KIND_BLOCK: ".blk", KIND_TAIL: ".tail", KIND_CHECKPOINT: ".ckpt"}


class Buffer(Protocol):
    """Anything with the buffer protocol (``memoryview(buf)`` works)."""

    def __buffer__(self, flags: int, /) -> memoryview: ...


# A caller's buffer. numpy declares the buffer protocol of its arrays to type checkers
# only from Python 3.12, so arrays are named beside it.
BufferLike = Buffer | npt.NDArray[np.generic]

# (buf, outer, t_capacity, row_bytes): one per SegmentSpec of a layout
Segment = tuple[BufferLike, int, int, int]


def view(buf: BufferLike) -> memoryview:
    """``memoryview(buf)`` of a caller's buffer."""
    return memoryview(buf)  # type: ignore[arg-type]  # numpy arrays: see BufferLike


class StoreWriteError(OSError):
    """A write that could not complete; nothing partial of it is left on disk."""


class CacheFolderError(RuntimeError):
    """The cache folder cannot be used (missing marker over foreign files, read-only, a
    file or a symlink where a folder or the lock should be...). The message says what is
    wrong and what to do; callers fall back to running without the SSD tier."""


@dataclass(frozen=True)
class Match:
    """The longest cached prefix of a token sequence (from the index alone)."""

    ns: str
    n_tokens: int
    block_keys: tuple[bytes, ...]
    tail_key: bytes | None = None
    tail_tokens: int = 0  # tokens used from the tail (a prefix of it)
    nbytes: int = 0  # payload bytes a restore reads
    layout: Layout | None = None  # the stored layout (to allocate destinations after a restart)
    checkpoint_key: bytes | None = None  # set by lookup_checkpoint


@dataclass(frozen=True)
class PutResult:
    n_tokens: int
    blocks_written: int
    blocks_present: int  # deduplicated: already on disk, not rewritten
    tail_written: bool
    bytes_written: int
    keys: tuple[bytes, ...]


@dataclass(frozen=True)
class Restore:
    n_tokens: int  # rows [0, n_tokens) of the destination are verified state
    requested: int
    blocks_read: int
    bytes_read: int
    corrupt: int  # blocks that failed verification (removed)
    missing: int  # blocks whose file had vanished


def token_ids(toks: npt.ArrayLike) -> TokenIds:
    """Token ids as contiguous little-endian uint32 (what keys and headers hash)."""
    arr = np.asarray(toks)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"tokens must be integers, got {arr.dtype}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= 1 << 32):
        raise ValueError("token ids must be in [0, 2**32)")
    return np.ascontiguousarray(arr, dtype="<u4")


def usable(toks: TokenIds, max_tokens: int | None) -> int:
    """How many of ``toks`` a lookup may use (``max_tokens`` clamped to [0, len])."""
    return toks.size if max_tokens is None else max(0, min(toks.size, int(max_tokens)))


def common(a: TokenIds, b: TokenIds) -> int:
    """Length of the common prefix of two token arrays."""
    m = min(a.size, b.size)
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if diff.size else m


def namespace_id(ns: str) -> bytes:
    return xxhash.xxh3_128_digest(ns.encode())


def check_namespace(ns: str) -> str:
    if not isinstance(ns, str) or not NS_RE.match(ns):
        raise ValueError(
            f"namespace {ns!r} must be 1-128 characters of letters, digits, '.', '_' or '-'"
        )
    return ns


KeyFn = Callable[[bytes, bytes, "TokenIds | bytes"], bytes]


def _keyed(domain: bytes) -> KeyFn:
    def key(parent: bytes, nsid: bytes, toks: TokenIds | bytes) -> bytes:
        raw = toks if isinstance(toks, bytes) else toks.tobytes()
        return xxhash.xxh3_128_digest(b"".join((domain, parent, nsid, raw)))

    return key


# Chain key: hash of (kind domain, parent key, namespace id, little-endian uint32 token ids).
block_key = _keyed(b"mlxkv/block/1")
tail_key = _keyed(b"mlxkv/tail/1")
ckpt_key = _keyed(b"mlxkv/ckpt/1")
KEY_FN = {KIND_BLOCK: block_key, KIND_TAIL: tail_key, KIND_CHECKPOINT: ckpt_key}


def check_segments(layout: Layout, segments: Sequence[Segment], ntokens: int,
                   writable: bool = False) -> list[Segment]:
    """Validate caller segments against ``layout``; -> [(buf, outer, t_cap, row_bytes)]."""
    if len(segments) != len(layout):
        raise ValueError(f"{len(segments)} segments for a layout of {len(layout)}")
    out: list[Segment] = []
    for spec, seg in zip(layout, segments):
        try:
            buf, outer, t_cap, row_bytes = seg
        except (TypeError, ValueError) as exc:
            raise ValueError(f"segment {spec.name}: expected (buf, outer, t_capacity, row_bytes)") from exc
        if int(outer) != spec.outer or int(row_bytes) != spec.row_bytes:
            raise ValueError(f"segment {spec.name}: outer/row_bytes ({outer}, {row_bytes}) do not match "
                             f"the layout ({spec.outer}, {spec.row_bytes})")
        if int(t_cap) < ntokens:
            raise ValueError(f"segment {spec.name}: t_capacity {t_cap} < {ntokens} tokens")
        if writable and view(buf).readonly:
            raise ValueError(f"segment {spec.name}: destination buffer is read-only")
        out.append((buf, int(outer), int(t_cap), int(row_bytes)))
    return out
