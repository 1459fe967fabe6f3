"""Cold block files are read with O_DIRECT (double-buffered windows straight into aligned
staging, scattered and hashed there), warm ones through the page cache (preadv straight
into the destination rows when they run long enough); all restore the same verified
bytes, and a damaged block is caught and removed either way."""

from __future__ import annotations

import os

import numpy as np
import pytest

from mlxkv.storage import _blocks as K
from mlxkv.storage import format as fmt
from mlxkv.storage.direct import WINDOW, windows
from mlxkv.storage.diskio import plan
from mlxkv.storage.format import PAGE
from mlxkv.storage.store import BlockStore

BT = 256
ROW = 1024  # bytes per token per outer slice: 4 x 256 x 1 KiB = 1 MiB blocks
LAYOUT = fmt.make_layout([fmt.SegmentSpec("k", "uint8", (ROW,), 4, ROW),
                          fmt.SegmentSpec("v", "uint8", (ROW // 2,), 2, ROW // 2)])


def _put(root, n):
    toks = np.arange(n, dtype=np.uint32)
    rng = np.random.default_rng(n)
    k = rng.integers(0, 255, (4, n, ROW), dtype=np.uint8)
    v = rng.integers(0, 255, (2, n, ROW // 2), dtype=np.uint8)
    BlockStore(root, block_tokens=BT).put_blocks("ns", toks, LAYOUT,
                                                 [(k, 4, n, ROW), (v, 2, n, ROW // 2)])
    return toks, k, v


def _files(root):
    return [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs
            if f.endswith((".blk", ".tail"))]


def _drop(paths) -> bool:
    ok = True
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        ok &= K.drop_cache(fd)
        os.close(fd)
    return ok


def _restore(root, toks, read_threads=2, direct_reads=True):
    store = BlockStore(root, block_tokens=BT, read_threads=read_threads, direct_reads=direct_reads)
    store.scan()
    n = toks.size
    k = np.zeros((4, n, ROW), np.uint8)
    v = np.zeros((2, n, ROW // 2), np.uint8)
    r = store.get_blocks("ns", toks, LAYOUT, [(k, 4, n, ROW), (v, 2, n, ROW // 2)])
    reads = store.reader.direct.reads if store.reader.direct is not None else 0
    store.close()
    return r, k, v, reads


@pytest.mark.parametrize("threads", [1, 2])
def test_cold_and_warm_restores_give_the_same_verified_bytes(tmp_path, threads):
    toks, k, v = _put(tmp_path, 3 * BT + 40)
    if not _drop(_files(tmp_path)):
        pytest.skip("the OS keeps the pages: nothing is cold here")
    r, k2, v2, direct = _restore(tmp_path, toks, threads)
    assert r.n_tokens == toks.size and r.corrupt == 0
    np.testing.assert_array_equal(k2, k)
    np.testing.assert_array_equal(v2, v)
    assert direct == 3  # the three 1 MiB blocks (the small tail goes buffered)
    # warm now? read through the page cache once, then no direct reads
    for p in _files(tmp_path):
        with open(p, "rb") as f:
            f.read()
    r, k3, _, direct = _restore(tmp_path, toks, threads)
    assert r.n_tokens == toks.size and direct == 0
    np.testing.assert_array_equal(k3, k)


def test_a_damaged_cold_block_is_caught_and_removed(tmp_path):
    toks, k, _ = _put(tmp_path, 3 * BT)
    store = BlockStore(tmp_path, block_tokens=BT)
    store.scan()
    second = store.lookup("ns", toks).block_keys[1].hex()
    path = next(p for p in _files(tmp_path) if second in p)
    with open(path, "r+b") as f:  # one byte of the payload, far into the file
        f.seek(os.path.getsize(path) - 5000)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    if not _drop(_files(tmp_path)):
        pytest.skip("the OS keeps the pages: nothing is cold here")
    r, k2, _, _ = _restore(tmp_path, toks, read_threads=1)
    assert r.n_tokens == BT and r.corrupt == 1 and not os.path.exists(path)
    np.testing.assert_array_equal(k2[:, :BT], k[:, :BT])


def test_a_damaged_warm_block_is_caught_when_the_kernel_scatters_it(tmp_path):
    """Warm blocks with long rows are read by preadv straight into the destination rows
    and hashed there: a flipped byte still fails the block."""
    toks, k, _ = _put(tmp_path, 3 * BT)
    store = BlockStore(tmp_path, block_tokens=BT)
    store.scan()
    third = store.lookup("ns", toks).block_keys[2].hex()
    path = next(p for p in _files(tmp_path) if third in p)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 70_000)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x01]))
    for p in _files(tmp_path):  # warm: in the page cache
        with open(p, "rb") as f:
            f.read()
    r, k2, _, direct = _restore(tmp_path, toks, read_threads=1)
    assert direct == 0 and r.n_tokens == 2 * BT and r.corrupt == 1
    assert not os.path.exists(path)
    np.testing.assert_array_equal(k2[:, : 2 * BT], k[:, : 2 * BT])


@pytest.mark.parametrize("threads", [1, 2])
def test_cold_restores_are_buffered_unless_asked(tmp_path, threads):
    toks, k, v = _put(tmp_path, 3 * BT + 40)
    _drop(_files(tmp_path))
    r, k2, v2, direct = _restore(tmp_path, toks, threads, direct_reads=False)
    assert r.n_tokens == toks.size and direct == 0
    np.testing.assert_array_equal(k2, k)
    np.testing.assert_array_equal(v2, v)


def test_windows_are_page_aligned_and_cover_every_piece():
    segs = [(bytearray(4 * BT * ROW), 4, BT, ROW), (bytearray(2 * BT * ROW // 2), 2, BT, ROW // 2)]
    pieces = plan(segs, 100)  # a partial block: pieces not on page boundaries
    wins = windows(pieces, limit=64 << 10)
    got = [p for _, _, ps in wins for p in ps]
    assert got == pieces
    for start, n, ps in wins:
        assert start % PAGE == 0 and n % PAGE == 0
        assert all(start <= off and off + m <= start + n for off, m, _ in ps)
    assert max(n for _, n, _ in windows(plan(segs, BT))) <= WINDOW
