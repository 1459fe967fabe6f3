"""Read a GGUF file's header (metadata and tensor table) with every count and length
checked against the file's size, before anything else (mlx's own reader included) sees it."""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# Caps well above any real file (a 400B model has a few thousand tensors and ~40 keys; a
# vocabulary ~260k tokens), so a hostile count fails here instead of allocating for it.
MAX_TENSORS = 1 << 17
MAX_KEYS = 1 << 16
MAX_KEY_BYTES = 1 << 16
MAX_STRING_BYTES = 1 << 26
MAX_ARRAY_ITEMS = 1 << 24
MAX_STRING_ITEMS = 1 << 21
MAX_DIMS = 4

# ggml tensor types: id -> (name, elements per block, bytes per block).
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2),
    26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17), 40: ("NVFP4", 64, 36), 41: ("Q1_0", 128, 18),
}

# Metadata value types: id -> (struct format, size) for the fixed-size ones.
_SCALARS: dict[int, tuple[str, int]] = {
    0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
    6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8),
}
_NUMPY_DTYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4",
                 7: "<u1", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9


class GGUFError(ValueError):
    """The file is not a GGUF file this loader can read; the message says why."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the table: ``shape`` in numpy order (outermost first)."""

    name: str
    type_id: int
    shape: tuple[int, ...]
    offset: int  # from the start of the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return GGML_TYPES[self.type_id][0]


@dataclass
class GGUFHeader:
    """What a GGUF file says before its tensor data."""

    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    alignment: int
    data_offset: int
    file_size: int
    types: dict[str, int] = field(default_factory=dict)  # metadata key -> value type id

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)


class _Cursor:
    def __init__(self, buf: mmap.mmap | bytes, path: Path):
        self.buf, self.pos, self.size, self.path = buf, 0, len(buf), path

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise GGUFError(f"{self.path}: truncated GGUF file: {what} needs {n} bytes at "
                            f"offset {self.pos}, the file has {self.size}")

    def scalar(self, fmt: str, size: int, what: str) -> Any:
        self.need(size, what)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return v

    def u32(self, what: str) -> int:
        return self.scalar("<I", 4, what)

    def u64(self, what: str) -> int:
        return self.scalar("<Q", 8, what)

    def string(self, what: str, cap: int = MAX_STRING_BYTES) -> str:
        n = self.u64(what + " length")
        if n > cap:
            raise GGUFError(f"{self.path}: {what} is {n} bytes long (at most {cap} accepted)")
        self.need(n, what)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFError(f"{self.path}: {what} is not valid UTF-8") from None


_U64 = struct.Struct("<Q").unpack_from


def _strings(cur: _Cursor, count: int, key: str) -> list[str]:
    """``count`` strings (a vocabulary: ~100k of them), read in one tight loop."""
    buf, pos, size = cur.buf, cur.pos, cur.size
    out: list[str] = []
    append = out.append
    try:
        for i in range(count):
            if pos + 8 > size:
                raise GGUFError(f"{cur.path}: truncated GGUF file: item {i} of {key!r}")
            (n,) = _U64(buf, pos)
            pos += 8
            if n > MAX_STRING_BYTES or pos + n > size:
                raise GGUFError(f"{cur.path}: truncated GGUF file: item {i} of {key!r} "
                                f"claims {n} bytes at offset {pos}")
            append(buf[pos:pos + n].decode("utf-8"))
            pos += n
    except UnicodeDecodeError:
        raise GGUFError(f"{cur.path}: item {len(out)} of {key!r} is not valid UTF-8") from None
    cur.pos = pos
    return out


def _read_value(cur: _Cursor, vtype: int, key: str) -> Any:
    if vtype in _SCALARS:
        fmt, size = _SCALARS[vtype]
        return cur.scalar(fmt, size, f"value of {key!r}")
    if vtype == _STRING:
        return cur.string(f"value of {key!r}")
    if vtype == _ARRAY:
        etype = cur.u32(f"item type of {key!r}")
        count = cur.u64(f"item count of {key!r}")
        if count > MAX_ARRAY_ITEMS:
            raise GGUFError(f"{cur.path}: metadata {key!r} has {count} items "
                            f"(at most {MAX_ARRAY_ITEMS} accepted)")
        if etype in _SCALARS:
            import numpy as np

            size = _SCALARS[etype][1]
            cur.need(count * size, f"items of {key!r}")
            arr = np.frombuffer(cur.buf, dtype=_NUMPY_DTYPES[etype], count=count,
                                offset=cur.pos).copy()
            cur.pos += count * size
            return arr.astype(bool) if etype == 7 else arr
        if etype == _STRING:
            if count > MAX_STRING_ITEMS:
                raise GGUFError(f"{cur.path}: metadata {key!r} has {count} strings "
                                f"(at most {MAX_STRING_ITEMS} accepted)")
            # Each string takes at least its 8-byte length: a count the file cannot hold
            # fails before the loop, not after a long one.
            cur.need(count * 8, f"items of {key!r}")
            return _strings(cur, count, key)
        if etype == _ARRAY:
            raise GGUFError(f"{cur.path}: metadata {key!r} is an array of arrays "
                            "(not supported)")
        raise GGUFError(f"{cur.path}: metadata {key!r} has items of unknown type {etype}")
    raise GGUFError(f"{cur.path}: metadata {key!r} has unknown value type {vtype}")


def read_header(path: str | os.PathLike) -> GGUFHeader:
    """Parse and validate the header of the GGUF file at ``path``.

    Raises :class:`GGUFError` for anything malformed: bad magic or version, counts or
    lengths past the end of the file or past the caps above, unknown value or tensor
    types, tensors whose data is misaligned, overlapping or outside the file."""
    path = Path(path)
    try:
        fh = open(path, "rb")
    except OSError as e:
        raise GGUFError(f"{path}: cannot open ({e.strerror})") from None
    with fh:
        size = os.fstat(fh.fileno()).st_size
        if size < 24:
            raise GGUFError(f"{path}: not a GGUF file ({size} bytes, too short for a header)")
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse(_Cursor(buf, path), size)


def _parse(cur: _Cursor, size: int) -> GGUFHeader:
    path = cur.path
    magic = bytes(cur.buf[0:4])
    cur.pos = 4
    if magic != MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (starts with {magic!r}, not {MAGIC!r})")
    version = cur.u32("version")
    if version not in SUPPORTED_VERSIONS:
        raise GGUFError(f"{path}: GGUF version {version} is not supported "
                        f"(versions {', '.join(map(str, SUPPORTED_VERSIONS))} are)")
    n_tensors = cur.u64("tensor count")
    n_keys = cur.u64("metadata count")
    if n_tensors > MAX_TENSORS:
        raise GGUFError(f"{path}: the header claims {n_tensors} tensors "
                        f"(at most {MAX_TENSORS} accepted)")
    if n_keys > MAX_KEYS:
        raise GGUFError(f"{path}: the header claims {n_keys} metadata entries "
                        f"(at most {MAX_KEYS} accepted)")
    metadata, types = _read_metadata(cur, n_keys)
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if (not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0
            or alignment & (alignment - 1) or alignment > 1 << 20):
        raise GGUFError(f"{path}: general.alignment {alignment!r} is not a power of two")
    entries = _read_tensor_entries(cur, n_tensors)
    data_offset = -(-cur.pos // alignment) * alignment
    if data_offset > size:
        raise GGUFError(f"{path}: truncated GGUF file: no tensor data after the header")
    tensors = _place_tensors(path, entries, data_offset, alignment, size)
    return GGUFHeader(path=path, version=version, metadata=metadata, tensors=tensors,
                      alignment=alignment, data_offset=data_offset, file_size=size,
                      types=types)


def _read_metadata(cur: _Cursor, n_keys: int) -> tuple[dict[str, Any], dict[str, int]]:
    """The header's ``n_keys`` metadata entries: their values and value types by key."""
    # The smallest entry is an empty key, a type and a one-byte value.
    cur.need(n_keys * 13, f"{n_keys} metadata entries")
    metadata: dict[str, Any] = {}
    types: dict[str, int] = {}
    for i in range(n_keys):
        key = cur.string(f"metadata key {i}", cap=MAX_KEY_BYTES)
        vtype = cur.u32(f"value type of {key!r}")
        if key in metadata:
            raise GGUFError(f"{cur.path}: metadata key {key!r} appears twice")
        metadata[key] = _read_value(cur, vtype, key)
        types[key] = vtype
    return metadata, types


_TensorEntry = tuple[str, list[int], int, int]  # name, dimensions (GGUF's order), type id, offset


def _read_tensor_entries(cur: _Cursor, n_tensors: int) -> list[_TensorEntry]:
    """The header's ``n_tensors`` tensor entries, as written."""
    # The smallest entry is an empty name, one dimension, a type and an offset.
    cur.need(n_tensors * 32, f"{n_tensors} tensor entries")
    entries = []
    for i in range(n_tensors):
        name = cur.string(f"name of tensor {i}", cap=MAX_KEY_BYTES)
        n_dims = cur.u32(f"dimension count of {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise GGUFError(f"{cur.path}: tensor {name!r} has {n_dims} dimensions "
                            f"(1 to {MAX_DIMS} accepted)")
        dims = [cur.u64(f"dimension {d} of {name!r}") for d in range(n_dims)]
        type_id = cur.u32(f"type of {name!r}")
        offset = cur.u64(f"data offset of {name!r}")
        entries.append((name, dims, type_id, offset))
    return entries


def _place_tensors(path: Path, entries: list[_TensorEntry], data_offset: int, alignment: int,
                   size: int) -> dict[str, TensorInfo]:
    """Each tensor's place in the file, checked: a known type, a shape its blocks divide,
    aligned, inside the file, and no two overlapping."""
    tensors: dict[str, TensorInfo] = {}
    spans = []
    for name, dims, type_id, offset in entries:
        if name in tensors:
            raise GGUFError(f"{path}: tensor {name!r} appears twice")
        if type_id not in GGML_TYPES:
            raise GGUFError(f"{path}: tensor {name!r} has unknown type id {type_id}")
        tname, block, block_bytes = GGML_TYPES[type_id]
        if any(d == 0 or d > 1 << 40 for d in dims):
            raise GGUFError(f"{path}: tensor {name!r} has a bad shape {dims}")
        if dims[0] % block:
            raise GGUFError(f"{path}: tensor {name!r} ({tname}) has rows of {dims[0]} "
                            f"elements, not a multiple of its block of {block}")
        count = 1
        for d in dims:
            count *= d
        if count > 1 << 40:
            raise GGUFError(f"{path}: tensor {name!r} has {count} elements (too many)")
        nbytes = count // block * block_bytes
        if offset % alignment:
            raise GGUFError(f"{path}: tensor {name!r} data offset {offset} is not aligned "
                            f"to {alignment}")
        start = data_offset + offset
        if start + nbytes > size:
            raise GGUFError(f"{path}: truncated GGUF file: tensor {name!r} needs bytes "
                            f"{start}..{start + nbytes}, the file has {size}")
        tensors[name] = TensorInfo(name, type_id, tuple(reversed(dims)), start, nbytes)
        spans.append((start, start + nbytes, name))
    spans.sort()
    for (_s0, e0, n0), (s1, _e1, n1) in zip(spans, spans[1:]):
        if s1 < e0:
            raise GGUFError(f"{path}: tensors {n0!r} and {n1!r} overlap in the file")
    return tensors
