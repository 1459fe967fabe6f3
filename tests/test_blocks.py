"""storage._blocks against its oracles: the xxhash package for XXH3-64, storage.reference
for pack/unpack; AlignedBuffer view counting; file I/O on real files; GIL release; strided
exporters refused; the hash-loop self-check and its fallback; kernels shared by threads."""

from __future__ import annotations

import logging
import os
import random
import re
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import xxhash

from mlxkv.storage import _blocks as B
from mlxkv.storage import reference as R

RNG = np.random.default_rng(20261130)
DATA = RNG.integers(0, 256, 20_000, dtype=np.uint8).tobytes()
SEEDS = [0, 1, 0x9E3779B97F4A7C15, 2**64 - 1]


ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(params=B.hash_isas())
def isa(request):
    """Run a test once per stripe loop this CPU supports (all must agree bit for bit)."""
    before = B.hash_isa()
    assert B.set_hash_isa(request.param) == request.param  # it passed its self-check
    yield request.param
    B.set_hash_isa(before)


def _run_python(code: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run code in a fresh interpreter at the repository root (a crash fails, not kills, the test)."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


# ------------------------------------------------------------------------ XXH3-64


def test_hash_every_length_0_to_10000(isa):
    mv = memoryview(DATA)
    seed = 0x1234_5678_9ABC_DEF0
    for n in range(10_001):
        off = n % 64  # every start offset 0..63 into the buffer
        piece = mv[off : off + n]
        assert B.xxh3_64(piece) == xxhash.xxh3_64_intdigest(piece), n
        assert B.xxh3_64(piece, seed) == xxhash.xxh3_64_intdigest(piece, seed), n


def test_hash_random_lengths_and_seeds():
    rnd = random.Random(7)
    mv = memoryview(DATA)
    edges = [0, 1, 2, 3, 4, 8, 9, 16, 17, 32, 33, 64, 65, 96, 97, 128, 129, 239, 240, 241,
             255, 256, 257, 1023, 1024, 1025, 2048, 4096 + 63, 16_384]
    for n in edges + [rnd.randrange(0, 20_000) for _ in range(300)]:
        seed = rnd.choice(SEEDS + [rnd.getrandbits(64)])
        off = rnd.randrange(0, 20_000 - n + 1)
        piece = mv[off : off + n]
        assert B.xxh3_64(piece, seed) == xxhash.xxh3_64_intdigest(piece, seed), (n, seed)


def test_hash_large_buffer_unaligned_offsets(isa):
    big = RNG.integers(0, 256, 5_000_000 + 64, dtype=np.uint8)
    mv = memoryview(big)
    for off in (0, 1, 7, 13, 63):
        for seed in (0, 0xDEADBEEF):
            piece = mv[off : off + 5_000_000 - off * 1001]
            assert B.xxh3_64(piece, seed) == xxhash.xxh3_64_intdigest(piece, seed), (off, seed)


@pytest.fixture(scope="module")
def over_4_gib():
    """(unaligned view of 4 GiB + 4,099 bytes, its xxh3_64 with seed 0x5EED). np.zeros maps
    untouched pages to the shared zero page, so this costs hashing time, not memory."""
    n = (4 << 30) + 4_099
    big = np.zeros(n + 1, np.uint8)
    for pos in (1, (1 << 32) - 1, 1 << 32, n - 5):
        big[pos] = pos % 251 + 1
    mv = memoryview(big)[1:]
    return mv, xxhash.xxh3_64_intdigest(mv, 0x5EED)


def test_hash_over_4_gib(isa, over_4_gib):
    # Lengths past 2**32: a 32-bit truncation anywhere would change the hash.
    mv, want = over_4_gib
    assert B.xxh3_64(mv, 0x5EED) == want
    h = B.Xxh3Hasher(0x5EED)
    h.update(mv[: (1 << 32) + 17])
    h.update(mv[(1 << 32) + 17 :])
    assert h.digest() == want and h.length == len(mv)


def test_hash_accepts_buffers_and_rejects_others():
    arr = np.arange(1000, dtype=np.float32)
    assert B.xxh3_64(arr) == xxhash.xxh3_64_intdigest(arr.tobytes())
    assert B.xxh3_64(bytearray(b"abc")) == xxhash.xxh3_64_intdigest(b"abc")
    with pytest.raises(TypeError):
        B.xxh3_64("not bytes")
    with pytest.raises(ValueError, match="contiguous"):
        B.xxh3_64(np.arange(100, dtype=np.uint8)[::2])
    with pytest.raises(OverflowError):
        B.xxh3_64(b"x", -1)


def test_streaming_hasher_any_chunking(isa):
    rnd = random.Random(3)
    for _ in range(150):
        n = rnd.choice([0, 1, 240, 241, 256, 257, 320, 1024, 1025, rnd.randrange(0, 12_000)])
        seed = rnd.choice(SEEDS)
        h = B.Xxh3Hasher(seed)
        pos = 0
        while pos < n:
            k = min(n - pos, rnd.choice([1, 3, 63, 64, 65, 255, 256, 257, rnd.randrange(1, 5000)]))
            h.update(DATA[pos : pos + k])
            pos += k
        assert h.length == n
        assert h.digest() == xxhash.xxh3_64_intdigest(DATA[:n], seed), (n, seed)


# ------------------------------------------------------------------ pack / unpack


def _kv_bf16(layers=3, heads=8, t_cap=300, dim=128):
    """mlx-lm KVCache-like keys/values [1, H, T_cap, D] as raw bf16 bits (uint16)."""
    segs = []
    for _ in range(layers * 2):
        a = RNG.integers(0, 2**16, (1, heads, t_cap, dim), dtype=np.uint16)
        segs.append((a, heads, t_cap, dim * 2))
    return segs


def _kv_f32(t_cap=64):
    a = RNG.standard_normal((2, 4, t_cap, 64), dtype=np.float32)
    b = RNG.standard_normal((2, 4, t_cap, 64), dtype=np.float32)
    return [(a, 8, t_cap, 256), (b, 8, t_cap, 256)]


def _kv_quantized(t_cap=200, heads=4, dim=128, bits=4, group=64):
    """QuantizedKVCache-like: packed uint32 + scales + biases per K and V."""
    segs = []
    for _ in range(2):  # K, V
        packed = RNG.integers(0, 2**32, (1, heads, t_cap, dim * bits // 32), dtype=np.uint32)
        scales = RNG.integers(0, 2**16, (1, heads, t_cap, dim // group), dtype=np.uint16)
        biases = RNG.integers(0, 2**16, (1, heads, t_cap, dim // group), dtype=np.uint16)
        segs += [(packed, heads, t_cap, dim * bits // 8), (scales, heads, t_cap, dim // group * 2),
                 (biases, heads, t_cap, dim // group * 2)]
    return segs


def _odd_rows(t_cap=37):
    """Odd row sizes and mixed exporters: bytes, bytearray, AlignedBuffer, memoryview."""
    a = RNG.integers(0, 256, 5 * t_cap * 3, dtype=np.uint8).tobytes()
    b = bytearray(RNG.integers(0, 256, 3 * t_cap * 7, dtype=np.uint8).tobytes())
    c = B.AlignedBuffer(2 * t_cap * 1)
    memoryview(c)[:] = RNG.integers(0, 256, 2 * t_cap, dtype=np.uint8).tobytes()
    d = memoryview(RNG.integers(0, 256, (1, t_cap, 13), dtype=np.uint8))
    return [(a, 5, t_cap, 3), (b, 3, t_cap, 7), (c, 2, t_cap, 1), (d, 1, t_cap, 13)]


LAYOUTS = {"bf16_kv": _kv_bf16, "f32": _kv_f32, "quantized": _kv_quantized, "odd_rows": _odd_rows}


def _ranges(t_cap):
    return [(0, t_cap), (0, 1), (t_cap - 1, t_cap), (0, 0), (t_cap, t_cap), (5, t_cap // 2 + 3),
            (t_cap // 3, t_cap)]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pack_matches_reference_and_hash(layout, isa):
    segs = LAYOUTS[layout]()
    t_cap = segs[0][2]
    for t0, t1 in _ranges(t_cap):
        n = B.packed_size(segs, t1 - t0)
        assert n == R.packed_size(segs, t1 - t0)
        for off in (0, 3):
            seed = 0xABCDEF if off else 0
            ours = bytearray(b"\xa5" * (n + off + 9))  # sentinel bytes around the block
            ref = bytearray(ours)
            got = B.pack(ours, off, segs, t0, t1, seed)
            exp = R.pack(ref, off, segs, t0, t1, seed)
            assert got == exp
            assert ours == ref  # same bytes, nothing written outside [off, off + n)
            assert got[1] == xxhash.xxh3_64_intdigest(bytes(ours[off : off + n]), seed)
            assert B.pack(ours, off, segs, t0, t1, seed, hash=False) == (n, None)
            assert R.pack(ref, off, segs, t0, t1, seed, hash=False) == (n, None)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_unpack_matches_reference_and_round_trips(layout):
    segs = LAYOUTS[layout]()
    t_cap = segs[0][2]
    for t0, t1 in _ranges(t_cap):
        n = B.packed_size(segs, t1 - t0)
        block = B.AlignedBuffer(n + 5)
        got = B.pack(block, 5, segs, t0, t1, 42)
        # Unpack into zeroed copies of every segment, with ours and with the reference.
        ours = [(np.zeros(len(memoryview(s[0]).cast("B")), np.uint8),) + tuple(s[1:]) for s in segs]
        ref = [(np.zeros_like(o[0]),) + tuple(o[1:]) for o in ours]
        assert B.unpack(block, 5, ours, t0, t1 - t0) == n
        assert R.unpack(block, 5, ref, t0, t1 - t0) == n
        for (o, outer, cap, rb), (r, *_), src in zip(ours, ref, segs):
            assert np.array_equal(o, r)
            rows = o.reshape(outer, cap * rb)
            orig = np.frombuffer(memoryview(src[0]).cast("B"), np.uint8).reshape(outer, cap * rb)
            assert np.array_equal(rows[:, t0 * rb : t1 * rb], orig[:, t0 * rb : t1 * rb])
            assert not rows[:, : t0 * rb].any() and not rows[:, t1 * rb :].any()
        fresh = [(np.zeros_like(o[0]),) + tuple(o[1:]) for o in ours]
        assert B.unpack_hash(block, 5, fresh, t0, t1 - t0, 42) == got
        assert R.unpack_hash(block, 5, ref, t0, t1 - t0, 42) == got
        assert all(np.array_equal(f[0], o[0]) for f, o in zip(fresh, ours))


@pytest.mark.parametrize("dst_offset, rb", [(0, 1024), (8, 1024), (0, 1000)])
def test_large_pack_streaming_stores_match_reference(dst_offset, rb, isa):
    # Beyond STREAM_MIN_BYTES the fused copy uses non-temporal stores (aligned: in the
    # stripe loop; unaligned: hash then stream-copy), with the hash state carrying odd tails.
    heads, t_cap = 8, 600
    segs = [(RNG.integers(0, 256, heads * t_cap * rb, dtype=np.uint8), heads, t_cap, rb)
            for _ in range(2)]
    t0, t1 = 3, 600
    n = B.packed_size(segs, t1 - t0)
    assert n >= B.STREAM_MIN_BYTES
    ours = B.AlignedBuffer(n + dst_offset)
    ref = bytearray(n + dst_offset)
    got = B.pack(ours, dst_offset, segs, t0, t1, 9)
    assert got == R.pack(ref, dst_offset, segs, t0, t1, 9)
    assert bytes(memoryview(ours)[dst_offset:]) == bytes(ref[dst_offset:])
    back = [(np.zeros_like(s[0]),) + tuple(s[1:]) for s in segs]
    assert B.unpack_hash(ours, dst_offset, back, t0, t1 - t0, 9) == got
    for (a, *_), (b, *_) in zip(back, segs):
        rows, orig = a.reshape(heads, -1), b.reshape(heads, -1)
        assert np.array_equal(rows[:, t0 * rb :], orig[:, t0 * rb :])


def test_unpack_to_another_position():
    segs = _kv_bf16(layers=1, heads=2, t_cap=40, dim=8)
    block = bytearray(B.packed_size(segs, 10))
    B.pack(block, 0, segs, 30, 40)
    dst = [(np.zeros_like(s[0]),) + tuple(s[1:]) for s in segs]
    B.unpack(block, 0, dst, 0, 10)
    for (d, *_), (s, *_) in zip(dst, segs):
        assert np.array_equal(d[:, :, 0:10], s[:, :, 30:40])
        assert not d[:, :, 10:].any()


def test_pack_and_unpack_bounds_errors():
    segs = _kv_f32(t_cap=16)
    n = B.packed_size(segs, 4)
    dst = bytearray(n)
    untouched = bytes(dst)
    bad_calls = [
        lambda: B.pack(dst, 0, segs, 0, 17),  # past t_capacity
        lambda: B.pack(dst, 0, segs, 5, 4),  # t1 < t0
        lambda: B.pack(dst, 0, segs, -1, 3),
        lambda: B.pack(dst, 1, segs, 0, 4),  # one byte too many
        lambda: B.pack(dst, -1, segs, 0, 4),
        lambda: B.pack(dst, n + 1, segs, 0, 0),
        lambda: B.pack(bytearray(n - 1), 0, segs, 0, 4),
        lambda: B.pack(dst, 0, [(segs[0][0], 8, 16, 255)], 0, 1),  # size mismatch
        lambda: B.pack(dst, 0, [(segs[0][0], 8, 16)], 0, 1),  # malformed tuple
        lambda: B.pack(dst, 0, [(segs[0][0], -8, -16, 256)], 0, 1),
        lambda: B.pack(b"\0" * n, 0, segs, 0, 4),  # read-only destination
        lambda: B.pack(dst, 0, [(segs[0][0][:, :, ::2], 8, 8, 256)], 0, 1),  # not contiguous
        lambda: B.unpack(bytes(n - 1), 0, segs, 0, 4),
        lambda: B.unpack(bytes(n), 0, segs, 13, 4),
        lambda: B.unpack(bytes(n), 0, segs, 0, -1),
        lambda: B.unpack(bytes(n), 0, [(bytes(8 * 16 * 256), 8, 16, 256)], 0, 4),  # read-only
    ]
    for call in bad_calls:
        with pytest.raises(ValueError):
            call()
        assert bytes(dst) == untouched
    with pytest.raises(TypeError):
        B.pack(dst, 0, [(object(), 1, 1, 1)], 0, 1)
    own = np.zeros((4, 16, 8), np.uint8)  # packing a buffer into itself: overlapping memcpy
    with pytest.raises(ValueError, match="overlaps"):
        B.pack(own, 0, [(own[:2], 2, 16, 8)], 0, 16)
    with pytest.raises(ValueError, match="overlaps"):
        B.unpack(own.reshape(-1), 128, [(own[1:3], 2, 16, 8)], 0, 4)
    with pytest.raises(ValueError):
        B.packed_size(segs, -1)
    # The reference agrees on what is an error.
    with pytest.raises(ValueError):
        R.pack(dst, 0, segs, 0, 17)
    with pytest.raises(ValueError):
        R.unpack(bytes(n - 1), 0, segs, 0, 4)


# ------------------------------------------------------------------ AlignedBuffer


@pytest.mark.parametrize("alignment", [64, 4096, 1 << 16])
def test_aligned_buffer_alignment_and_contents(alignment):
    buf = B.AlignedBuffer(10_000, alignment, zero=True)
    assert buf.address % alignment == 0
    assert (buf.nbytes, buf.alignment, len(buf)) == (10_000, alignment, 10_000)
    mv = memoryview(buf)
    assert (mv.format, mv.ndim, mv.shape, mv.readonly) == ("B", 1, (10_000,), False)
    assert mv.tobytes() == bytes(10_000)
    mv[100:103] = b"abc"
    assert bytes(np.frombuffer(buf, np.uint8)[100:103]) == b"abc"
    mv.release()
    with pytest.raises(ValueError):
        B.AlignedBuffer(10, 3000)
    with pytest.raises(ValueError):
        B.AlignedBuffer(-1)


def test_aligned_buffer_counts_views_and_refuses_resize_or_free():
    buf = B.AlignedBuffer(4096)
    memoryview(buf)[:4] = b"keep"
    assert buf.exports == 0
    mv = memoryview(buf)
    arr = np.frombuffer(buf, np.uint8)
    assert buf.exports == 2
    with pytest.raises(BufferError):
        buf.resize(8192)
    with pytest.raises(BufferError):
        buf.free()
    mv.release()
    assert buf.exports == 1
    with pytest.raises(BufferError):
        buf.resize(8192)
    del arr
    assert buf.exports == 0
    buf.resize(8192)
    assert buf.nbytes == 8192 and buf.address % 4096 == 0
    assert bytes(memoryview(buf)[:4]) == b"keep"
    buf.free()
    assert buf.freed and buf.nbytes == 0
    with pytest.raises(BufferError):
        memoryview(buf)
    buf.resize(100)  # reallocates after free
    assert len(memoryview(buf)) == 100


def test_aligned_buffer_resize_zero_fills_growth():
    buf = B.AlignedBuffer(10, zero=True)
    memoryview(buf)[:] = b"x" * 10
    buf.resize(5000)
    data = bytes(memoryview(buf))
    assert data[:10] == b"x" * 10 and data[10:] == bytes(4990)


# ------------------------------------------------------------------ file I/O


def _random_aligned(n):
    buf = B.AlignedBuffer(n)
    memoryview(buf)[:] = RNG.integers(0, 256, n, dtype=np.uint8).tobytes()
    return buf


@pytest.mark.parametrize("direct", [True, False])
def test_write_fsync_read_round_trip(tmp_path, direct):
    path = tmp_path / "block.bin"
    fd, is_direct = B.open_direct(path, os.O_CREAT | os.O_RDWR | os.O_EXCL, 0o600, direct=direct)
    try:
        if not direct:
            assert is_direct is False
        if is_direct and sys.platform.startswith("linux"):
            import fcntl

            assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT
        data = _random_aligned(1 << 20)
        assert B.pwrite_full(fd, data, 0) == 1 << 20
        assert B.pwrite_full(fd, data, 1 << 20) == 1 << 20
        B.fdatasync(fd)
        B.fsync(fd)
        B.fsync_dir(tmp_path)
        assert isinstance(B.drop_cache(fd), bool)
        back = B.AlignedBuffer(2 << 20)
        assert B.pread_full(fd, back, 0) == 2 << 20
        assert bytes(memoryview(back)[: 1 << 20]) == bytes(memoryview(data))
        assert bytes(memoryview(back)[1 << 20 :]) == bytes(memoryview(data))
        # Short read only at end of file.
        assert B.pread_full(fd, back, 1 << 20) == 1 << 20
        assert B.pread_full(fd, back, 4 << 20) == 0
    finally:
        os.close(fd)
    assert path.stat().st_size == 2 << 20


def test_buffered_fallback_takes_unaligned_buffers(tmp_path):
    path = tmp_path / "tail.bin"
    fd, _ = B.open_direct(path, os.O_CREAT | os.O_RDWR, direct=True)
    try:
        B.set_direct(fd, False)  # e.g. to write an unaligned tail
        payload = DATA[:12_345]
        assert B.pwrite_full(fd, memoryview(payload)[1:], 7) == 12_344
        back = bytearray(12_344)
        assert B.pread_full(fd, back, 7) == 12_344
        assert bytes(back) == payload[1:]
    finally:
        os.close(fd)


def test_pwritev_writes_buffers_back_to_back(tmp_path):
    path = tmp_path / "vec.bin"
    parts = [_random_aligned(8192), b"hello", bytearray(b"x" * 3000), memoryview(DATA)[:1500], b""]
    parts += [bytes([i % 256]) * (i % 7 + 1) for i in range(1500)]  # more vectors than IOV_MAX
    expect = b"".join(bytes(memoryview(p)) for p in parts)
    with open(path, "wb") as f:
        f.write(b"\0" * 10)
    fd = os.open(path, os.O_RDWR)
    try:
        assert B.pwritev_full(fd, parts, 10) == len(expect)
        B.fsync(fd)
    finally:
        os.close(fd)
    assert path.read_bytes() == b"\0" * 10 + expect


def test_io_errors_carry_errno_and_filename(tmp_path):
    missing = tmp_path / "no" / "such.bin"
    with pytest.raises(FileNotFoundError) as exc:
        B.open_direct(missing, os.O_RDONLY)
    assert exc.value.filename == str(missing)
    with pytest.raises(FileNotFoundError):
        B.fsync_dir(tmp_path / "nodir")
    r, w = os.pipe()
    os.close(r)
    os.close(w)
    with pytest.raises(OSError) as exc:
        B.pwrite_full(w, b"abc", 0, path="closed-fd")
    assert exc.value.errno == 9 and exc.value.filename == "closed-fd"  # EBADF
    with pytest.raises(OSError):
        B.pread_full(w, bytearray(3), 0)
    with pytest.raises(OSError):
        B.fsync(w)
    with pytest.raises(ValueError):
        B.pwrite_full(0, b"x", -1)
    ro = tmp_path / "ro.bin"
    ro.write_bytes(b"abc")
    fd = os.open(ro, os.O_RDONLY)
    try:
        with pytest.raises(ValueError):  # destination must be writable
            B.pread_full(fd, b"xyz", 0)
    finally:
        os.close(fd)


# ------------------------------------------------------------------ the GIL


def _progress_during(call, attempts=20):
    """True if another Python thread ran while ``call()`` was executing.

    The switch interval is raised so the calling thread never hands the GIL over on its
    own; the counter thread sleeps between iterations so it never hogs the GIL. Then the
    counter can only advance between the two reads if ``call`` released the GIL.
    """
    running, stop = threading.Event(), threading.Event()
    count = [0]

    def counter():
        while not stop.is_set():
            count[0] += 1
            running.set()
            stop.wait(0.0002)

    old = sys.getswitchinterval()
    t = threading.Thread(target=counter)
    t.start()
    try:
        running.wait()
        sys.setswitchinterval(10.0)
        # A thread that began waiting for the GIL under the old interval would still ask for
        # it after 5 ms, inside call(): let every such wait end here first.
        time.sleep(0.05)
        for _ in range(attempts):  # the OS may not schedule the counter in one call's time
            before = count[0]
            call()
            if count[0] > before:
                return True
        return False
    finally:
        sys.setswitchinterval(old)
        stop.set()
        t.join()


def test_kernels_and_io_release_the_gil(tmp_path):
    src = np.ones((64, 1024, 1024), np.uint8)  # 64 MiB, 64 outer slices
    segs = [(src, 64, 1024, 1024)]
    dst = B.AlignedBuffer(src.nbytes)
    assert _progress_during(lambda: B.pack(dst, 0, segs, 0, 1024))
    assert _progress_during(lambda: B.pack(dst, 0, segs, 0, 1024, hash=False))
    assert _progress_during(lambda: B.unpack(dst, 0, segs, 0, 1024))
    assert _progress_during(lambda: B.unpack_hash(dst, 0, segs, 0, 1024))
    assert _progress_during(lambda: B.unpack_hash(dst, 0, segs, 0, 1024, hasher=B.Xxh3Hasher()))
    assert _progress_during(lambda: B.xxh3_64(dst))
    assert _progress_during(lambda: B.Xxh3Hasher().update(dst))
    grow = B.AlignedBuffer(src.nbytes, zero=True)
    assert _progress_during(lambda: grow.resize(grow.nbytes + 4096))
    fd = os.open(tmp_path / "gil.bin", os.O_CREAT | os.O_RDWR)
    try:
        assert _progress_during(lambda: B.pwrite_full(fd, dst, 0))
        assert _progress_during(lambda: B.pread_full(fd, dst, 0))
    finally:
        os.close(fd)


def test_gil_probe_detects_a_call_that_holds_the_gil():
    # The probe itself must be able to fail: a pure-Python busy loop keeps the GIL.
    def busy():
        x = 0
        for i in range(100_000):
            x += i

    assert not _progress_during(busy, attempts=5)


# ------------------------------------------------------------------ strided exporters


def _strided_numpy():
    a = RNG.integers(0, 256, (8, 64), dtype=np.uint8)
    return {"every_other_row": a[::2], "column_slice": a[:, 1:33], "transposed": a.T,
            "reversed": a[::-1], "broadcast": np.broadcast_to(a[0], (8, 64))}


def _refusals(buf, nbytes):
    """Every kernel entry point that takes a buffer, handed ``buf`` in each role."""
    flat = bytearray(nbytes + 64)
    return {
        "xxh3_64": lambda: B.xxh3_64(buf),
        "Xxh3Hasher.update": lambda: B.Xxh3Hasher().update(buf),
        "pack segment": lambda: B.pack(flat, 0, [(buf, 1, 1, nbytes)], 0, 1),
        "pack dst": lambda: B.pack(buf, 0, [(bytes(1), 1, 1, 1)], 0, 1),
        "unpack src": lambda: B.unpack(buf, 0, [(bytearray(1), 1, 1, 1)], 0, 1),
        "unpack segment": lambda: B.unpack(flat, 0, [(buf, 1, 1, nbytes)], 0, 1),
        "unpack_hash segment": lambda: B.unpack_hash(flat, 0, [(buf, 1, 1, nbytes)], 0, 1),
        "pwrite_full": lambda: B.pwrite_full(-1, buf, 0),
        "pwritev_full": lambda: B.pwritev_full(-1, [b"ok", buf], 0),
        "pread_full": lambda: B.pread_full(-1, buf, 0),
    }


def _assert_refused(calls: dict, match: str) -> None:
    for name, call in calls.items():
        try:
            call()
        except ValueError as exc:
            assert re.search(match, str(exc)), (name, str(exc))
        else:
            pytest.fail(f"{name} accepted a strided buffer")


@pytest.mark.parametrize("name", list(_strided_numpy()))
def test_strided_numpy_views_are_refused_by_every_entry_point(name):
    view = _strided_numpy()[name]
    _assert_refused(_refusals(view, view.nbytes), "contiguous|read-only")


def _mlx_cases():
    mx = pytest.importorskip("mlx.core")
    a = mx.arange(8 * 64).astype(mx.uint8).reshape(8, 64)
    strided = {"every_other_row": a[::2], "column_slice": a[:, 1:33], "transposed": a.T,
               "broadcast": mx.broadcast_to(a[0], (8, 64)),
               "broadcast_column": mx.broadcast_to(a[:, :1], (8, 64))}
    contiguous = {"whole": a, "row_slice": a[2:5], "column_slice_of_one_row": a[3, 5:40]}
    mx.eval(*strided.values(), *contiguous.values())
    return mx, strided, contiguous


def test_mlx_strided_arrays_are_refused_never_misread():
    # MLX ignores the request for contiguous memory and reports len = nbytes over strided
    # memory: the kernel must check what it got, or it reads the wrong bytes.
    mx, strided, contiguous = _mlx_cases()
    for name, arr in strided.items():
        assert not memoryview(arr).c_contiguous, name  # the exporter says so in its strides
        calls = _refusals(arr, arr.nbytes)
        for writes in ("pack dst", "unpack segment", "unpack_hash segment", "pread_full"):
            del calls[writes]  # mlx arrays export read-only: refused for that already
        _assert_refused(calls, "not C-contiguous")
    for name, arr in contiguous.items():
        want = np.array(arr).tobytes()
        assert B.xxh3_64(arr) == xxhash.xxh3_64_intdigest(want), name
        out = bytearray(len(want))
        assert B.pack(out, 0, [(arr, 1, 1, len(want))], 0, 1)[0] == len(want)
        assert bytes(out) == want, name


# ------------------------------------------------------------------ hash-loop self-check


def _kat_input(n: int) -> bytes:
    i = np.arange(n, dtype=np.uint64)
    return (((i * np.uint64(0x9E3779B1)) & np.uint64(0xFFFFFFFF)) >> np.uint64(24)).astype(np.uint8).tobytes()


def test_self_check_vectors_are_xxhash_answers():
    for n, h0, h1 in B._KAT:
        data = _kat_input(n)
        assert xxhash.xxh3_64_intdigest(data, 0) == h0, n
        assert xxhash.xxh3_64_intdigest(data, B._KAT_SEED) == h1, n


def test_every_hash_loop_passes_the_self_check():
    assert B.hash_self_check() is None
    for name in B.hash_isas():
        assert B.hash_self_check(name) is None, name
    with pytest.raises(ValueError, match="not available"):
        B.hash_self_check("no-such-loop")


def test_failed_self_check_falls_back_to_scalar_with_one_warning(caplog):
    vector = [name for name in B.hash_isas() if name != "scalar"]
    if not vector:
        pytest.skip("only the scalar loop runs on this CPU")
    before = B.hash_isa()
    try:
        with caplog.at_level(logging.WARNING, logger="mlxkv.storage"):
            assert B.set_hash_isa(vector[-1], tamper=1) == "scalar"
            assert B.hash_isa() == "scalar"
            assert B.set_hash_isa(vector[-1], tamper=1 << 40) == "scalar"  # same condition again
        warnings = [r for r in caplog.records if r.name == "mlxkv.storage"]
        assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
        assert vector[-1] in warnings[0].getMessage() and "scalar" in warnings[0].getMessage()
        assert B.xxh3_64(DATA) == xxhash.xxh3_64_intdigest(DATA)  # the fallback hashes right
    finally:
        B.set_hash_isa(before)
    assert B.hash_isa() == before


def test_import_selects_a_checked_loop_and_never_raises():
    probe = "from mlxkv.storage import _blocks as B; print(B.hash_isa(), B.hash_self_check())"
    r = _run_python(probe, {"MLXKV_XXH3_ISA": "scalar"})
    assert r.returncode == 0 and r.stdout.split() == ["scalar", "None"], r.stderr
    r = _run_python("import logging; logging.basicConfig(); " + probe, {"MLXKV_XXH3_ISA": "bogus"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [B.set_hash_isa("best"), "None"]
    assert "MLXKV_XXH3_ISA='bogus' is not usable" in r.stderr and "Traceback" not in r.stderr


# ------------------------------------------------------------------ verified unpack


@pytest.mark.parametrize("layout", LAYOUTS)
def test_unpack_hash_is_the_hash_of_what_landed(layout, isa):
    segs = LAYOUTS[layout]()
    t_cap = segs[0][2]
    for t0, t1 in _ranges(t_cap):
        n = B.packed_size(segs, t1 - t0)
        block = bytearray(n + 3)
        _, h = B.pack(block, 3, segs, t0, t1, 77)
        dst = [(np.zeros(len(memoryview(s[0]).cast("B")), np.uint8),) + tuple(s[1:]) for s in segs]
        assert B.unpack_hash(block, 3, dst, t0, t1 - t0, 77) == (n, h)
        # Re-pack the destination rows: the same bytes, so the same hash.
        again = bytearray(n)
        assert B.pack(again, 0, dst, t0, t1, 77) == (n, h) and again == block[3:]


def test_unpack_hash_every_length_and_alignment(isa):
    src = np.frombuffer(DATA, np.uint8)
    dst = np.zeros(4096 + 128, np.uint8)
    for n in range(4097):
        so, do = n % 63 + 1, (n * 7) % 64
        _, h = B.unpack_hash(src[so : so + n], 0, [(dst[do : do + n], 1, 1, n)], 0, 1, n)
        assert h == xxhash.xxh3_64_intdigest(src[so : so + n], n), n
        assert bytes(dst[do : do + n]) == bytes(src[so : so + n]), n


def test_unpack_hash_into_a_hasher_in_pieces():
    segs = _kv_bf16(layers=2, heads=4, t_cap=64, dim=64)
    n = B.packed_size(segs, 64)
    block = bytearray(n)
    _, h = B.pack(block, 0, segs, 0, 64, 5)
    dst = [(np.zeros_like(s[0]),) + tuple(s[1:]) for s in segs]
    hasher = B.Xxh3Hasher(5)
    pos = 0
    for seg in dst:  # one segment per call, as a piecewise restore does
        k, _ = B.unpack_hash(block, pos, [seg], 0, 64, hasher=hasher)
        pos += k
    assert pos == n and hasher.digest() == h and hasher.length == n
    assert all(np.array_equal(d[0], s[0]) for d, s in zip(dst, segs))
    class IntDigest:  # the reference takes any hasher with update() and an int digest()
        def __init__(self, seed: int) -> None:
            self.h = xxhash.xxh3_64(seed=seed)
            self.update = self.h.update
            self.digest = self.h.intdigest

    ref = IntDigest(5)
    pos = 0
    for seg in dst:
        pos += R.unpack_hash(block, pos, [seg], 0, 64, hasher=ref)[0]
    assert ref.digest() == h


def test_unpack_refuses_overlapping_destinations():
    # Two destinations sharing bytes: the second scatter overwrites the first after it
    # landed, so a hash of the packed bytes would pass over wrong KV rows. Refused up front.
    segs = _kv_f32(t_cap=16)
    n = B.packed_size(segs, 16)
    block = bytearray(n)
    B.pack(block, 0, segs, 0, 16)
    one = np.zeros_like(segs[0][0])
    size = one.nbytes
    shared = np.zeros(2 * size - 4096, np.uint8)
    for dst in ([(one,) + segs[0][1:], (one,) + segs[1][1:]],  # the same array twice
                [(shared[:size],) + segs[0][1:], (shared[size - 4096 :],) + segs[1][1:]]):
        for call in (B.unpack, B.unpack_hash, R.unpack, R.unpack_hash):
            with pytest.raises(ValueError, match="overlaps segment"):
                call(block, 0, dst, 0, 16)
            assert not one.any() and not shared.any()  # refused before writing anything
    a = np.zeros(8 * 16 * 256 * 2, np.uint8)  # adjacent halves of one array are fine
    assert B.unpack_hash(block, 0, [(a[: a.size // 2], 8, 16, 256), (a[a.size // 2 :], 8, 16, 256)],
                         0, 16)[0] == n


def test_unpack_hash_takes_segments_from_an_iterator():
    segs = _kv_f32(t_cap=8)
    n = B.packed_size(segs, 8)
    block = bytearray(n)
    _, h = B.pack(block, 0, iter(segs), 0, 8, 3)
    dst = [(np.zeros_like(s[0]),) + tuple(s[1:]) for s in segs]
    assert B.unpack_hash(block, 0, (d for d in dst), 0, 8, 3) == (n, h)
    assert all(np.array_equal(d[0], s[0]) for d, s in zip(dst, segs))


def test_segment_dimensions_beyond_ssize_t_are_a_value_error():
    with pytest.raises(ValueError, match="too large"):
        B.pack(bytearray(8), 0, [(b"", 0, 2**70, 1)], 0, 0)


# ------------------------------------------------------------------ threads


def test_aligned_buffer_resize_copy_is_not_raced_by_other_threads():
    # resize copies with the GIL released; other threads' resize/free/new views must be
    # refused meanwhile, never free or export the memory being copied. In a subprocess: on
    # a racing implementation this is a use-after-free or double free (a crash).
    r = _run_python("""
        import threading
        from mlxkv.storage import _blocks as B
        N = 32 << 20
        buf = B.AlignedBuffer(N)
        memoryview(buf)[:8] = b"pattern!"
        refused, errors = [0], []

        def guard(fn):
            try:
                fn()
            except BufferError as exc:
                if "another thread" in str(exc):
                    refused[0] += 1
                elif "live view" not in str(exc):
                    errors.append(exc)

        def resizer(start):
            start.wait()
            for i in range(16):
                guard(lambda: buf.resize(N + (i % 2) * 4096))

        def look():
            with memoryview(buf) as mv:
                assert mv[:8] == b"pattern!", bytes(mv[:8])

        def race(other, resizers):
            # `other` runs over and over until the resizers are done
            start, stop = threading.Barrier(resizers + 1, timeout=30), threading.Event()
            def loop():
                start.wait()
                while not stop.is_set():
                    guard(other)
            threads = [threading.Thread(target=resizer, args=(start,)) for _ in range(resizers)]
            looper = threading.Thread(target=loop)
            for t in threads + [looper]:
                t.start()
            for t in threads:
                t.join(120)
            stop.set()
            looper.join(120)
            assert not errors, errors

        race(look, 2)  # two resizers and a reader of new views
        assert bytes(memoryview(buf)[:8]) == b"pattern!"
        assert buf.exports == 0 and not buf.freed
        race(buf.free, 1)  # a resizer and a freer
        print("ok", refused[0])
    """)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert r.stdout.startswith("ok") and int(r.stdout.split()[1]) > 0, r.stdout  # they did overlap


def test_hasher_shared_by_threads_serializes_updates():
    # Two threads feed one hasher whole periods of one pattern, large updates (GIL released)
    # and small ones (GIL held): every interleaving of whole updates gives the same input, so
    # the digest is exact unless two updates overlapped (a corrupted state).
    period = RNG.integers(0, 256, 100, dtype=np.uint8)
    big, small = np.tile(period, 40_000), period
    h = B.Xxh3Hasher(11)
    rounds = 64
    start = threading.Barrier(2, timeout=60)

    def feed():
        start.wait()
        for _ in range(rounds):
            h.update(big)
            h.update(small)
        return True

    with ThreadPoolExecutor(2) as pool:
        assert all(f.result(timeout=120) for f in [pool.submit(feed) for _ in range(2)])
    n = 2 * rounds * (big.nbytes + small.nbytes)
    assert h.length == n
    assert h.digest() == xxhash.xxh3_64_intdigest(np.tile(period, n // 100), 11)


def test_switching_hash_loop_while_threads_hash():
    # Each hash runs one loop start to end, whatever another thread selects meanwhile.
    big = RNG.integers(0, 256, 3 << 20, dtype=np.uint8)
    want = xxhash.xxh3_64_intdigest(big, 9)
    segs = [(big.reshape(16, -1), 16, 1, big.nbytes // 16)]
    block = B.AlignedBuffer(big.nbytes)
    out = [(np.zeros_like(big).reshape(16, -1), 16, 1, big.nbytes // 16)]
    done, before = threading.Event(), B.hash_isa()

    def one_shot():
        return all(B.xxh3_64(big, 9) == want for _ in range(40))

    def streaming():
        ok = True
        for _ in range(20):
            h = B.Xxh3Hasher(9)
            for piece in np.array_split(big, 7):
                h.update(piece)
            ok &= h.digest() == want
        return ok

    def kernels():
        ok = True
        for _ in range(20):
            ok &= B.pack(block, 0, segs, 0, 1, 9) == (big.nbytes, want)
            ok &= B.unpack_hash(block, 0, out, 0, 1, 9) == (big.nbytes, want)
        return ok

    def switcher():
        names, i = B.hash_isas(), 0
        while not done.is_set():
            B.set_hash_isa(names[i % len(names)])
            i += 1
        return i

    try:
        with ThreadPoolExecutor(4) as pool:
            sw = pool.submit(switcher)
            work = [pool.submit(f) for f in (one_shot, streaming, kernels)]
            results = [f.result(timeout=300) for f in work]
            done.set()
            assert sw.result(timeout=60) > 1
        assert results == [True, True, True]
    finally:
        done.set()
        B.set_hash_isa(before)
