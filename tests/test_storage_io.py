"""Writer/reader threads: futures, pinning, back-pressure, reads that overtake writes, close."""

from __future__ import annotations

import gc
import threading
import weakref

import numpy as np
import pytest

from mlxkv.storage import format as fmt
from mlxkv.storage.io import ReadRequest, StorageClosed, StorageIO, WriteQueueFull, WriteRequest
from mlxkv.storage.store import BlockStore, StoreWriteError

BT = 16
LAYOUT = fmt.make_layout([fmt.SegmentSpec(f"l{i}.{kv}", "bfloat16", (16,), 2, 32)
                          for i in range(2) for kv in "kv"])
WAIT = 60  # generous bound on future waits so a broken thread fails the test, not hangs it


def kv(tokens, t_cap):
    toks = np.asarray(tokens, dtype=np.int64)
    out = []
    for i, s in enumerate(LAYOUT):
        a = np.zeros((s.outer, t_cap, s.row_bytes), np.uint8)
        a[:, : toks.size] = (toks[None, :, None] * 3 + i + np.arange(s.row_bytes)) % 253
        out.append(a)
    return out


def segs(arrays):
    return [(a, s.outer, a.shape[1], s.row_bytes) for s, a in zip(LAYOUT, arrays)]


def snapshot(tokens, **kw):
    arrays = kv(tokens, len(tokens))
    return WriteRequest("m", np.asarray(tokens), LAYOUT, segs(arrays), **kw), arrays


class Gate:
    """Holds the writer inside a snapshot's on_start until released."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self) -> None:
        self.entered.set()
        assert self.release.wait(WAIT)


@pytest.fixture
def io(tmp_path):
    sio = StorageIO(BlockStore(tmp_path, block_tokens=BT), max_pending_writes=2)
    yield sio
    sio.close(timeout=WAIT)


def test_write_then_read_through_futures(io):
    toks = np.arange(3 * BT + 4)
    snap, src = snapshot(toks, manifest="chat")
    res = io.submit_write(snap).result(WAIT)
    assert (res.blocks_written, res.tail_written) == (3, True)
    dst = kv([], 64)
    r = io.submit_read(ReadRequest("m", toks, LAYOUT, segs(dst))).result(WAIT)
    assert r.n_tokens == toks.size
    for a, b in zip(src, dst):
        np.testing.assert_array_equal(a[:, : toks.size], b[:, : toks.size])
    assert io.counts()["written"] == 1 and io.counts()["read"] == 1


def test_read_is_not_blocked_behind_queued_writes(io):
    toks = np.arange(2 * BT)
    io.submit_write(snapshot(toks)[0]).result(WAIT)
    gate = Gate()
    first = io.submit_write(snapshot(np.arange(1000, 1000 + 2 * BT), on_start=gate)[0])
    assert gate.entered.wait(WAIT)  # the writer is busy...
    queued = io.submit_write(snapshot(np.arange(2000, 2000 + 2 * BT))[0])  # ...and one queued
    dst = kv([], 2 * BT)
    r = io.submit_read(ReadRequest("m", toks, LAYOUT, segs(dst))).result(WAIT)
    assert r.n_tokens == 2 * BT
    assert not first.done() and not queued.done()  # the read overtook both writes
    gate.release.set()
    assert first.result(WAIT).blocks_written == 2 and queued.result(WAIT).blocks_written == 2


def test_full_queue_pushes_back_and_never_drops(io):
    gate = Gate()
    a = io.submit_write(snapshot(np.arange(BT), on_start=gate)[0])
    assert gate.entered.wait(WAIT)
    b = io.submit_write(snapshot(np.arange(100, 100 + BT))[0])  # second slot
    c = io.submit_write(snapshot(np.arange(200, 200 + BT))[0], block=False)
    with pytest.raises(WriteQueueFull):
        c.result(0)
    d = io.submit_write(snapshot(np.arange(300, 300 + BT))[0], timeout=0.01)
    with pytest.raises(WriteQueueFull):
        d.result(0)
    unblocked = threading.Event()
    results = []

    def blocking_submit():
        results.append(io.submit_write(snapshot(np.arange(400, 400 + BT))[0]))
        unblocked.set()

    t = threading.Thread(target=blocking_submit)
    t.start()
    assert io.pending_writes == 2  # both slots are taken while the gate is closed
    gate.release.set()
    assert unblocked.wait(WAIT)
    t.join(WAIT)
    for f in (a, b, results[0]):
        assert f.result(WAIT).blocks_written == 1
    assert io.store.longest_prefix("m", np.arange(400, 400 + BT)) == BT
    assert io.store.longest_prefix("m", np.arange(200, 200 + BT)) == 0  # refused, not lost


def test_buffers_stay_pinned_until_the_future_settles(io):
    class Holder:  # stands in for the mx arrays behind the memoryviews
        pass

    gate = Gate()
    snap, arrays = snapshot(np.arange(2 * BT), on_start=gate)
    keep = Holder()
    snap.keep = keep
    ref_keep, ref_arr = weakref.ref(keep), weakref.ref(arrays[0])
    fut = io.submit_write(snap)
    del snap, arrays, keep
    assert gate.entered.wait(WAIT)
    gc.collect()
    assert ref_keep() is not None and ref_arr() is not None  # held by the writer
    gate.release.set()
    fut.result(WAIT)
    del fut
    gc.collect()
    assert ref_keep() is None and ref_arr() is None  # released once settled


def test_failed_write_fails_its_future_and_reads_continue(tmp_path):
    store = BlockStore(tmp_path, block_tokens=BT)
    with StorageIO(store) as sio:
        toks = np.arange(BT)
        sio.submit_write(snapshot(toks)[0]).result(WAIT)
        (tmp_path / "blocked").write_text("not a folder")
        snap, _ = snapshot(np.arange(2 * BT))
        snap.ns = "blocked"
        with pytest.raises(StoreWriteError):
            sio.submit_write(snap).result(WAIT)
        r = sio.submit_read(ReadRequest("m", toks, LAYOUT, segs(kv([], BT)))).result(WAIT)
        assert r.n_tokens == BT
        assert sio.counts()["failed"] == 1


def test_close_drains_queued_writes(tmp_path):
    sio = StorageIO(BlockStore(tmp_path, block_tokens=BT), max_pending_writes=8)
    futs = [sio.submit_write(snapshot(np.arange(100 * j, 100 * j + 2 * BT))[0]) for j in range(5)]
    rep = sio.close(timeout=WAIT)
    assert (rep["written"], rep["failed"], rep["pending"]) == (5, 0, 0)
    assert all(f.done() and f.exception() is None for f in futs)
    with pytest.raises(StorageClosed):
        sio.submit_write(snapshot(np.arange(BT))[0])


def test_close_with_a_deadline_reports_pending_and_fails_the_queued(tmp_path):
    sio = StorageIO(BlockStore(tmp_path, block_tokens=BT), max_pending_writes=8)
    gate = Gate()
    running = sio.submit_write(snapshot(np.arange(BT), on_start=gate)[0])
    assert gate.entered.wait(WAIT)
    queued = [sio.submit_write(snapshot(np.arange(100 * j, 100 * j + BT))[0]) for j in (1, 2)]
    rep = sio.close(timeout=0)
    assert rep["pending"] == 3 and rep["written"] == 0
    gate.release.set()
    assert running.result(WAIT).blocks_written == 1  # the running write completes
    for f in queued:
        with pytest.raises(StorageClosed):
            f.result(WAIT)
    assert sio.close(timeout=WAIT)["pending"] == 0


def test_checkpoint_write_and_read_through_the_threads(io):
    layout = fmt.make_layout([("ssm", "float32", (12,), 2, 48)])
    state = np.arange(96, dtype=np.uint8).reshape(2, 1, 48)
    toks = np.arange(BT + 3)
    snap = WriteRequest("m", toks, layout, [(state, 2, 1, 48)], checkpoint=True)
    assert io.submit_write(snap).result(WAIT).blocks_written == 1
    m = io.store.lookup_checkpoint("m", np.concatenate([toks, [5]]))
    dst = np.zeros_like(state)
    r = io.submit_read(ReadRequest("m", toks, layout, [(dst, 2, 1, 48)], n_tokens=m,
                                   checkpoint=True)).result(WAIT)
    assert r.n_tokens == toks.size
    np.testing.assert_array_equal(dst, state)


def test_unusable_folder_fails_the_write_future_cleanly(tmp_path, caplog):
    """The folder's lock replaced by a folder: each write's future fails with
    StoreWriteError (one warning, no traceback logged), and reads go on."""
    from mlxkv.storage.store import reset_warnings

    reset_warnings()
    store = BlockStore(tmp_path, block_tokens=BT)
    with StorageIO(store) as sio:
        toks = np.arange(BT)
        sio.submit_write(snapshot(toks)[0]).result(WAIT)
        (tmp_path / ".lock").unlink()
        (tmp_path / ".lock").mkdir()
        for j in range(3):
            with pytest.raises(StoreWriteError, match="lock"):
                sio.submit_write(snapshot(np.arange(100 * j + 100, 100 * j + 100 + BT))[0]).result(WAIT)
        r = sio.submit_read(ReadRequest("m", toks, LAYOUT, segs(kv([], BT)))).result(WAIT)
        assert r.n_tokens == BT
        assert sio.counts()["failed"] == 3
    assert [r.levelname for r in caplog.records] == ["WARNING"]
