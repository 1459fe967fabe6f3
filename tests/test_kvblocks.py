"""Restore destinations allocated without a zero fill (engine.cache.buffers via
kvblocks.writable_arrays): real, distinct, writable buffers; restores into them are
byte-exact and stop at a corrupt block; a process using them exits cleanly."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlxkv.engine.cache import buffers as mxb
from mlxkv.engine.cache import kvblocks as kb

ROOT = Path(__file__).resolve().parent.parent


def _addr(a: mx.array) -> int:
    return int(np.frombuffer(kb.byte_view(a), dtype=np.uint8).ctypes.data)


SHAPES = [(1, 2, 512, 16), (1, 2, 512, 16), (3, 5), (7,), (), (1, 4, 256, 8), (2, 0, 3)]
DTYPES = [mx.bfloat16, mx.float32, mx.int8, mx.uint32, mx.float16, mx.bfloat16, mx.float32]


@pytest.mark.parametrize("alloc", [kb.writable_arrays, mxb.unfilled_arrays, mxb.zeroed_arrays])
def test_destinations_are_distinct_writable_buffers_and_hold_what_is_written(alloc):
    arrays = alloc(SHAPES, DTYPES)
    assert [tuple(a.shape) for a in arrays] == SHAPES
    assert [a.dtype for a in arrays] == DTYPES
    sized = [a for a in arrays if a.nbytes]
    assert len({_addr(a) for a in sized}) == len(sized)  # no two share a buffer
    rng = np.random.default_rng(7)
    want = []
    arrays = sized
    for a in arrays:
        mv = kb.byte_view(a)
        assert not mv.readonly and mv.nbytes == a.size * a.itemsize
        b = rng.integers(0, 256, size=mv.nbytes, dtype=np.uint8)
        mv[:] = b.tobytes()
        want.append(b)
    # every array holds exactly its own bytes (a write never lands in another one) ...
    for a, b in zip(arrays, want):
        assert bytes(kb.byte_view(a)) == b.tobytes()
    # ... and MLX reads them (a copy made by MLX holds the same bits)
    for a, b in zip(arrays, want):
        c = mx.concatenate([a.reshape(-1), a.reshape(-1)])
        mx.eval(c)
        assert bytes(memoryview(c).cast("B")) == b.tobytes() * 2


def test_unfilled_path_is_used_and_zeroed_fallback_is_zero():
    a = mxb.unfilled_arrays([(1, 8, 64, 128)], [mx.bfloat16])  # raises if MLX changed
    assert a[0].dtype == mx.bfloat16
    kb.writable_arrays([(4, 4)], [mx.float32])
    assert mxb.unfilled_usable()
    z = mxb.zeroed_arrays([(1, 2, 64, 8), (5,)], [mx.bfloat16, mx.int32])
    assert all(not any(bytes(kb.byte_view(x))) for x in z)


def test_prefault_keeps_contents():
    a = mxb.unfilled_arrays([(1, 8, 1024, 128), (3, 5)], [mx.bfloat16, mx.float32],
                            populate=False)
    want = np.random.default_rng(1).integers(0, 256, size=a[0].nbytes, dtype=np.uint8)
    kb.byte_view(a[0])[:] = want.tobytes()
    covered = mxb.prefault(a)
    if sys.platform.startswith("linux") and mxb._madvise:
        assert a[0].nbytes - 4096 <= covered <= a[0].nbytes  # the small one is skipped
    assert bytes(kb.byte_view(a[0])) == want.tobytes()


def test_writable_arrays_falls_back_to_zeros_for_good(monkeypatch, caplog):
    calls = []

    def broken(shapes, dtypes, **options):
        calls.append(1)
        raise RuntimeError("no .npy streams in this MLX")

    monkeypatch.setattr(mxb, "unfilled_arrays", broken)
    monkeypatch.setattr(mxb, "_given_up", None)
    arrays = kb.writable_arrays([(1, 2, 32, 8)] * 2, [mx.bfloat16] * 2)
    assert "zero-filled from now on" in caplog.text
    assert _addr(arrays[0]) != _addr(arrays[1])
    assert not any(bytes(kb.byte_view(arrays[0])))
    # once given up (as after MLX kept a stream past the release wait), the unfilled
    # path, and its wait on the engine thread, is never tried again; one warning
    assert not mxb.unfilled_usable()
    caplog.clear()
    again = kb.writable_arrays([(3, 5)], [mx.float32])
    assert len(calls) == 1 and not caplog.text and not any(bytes(kb.byte_view(again[0])))


def test_a_stream_kept_past_the_release_wait_switches_to_zeros_for_good(monkeypatch, caplog):
    kept = []  # stands for MLX holding a stream past the wait

    class KeptStream(mxb._Unfilled):
        def __init__(self, header: bytes) -> None:
            super().__init__(header)
            kept.append(self)

    monkeypatch.setattr(mxb, "_Unfilled", KeptStream)
    monkeypatch.setattr(mxb, "RELEASE_TIMEOUT_S", 0.01)
    monkeypatch.setattr(mxb, "_given_up", None)
    a = kb.writable_arrays([(2, 3)], [mx.float32])  # the wait times out: still usable
    assert a[0].shape == (2, 3) and kept
    assert not mxb.unfilled_usable() and caplog.text.count("zero-filled from now on") == 1
    n = len(kept)
    z = kb.writable_arrays([(4, 5)], [mx.float32])  # no stream, no wait: zeros
    assert len(kept) == n and not any(bytes(kb.byte_view(z[0])))
    assert caplog.text.count("zero-filled from now on") == 1
    kept.clear()


def test_npy_header_is_what_numpy_writes():
    import io

    for shape in [(1, 8, 4096, 128), (5,), (), (0, 3)]:
        for dt in (np.uint8, np.uint16, np.uint32, np.uint64):
            buf = io.BytesIO()
            np.save(buf, np.zeros(shape, dtype=dt))
            itemsize = np.dtype(dt).itemsize
            assert mxb.npy_header(itemsize, shape) == buf.getvalue()[: len(buf.getvalue())
                                                                     - itemsize * int(np.prod(shape))]


# ----------------------------------------------------------------------------- restores
H, D, BT = 2, 8, 16


def _store(tmp_path):
    from mlxkv.storage import format as fmt
    from mlxkv.storage.io import StorageIO
    from mlxkv.storage.store import BlockStore

    store = BlockStore(str(tmp_path / "store"), block_tokens=BT)
    layout = fmt.make_layout([fmt.SegmentSpec(f"{li}.{kv}", "bfloat16", (D,), H, 2 * D)
                              for li in range(2) for kv in "kv"])
    return store, StorageIO(store), layout


def test_restore_into_unfilled_arrays_is_exact_and_stops_at_a_corrupt_block(tmp_path):
    from mlxkv.storage.io import ReadRequest, WriteRequest

    store, sio, layout = _store(tmp_path)
    T = 5 * BT
    rng = np.random.default_rng(3)
    src = [rng.integers(0, 1 << 16, size=(1, H, T, D), dtype=np.uint16) & 0x3FFF
           for _ in range(4)]
    toks = np.arange(100, 100 + T, dtype=np.uint32)
    sio.submit_write(WriteRequest("ns", toks, layout, [(memoryview(a), H, T, 2 * D) for a in src],
                              tail=False)).result(timeout=60)
    cap = kb.round_up(T + 40)

    def restore():
        arrays = kb.writable_arrays([(1, H, cap, D)] * 4, [mx.bfloat16] * 4)
        segs = [(kb.byte_view(a), H, cap, 2 * D) for a in arrays]
        res = sio.submit_read(ReadRequest("ns", toks, layout, segs, n_tokens=T,
                                          keep=arrays)).result(timeout=60)
        spec = kb.LayerSpec("kv")
        return res, [kb.make_layer(spec, arrays[i : i + 2], res.n_tokens) for i in (0, 2)]

    def visible(layers):  # what attention reads: the rows up to offset
        return [np.array(a[:, :, : c.offset].view(mx.uint16))
                for c in layers for a in (c.keys, c.values)]

    res, layers = restore()
    assert res.n_tokens == T
    for got, want in zip(visible(layers), src):
        assert got.shape == want.shape and (got == want).all()

    # flip one payload byte of the third block: the restore keeps the two before it only
    key = store.chain_keys("ns", toks)[2].hex()
    path = tmp_path / "store" / "ns" / key[:2] / f"{key}.blk"
    data = bytearray(path.read_bytes())
    data[4096 + 10] ^= 0x5A
    path.write_bytes(bytes(data))
    res, layers = restore()
    assert res.n_tokens == 2 * BT and res.corrupt == 1
    assert all(c.offset == 2 * BT for c in layers)
    for got, want in zip(visible(layers), src):
        assert got.shape == (1, H, 2 * BT, D) and (got == want[:, :, : 2 * BT]).all()
    assert not path.exists()
    sio.close(timeout=30)


# ----------------------------------------------------------------------------- exit
EXIT_SCRIPT = textwrap.dedent("""
    from mlxkv.engine.blas import preload
    preload()
    import mlx.core as mx
    from mlxkv.engine.cache import buffers as mxb, kvblocks as kb
    # uint16 has no view step: the interpreter reaches its exit right after the load, the
    # moment where MLX's I/O thread still held the stream before the release wait
    a = mxb.unfilled_arrays([(1, 8, 1024, 128)] * 4, [mx.uint16] * 4)
    b = kb.writable_arrays([(1, 8, 1024, 128)] * 2, [mx.bfloat16] * 2)
    kb.byte_view(b[0])[:4] = b"abcd"
""")


def test_a_process_using_unfilled_arrays_exits_cleanly():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for _ in range(4):  # without the release wait about one exit in four aborted
        p = subprocess.run([sys.executable, "-c", EXIT_SCRIPT], check=False, cwd=ROOT,
                           env=env, capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        assert "terminate called" not in p.stderr
