"""On-disk formats of the block store: block, tail and checkpoint files, manifests and
learned files.

Every file opens with a prefix (magic, format version, kind, header length) and ends its
header with an XXH3-64 hash of everything before it, so a damaged header is caught before
a field is trusted: an unknown version raises :class:`UnknownVersion` (skipped, never
misread), any other damage :class:`FormatError`. The byte layouts: docs/storage.md.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import xxhash

PAGE = 4096
FORMAT_VERSION = 1
MAGIC = b"MLXKV\x00\x01\x00"
KIND_BLOCK = 1
KIND_TAIL = 2
KIND_CHECKPOINT = 4  # whole (non-sliceable) state at one exact token position
KIND_MANIFEST = 3
KIND_LEARNED = 5  # token sequences a speculation source learned (one file per namespace)
KIND_NAMES = {KIND_BLOCK: "block", KIND_TAIL: "tail", KIND_MANIFEST: "manifest",
              KIND_CHECKPOINT: "checkpoint", KIND_LEARNED: "learned"}
ENTRY_KINDS = (KIND_BLOCK, KIND_TAIL, KIND_CHECKPOINT)

_PREFIX = struct.Struct("<8sHHI")  # magic, version, kind, header body length
PREFIX_SIZE = _PREFIX.size  # 16
_HASH = struct.Struct("<Q")
_BLOCK = struct.Struct("<16s16s16sQQQIII")
_MAN = struct.Struct("<I")
MAX_HEADER = 1 << 24  # a header larger than 16 MiB is damage, not data
MAX_MANIFEST = 1 << 28  # bytes: 64 M token ids; a larger .man file is not one of ours
MAX_META = 1 << 20  # bytes of metadata JSON in one header
MAX_DEPTH = 8  # nesting of metadata JSON (ours is 3 deep)
# Tokens in one learned file: its body (4 bytes a token, plus lengths) stays under MAX_HEADER.
MAX_LEARNED_TOKENS = 1 << 20

# Bytes per element of the dtypes KV caches use; others are accepted without the check.
DTYPE_SIZES = {
    "bool": 1, "uint8": 1, "int8": 1, "uint16": 2, "int16": 2, "float16": 2, "bfloat16": 2,
    "uint32": 4, "int32": 4, "float32": 4, "uint64": 8, "int64": 8, "float64": 8,
}


class FormatError(ValueError):
    """A file that is not a valid mlxkv file (bad magic, hash, size or field)."""


class UnknownVersion(FormatError):
    """A well-formed prefix with a format version this code does not read."""


@dataclass(frozen=True)
class SegmentSpec:
    """One per-layer tensor of a block: ``[outer, tokens, *shape]`` of ``dtype``.

    ``row_bytes`` is the bytes of one token's row in one outer slice (for mlx-lm KVCache
    keys ``[B, H, T, D]``: outer = B*H, shape = (D,), row_bytes = D * itemsize).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    outer: int
    row_bytes: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"segment name must be a non-empty string, got {self.name!r}")
        if self.outer <= 0 or self.row_bytes <= 0 or any(s <= 0 for s in self.shape):
            raise ValueError(f"segment {self.name}: outer, row_bytes and shape must be > 0")
        size = DTYPE_SIZES.get(self.dtype)
        if size is not None and int(np.prod(self.shape, dtype=np.int64)) * size != self.row_bytes:
            raise ValueError(
                f"segment {self.name}: shape {self.shape} of {self.dtype} is "
                f"{int(np.prod(self.shape)) * size} bytes per row, not row_bytes={self.row_bytes}"
            )


Layout = tuple[SegmentSpec, ...]
# A spec as callers may give it: (name, dtype, shape, outer, row_bytes), or a dict of
# those fields (from JSON)
SpecLike = SegmentSpec | Mapping[str, Any] | tuple[str, str, tuple[int, ...], int, int]
LayoutLike = Iterable[SpecLike]  # what make_layout takes
TokenIds = npt.NDArray[np.uint32]  # token ids as stored: little-endian uint32
ByteView = bytes | bytearray | memoryview  # bytes read from a file, or a view of them


def make_layout(specs: Iterable[SpecLike]) -> Layout:
    """A layout from SegmentSpecs or dicts/tuples (name, dtype, shape, outer, row_bytes)."""
    out: list[SegmentSpec] = []
    for s in specs:
        if isinstance(s, SegmentSpec):
            out.append(s)
        elif isinstance(s, Mapping):
            out.append(SegmentSpec(s["name"], s["dtype"], tuple(s["shape"]), s["outer"], s["row_bytes"]))
        else:
            out.append(SegmentSpec(*s))
    if not out:
        raise ValueError("a layout needs at least one segment")
    names = [s.name for s in out]
    if len(set(names)) != len(names):
        raise ValueError(f"segment names must be unique: {names}")
    return tuple(out)


def layout_json(layout: Layout) -> list[list[str | int | list[int]]]:
    return [[s.name, s.dtype, list(s.shape), s.outer, s.row_bytes] for s in layout]


def layout_from_json(obj: Any) -> Layout:
    return tuple(SegmentSpec(n, d, tuple(sh), o, r) for n, d, sh, o, r in obj)


def bytes_per_token(layout: Layout) -> int:
    return sum(s.outer * s.row_bytes for s in layout)


def content_seed(key: bytes) -> int:
    """Hash seed bound to the key, so a payload moved to another file fails its check."""
    return int.from_bytes(key[:8], "little")


def align(n: int, a: int = PAGE) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class BlockHeader:
    """Parsed header of a block or tail file."""

    kind: int
    key: bytes
    parent: bytes
    ns_id: bytes
    ns: str
    content_hash: int
    payload_offset: int
    payload_len: int
    t0: int
    t1: int
    layout: Layout
    token_bytes: bytes  # little-endian uint32 token ids of [t0, t1)

    @property
    def tokens(self) -> TokenIds:
        return np.frombuffer(self.token_bytes, dtype="<u4")

    @property
    def file_size(self) -> int:
        return self.payload_offset + align(self.payload_len)


def _prefix(kind: int, body: bytes, version: int = FORMAT_VERSION) -> bytes:
    """prefix + body + header hash."""
    raw = _PREFIX.pack(MAGIC, version, kind, len(body)) + body
    return raw + _HASH.pack(xxhash.xxh3_64_intdigest(raw))


def block_header_size(layout: Layout, ns: str, ntokens: int) -> int:
    """Bytes before the payload (header rounded up to a page)."""
    meta = _meta_bytes(layout, ns)
    return align(PREFIX_SIZE + _BLOCK.size + len(meta) + 4 * ntokens + _HASH.size)


_meta_cache: dict[tuple[Layout, str], bytes] = {}


def _meta_bytes(layout: Layout, ns: str) -> bytes:
    k = (layout, ns)
    m = _meta_cache.get(k)
    if m is None:
        m = json.dumps({"ns": ns, "layout": layout_json(layout)}, separators=(",", ":")).encode()
        if len(_meta_cache) > 256:
            _meta_cache.clear()
        _meta_cache[k] = m
    return m


def encode_block_header(
    kind: int, key: bytes, parent: bytes, ns_id: bytes, ns: str, layout: Layout,
    t0: int, t1: int, tokens: npt.ArrayLike, content_hash: int, payload_len: int,
    version: int = FORMAT_VERSION,
) -> bytes:
    """The header bytes of a block/tail file, zero-padded to the payload offset."""
    if kind not in ENTRY_KINDS:
        raise ValueError(f"not a block kind: {kind}")
    toks = np.ascontiguousarray(tokens, dtype="<u4")
    if toks.size != t1 - t0:
        raise ValueError(f"{toks.size} token ids for range [{t0}, {t1})")
    meta = _meta_bytes(layout, ns)
    size = align(PREFIX_SIZE + _BLOCK.size + len(meta) + toks.nbytes + _HASH.size)
    body = _BLOCK.pack(key, parent, ns_id, content_hash, size, payload_len, t0, t1, len(meta))
    raw = _prefix(kind, body + meta + toks.tobytes(), version)
    return raw + bytes(size - len(raw))


def parse_prefix(buf: ByteView) -> tuple[int, int, int]:
    """(version, kind, header body length); FormatError/UnknownVersion if unusable."""
    if len(buf) < PREFIX_SIZE:
        raise FormatError(f"file too short for a header ({len(buf)} bytes)")
    magic, version, kind, hlen = _PREFIX.unpack_from(buf, 0)
    if magic != MAGIC:
        raise FormatError("bad magic: not an mlxkv file")
    if version != FORMAT_VERSION:
        raise UnknownVersion(f"format version {version} (this build reads {FORMAT_VERSION})")
    if kind not in KIND_NAMES:
        raise FormatError(f"unknown record kind {kind}")
    if hlen > MAX_HEADER:
        raise FormatError(f"header length {hlen} is implausible")
    return version, kind, hlen


def header_span(buf: ByteView) -> int:
    """Bytes needed to verify the header that starts ``buf`` (prefix + body + hash)."""
    return PREFIX_SIZE + parse_prefix(buf)[2] + _HASH.size


_layout_cache: dict[bytes, tuple[str, Layout, int]] = {}


def _verified_body(buf: ByteView) -> tuple[int, bytes]:
    """(kind, body bytes) after checking the header hash; ``buf`` is bytes or a view."""
    _, kind, hlen = parse_prefix(buf)
    end = PREFIX_SIZE + hlen
    if len(buf) < end + _HASH.size:
        raise FormatError(f"truncated header: {len(buf)} of {end + _HASH.size} bytes")
    raw = bytes(buf[:end])
    if xxhash.xxh3_64_intdigest(raw) != _HASH.unpack_from(buf, end)[0]:
        raise FormatError("header hash mismatch")
    return kind, raw[PREFIX_SIZE:]


_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')


def load_json(raw: bytes, what: str) -> Any:
    """``json.loads`` of at most MAX_META bytes nested at most MAX_DEPTH deep; FormatError
    otherwise (a nesting check first: the parser itself would recurse once per level)."""
    if len(raw) > MAX_META:
        raise FormatError(f"{what}: {len(raw)} bytes of metadata (at most {MAX_META})")
    depth = np.frombuffer(_JSON_STRING.sub(b'""', raw), dtype=np.uint8)
    steps = (depth == ord("[")).astype(np.int32) + (depth == ord("{"))
    steps -= (depth == ord("]")).astype(np.int32) + (depth == ord("}"))
    if steps.size and int(np.cumsum(steps).max()) > MAX_DEPTH:
        raise FormatError(f"{what}: metadata nested deeper than {MAX_DEPTH} levels")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise FormatError(f"{what}: bad metadata JSON: {exc}") from exc


def _meta(raw: bytes) -> tuple[str, Layout, int]:
    """(namespace, layout, bytes per token) of a header's metadata, cached by its bytes."""
    hit = _layout_cache.get(raw)
    if hit is None:
        meta = load_json(raw, "header")
        try:
            layout = layout_from_json(meta["layout"])
            hit = (str(meta["ns"]), layout, bytes_per_token(layout))
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            raise FormatError(f"bad header metadata: {exc}") from exc
        if len(_layout_cache) > 1024:
            _layout_cache.clear()
        _layout_cache[raw] = hit
    return hit


def decode_block_header(buf: ByteView) -> BlockHeader:
    """Parse and verify a block/tail header from the start of ``buf``."""
    kind, body = _verified_body(buf)
    if kind not in ENTRY_KINDS:
        raise FormatError(f"expected a block, tail or checkpoint, found a {KIND_NAMES[kind]}")
    if len(body) < _BLOCK.size:
        raise FormatError("header body too short")
    key, parent, ns_id, chash, poff, plen, t0, t1, mlen = _BLOCK.unpack_from(body, 0)
    end_meta = _BLOCK.size + mlen
    ntok = t1 - t0
    if t1 < t0 or end_meta + 4 * ntok != len(body):
        raise FormatError(f"inconsistent header sizes (tokens [{t0}, {t1}), meta {mlen})")
    if poff % PAGE or poff < PREFIX_SIZE + len(body) + _HASH.size:
        raise FormatError(f"bad payload offset {poff}")
    ns, layout, bpt = _meta(body[_BLOCK.size : end_meta])
    if plen != bpt * (1 if kind == KIND_CHECKPOINT else ntok):
        raise FormatError(f"payload length {plen} does not match layout x {ntok} tokens")
    return BlockHeader(kind, key, parent, ns_id, ns, chash, poff, plen, t0, t1, layout,
                       body[end_meta:])


@dataclass(frozen=True)
class Manifest:
    """A named conversation: its tokens and the block/tail keys that hold its state."""

    name: str
    ns: str
    tokens: TokenIds
    block_keys: tuple[bytes, ...]
    tail_key: bytes | None
    created: float
    extra_keys: tuple[bytes, ...] = ()  # checkpoints (and anything else) it keeps alive


def encode_manifest(m: Manifest, version: int = FORMAT_VERSION) -> bytes:
    meta = json.dumps(
        {"name": m.name, "ns": m.ns, "n_keys": len(m.block_keys),
         "tail": m.tail_key.hex() if m.tail_key else None, "created": m.created,
         "extra": [k.hex() for k in m.extra_keys]},
        separators=(",", ":"),
    ).encode()
    toks = np.ascontiguousarray(m.tokens, dtype="<u4")
    body = _MAN.pack(len(meta)) + meta + toks.tobytes() + b"".join(m.block_keys)
    return _prefix(KIND_MANIFEST, body, version)


def _meta_body(buf: ByteView, kind: int, what: str) -> tuple[Any, bytes, int]:
    """(metadata, body, where the data after the metadata starts) of a verified all-header
    file of ``kind`` whose body opens with ``meta length u32 | meta (JSON)``."""
    got, body = _verified_body(buf)
    if got != kind:
        raise FormatError(f"expected a {KIND_NAMES[kind]}, found a {KIND_NAMES[got]}")
    if len(body) < _MAN.size:
        raise FormatError(f"{what} body too short")
    (mlen,) = _MAN.unpack_from(body, 0)
    if _MAN.size + mlen > len(body):
        raise FormatError(f"{what} metadata length {mlen} exceeds the body")
    return load_json(body[_MAN.size: _MAN.size + mlen], what), body, _MAN.size + mlen


def decode_manifest(buf: ByteView) -> Manifest:
    meta, body, start = _meta_body(buf, KIND_MANIFEST, "manifest")
    try:
        nkeys = int(meta["n_keys"])
        rest = len(body) - start - 16 * nkeys
        if nkeys < 0 or rest < 0 or rest % 4:
            raise FormatError("manifest sizes do not add up")
        tokens = np.frombuffer(body[start : start + rest], dtype="<u4").copy()
        key_bytes = body[start + rest :]
        keys = tuple(key_bytes[i * 16 : (i + 1) * 16] for i in range(nkeys))
        tail = bytes.fromhex(meta["tail"]) if meta["tail"] else None
        extra = tuple(bytes.fromhex(k) for k in meta.get("extra", ()))
        return Manifest(str(meta["name"]), str(meta["ns"]), tokens, keys, tail,
                        float(meta["created"]), extra)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise FormatError(f"bad manifest: {exc}") from exc


@dataclass(frozen=True)
class Learned:
    """Token sequences a speculation source learned in namespace ``ns`` (oldest first), in
    the layout ``schema`` names."""

    ns: str
    schema: str
    sequences: tuple[TokenIds, ...]  # uint32 token ids, each non-empty
    saved: float

    @property
    def tokens(self) -> int:
        return sum(len(s) for s in self.sequences)


def encode_learned(learned: Learned, version: int = FORMAT_VERSION) -> bytes:
    seqs = [np.ascontiguousarray(s, dtype="<u4") for s in learned.sequences]
    if any(s.ndim != 1 or s.size == 0 for s in seqs):
        raise ValueError("learned sequences must be flat and non-empty")
    total = sum(s.size for s in seqs)
    if total > MAX_LEARNED_TOKENS:
        raise ValueError(f"{total} learned tokens: at most {MAX_LEARNED_TOKENS} fit one file")
    meta = json.dumps({"ns": learned.ns, "schema": learned.schema, "sequences": len(seqs),
                       "tokens": total, "saved": learned.saved}, separators=(",", ":")).encode()
    lengths = np.array([s.size for s in seqs], dtype="<u4")
    body = _MAN.pack(len(meta)) + meta + lengths.tobytes() + b"".join(s.tobytes() for s in seqs)
    return _prefix(KIND_LEARNED, body, version)


def decode_learned(buf: ByteView) -> Learned:
    """Parse and verify a learned file read whole; FormatError if any byte or count is off."""
    meta, body, start = _meta_body(buf, KIND_LEARNED, "learned")
    try:
        n, total = int(meta["sequences"]), int(meta["tokens"])
        ns, schema, saved = str(meta["ns"]), str(meta["schema"]), float(meta["saved"])
    except (ValueError, KeyError, TypeError) as exc:
        raise FormatError(f"bad learned metadata: {exc}") from exc
    if not (0 <= n <= total <= MAX_LEARNED_TOKENS) or start + 4 * (n + total) != len(body):
        raise FormatError(f"learned sizes do not add up ({n} sequences, {total} tokens, "
                          f"{len(body) - start} bytes)")
    lengths = np.frombuffer(body, dtype="<u4", count=n, offset=start).astype(np.int64)
    if n and (int(lengths.min()) < 1 or int(lengths.sum()) != total):
        raise FormatError("learned sequence lengths do not add up to its token count")
    tokens = np.frombuffer(body, dtype="<u4", count=total, offset=start + 4 * n)
    ends = np.cumsum(lengths)
    seqs = tuple(tokens[e - k: e].copy() for e, k in zip(ends.tolist(), lengths.tolist()))
    return Learned(ns, schema, seqs, saved)
