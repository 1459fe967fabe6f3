"""On-disk format: header round trips, damage detection, versioning."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from mlxkv.storage import format as fmt
from mlxkv.storage.format import FormatError, SegmentSpec, UnknownVersion

KV_BF16 = fmt.make_layout(
    [SegmentSpec(f"l{i}.{kv}", "bfloat16", (128,), 8, 256) for i in range(4) for kv in "kv"]
)
KV_F32 = fmt.make_layout([SegmentSpec("l0.k", "float32", (64,), 2, 256),
                          SegmentSpec("l0.v", "float32", (64,), 2, 256)])
QUANT = fmt.make_layout([
    SegmentSpec("l0.k.w", "uint32", (16,), 8, 64),  # 128 dims at 4 bits
    SegmentSpec("l0.k.scales", "bfloat16", (2,), 8, 4),
    SegmentSpec("l0.k.biases", "bfloat16", (2,), 8, 4),
])


def _header(layout, kind=fmt.KIND_BLOCK, t0=256, t1=512, version=fmt.FORMAT_VERSION):
    toks = np.arange(t0, t1, dtype=np.uint32) * 7
    plen = fmt.bytes_per_token(layout) * (t1 - t0)
    raw = fmt.encode_block_header(kind, b"k" * 16, b"p" * 16, b"n" * 16, "model-a", layout,
                                  t0, t1, toks, 0x1234_5678_9ABC_DEF0, plen, version=version)
    return raw, toks, plen


@pytest.mark.parametrize("layout", [KV_BF16, KV_F32, QUANT], ids=["bf16", "f32", "quant"])
@pytest.mark.parametrize("kind", [fmt.KIND_BLOCK, fmt.KIND_TAIL])
def test_block_header_round_trip(layout, kind):
    raw, toks, plen = _header(layout, kind)
    assert len(raw) % fmt.PAGE == 0
    h = fmt.decode_block_header(raw)
    assert (h.kind, h.key, h.parent, h.ns_id, h.ns) == (kind, b"k" * 16, b"p" * 16, b"n" * 16, "model-a")
    assert (h.t0, h.t1, h.payload_len, h.content_hash) == (256, 512, plen, 0x1234_5678_9ABC_DEF0)
    assert h.payload_offset == len(raw) and h.payload_offset % fmt.PAGE == 0
    assert h.layout == layout
    np.testing.assert_array_equal(h.tokens, toks)
    assert fmt.block_header_size(layout, "model-a", 256) == len(raw)


def test_every_header_byte_is_covered_by_the_header_hash():
    raw, _, _ = _header(KV_F32, t0=0, t1=16)
    end = fmt.header_span(raw)
    for i in range(end):
        bad = bytearray(raw)
        bad[i] ^= 0x01
        with pytest.raises(FormatError):
            fmt.decode_block_header(bytes(bad))


def test_unknown_version_is_refused_not_misread():
    raw, _, _ = _header(KV_F32, version=fmt.FORMAT_VERSION + 1)
    with pytest.raises(UnknownVersion, match="format version 2"):
        fmt.decode_block_header(raw)


def test_bad_magic_and_truncation():
    raw, _, _ = _header(KV_F32)
    with pytest.raises(FormatError, match="magic"):
        fmt.decode_block_header(b"NOTMLXKV" + raw[8:])
    with pytest.raises(FormatError, match="too short"):
        fmt.decode_block_header(raw[:10])
    with pytest.raises(FormatError, match="truncated"):
        fmt.decode_block_header(raw[: fmt.PREFIX_SIZE + 20])


def test_manifest_is_not_a_block_and_round_trips():
    m = fmt.Manifest("chat-1", "model-a", np.arange(700, dtype=np.uint32),
                     (b"a" * 16, b"b" * 16), b"t" * 16, 123.5)
    raw = fmt.encode_manifest(m)
    back = fmt.decode_manifest(raw)
    assert (back.name, back.ns, back.block_keys, back.tail_key, back.created) == \
        ("chat-1", "model-a", m.block_keys, m.tail_key, 123.5)
    np.testing.assert_array_equal(back.tokens, m.tokens)
    with pytest.raises(FormatError, match="expected a block"):
        fmt.decode_block_header(raw)
    bad = bytearray(raw)
    bad[-1] ^= 0xFF
    with pytest.raises(FormatError, match="hash"):
        fmt.decode_manifest(bytes(bad))


def test_segment_spec_validation():
    with pytest.raises(ValueError, match="row_bytes"):
        SegmentSpec("k", "bfloat16", (128,), 8, 128)  # 128 bf16 = 256 bytes
    with pytest.raises(ValueError, match="> 0"):
        SegmentSpec("k", "float32", (4,), 0, 16)
    with pytest.raises(ValueError, match="unique"):
        fmt.make_layout([("k", "float32", (4,), 1, 16), ("k", "float32", (4,), 1, 16)])
    assert fmt.make_layout([("k", "mystery8", (3,), 1, 5)])[0].row_bytes == 5  # unknown dtype ok


def test_prefix_layout_is_stable():
    raw, _, _ = _header(KV_F32)
    magic, version, kind, hlen = struct.unpack_from("<8sHHI", raw)
    assert (magic, version, kind) == (fmt.MAGIC, 1, fmt.KIND_BLOCK)
    assert fmt.header_span(raw) == 16 + hlen + 8 <= len(raw)


def test_every_manifest_byte_is_covered_by_its_hash():
    m = fmt.Manifest("chat-1", "model-a", np.arange(40, dtype=np.uint32),
                     (b"a" * 16, b"b" * 16), b"t" * 16, 123.5, (b"c" * 16,))
    raw = fmt.encode_manifest(m)
    for i in range(len(raw)):
        bad = bytearray(raw)
        bad[i] ^= 0x01
        with pytest.raises(FormatError):
            fmt.decode_manifest(bytes(bad))


@pytest.mark.parametrize("meta", [b"[" * 100_000 + b"]" * 100_000,
                                  b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
                                  b"[" * 100_000, b'"' + b"x" * (2 << 20) + b'"'],
                         ids=["deep-list", "deep-object", "unclosed", "huge"])
def test_hostile_metadata_json_is_a_format_error(meta):
    """Header and manifest metadata nested 100,000 deep or megabytes long (with a valid
    header hash: written on purpose, not damaged) is a FormatError, not a RecursionError."""
    body = fmt._BLOCK.pack(b"k" * 16, b"p" * 16, b"n" * 16, 0, fmt.align(len(meta) + 200), 0,
                           0, 0, len(meta)) + meta
    with pytest.raises(FormatError):
        fmt.decode_block_header(fmt._prefix(fmt.KIND_BLOCK, body))
    with pytest.raises(FormatError):
        fmt.decode_manifest(fmt._prefix(fmt.KIND_MANIFEST, struct.pack("<I", len(meta)) + meta))


def test_metadata_strings_with_brackets_are_not_nesting():
    meta = {"ns": "[[[[[[[[[[[[", "layout": fmt.layout_json(KV_F32)}
    assert fmt.load_json(json_bytes(meta), "header") == meta


def test_short_or_inconsistent_manifests_are_format_errors():
    for body in (b"", b"\x01\x00", struct.pack("<I", 1000) + b"{}"):
        with pytest.raises(FormatError):
            fmt.decode_manifest(fmt._prefix(fmt.KIND_MANIFEST, body))


def json_bytes(obj):
    import json

    return json.dumps(obj).encode()
