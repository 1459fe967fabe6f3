"""Block store: round trips, chain keys, dedup, eviction/GC, corruption, crashes, full
disks and two processes sharing one folder. Real files, real fsync, real subprocesses."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from mlxkv.storage import format as fmt
from mlxkv.storage.format import SegmentSpec
from mlxkv.storage.store import BlockStore, StoreWriteError, reset_warnings

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _fresh_warnings():
    reset_warnings()  # storage warns once per condition per process; each test starts fresh

def make_kv(layout, tokens, t_cap):
    """One uint8 array [outer, t_cap, row_bytes] per segment; rows past len(tokens) are 0.

    KV content is a pure function of the token ids (as real KV is of its prefix), so any
    process can rebuild what a block must contain (the subprocesses import this)."""
    toks = np.asarray(tokens, dtype=np.int64)
    out = []
    for i, s in enumerate(layout):
        a = np.zeros((s.outer, t_cap, s.row_bytes), dtype=np.uint8)
        o = np.arange(s.outer)[:, None, None]
        b = np.arange(s.row_bytes)[None, None, :]
        a[:, : toks.size] = (toks[None, :, None] * 7 + i * 131 + o * 31 + b) % 251
        out.append(a)
    return out


def segs(layout, arrays):
    return [(a, s.outer, a.shape[1], s.row_bytes) for s, a in zip(layout, arrays)]


# prepended to every subprocess script (run with the repository root as cwd)
KV_HELPER = """
import sys
sys.path.insert(0, "tests")
import numpy as np
from test_store import make_kv, segs
"""

BF16 = fmt.make_layout([SegmentSpec(f"l{i}.{kv}", "bfloat16", (16,), 4, 32)
                        for i in range(3) for kv in "kv"])
F32 = fmt.make_layout([SegmentSpec("l0.k", "float32", (8,), 2, 32),
                       SegmentSpec("l0.v", "float32", (8,), 2, 32)])
QUANT = fmt.make_layout([SegmentSpec(f"l{i}.{kv}.{p}", dt, (n,), 4, nb)
                         for i in range(2) for kv in "kv"
                         for p, dt, n, nb in (("w", "uint32", 4, 16), ("scales", "bfloat16", 2, 4),
                                              ("biases", "bfloat16", 2, 4))])
BT = 16


def restore(store, ns, tokens, layout, t_cap, n=None):
    dst = [np.full((s.outer, t_cap, s.row_bytes), 0xEE, np.uint8) for s in layout]
    r = store.get_blocks(ns, tokens, layout, segs(layout, dst), n)
    return r, dst


def assert_rows_equal(a_list, b_list, n):
    for a, b in zip(a_list, b_list):
        np.testing.assert_array_equal(a[:, :n], b[:, :n])


@pytest.mark.parametrize("threads", [1, 3], ids=["sequential", "parallel"])
@pytest.mark.parametrize("layout", [BF16, F32, QUANT], ids=["bf16", "f32", "quant"])
def test_round_trip_blocks_and_tail(tmp_path, layout, threads):
    store = BlockStore(tmp_path, block_tokens=BT, read_threads=threads)
    toks = np.arange(1000, 1000 + 3 * BT + 5)
    src = make_kv(layout, toks, 64)
    r = store.put_blocks("m", toks, layout, segs(layout, src))
    assert (r.blocks_written, r.blocks_present, r.tail_written) == (3, 0, True)
    assert store.longest_prefix("m", toks) == toks.size
    got, dst = restore(store, "m", toks, layout, 64)
    assert got.n_tokens == toks.size and got.corrupt == got.missing == 0
    assert_rows_equal(src, dst, toks.size)
    # a fresh process (new store object) finds everything by scanning headers
    store2 = BlockStore(tmp_path, block_tokens=BT)
    rep = store2.scan()
    assert (rep["blocks"], rep["tails"], rep["bad_removed"]) == (3, 1, 0)
    got, dst = restore(store2, "m", toks, layout, 64)
    assert got.n_tokens == toks.size
    assert_rows_equal(src, dst, toks.size)


def test_restore_into_mx_arrays(tmp_path):
    mx = pytest.importorskip("mlx.core")
    store = BlockStore(tmp_path, block_tokens=BT)
    toks = np.arange(2 * BT + 3)
    k = mx.random.normal((1, 4, 64, 16)).astype(mx.bfloat16)
    v = mx.random.normal((1, 4, 64, 16)).astype(mx.bfloat16)
    mx.eval(k, v)
    layout = fmt.make_layout([SegmentSpec("k", "bfloat16", (16,), 4, 32),
                              SegmentSpec("v", "bfloat16", (16,), 4, 32)])
    store.put_blocks("m", toks, layout, [(memoryview(a), 4, 64, 32) for a in (k, v)])
    dk, dv = mx.zeros((1, 4, 40, 16), mx.bfloat16), mx.zeros((1, 4, 40, 16), mx.bfloat16)
    mx.eval(dk, dv)
    r = store.get_blocks("m", toks, layout, [(memoryview(a), 4, 40, 32) for a in (dk, dv)])
    assert r.n_tokens == toks.size
    n = toks.size
    assert mx.array_equal(dk[:, :, :n], k[:, :, :n]).item()
    assert mx.array_equal(dv[:, :, :n], v[:, :, :n]).item()


def test_chain_keys_prefix_lookup_and_namespaces(tmp_path):
    store = BlockStore(tmp_path, block_tokens=BT)
    toks = np.arange(5 * BT)
    keys = store.chain_keys("m", toks)
    assert len(keys) == 5 and len(set(keys)) == 5 and all(len(k) == 16 for k in keys)
    assert keys[:3] == store.chain_keys("m", toks[: 3 * BT + 7])  # a prefix has the prefix keys
    assert store.chain_keys("other", toks)[0] != keys[0]  # namespaces never share keys
    changed = toks.copy()
    changed[BT + 2] += 1  # one token in block 1 changes that block and all after it
    k2 = store.chain_keys("m", changed)
    assert k2[0] == keys[0] and all(a != b for a, b in zip(k2[1:], keys[1:]))

    src = make_kv(F32, toks, 5 * BT)
    store.put_blocks("m", toks[: 3 * BT], F32, segs(F32, src))
    assert store.longest_prefix("m", toks) == 3 * BT
    assert store.longest_prefix("m", changed) == BT + 2  # block 1 serves its first 2 rows
    assert store.longest_prefix("other", toks) == 0
    # a limit inside the last stored block: that block serves the rows up to the limit
    assert store.longest_prefix("m", toks, max_tokens=3 * BT - 1) == 3 * BT - 1
    assert store.lookup("m", toks).nbytes == 3 * BT * fmt.bytes_per_token(F32)
    assert store.lookup("m", toks).layout == F32 and store.lookup("other", toks).layout is None


def test_tail_is_reused_for_a_continuing_conversation(tmp_path):
    store = BlockStore(tmp_path, block_tokens=BT)
    turn1 = np.arange(2 * BT + 9)
    src = make_kv(F32, turn1, 64)
    store.put_blocks("m", turn1, F32, segs(F32, src))
    turn2 = np.concatenate([turn1, [7, 7, 7]])
    m = store.lookup("m", turn2)
    assert m.n_tokens == turn1.size and m.tail_tokens == 9  # only 3 new tokens to prefill
    # the same prompt again: at most n-1 tokens, served from a prefix of the tail
    m = store.lookup("m", turn1, max_tokens=turn1.size - 1)
    assert m.n_tokens == turn1.size - 1 and m.tail_tokens == 8
    got, dst = restore(store, "m", turn1, F32, 64, m)
    assert got.n_tokens == turn1.size - 1
    assert_rows_equal(src, dst, turn1.size - 1)
    # a diverging continuation uses only the matching part of the tail
    div = turn1.copy()
    div[2 * BT + 4] = 999
    assert store.longest_prefix("m", div) == 2 * BT + 4
    # turn 2 persisted: its longer tail supersedes turn 1's
    src2 = make_kv(F32, turn2, 64)
    store.put_blocks("m", turn2, F32, segs(F32, src2))
    st = store.stats()
    assert st["tails"] == 1 and st["tails_superseded"] == 1
    assert store.longest_prefix("m", turn1) == turn1.size


def test_shared_prefixes_are_stored_once(tmp_path):
    store = BlockStore(tmp_path, block_tokens=BT)
    prefix = np.arange(6 * BT)
    per_block = fmt.block_header_size(BF16, "m", BT) + BT * fmt.bytes_per_token(BF16)
    for u in range(4):
        toks = np.concatenate([prefix, 10_000 + 100 * u + np.arange(2 * BT)])
        r = store.put_blocks("m", toks, BF16, segs(BF16, make_kv(BF16, toks, 8 * BT)))
        assert (r.blocks_written, r.blocks_present) == ((8, 0) if u == 0 else (2, 6))
    st = store.stats()
    assert st["blocks"] == 6 + 4 * 2 and st["dedup_blocks"] == 18
    assert st["bytes"] == (6 + 8) * per_block
    disk = sum(f.stat().st_size for f in tmp_path.rglob("*.blk"))
    assert disk == st["bytes"]


def test_lru_eviction_counts_shared_blocks_once_and_keeps_recent(tmp_path):
    per_block = fmt.block_header_size(F32, "m", BT) + fmt.align(BT * fmt.bytes_per_token(F32))
    store = BlockStore(tmp_path, block_tokens=BT, max_bytes=6 * per_block)
    prefix = np.arange(2 * BT)
    a = np.concatenate([prefix, 500 + np.arange(2 * BT)])
    b = np.concatenate([prefix, 900 + np.arange(2 * BT)])
    store.put_blocks("m", a, F32, segs(F32, make_kv(F32, a, 4 * BT)))
    store.put_blocks("m", b, F32, segs(F32, make_kv(F32, b, 4 * BT)))
    assert store.stats()["bytes"] == 6 * per_block  # 2 shared + 2 + 2: at the cap, no eviction
    assert store.stats()["evicted"] == 0
    restore(store, "m", a, F32, 4 * BT)  # a is now the most recently used
    c = np.concatenate([prefix, 1300 + np.arange(BT)])
    store.put_blocks("m", c, F32, segs(F32, make_kv(F32, c, 4 * BT)))
    st = store.stats()
    assert st["bytes"] <= 6 * per_block and st["evicted"] == 1
    assert store.longest_prefix("m", a) == a.size  # recently used chain kept whole
    assert store.longest_prefix("m", c) == c.size  # just written
    assert store.longest_prefix("m", b) == 3 * BT  # b's deepest block went first
    assert len(list(tmp_path.rglob("*.blk"))) == st["blocks"] == 6


def test_gc_removes_only_unreferenced_entries(tmp_path):
    store = BlockStore(tmp_path, block_tokens=BT)
    prefix = np.arange(2 * BT)
    keep = np.concatenate([prefix, 100 + np.arange(BT + 3)])
    drop = np.concatenate([prefix, 300 + np.arange(BT + 5)])
    store.put_blocks("m", keep, F32, segs(F32, make_kv(F32, keep, 64)), manifest="chat-keep")
    store.put_blocks("m", drop, F32, segs(F32, make_kv(F32, drop, 64)))
    assert store.get_manifest("m", "chat-keep").tokens.size == keep.size
    rep = store.gc("m", min_age_s=0)
    assert rep["removed"] == 2  # drop's own block and its tail; the shared prefix stays
    assert store.longest_prefix("m", keep) == keep.size
    assert store.longest_prefix("m", drop) == 2 * BT
    assert store.delete_manifest("m", "chat-keep")
    assert store.gc("m", min_age_s=0)["removed"] == 4
    assert store.stats()["bytes"] == 0 and not list(tmp_path.rglob("*.blk"))


def test_gc_drops_manifests_whose_state_was_evicted(tmp_path):
    store = BlockStore(tmp_path, block_tokens=BT)
    a, b = np.arange(2 * BT), 500 + np.arange(2 * BT)
    store.put_blocks("m", a, F32, segs(F32, make_kv(F32, a, 2 * BT)), manifest="a")
    store.put_blocks("m", b, F32, segs(F32, make_kv(F32, b, 2 * BT)), manifest="b")
    store.evict(store.stats()["bytes"] // 2)  # a (least recently used) goes
    rep = store.gc("m", min_age_s=0)
    assert rep["manifests_removed"] == 1 and rep["removed"] == 0
    assert store.get_manifest("m", "a") is None and store.get_manifest("m", "b") is not None
    assert store.longest_prefix("m", b) == b.size


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


@pytest.mark.parametrize("threads", [1, 4], ids=["sequential", "parallel"])
def test_corrupt_payload_is_a_miss_removed_and_counted(tmp_path, threads):
    store = BlockStore(tmp_path, block_tokens=BT, read_threads=threads)
    toks = np.arange(3 * BT)
    src = make_kv(F32, toks, 3 * BT)
    r = store.put_blocks("m", toks, F32, segs(F32, src))
    victim = Path(store.index.path("m", r.keys[1], fmt.KIND_BLOCK))
    _flip(victim, fmt.block_header_size(F32, "m", BT) + 100)
    got, dst = restore(store, "m", toks, F32, 3 * BT)
    assert (got.n_tokens, got.corrupt) == (BT, 1)  # only the verified prefix is returned
    assert_rows_equal(src, dst, BT)
    assert not victim.exists() and store.stats()["corrupt_removed"] == 1
    assert store.longest_prefix("m", toks) == BT  # never restored again


def test_corrupt_header_is_removed_at_scan(tmp_path):
    store = BlockStore(tmp_path, block_tokens=BT)
    toks = np.arange(2 * BT)
    r = store.put_blocks("m", toks, F32, segs(F32, make_kv(F32, toks, 2 * BT)))
    victim = Path(store.index.path("m", r.keys[0], fmt.KIND_BLOCK))
    _flip(victim, 60)
    store2 = BlockStore(tmp_path, block_tokens=BT)
    rep = store2.scan()
    assert rep["bad_removed"] == 1 and rep["blocks"] == 1 and not victim.exists()
    assert store2.longest_prefix("m", toks) == 0  # the chain is broken at block 0


def test_unknown_version_is_skipped_with_a_reason(tmp_path):
    store = BlockStore(tmp_path, block_tokens=BT)
    toks = np.arange(BT)
    r = store.put_blocks("m", toks, F32, segs(F32, make_kv(F32, toks, BT)))
    path = Path(store.index.path("m", r.keys[0], fmt.KIND_BLOCK))
    raw = bytearray(path.read_bytes())
    raw[8:10] = (fmt.FORMAT_VERSION + 1).to_bytes(2, "little")  # a future mlxkv's file
    path.write_bytes(bytes(raw))
    store2 = BlockStore(tmp_path, block_tokens=BT)
    rep = store2.scan()
    assert rep["skipped"] == 1 and rep["blocks"] == 0 and path.exists()
    assert "format version 2" in store2.stats()["skipped_unknown_version"][str(path)]


@pytest.mark.parametrize("threads", [1, 4], ids=["sequential", "parallel"])
def test_scan_removes_temp_orphans_and_drops_vanished_files(tmp_path, threads):
    store = BlockStore(tmp_path, block_tokens=BT, read_threads=threads)
    toks = np.arange(2 * BT)
    r = store.put_blocks("m", toks, F32, segs(F32, make_kv(F32, toks, 2 * BT)))
    orphan = tmp_path / "m" / "ab" / f".ab{'0' * 30}.1.2.tmp"  # named as our writers name them
    orphan.parent.mkdir(exist_ok=True)
    orphan.write_bytes(b"half a block")
    theirs = tmp_path / "m" / "ab" / "notes.tmp"  # not a name of ours: never removed
    theirs.write_bytes(b"someone's notes")
    os.unlink(store.index.path("m", r.keys[1], fmt.KIND_BLOCK))  # another process evicted it
    got, _ = restore(store, "m", toks, F32, 2 * BT)
    assert (got.n_tokens, got.missing) == (BT, 1) and store.stats()["vanished"] == 1
    rep = store.scan()
    assert rep["tmp_removed"] == 1 and not orphan.exists() and rep["blocks"] == 1
    assert theirs.read_bytes() == b"someone's notes" and rep["foreign"] == 1


def test_bad_arguments_say_what_is_wrong(tmp_path):
    store = BlockStore(tmp_path, block_tokens=BT)
    toks = np.arange(BT)
    with pytest.raises(ValueError, match="namespace"):
        store.longest_prefix("../etc", toks)
    with pytest.raises(ValueError, match="t_capacity"):
        store.put_blocks("m", toks, F32, segs(F32, make_kv(F32, toks[:4], 4)))
    with pytest.raises(ValueError, match="segments for a layout"):
        store.put_blocks("m", toks, F32, segs(F32, make_kv(F32, toks, BT))[:1])
    with pytest.raises(ValueError, match="read-only"):
        ro = [(bytes(s.outer * BT * s.row_bytes), s.outer, BT, s.row_bytes) for s in F32]
        store.put_blocks("m", toks, F32, segs(F32, make_kv(F32, toks, BT)))
        store.get_blocks("m", toks, F32, ro)
    with pytest.raises(ValueError, match="token ids"):
        store.lookup("m", [-1, 2])


def test_unwritable_folder_fails_the_write_and_keeps_reads(tmp_path, caplog):
    store = BlockStore(tmp_path, block_tokens=BT)
    toks = np.arange(BT)
    store.put_blocks("m", toks, F32, segs(F32, make_kv(F32, toks, BT)))
    (tmp_path / "blocked").write_text("a file where the namespace folder should be")
    more = np.arange(2 * BT)
    for _ in range(2):
        with pytest.raises(StoreWriteError):
            store.put_blocks("blocked", more, F32, segs(F32, make_kv(F32, more, 2 * BT)))
    assert sum("cannot write" in r.message for r in caplog.records) == 1  # warned once
    assert store.stats()["write_failures"] == 2
    got, _ = restore(store, "m", toks, F32, BT)
    assert got.n_tokens == BT


# ----------------------------------------------------------------------------- processes
def _run_child(code: str, *args: str, **kw) -> subprocess.Popen:
    script = KV_HELPER + textwrap.dedent(code)
    return subprocess.Popen([sys.executable, "-c", script, *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _readline(proc: subprocess.Popen, timeout: float = 60) -> str:
    """The child's next stdout line, for a child that prints it and then waits (nothing
    else is buffered); fails, killing the child, instead of waiting forever."""
    import selectors

    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            proc.kill()
            pytest.fail(f"no output from the child in {timeout} s")
    return proc.stdout.readline()


def _lines(proc: subprocess.Popen, timeout: float = 60):
    """The child's stdout lines as they come (read by a helper thread); fails, killing the
    child, when none comes for ``timeout`` seconds."""
    import queue
    import threading

    q: queue.SimpleQueue = queue.SimpleQueue()

    def pump() -> None:
        for line in proc.stdout:
            q.put(line)
        q.put(None)

    threading.Thread(target=pump, daemon=True).start()
    while True:
        try:
            line = q.get(timeout=timeout)
        except queue.Empty:
            proc.kill()
            pytest.fail(f"no output from the child in {timeout} s")
        if line is None:
            return
        yield line


WRITER = '''
import sys
from mlxkv.storage import format as fmt
from mlxkv.storage.store import BlockStore
layout = fmt.make_layout([("l%d.%s" % (i, kv), "bfloat16", (64,), 8, 128)
                          for i in range(4) for kv in "kv"])
root, ns, base, count = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
store = BlockStore(root, block_tokens=16)
store.scan()
for j in range(count):
    toks = np.concatenate([np.arange(64), base + 1000 * j + np.arange(40)])
    print("start", j, flush=True)
    store.put_blocks(ns, toks, layout, segs(layout, make_kv(layout, toks, 104)))
    print("done", j, flush=True)
'''
WLAYOUT = fmt.make_layout([(f"l{i}.{kv}", "bfloat16", (64,), 8, 128) for i in range(4) for kv in "kv"])


def _verify_all(root: Path, ns: str) -> int:
    """Scan, then restore every indexed chain and compare with the expected bytes."""
    store = BlockStore(root, block_tokens=16)
    store.scan()
    assert not list(root.rglob("*.tmp"))
    n = 0
    for key, e in list(store.index.spaces[ns].blocks.items()):
        hdr = fmt.decode_block_header(Path(e.path).read_bytes())
        assert hdr.key == key
    for parent, tails in store.index.spaces[ns].tails.items():
        for _entry in tails.values():
            chain = [p for p in store.index.spaces[ns].blocks if p == parent]
            assert chain, "a tail's parent block is missing"
    for e in [t for ts in store.index.spaces[ns].tails.values() for t in ts.values()]:
        start = int(e.tokens[0]) - 32  # the tail is the last 8 of 40 unique tokens
        toks = np.concatenate([np.arange(64), start + np.arange(40)])
        got, dst = restore(store, ns, toks, WLAYOUT, 104)
        assert got.n_tokens == toks.size and got.corrupt == 0
        assert_rows_equal(make_kv(WLAYOUT, toks, 104), dst, toks.size)
        n += 1
    return n


def test_sigkill_during_writes_leaves_only_complete_verified_entries(tmp_path):
    child = _run_child(WRITER, str(tmp_path), "m", "5000", "1000")
    starts = 0
    for line in _lines(child):
        starts += line.startswith("start")
        if starts == 6:  # killed while writing its 6th snapshot
            os.kill(child.pid, signal.SIGKILL)
            break
    child.wait(timeout=60)
    assert child.returncode == -signal.SIGKILL
    assert _verify_all(tmp_path, "m") >= 5


def test_two_processes_share_one_folder(tmp_path):
    a = _run_child(WRITER, str(tmp_path), "m", "20000", "6")
    b = _run_child(WRITER, str(tmp_path), "m", "40000", "6")  # same 64-token prefix as a
    for p in (a, b):
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    assert _verify_all(tmp_path, "m") == 12
    store = BlockStore(tmp_path, block_tokens=16)
    store.scan()
    assert store.stats()["blocks"] == 4 + 12 * 2  # the shared prefix exists once
    # a reader in another process sees a block vanish (evicted by us) as a miss
    reader = _run_child('''
        import sys
        from mlxkv.storage.store import BlockStore
        from mlxkv.storage import format as fmt
        layout = fmt.make_layout([("l%d.%s" % (i, kv), "bfloat16", (64,), 8, 128)
                                  for i in range(4) for kv in "kv"])
        store = BlockStore(sys.argv[1], block_tokens=16)
        store.scan()
        toks = np.concatenate([np.arange(64), 20000 + np.arange(40)])
        print(store.longest_prefix("m", toks), flush=True)
        sys.stdin.readline()  # the other process evicts everything now
        dst = make_kv(layout, [], 104)
        r = store.get_blocks("m", toks, layout, segs(layout, dst))
        print(r.n_tokens, r.missing, flush=True)
    ''', str(tmp_path), stdin=subprocess.PIPE)
    assert _readline(reader).strip() == "104"
    store.evict(0)
    out, err = reader.communicate("go\n", timeout=60)
    assert reader.returncode == 0, err
    assert out.split() == ["0", "1"]


def test_lookup_finds_another_processes_new_blocks_without_a_rescan(tmp_path):
    """A reader that scanned before the writes finds them by lookup (a probe of the file
    each missing key maps to) and restores them byte-exact; no second scan()."""
    toks = np.arange(3000, 3000 + 4 * BT + 5)
    ours = BlockStore(tmp_path, block_tokens=BT)
    ours.put_blocks("m", toks[: 2 * BT], BF16, segs(BF16, make_kv(BF16, toks[: 2 * BT], 2 * BT)))
    reader = _run_child('''
        import json, sys
        from test_store import BF16, BT, make_kv, segs
        from mlxkv.storage.store import BlockStore
        store = BlockStore(sys.argv[1], block_tokens=BT)
        print(store.scan()["blocks"], flush=True)
        toks = np.arange(3000, 3000 + 4 * BT + 5)
        other = np.arange(90000, 90000 + 3 * BT)
        sys.stdin.readline()  # the other process has written the rest of the chain now
        m = store.lookup("m", toks)
        dst = make_kv(BF16, [], toks.size)
        r = store.get_blocks("m", toks, BF16, segs(BF16, dst), m)
        want = make_kv(BF16, toks, toks.size)
        exact = all(np.array_equal(a, b) for a, b in zip(dst, want))
        st = store.stats()
        print(json.dumps({"n": m.n_tokens, "blocks": len(m.block_keys),
                          "tail": m.tail_tokens, "restored": r.n_tokens, "exact": exact,
                          "probed": st["probed"], "indexed": st["blocks"] + st["tails"],
                          "miss": store.longest_prefix("m", other)}), flush=True)
    ''', str(tmp_path), stdin=subprocess.PIPE)
    assert _readline(reader).strip() == "2"  # its index: our first two blocks
    r = ours.put_blocks("m", toks, BF16, segs(BF16, make_kv(BF16, toks, toks.size)))
    assert (r.blocks_written, r.blocks_present, r.tail_written) == (2, 2, True)
    out, err = reader.communicate("go\n", timeout=60)
    assert reader.returncode == 0, err
    got = json.loads(out.strip().splitlines()[-1])
    assert got == {"n": toks.size, "blocks": 4, "tail": 5, "restored": toks.size,
                   "exact": True, "probed": 3, "indexed": 5, "miss": 0}


def test_a_lookup_costs_at_most_one_failed_open(tmp_path, monkeypatch):
    """The miss path stays cheap: a lookup opens at most one file (the first chain key,
    or the exact tail, that the index lacks), and none when the index covers the query."""
    store = BlockStore(tmp_path, block_tokens=BT)
    toks = np.arange(2 * BT + 5)
    store.put_blocks("m", toks, F32, segs(F32, make_kv(F32, toks, toks.size)))
    opened: list[str] = []
    real_open = os.open

    def counting_open(path, *a, **k):
        if str(path).startswith(str(tmp_path)):
            opened.append(str(path))
        return real_open(path, *a, **k)

    monkeypatch.setattr(os, "open", counting_open)
    cases = [(toks, None, toks.size, 0),  # all indexed: no I/O
             (toks, toks.size - 1, toks.size - 1, 0),
             (np.append(toks, 99999), None, toks.size, 1),  # the indexed tail ends early
             (np.concatenate([toks[: 2 * BT], np.arange(9000, 9000 + 3 * BT)]), None, 2 * BT, 1),
             (np.arange(7000, 7000 + 4 * BT), None, 0, 1)]
    for query, limit, want, opens in cases:
        opened.clear()
        assert store.longest_prefix("m", query, limit) == want
        assert len(opened) == opens, opened
    opened.clear()
    assert store.longest_prefix("nothing-here", toks) == 0
    assert len(opened) == 1

def test_lookup_never_reindexes_a_file_our_eviction_is_removing(tmp_path):
    """Eviction drops entries under the store lock and unlinks their files after it: a
    lookup in between must not probe the still-present file back into the index."""
    store = BlockStore(tmp_path, block_tokens=BT)
    toks = np.arange(3 * BT)
    r = store.put_blocks("m", toks, F32, segs(F32, make_kv(F32, toks, toks.size)))
    victim = store.index.spaces["m"].blocks[r.keys[2]]
    with store.index.lock:
        store.index.retire(victim)  # the first half of an eviction
    assert Path(victim.path).exists()
    assert store.longest_prefix("m", toks) == 2 * BT
    store.index.remove_retired([victim])  # the second half
    assert not Path(victim.path).exists()
    assert store.longest_prefix("m", toks) == 2 * BT
    assert store.stats()["bytes"] == sum(p.stat().st_size for p in tmp_path.rglob("*.blk"))

def _blocked_flock_waiters(path: Path) -> int:
    """Lock requests waiting on ``path`` (an flock), as the kernel lists them."""
    ino = os.stat(path).st_ino
    n = 0
    with open("/proc/locks") as f:
        for line in f:
            parts = line.split()
            if "->" in parts and "FLOCK" in parts and \
                    any(p.count(":") == 2 and int(p.rsplit(":", 1)[1]) == ino for p in parts):
                n += 1
    return n


@pytest.mark.skipif(not os.path.exists("/proc/locks"), reason="needs Linux /proc/locks")
@pytest.mark.parametrize("op", ["evict", "gc"])
def test_maintenance_lock_of_one_process_blocks_anothers_eviction_and_gc(tmp_path, op):
    from concurrent.futures import ThreadPoolExecutor

    store = BlockStore(tmp_path, block_tokens=BT)
    toks = np.arange(4 * BT + 3)
    store.put_blocks("m", toks, F32, segs(F32, make_kv(F32, toks, toks.size)))
    files = sorted(tmp_path.rglob("*.blk")) + sorted(tmp_path.rglob("*.tail"))
    assert len(files) == 5
    holder = _run_child('''
        import sys
        from mlxkv.storage.store import BlockStore
        store = BlockStore(sys.argv[1], block_tokens=16)
        with store.context.folder_lock(shared=False):  # what evict/gc/scan hold while they work
            print("held", flush=True)
            sys.stdin.readline()
        print("released", flush=True)
    ''', str(tmp_path), stdin=subprocess.PIPE)
    assert _readline(holder).strip() == "held"
    with ThreadPoolExecutor(1) as ex:
        fut = ex.submit(store.evict, 0) if op == "evict" else \
            ex.submit(store.gc, "m", 0.0)
        # Wait for the kernel to list our request as blocked behind the holder (a
        # condition, polled: flock has no event to wait on). Not a timing assumption.
        deadline = time.monotonic() + 60
        while not _blocked_flock_waiters(tmp_path / ".lock") and not fut.done():
            assert time.monotonic() < deadline, "the eviction never reached the lock"
            time.sleep(0.002)
        assert not fut.done(), f"{op} ran while another process held the lock"
        assert all(p.exists() for p in files)
        holder.stdin.write("release\n")
        holder.stdin.flush()
        res = fut.result(timeout=60)
    out, err = holder.communicate(timeout=60)
    assert holder.returncode == 0, err
    assert out.strip() == "released"
    assert (res["evicted"] if op == "evict" else res["removed"]) == 5
    assert not any(p.exists() for p in files)

def test_file_size_limit_fails_writes_cleanly(tmp_path):
    child = _run_child('''
        import json, os, resource, signal, sys
        from mlxkv.storage import format as fmt
        from mlxkv.storage.store import BlockStore, StoreWriteError
        layout = fmt.make_layout([("k", "bfloat16", (64,), 8, 128)])
        store = BlockStore(sys.argv[1], block_tokens=16)
        small = np.arange(16)
        store.put_blocks("m", small, layout, segs(layout, make_kv(layout, small, 16)))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of being killed
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))
        big = fmt.make_layout([("k", "bfloat16", (64,), 64, 128)])  # 128 KiB per block
        toks = np.arange(1000, 1064)
        try:
            store.put_blocks("m", toks, big, segs(big, make_kv(big, toks, 64)))
            res = "written"
        except StoreWriteError as exc:
            res = os.strerror(exc.errno)
        dst = make_kv(layout, [], 16)
        r = store.get_blocks("m", small, layout, segs(layout, dst))
        print(json.dumps({"res": res, "restored": r.n_tokens,
                          "failures": store.stats()["write_failures"]}))
    ''', str(tmp_path))
    out, err = child.communicate(timeout=60)
    assert child.returncode == 0, err
    rep = json.loads(out.strip().splitlines()[-1])
    assert rep == {"res": os.strerror(27), "restored": 16, "failures": 1}  # EFBIG
    assert not list(tmp_path.rglob("*.tmp"))
    assert len(list(tmp_path.rglob("*.blk"))) == 1


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 1 MiB tmpfs (a real full disk); skipped where mounting is not allowed."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("mounting a 1 MiB tmpfs needs root; test_file_size_limit_fails_writes_"
                    "cleanly covers failing writes")
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(mnt)],
                       capture_output=True, text=True, check=False, timeout=60)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a 1 MiB tmpfs here ({r.stderr.strip() or r.returncode}); "
                    "test_file_size_limit_fails_writes_cleanly covers failing writes")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False, timeout=60)


def test_full_disk_keeps_the_prefix_that_fit_and_reads(tiny_tmpfs, caplog):
    """Blocks are committed in chain order: when the disk fills up part way through a
    write, the blocks that fit are renamed into place (a usable prefix of the chain), the
    rest leaves nothing behind, one warning is logged, and reads go on."""
    store = BlockStore(tiny_tmpfs, block_tokens=BT)
    small = np.arange(BT)
    store.put_blocks("m", small, F32, segs(F32, make_kv(F32, small, BT)))
    big = fmt.make_layout([("k", "bfloat16", (64,), 64, 128)])
    toks = np.arange(5000, 5000 + 8 * BT)  # 8 blocks of 128 KiB + headers > 1 MiB
    src = make_kv(big, toks, 8 * BT)
    with pytest.raises(StoreWriteError) as info:
        store.put_blocks("m", toks, big, segs(big, src))
    assert info.value.errno == 28  # ENOSPC
    assert not list(tiny_tmpfs.rglob("*.tmp"))
    landed = store.longest_prefix("m", toks)
    assert BT <= landed < toks.size and landed % BT == 0  # the prefix that fit is usable
    assert len(list(tiny_tmpfs.rglob("*.blk"))) == 1 + landed // BT  # and nothing more
    got, dst = restore(store, "m", toks, big, 8 * BT)
    assert got.n_tokens == landed and got.corrupt == 0
    assert_rows_equal(src, dst, landed)
    # a second store in the same process writing to the full disk: still one warning
    other = BlockStore(tiny_tmpfs, block_tokens=BT)
    more = np.arange(9000, 9000 + 8 * BT)
    for s in (store, other):
        with pytest.raises(StoreWriteError):
            s.put_blocks("m", more, big, segs(big, make_kv(big, more, 8 * BT)))
    assert sum("cannot write" in r.message for r in caplog.records) == 1
    # a learned file (the suffix index) that does not fit: the same error, the same warning
    seqs = tuple(np.full(100_000, i, dtype=np.uint32) for i in range(4))  # 1.6 MB
    with pytest.raises(StoreWriteError) as info:
        store.put_learned("m", "suffix", fmt.Learned("m", "s", seqs, 0.0))
    assert info.value.errno == 28 and "learned file write failed" in str(info.value)
    assert sum("cannot write" in r.message for r in caplog.records) == 1
    assert not list(tiny_tmpfs.rglob("*.tmp")) and not list(tiny_tmpfs.rglob("*.lrn"))
    assert restore(store, "m", small, F32, BT)[0].n_tokens == BT
    # a fresh scan finds exactly the same
    assert BlockStore(tiny_tmpfs, block_tokens=BT).scan()["blocks"] == 1 + landed // BT + \
        store.longest_prefix("m", more) // BT


def test_restores_never_map_files(tmp_path, monkeypatch):
    """Files are read with pread, never mapped (a mapped file truncated under a reader
    raises SIGBUS); a corrupt block is still detected on that path."""
    import mmap

    def no_mmap(*a, **k):
        raise AssertionError("a restore mapped a file")

    monkeypatch.setattr(mmap, "mmap", no_mmap)
    store = BlockStore(tmp_path, block_tokens=BT)
    toks = np.arange(4 * BT)
    src = make_kv(BF16, toks, 4 * BT)
    r = store.put_blocks("m", toks, BF16, segs(BF16, src))
    got, dst = restore(store, "m", toks, BF16, 4 * BT)
    assert got.n_tokens == toks.size
    assert_rows_equal(src, dst, toks.size)
    _flip(Path(store.index.path("m", r.keys[2], fmt.KIND_BLOCK)),
          fmt.block_header_size(BF16, "m", BT) + 5)
    got, _ = restore(store, "m", toks, BF16, 4 * BT)
    assert (got.n_tokens, got.corrupt) == (2 * BT, 1)


@pytest.mark.skipif(not os.path.exists("/proc/self/fd"), reason="needs Linux /proc/self/fd")
@pytest.mark.parametrize("threads", [1, 3], ids=["sequential", "parallel"])
def test_block_truncated_under_a_restore_is_a_miss_not_a_crash(tmp_path, threads):
    """Another process truncates block 1 after the lookup, at the moment the restore
    first touches it (whether it maps or reads the file): a miss from block 1 on,
    never SIGBUS. In a child process, so a crash fails the test instead of the run."""
    child = _run_child('''
        import json, mmap, os, sys
        from mlxkv.storage import diskio, format as fmt
        from mlxkv.storage.store import BlockStore
        from test_store import BF16, BT
        store = BlockStore(sys.argv[1], block_tokens=BT, read_threads=int(sys.argv[2]))
        toks = np.arange(3 * BT)
        r = store.put_blocks("m", toks, BF16, segs(BF16, make_kv(BF16, toks, 3 * BT)))
        victim = store.index.path("m", r.keys[1], fmt.KIND_BLOCK)
        m = store.lookup("m", toks)

        def cut(fd):
            if os.path.exists(victim) and os.readlink(f"/proc/self/fd/{fd}") == victim \\
                    and os.path.getsize(victim) > 4096:
                os.truncate(victim, 4096)

        real_mmap, real_pread = mmap.mmap, diskio.pread_full

        def mapping(fd, *a, **k):
            mp = real_mmap(fd, *a, **k)
            cut(fd)
            return mp

        def reading(fd, *a, **k):
            cut(fd)
            return real_pread(fd, *a, **k)

        mmap.mmap, diskio.pread_full = mapping, reading
        dst = make_kv(BF16, [], 3 * BT)
        g = store.get_blocks("m", toks, BF16, segs(BF16, dst), m)
        print(json.dumps([g.n_tokens, g.corrupt + g.missing]))
    ''', str(tmp_path), str(threads))
    out, err = child.communicate(timeout=60)
    assert child.returncode == 0, f"restore crashed (rc {child.returncode}): {err}"
    assert json.loads(out.strip().splitlines()[-1]) == [BT, 1]


def test_buffered_writes_give_the_same_files(tmp_path):
    toks = np.arange(2 * BT + 3)
    src = make_kv(QUANT, toks, 64)
    a = BlockStore(tmp_path / "direct", block_tokens=BT, direct_io=True)
    b = BlockStore(tmp_path / "buffered", block_tokens=BT, direct_io=False)
    for s in (a, b):
        s.put_blocks("m", toks, QUANT, segs(QUANT, src))
    def files(root):
        return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*.*")
                if p.name != ".lock"}

    fa, fb = files(tmp_path / "direct"), files(tmp_path / "buffered")
    assert len(fa) == 3 and fa == fb  # same names, byte-identical contents


# ----------------------------------------------------------------------------- checkpoints
RING = fmt.make_layout([("l0.ring.k", "bfloat16", (8, 16), 4, 256),  # a 8-slot window
                        ("l1.ssm", "float32", (24,), 1, 96)])


def ring_state(seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 255, (s.outer, 1, s.row_bytes), dtype=np.uint8) for s in RING]


def test_checkpoints_restore_only_at_their_exact_position(tmp_path):
    store = BlockStore(tmp_path, block_tokens=BT)
    toks = np.arange(2 * BT + 5)
    early, late = ring_state(1), ring_state(2)
    store.put_checkpoint("m", toks[: BT + 3], RING, segs(RING, early))
    r = store.put_checkpoint("m", toks, RING, segs(RING, late))
    assert r.blocks_written == 1 and store.stats()["checkpoints"] == 2
    query = np.concatenate([toks, [99, 98]])
    m = store.lookup_checkpoint("m", query)
    assert m.n_tokens == toks.size and m.layout == RING and m.checkpoint_key == r.keys[0]
    assert store.lookup_checkpoint("m", query, max_tokens=toks.size - 1).n_tokens == BT + 3
    div = query.copy()
    div[2 * BT + 1] = 7  # diverges inside the late checkpoint's suffix: only the early one
    assert store.lookup_checkpoint("m", div).n_tokens == BT + 3
    assert store.lookup_checkpoint("m", toks[: BT + 2]).n_tokens == 0  # no partial states
    assert store.longest_prefix("m", query) == 0  # checkpoints are not KV blocks
    assert store.put_checkpoint("m", toks, RING, segs(RING, late)).blocks_present == 1
    # after a restart
    store2 = BlockStore(tmp_path, block_tokens=BT)
    assert store2.scan()["checkpoints"] == 2
    m = store2.lookup_checkpoint("m", query)
    dst = [np.zeros_like(a) for a in late]
    got = store2.get_checkpoint("m", m, RING, segs(RING, dst))
    assert got.n_tokens == toks.size
    for a, b in zip(late, dst):
        np.testing.assert_array_equal(a, b)


def test_corrupt_checkpoint_is_a_miss_and_gc_keeps_referenced_ones(tmp_path):
    store = BlockStore(tmp_path, block_tokens=BT)
    a, b = np.arange(BT + 4), 300 + np.arange(5)
    ka = store.put_checkpoint("m", a, RING, segs(RING, ring_state(3)), manifest="chat").keys[0]
    kb = store.put_checkpoint("m", b, RING, segs(RING, ring_state(4))).keys[0]
    assert store.get_manifest("m", "chat").extra_keys == (ka,)
    assert store.gc("m", min_age_s=0)["removed"] == 1  # b: referenced by no manifest
    assert store.lookup_checkpoint("m", b).n_tokens == 0
    path = Path(store.index.path("m", ka, fmt.KIND_CHECKPOINT))
    _flip(path, fmt.block_header_size(RING, "m", 4) + 10)
    m = store.lookup_checkpoint("m", a)
    got = store.get_checkpoint("m", m, RING, segs(RING, ring_state(0)))
    assert (got.n_tokens, got.corrupt) == (0, 1) and not path.exists()
    assert kb != ka


def test_round_trip_on_the_numpy_reference_kernel(tmp_path):
    """Without the built extension (``storage._blocks`` unimportable) the store runs on
    storage.reference; restores, which hash the scattered bytes piece by piece, must still
    verify and round-trip."""
    script = 'import sys; sys.modules["mlxkv.storage._blocks"] = None\n' + KV_HELPER + textwrap.dedent(f"""
        from mlxkv.storage import diskio
        assert diskio.KERNEL == "reference", diskio.KERNEL
        from mlxkv.storage.store import BlockStore
        from test_store import BF16, BT
        store = BlockStore({str(tmp_path)!r}, block_tokens=BT)
        tokens = list(range(3, 3 + 2 * BT + 5))
        src = make_kv(BF16, tokens, len(tokens))
        store.put_blocks("m", tokens, BF16, segs(BF16, src))
        dst = [np.full_like(a, 0xEE) for a in src]
        r = store.get_blocks("m", tokens, BF16, segs(BF16, dst))
        assert r.n_tokens == len(tokens), r
        for a, b in zip(src, dst):
            np.testing.assert_array_equal(a, b)
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
