"""Pure numpy + xxhash reference of the ``storage._blocks`` kernels.

Same signatures and errors as the Cython versions; the tests compare the two byte for byte.
Slow but obviously correct: use it as the oracle, or as a stand-in while ``_blocks`` is
not built. A *segment* is ``(buf, outer, t_capacity, row_bytes)`` (see ``storage/_blocks.pyx``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt
import xxhash

from mlxkv.storage.keys import BufferLike, Segment, view

Bytes = npt.NDArray[np.uint8]
_Checked = tuple[Bytes, int, int, int]  # a segment as a flat byte array and its sizes


class Hasher(Protocol):
    """A streaming hash: ``update(buf)`` any number of times, then ``digest()``."""

    def update(self, buf: BufferLike) -> None: ...

    def digest(self) -> int: ...


def xxh3_64(buf: BufferLike, seed: int = 0) -> int:
    """XXH3-64 of a contiguous buffer (the ``xxhash`` package is the definition)."""
    return xxhash.xxh3_64_intdigest(view(buf).cast("B"), seed)


def _as_bytes(buf: BufferLike, writable: bool, what: str) -> Bytes:
    """A flat uint8 view of ``buf`` (no copy); ValueError if not C-contiguous / writable."""
    try:
        mv = view(buf)
    except TypeError as exc:
        raise TypeError(f"{what}: object does not export a buffer: {type(buf).__name__}") from exc
    if not mv.c_contiguous:
        raise ValueError(f"{what}: buffer is not C-contiguous")
    if writable and mv.readonly:
        raise ValueError(f"{what}: buffer is read-only")
    return np.frombuffer(mv.cast("B") if mv.ndim != 1 or mv.format != "B" else mv, dtype=np.uint8)


def _check_segment(i: int, seg: Segment, writable: bool) -> _Checked:
    try:
        buf, outer, t_cap, row_bytes = seg
    except (TypeError, ValueError) as exc:
        raise ValueError(f"segment {i}: expected (buf, outer, t_capacity, row_bytes)") from exc
    outer, t_cap, row_bytes = int(outer), int(t_cap), int(row_bytes)
    if outer < 0 or t_cap < 0 or row_bytes < 0:
        raise ValueError(f"segment {i}: negative dimension ({outer}, {t_cap}, {row_bytes})")
    arr = _as_bytes(buf, writable, f"segment {i}")
    if arr.size != outer * t_cap * row_bytes:
        raise ValueError(
            f"segment {i}: buffer has {arr.size} bytes, expected "
            f"outer*t_capacity*row_bytes = {outer}*{t_cap}*{row_bytes} = {outer * t_cap * row_bytes}"
        )
    return arr, outer, t_cap, row_bytes


def packed_size(segments: Sequence[Segment], ntokens: int) -> int:
    """Bytes a block of ``ntokens`` tokens of these segments occupies when packed."""
    if ntokens < 0:
        raise ValueError(f"ntokens must be >= 0, got {ntokens}")
    total = 0
    for i, seg in enumerate(segments):
        if len(seg) != 4:
            raise ValueError(f"segment {i}: expected (buf, outer, t_capacity, row_bytes)")
        total += int(seg[1]) * ntokens * int(seg[3])
    return total


def _check_range(segs: list[_Checked], t0: int, t1: int) -> None:
    if t0 < 0 or t1 < t0:
        raise ValueError(f"bad token range [{t0}, {t1})")
    for i, (_, _, t_cap, _) in enumerate(segs):
        if t1 > t_cap:
            raise ValueError(f"segment {i}: token range [{t0}, {t1}) exceeds t_capacity {t_cap}")


def _check_flat(flat: Bytes, offset: int, need: int, what: str) -> None:
    if offset < 0 or offset + need > flat.size:
        raise ValueError(
            f"{what}: {need} bytes at offset {offset} do not fit in a buffer of {flat.size} bytes"
        )


def pack(
    dst: BufferLike,
    dst_offset: int,
    segments: Sequence[Segment],
    t0: int,
    t1: int,
    seed: int = 0,
    *,
    hash: bool = True,  # same keyword as the kernel (shadows the builtin here only)
) -> tuple[int, int | None]:
    """Gather rows [t0, t1) of every segment into ``dst`` at ``dst_offset``.

    Returns ``(nbytes_written, xxh3_64(seed) of those bytes)`` (hash None if ``hash=False``).
    """
    segs = [_check_segment(i, s, writable=False) for i, s in enumerate(segments)]
    _check_range([s for s in segs], t0, t1)
    out = _as_bytes(dst, True, "dst")
    n = t1 - t0
    total = sum(o * n * row_bytes for _, o, _, row_bytes in segs)
    _check_flat(out, dst_offset, total, "dst")
    pos = dst_offset
    for arr, outer, t_cap, row_bytes in segs:
        if outer * n * row_bytes == 0:
            continue
        rows = arr.reshape(outer, t_cap * row_bytes)[:, t0 * row_bytes : t1 * row_bytes]
        out[pos : pos + rows.size] = rows.reshape(-1)
        pos += rows.size
    if not hash:
        return total, None
    return total, xxh3_64(out[dst_offset : dst_offset + total], seed)


def _check_disjoint(segs: list[_Checked]) -> None:
    """Destinations must not share bytes (a later scatter would overwrite an earlier one)."""
    spans = sorted((a.__array_interface__["data"][0], a.size, i) for i, (a, *_) in enumerate(segs) if a.size)
    for (p0, n0, i0), (p1, _, i1) in zip(spans, spans[1:]):
        if p1 < p0 + n0:
            raise ValueError(f"segment {i1} overlaps segment {i0} (destinations must be disjoint)")


def unpack(
    src: BufferLike, src_offset: int, segments: Sequence[Segment], dst_t0: int, ntokens: int
) -> int:
    """Scatter a packed block from ``src`` into rows [dst_t0, dst_t0+ntokens) of each segment.

    Returns the number of bytes read from ``src``. Segments must be writable and disjoint.
    """
    if ntokens < 0:
        raise ValueError(f"ntokens must be >= 0, got {ntokens}")
    segs = [_check_segment(i, s, writable=True) for i, s in enumerate(segments)]
    _check_disjoint(segs)
    _check_range(segs, dst_t0, dst_t0 + ntokens)
    inp = _as_bytes(src, False, "src")
    total = sum(o * ntokens * row_bytes for _, o, _, row_bytes in segs)
    _check_flat(inp, src_offset, total, "src")
    pos = src_offset
    for arr, outer, t_cap, row_bytes in segs:
        size = outer * ntokens * row_bytes
        if size == 0:
            continue
        rows = arr.reshape(outer, t_cap * row_bytes)
        rows[:, dst_t0 * row_bytes : (dst_t0 + ntokens) * row_bytes] = inp[pos : pos + size].reshape(
            outer, ntokens * row_bytes
        )
        pos += size
    return total


def unpack_hash(
    src: BufferLike, src_offset: int, segments: Sequence[Segment], dst_t0: int, ntokens: int,
    seed: int = 0, *, hasher: Hasher | None = None,
) -> tuple[int, int]:
    """``unpack``, then xxh3_64(seed) of the bytes as they landed in the segments:
    ``(nbytes, hash)``. With ``hasher`` (``update(buf)``, ``digest() -> int``) the landed
    bytes are fed to it instead and the hash is ``hasher.digest()``."""
    segments = list(segments)
    n = unpack(src, src_offset, segments, dst_t0, ntokens)
    landed = np.empty(n, np.uint8)
    pack(landed, 0, segments, dst_t0, dst_t0 + ntokens, hash=False)
    if hasher is None:
        return n, xxh3_64(landed, seed)
    hasher.update(landed)
    return n, hasher.digest()
