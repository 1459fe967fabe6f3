"""``_blocks.preadv_hash``: a block read from its file straight into the destination rows
and hashed there, piece by piece, in one kernel call; the warm restore uses it for every
block whose rows run long enough, and a damaged block is still caught and removed (with it
and with the Python loop that stands in where the kernel lacks it)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import xxhash

from mlxkv.storage import _blocks as K
from mlxkv.storage import format as fmt
from mlxkv.storage.store import BlockStore

N = 300
SHAPES = [(4, 1024), (2, 512), (3, 8)]  # (outer, row bytes): long, medium and short rows


def _sources():
    rng = np.random.default_rng(7)
    return [rng.integers(0, 256, (o, N, rb), dtype=np.uint8) for o, rb in SHAPES]


def _segs(arrays, cap):
    return [(a, a.shape[0], cap, a.shape[2]) for a in arrays]


def _packed_file(tmp_path, t0, t1, seed, lead=100):
    src = _sources()
    packed = bytearray(K.packed_size(_segs(src, N), t1 - t0))
    nbytes, digest = K.pack(packed, 0, _segs(src, N), t0, t1, seed)
    path = tmp_path / "block"
    path.write_bytes(b"\xee" * lead + bytes(packed))
    return src, path, bytes(packed), digest


@pytest.mark.parametrize("piece", [1, 4096, 300_000, 512 << 10, 1 << 40])
def test_preadv_hash_lands_the_packed_rows_and_hashes_them(tmp_path, piece):
    t0, t1, seed = 10, 266, 5
    src, path, packed, digest = _packed_file(tmp_path, t0, t1, seed)
    dst = [np.full((a.shape[0], 400, a.shape[2]), 0xAB, np.uint8) for a in src]
    fd = os.open(path, os.O_RDONLY)
    try:
        got, h = K.preadv_hash(fd, 100, _segs(dst, 400), 50, t1 - t0, seed, piece)
    finally:
        os.close(fd)
    assert (got, h) == (len(packed), digest)
    assert h == xxhash.xxh3_64_intdigest(packed, seed)
    for d, a in zip(dst, src):
        np.testing.assert_array_equal(d[:, 50 : 50 + t1 - t0], a[:, t0:t1])
        assert (d[:, :50] == 0xAB).all() and (d[:, 50 + t1 - t0 :] == 0xAB).all()


def test_preadv_hash_is_short_only_at_end_of_file_and_hashes_what_it_read(tmp_path):
    src, path, packed, _ = _packed_file(tmp_path, 0, 256, 3)
    os.truncate(path, 100 + len(packed) - 777)
    dst = [np.zeros((a.shape[0], N, a.shape[2]), np.uint8) for a in src]
    fd = os.open(path, os.O_RDONLY)
    try:
        got, h = K.preadv_hash(fd, 100, _segs(dst, N), 0, 256, 3, 4096)
    finally:
        os.close(fd)
    assert got == len(packed) - 777
    assert h == xxhash.xxh3_64_intdigest(packed[:got], 3)


def test_preadv_hash_refuses_bad_destinations_before_reading(tmp_path):
    src, path, _, _ = _packed_file(tmp_path, 0, 256, 0)
    fd = os.open(path, os.O_RDONLY)
    try:
        big = np.zeros(4 * N * 1024 + 2 * N * 512, np.uint8)
        overlapping = [(big[: 4 * N * 1024], 4, N, 1024), (big[1024 : 1024 + 2 * N * 512], 2, N, 512)]
        with pytest.raises(ValueError, match="overlaps"):
            K.preadv_hash(fd, 100, overlapping, 0, 256)
        assert not big.any()
        ro = np.zeros((4, N, 1024), np.uint8)
        ro.flags.writeable = False
        with pytest.raises(ValueError, match="read-only"):
            K.preadv_hash(fd, 100, [(ro, 4, N, 1024)], 0, 256)
        with pytest.raises(ValueError, match="exceeds t_capacity"):
            K.preadv_hash(fd, 100, [(np.zeros((4, N, 1024), np.uint8), 4, N, 1024)], 100, 256)
        with pytest.raises(ValueError, match="offset"):
            K.preadv_hash(fd, -1, [(np.zeros((4, N, 1024), np.uint8), 4, N, 1024)], 0, 256)
    finally:
        os.close(fd)


def test_preadv_hash_names_the_file_in_its_error(tmp_path):
    fd = os.open(tmp_path, os.O_RDONLY)  # a folder: read() fails with EISDIR
    try:
        with pytest.raises(OSError) as exc:
            K.preadv_hash(fd, 0, [(np.zeros((1, 4, 64), np.uint8), 1, 4, 64)], 0, 4,
                          path="some/block.blk")
    finally:
        os.close(fd)
    assert exc.value.filename == "some/block.blk"


BT = 256
ROW = 1024
LAYOUT = fmt.make_layout([fmt.SegmentSpec("k", "uint8", (ROW,), 4, ROW),
                          fmt.SegmentSpec("v", "uint8", (ROW // 2,), 2, ROW // 2)])


def _store_with_a_damaged_third_block(root):
    n = 4 * BT
    toks = np.arange(n, dtype=np.uint32)
    rng = np.random.default_rng(n)
    k = rng.integers(0, 255, (4, n, ROW), dtype=np.uint8)
    v = rng.integers(0, 255, (2, n, ROW // 2), dtype=np.uint8)
    store = BlockStore(root, block_tokens=BT)
    store.put_blocks("ns", toks, LAYOUT, [(k, 4, n, ROW), (v, 2, n, ROW // 2)])
    third = store.lookup("ns", toks).block_keys[2].hex()
    store.close()
    files = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".blk")]
    path = next(p for p in files if third in p)
    with open(path, "r+b") as f:  # one bit of a row of v, deep in the payload
        f.seek(os.path.getsize(path) - 5000)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x10]))
    for p in files:  # warm: every file in the page cache
        with open(p, "rb") as f:
            f.read()
    return toks, k, v, path


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "python-loop"])
def test_a_damaged_warm_block_is_caught_on_the_scattering_paths(tmp_path, monkeypatch, threads,
                                                                kernel):
    toks, k, v, path = _store_with_a_damaged_third_block(tmp_path)
    calls = []
    if kernel:
        real = K.preadv_hash

        def counted(*a, **kw):
            calls.append(a[3])
            return real(*a, **kw)

        monkeypatch.setattr(K, "preadv_hash", counted)
    else:
        monkeypatch.delattr(K, "preadv_hash")
    store = BlockStore(tmp_path, block_tokens=BT, read_threads=threads)
    store.scan()
    n = toks.size
    k2 = np.zeros((4, n, ROW), np.uint8)
    v2 = np.zeros((2, n, ROW // 2), np.uint8)
    r = store.get_blocks("ns", toks, LAYOUT, [(k2, 4, n, ROW), (v2, 2, n, ROW // 2)])
    store.close()
    assert r.n_tokens == 2 * BT and r.corrupt == 1 and r.blocks_read == 2
    assert not os.path.exists(path)
    np.testing.assert_array_equal(k2[:, : 2 * BT], k[:, : 2 * BT])
    np.testing.assert_array_equal(v2[:, : 2 * BT], v[:, : 2 * BT])
    if kernel:  # one call per block read, the damaged one included
        assert sorted(calls)[:3] == [0, BT, 2 * BT]
