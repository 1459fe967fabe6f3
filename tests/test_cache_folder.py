"""The cache folder against hostile or damaged contents: a marker before anything is
scanned, written or removed; no symlink followed; no FIFO waited on; damaged manifests
reported and never a reason to remove blocks; one clear error for an unusable folder.
Real files, symlinks, FIFOs, mounts and subprocesses."""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from test_store import BT, F32, KV_HELPER, ROOT, _flip, make_kv, restore, segs

import mlxkv.storage
from mlxkv.storage import format as fmt
from mlxkv.storage.folder import MARKER
from mlxkv.storage.keys import CacheFolderError, namespace_id
from mlxkv.storage.store import BlockStore, StoreWriteError, reset_warnings

WAIT = 60


@pytest.fixture(autouse=True)
def _fresh_warnings():
    reset_warnings()


def tree(root: Path) -> dict[str, bytes | str]:
    """Every path under ``root`` (symlinks not followed) -> its bytes, link target or kind."""
    out: dict[str, bytes | str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = os.fsdecode(os.path.relpath(p, root))
            st = p.lstat()
            if stat.S_ISLNK(st.st_mode):
                out[rel] = "-> " + os.readlink(p)
            elif stat.S_ISREG(st.st_mode):
                out[rel] = p.read_bytes()
            else:
                out[rel] = stat.filemode(st.st_mode)[0]
    return out


def put(store: BlockStore, toks, ns: str = "m", **kw):
    return store.put_blocks(ns, toks, F32, segs(F32, make_kv(F32, toks, toks.size)), **kw)


def old_cache(root: Path) -> tuple[np.ndarray, list[bytes]]:
    """A folder as the previous version left it: our layout, no marker."""
    store = BlockStore(root, block_tokens=BT)
    toks = np.arange(3 * BT + 5)
    r = put(store, toks, manifest="chat")
    (root / MARKER).unlink()
    return toks, list(r.keys)


def run_child(code: str, *args: str) -> tuple[int, str, str]:
    p = subprocess.run([sys.executable, "-c", KV_HELPER + textwrap.dedent(code), *args],
                       cwd=ROOT, capture_output=True, text=True, timeout=WAIT)
    return p.returncode, p.stdout, p.stderr


# ----------------------------------------------------------------------------- the marker
def test_a_new_folder_is_marked_and_private(tmp_path):
    root = tmp_path / "cache"
    store = BlockStore(root, block_tokens=BT)
    marker = json.loads((root / MARKER).read_text())
    assert marker["format"] == 1
    put(store, np.arange(2 * BT + 3), manifest="chat")
    for p in [root, *root.rglob("*")]:
        mode = stat.S_IMODE(p.lstat().st_mode)
        assert mode == (0o700 if p.is_dir() else 0o600), f"{p}: {oct(mode)}"
    assert mlxkv.storage.CacheFolderError is CacheFolderError
    assert issubclass(CacheFolderError, RuntimeError)


def test_a_folder_of_user_files_is_refused_and_left_untouched(tmp_path):
    """``--cache-dir ~``: files named like ours in folders shaped like ours, plus a
    user's own; the store refuses the folder before it scans, writes or removes."""
    home = tmp_path / "home"
    (home / "Music" / "ab").mkdir(parents=True)
    (home / "Music" / "ab" / "draft.tmp").write_bytes(b"an editor's autosave")
    (home / "Music" / "ab" / ("ab" + "0" * 30 + ".blk")).write_bytes(b"not a block")
    (home / "notes.txt").write_text("mine")
    before = tree(home)
    with pytest.raises(CacheFolderError, match="not an mlxkv cache.*--cache-dir"):
        BlockStore(home, block_tokens=BT)
    assert tree(home) == before


def test_a_folder_of_only_user_folders_is_refused_without_a_lock_file(tmp_path):
    """Only sub-folders at the top (a project folder): the deep check refuses it before
    the lock is taken, so not even a .lock file is left behind."""
    proj = tmp_path / "code"
    (proj / "proj" / "src").mkdir(parents=True)
    (proj / "proj" / "src" / "main.py").write_text("print('mine')")
    before = tree(proj)
    with pytest.raises(CacheFolderError, match="not an mlxkv cache"):
        BlockStore(proj, block_tokens=BT)
    assert tree(proj) == before


def test_clear_removes_only_our_own_folders(tmp_path):
    store = BlockStore(tmp_path, block_tokens=BT)
    tokens = list(range(2 * BT + 3))
    store.put_blocks("m", tokens, F32, segs(F32, make_kv(F32, tokens, len(tokens))))
    (tmp_path / "m" / "mine").mkdir()  # empty, and not ours
    rep = store.clear("m")
    assert rep["removed"] >= 2 and not rep["folder_removed"]
    assert (tmp_path / "m" / "mine").is_dir()
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["mine"]


def test_an_unmarked_folder_of_only_our_files_is_adopted(tmp_path):
    toks, keys = old_cache(tmp_path)
    leftover = tmp_path / "m" / keys[0].hex()[:2] / f".{keys[0].hex()}.123.456.tmp"
    leftover.write_bytes(b"")  # a write the previous version never finished
    store = BlockStore(tmp_path, block_tokens=BT)
    assert json.loads((tmp_path / MARKER).read_text())["format"] == 1
    rep = store.scan()
    assert (rep["blocks"], rep["tails"], rep["tmp_removed"]) == (3, 1, 1)
    assert store.get_manifest("m", "chat") is not None
    assert restore(store, "m", toks, F32, toks.size)[0].n_tokens == toks.size


def test_learned_files_are_ours_to_scan_adopt_and_clear(tmp_path):
    # what speculation learned in a namespace (storage.learned) sits beside its blocks: a
    # scan neither counts it as foreign nor touches it (but for a killed writer's temp
    # file), an unmarked folder holding one is adopted, and clearing the namespace removes it
    toks, _ = old_cache(tmp_path)
    learned = fmt.Learned("m", "suffix-outputs-v1", (np.arange(7, dtype=np.uint32),), 0.0)
    BlockStore(tmp_path, block_tokens=BT).put_learned("m", "suffix", learned)
    (tmp_path / MARKER).unlink()
    temp = tmp_path / "m" / "learned" / "suffix.lrn.123.456.tmp"
    temp.write_bytes(fmt.encode_learned(learned)[:40])  # a writer killed mid-write
    store = BlockStore(tmp_path, block_tokens=BT)  # adopted: everything in it is ours
    rep = store.scan()
    assert (rep["foreign"], rep["tmp_removed"]) == (0, 1) and not temp.exists()
    assert store.stats()["skipped"] == {}
    assert store.get_learned("m", "suffix").sequences[0].tolist() == list(range(7))
    assert [f.name for f in store.learned_files("m")] == ["suffix"]
    rep = store.clear("m")
    assert rep["learned_removed"] == 1 and rep["folder_removed"]


@pytest.mark.parametrize("extra", ["file", "symlink", "bad-magic", "wrong-kind", "subfolder"])
def test_an_unmarked_folder_with_anything_else_is_not_adopted(tmp_path, extra):
    toks, keys = old_cache(tmp_path)
    shard = tmp_path / "m" / keys[0].hex()[:2]
    if extra == "file":
        (tmp_path / "m" / "readme.md").write_text("someone's")
    elif extra == "symlink":
        (shard / (keys[0].hex()[:2] + "2" * 30 + ".blk")).symlink_to(tmp_path / "m" / "manifests")
    elif extra == "bad-magic":
        (shard / (keys[0].hex()[:2] + "1" * 30 + ".blk")).write_bytes(b"x" * 64)
    elif extra == "wrong-kind":  # an mlxkv manifest where a block should be
        man = next((tmp_path / "m" / "manifests").iterdir()).read_bytes()
        (shard / (keys[0].hex()[:2] + "1" * 30 + ".blk")).write_bytes(man)
    else:
        (shard / "sub").mkdir()
    before = tree(tmp_path)
    with pytest.raises(CacheFolderError, match="no MLXKV-CACHE marker"):
        BlockStore(tmp_path, block_tokens=BT)
    assert tree(tmp_path) == before


# ----------------------------------------------------------------------------- unusable folders
@pytest.fixture
def read_only_folder(tmp_path):
    """A read-only folder: a read-only tmpfs as root (permission bits do not stop root),
    else a folder without write permission."""
    root = tmp_path / "ro"
    root.mkdir()
    if os.geteuid() != 0:
        root.chmod(0o500)
        yield root
        root.chmod(0o700)
        return
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,ro", "tmpfs", str(root)],
                       capture_output=True, text=True, check=False, timeout=WAIT)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs ({r.stderr.strip()}), and root ignores "
                    "permission bits")
    try:
        yield root
    finally:
        subprocess.run(["umount", "-l", str(root)], check=False, timeout=WAIT)


def test_a_read_only_folder_is_one_clear_error(read_only_folder):
    with pytest.raises(CacheFolderError, match="read-only.*--no-ssd-cache"):
        BlockStore(read_only_folder, block_tokens=BT)


@pytest.mark.parametrize("case", ["file", "lock-folder", "lock-folder-unmarked", "marker-damaged",
                                  "marker-newer", "marker-folder"])
def test_unusable_folders_are_one_clear_error(tmp_path, case):
    root = tmp_path / "cache"
    if case == "file":
        root.write_text("a file where the folder should be")
    else:
        BlockStore(root, block_tokens=BT)
        if case.startswith("lock-folder"):
            (root / ".lock").unlink()
            (root / ".lock").mkdir()
            if case.endswith("unmarked"):
                (root / MARKER).unlink()
        elif case == "marker-damaged":
            (root / MARKER).write_bytes(b"[" * 100_000)
        elif case == "marker-newer":
            (root / MARKER).write_text('{"format": 99}')
        else:
            (root / MARKER).unlink()
            (root / MARKER).mkdir()
    with pytest.raises(CacheFolderError) as info:
        BlockStore(root, block_tokens=BT).scan()
    msg = str(info.value)
    assert str(root) in msg and "--cache-dir" in msg and "\n" not in msg


def test_a_lock_replaced_by_a_folder_fails_writes_cleanly_and_reads_go_on(tmp_path, caplog):
    store = BlockStore(tmp_path, block_tokens=BT)
    toks = np.arange(2 * BT)
    put(store, toks)
    (tmp_path / ".lock").unlink()
    (tmp_path / ".lock").mkdir()
    more = np.arange(500, 500 + 2 * BT)
    for _ in range(3):
        with pytest.raises(StoreWriteError, match="not a regular file"):
            put(store, more)
    assert sum(".lock" in r.message for r in caplog.records) == 1  # warned once
    with pytest.raises(CacheFolderError, match=".lock"):
        store.scan()
    assert restore(store, "m", toks, F32, toks.size)[0].n_tokens == toks.size
    assert store.longest_prefix("m", more) == 0


def test_a_dangling_lock_symlink_creates_nothing_outside(tmp_path):
    root = tmp_path / "cache"
    root.mkdir()
    BlockStore(root, block_tokens=BT)
    target = tmp_path / "elsewhere" / "created-by-mlxkv"
    target.parent.mkdir()
    (root / ".lock").unlink(missing_ok=True)
    (root / ".lock").symlink_to(target)
    with pytest.raises(CacheFolderError, match=".lock"):
        BlockStore(root, block_tokens=BT).scan()
    assert not target.exists()


# ----------------------------------------------------------------------------- hostile files
def test_symlinked_namespace_and_shard_folders_are_never_followed(tmp_path):
    """Files outside the cache, reached through a symlinked namespace folder or shard,
    named as ours and unparsable, are neither scanned, nor removed, nor written."""
    root, outside = tmp_path / "cache", tmp_path / "outside"
    root.mkdir()
    store = BlockStore(root, block_tokens=BT)
    toks = np.arange(2 * BT)
    keys = {ns: store.chain_keys(ns, toks)[0].hex() for ns in ("m", "n")}
    for ns, key in keys.items():  # what a probe of these tokens would open, and a temp name
        d = outside / ns / key[:2]
        d.mkdir(parents=True)
        (d / f"{key}.blk").write_bytes(b"user data, not a block")
        (d / f".{key}.1.2.tmp").write_bytes(b"user data")
    (root / "m").symlink_to(outside / "m")  # a namespace folder
    (root / "n").mkdir()
    (root / "n" / keys["n"][:2]).symlink_to(outside / "n" / keys["n"][:2])  # a shard
    before = tree(outside)
    rep = store.scan()
    assert rep["bad_removed"] == rep["tmp_removed"] == 0 and rep["foreign"] == 2
    for ns in ("m", "n"):
        assert store.longest_prefix(ns, toks) == 0  # the probe reads, and removes nothing
        with pytest.raises(StoreWriteError, match="not a folder of the cache"):
            put(store, toks, ns)
    assert store.gc(min_age_s=0)["removed"] == 0
    assert tree(outside) == before


def test_fifos_named_like_a_block_or_a_manifest_hang_nothing(tmp_path):
    """Opening a FIFO for reading waits for a writer: every reader of a FIFO named like a
    block, and every ``cache`` verb over a FIFO named like a manifest, would hang. In a
    child process with a deadline, so a hang fails the test."""
    store = BlockStore(tmp_path, block_tokens=BT)
    toks = np.arange(3 * BT)
    r = put(store, toks[: 2 * BT], manifest="chat")
    fifo_blk = Path(store.index.path("m", store.chain_keys("m", toks)[2], fmt.KIND_BLOCK))
    fifo_blk.parent.mkdir(exist_ok=True)
    os.mkfifo(fifo_blk)
    fifo_man = Path(store.upkeep.manifest_path("m", "other"))
    os.mkfifo(fifo_man)
    victim = Path(store.index.path("m", r.keys[1], fmt.KIND_BLOCK))
    victim.unlink()
    os.mkfifo(victim)  # an indexed block replaced by a FIFO after the scan
    code, out, err = run_child('''
        import json, sys
        from mlxkv.storage.store import BlockStore
        from test_store import F32, BT
        store = BlockStore(sys.argv[1], block_tokens=BT)
        store.scan()
        toks = np.arange(3 * BT)
        n = store.longest_prefix("m", toks)
        dst = make_kv(F32, [], 3 * BT)
        g = store.get_blocks("m", toks, F32, segs(F32, dst))
        mans = [m.name for m in store.manifests("m")]
        gc = store.gc("m", min_age_s=0)
        print(json.dumps({"n": n, "restored": g.n_tokens, "manifests": mans,
                          "damaged": list(store.damaged_manifests("m").values()),
                          "gc_removed": gc["removed"], "other": store.get_manifest("m", "other")}))
    ''', str(tmp_path))
    assert code == 0, err
    got = json.loads(out.strip().splitlines()[-1])
    assert got == {"n": BT, "restored": BT, "manifests": ["chat"],
                   "damaged": ["not a regular file"], "gc_removed": 0, "other": None}
    assert all(stat.S_ISFIFO(p.lstat().st_mode) for p in (fifo_blk, fifo_man, victim))
    # the FIFO in place of block 1 hid nothing else: block 0 is still a hit in this process
    dst = make_kv(F32, [], 3 * BT)
    assert store.get_blocks("m", toks, F32, segs(F32, dst)).n_tokens == BT


def _deep(n: int) -> bytes:
    return b"[" * n + b"]" * n


def test_deeply_nested_metadata_is_a_miss_with_a_reason(tmp_path):
    """A header or manifest whose metadata JSON nests 100,000 deep (header hash valid):
    the block is damage (removed at scan, as any block that fails its checks), the
    manifest is reported as damaged; nothing raises RecursionError."""
    store = BlockStore(tmp_path, block_tokens=BT)
    toks = np.arange(2 * BT)
    r = put(store, toks, manifest="chat")
    path = Path(store.index.path("m", r.keys[1], fmt.KIND_BLOCK))
    e = store.index.spaces["m"].blocks[r.keys[1]]
    meta, tok_bytes = _deep(100_000), toks[BT:].astype("<u4").tobytes()
    poff = fmt.align(fmt.PREFIX_SIZE + fmt._BLOCK.size + len(meta) + len(tok_bytes) + 8)
    body = fmt._BLOCK.pack(e.key, e.parent, namespace_id("m"), e.content_hash, poff,
                           e.payload_len, e.t0, e.t1, len(meta)) + meta + tok_bytes
    head = fmt._prefix(fmt.KIND_BLOCK, body)
    path.write_bytes(head + bytes(poff + e.payload_len - len(head)))
    man = Path(store.upkeep.manifest_path("m", "chat"))
    man.write_bytes(fmt._prefix(fmt.KIND_MANIFEST, fmt._MAN.pack(200_000) + _deep(100_000)))
    fresh = BlockStore(tmp_path, block_tokens=BT)
    rep = fresh.scan()
    assert (rep["blocks"], rep["bad_removed"]) == (1, 1) and not path.exists()
    assert fresh.longest_prefix("m", toks) == BT
    assert fresh.manifests("m") == []
    assert "nested deeper" in fresh.damaged_manifests("m")[str(man)]
    assert fresh.get_manifest("m", "chat") is None


def test_a_manifest_with_one_flipped_bit_is_reported_and_keeps_its_blocks(tmp_path):
    """``verify`` must see a damaged manifest, and ``gc`` must not remove the blocks of a
    conversation whose manifest it cannot read."""
    store = BlockStore(tmp_path, block_tokens=BT)
    keep = np.arange(3 * BT + 4)
    put(store, keep, manifest="chat")
    loose = np.arange(900, 900 + BT)
    put(store, loose)  # referenced by no manifest
    man = Path(store.upkeep.manifest_path("m", "chat"))
    _flip(man, man.stat().st_size - 40)  # inside the block keys
    files = sorted(p for p in tmp_path.rglob("*") if p.suffix in (".blk", ".tail"))
    rep = store.gc("m", min_age_s=0)
    assert rep["removed"] == 0 and all(p.exists() for p in files)
    errors: dict[str, str] = {}
    assert store.manifests("m", errors) == []
    assert errors == {str(man): "header hash mismatch"}
    assert store.damaged_manifests("m") == errors
    assert rep["unreadable_manifests"] == errors
    assert rep == store.gc(min_age_s=0)  # every namespace: the same
    assert all(p.exists() for p in files) and man.exists()
    assert store.longest_prefix("m", keep) == keep.size
    # clearing the namespace removes it whole, the damaged manifest included
    cleared = store.clear("m")
    assert cleared == {"removed": 5, "bytes": cleared["bytes"], "manifests_removed": 1,
                       "learned_removed": 0, "folder_removed": True}
    assert not (tmp_path / "m").exists() and (tmp_path / MARKER).exists()


def test_names_that_are_not_utf8_are_skipped_and_reported_printably(tmp_path):
    store = BlockStore(tmp_path, block_tokens=BT)
    toks = np.arange(BT)
    r = put(store, toks)
    path = Path(store.index.path("m", r.keys[0], fmt.KIND_BLOCK))
    raw = bytearray(path.read_bytes())
    raw[8:10] = (fmt.FORMAT_VERSION + 1).to_bytes(2, "little")  # a newer mlxkv's file
    odd = os.fsencode(path.parent) + b"/" + os.fsencode(path.stem) + b"\xff.blk"
    with open(odd, "wb") as f:
        f.write(bytes(raw))
    os.mkdir(os.fsencode(tmp_path) + b"/\xfe\xfd")
    fresh = BlockStore(tmp_path, block_tokens=BT)
    rep = fresh.scan()
    st = fresh.stats()
    json.dumps(st, ensure_ascii=False).encode("utf-8")  # printable: no lone surrogates
    assert os.path.exists(odd)
    assert (rep["blocks"], rep["foreign"], rep["bad_removed"]) == (1, 1, 0)
    assert any(p.endswith("\\xff.blk") for p in st["skipped"])


def test_read_errors_never_remove_a_file(tmp_path, monkeypatch):
    """A disk that fails reads (EIO): the scan skips the file with a reason and a restore
    is a miss; the file stays (a read error is not proof of damage)."""
    store = BlockStore(tmp_path, block_tokens=BT)
    toks = np.arange(2 * BT)
    r = put(store, toks)
    bad = store.index.path("m", r.keys[1], fmt.KIND_BLOCK)
    real_pread = os.pread

    def failing_pread(fd, n, off):
        if os.readlink(f"/proc/self/fd/{fd}") == bad:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_pread(fd, n, off)

    monkeypatch.setattr(os, "pread", failing_pread)
    fresh = BlockStore(tmp_path, block_tokens=BT)
    rep = fresh.scan()
    assert os.path.exists(bad)
    assert (rep["blocks"], rep["bad_removed"], rep["unreadable"]) == (1, 0, 1)
    assert fresh.stats()["skipped"] == {bad: os.strerror(errno.EIO)}
    from mlxkv.storage import diskio

    def failing_pread_full(fd, buf, off):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "pread", real_pread)
    monkeypatch.setattr(diskio, "pread_full", failing_pread_full)
    got, _ = restore(store, "m", toks, F32, toks.size)
    assert (got.n_tokens, got.corrupt) == (0, 0) and store.stats()["read_errors"] >= 1
    assert os.path.exists(bad) and os.path.exists(store.index.path("m", r.keys[0], fmt.KIND_BLOCK))
