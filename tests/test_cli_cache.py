"""`mlxkv cache ...` on folders that cannot be used (a file, a read-only folder, a `.lock`
that is a folder) and on damaged manifests: one `mlxkv: error:` line, never a traceback;
`verify` names what is damaged and exits 1. Real folders, real subprocesses."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
VERBS = [["stats"], ["ls"], ["verify"], ["gc"], ["flush"], ["clear", "--yes"]]


def mlxkv(*args, timeout=60):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "XDG_CONFIG_HOME": str(ROOT / ".cache" / "no-config")}
    env.pop("MLXKV_CONFIG", None)
    env.pop("MLXKV_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "mlxkv", *args], cwd=ROOT,
                          capture_output=True, text=True, env=env, timeout=timeout)


def assert_one_error_line(r, *needles):
    lines = [ln for ln in r.stderr.splitlines() if "PyTorch was not found" not in ln]
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    assert len(lines) == 1 and lines[0].startswith("mlxkv: error: "), r.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def fill(root: Path, ns: str = "ns-a") -> None:
    """One saved conversation (a block, a tail, a manifest) written by the block store."""
    from mlxkv.storage import format as fmt
    from mlxkv.storage.format import SegmentSpec
    from mlxkv.storage.store import BlockStore

    layout = fmt.make_layout([SegmentSpec("l0.k", "float32", (8,), 2, 32),
                              SegmentSpec("l0.v", "float32", (8,), 2, 32)])
    n = 300
    segs = [((np.arange(s.outer * n * s.row_bytes) % 251).astype(np.uint8), s.outer, n, s.row_bytes)
            for s in layout]
    BlockStore(root).put_blocks(ns, np.arange(100, 100 + n), layout, segs, manifest="conversation-1")


@pytest.fixture(scope="module")
def filled(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("filled") / "cache"
    fill(root)
    return root


def copy_of(filled: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "cache"
    shutil.copytree(filled, dst)
    return dst


@pytest.mark.parametrize("verb", VERBS, ids=[v[0] for v in VERBS])
def test_cache_folder_that_is_a_file(tmp_path, verb):
    path = tmp_path / "not-a-folder"
    path.write_text("my notes\n")
    r = mlxkv("cache", *verb, "--cache-dir", str(path))
    assert_one_error_line(r, str(path))
    assert path.read_text() == "my notes\n"


@pytest.mark.parametrize("verb", VERBS, ids=[v[0] for v in VERBS])
def test_lock_that_is_a_folder(filled, tmp_path, verb):
    """A folder whose .lock cannot be opened breaks every verb even for root: one line."""
    root = copy_of(filled, tmp_path)
    (root / ".lock").unlink(missing_ok=True)
    (root / ".lock").mkdir()
    r = mlxkv("--cache-dir", str(root), "cache", *verb)
    assert_one_error_line(r, ".lock")
    assert (root / "ns-a").is_dir()


@pytest.fixture
def read_only_folder(filled, tmp_path):
    """A cache folder the process cannot write to: chmod for a normal user; for root a
    read-only bind mount, else an immutable folder (chattr +i); else skipped."""
    root = copy_of(filled, tmp_path)
    if os.geteuid() != 0:
        os.chmod(root, 0o555)
        yield root
        os.chmod(root, 0o755)
        return
    view = tmp_path / "read-only-view"
    view.mkdir()
    mounted = subprocess.run(["mount", "--bind", str(root), str(view)], capture_output=True,
                             timeout=30).returncode == 0
    if mounted:
        try:
            if subprocess.run(["mount", "-o", "remount,bind,ro", str(view)], capture_output=True,
                              timeout=30).returncode == 0:
                yield view
                return
        finally:
            subprocess.run(["umount", str(view)], capture_output=True, timeout=30)
    if shutil.which("chattr") and subprocess.run(["chattr", "+i", str(root)], capture_output=True,
                                                 timeout=30).returncode == 0:
        try:
            yield root
        finally:
            subprocess.run(["chattr", "-i", str(root)], capture_output=True, timeout=30)
        return
    pytest.skip("running as root without mount or chattr: cannot make a read-only folder")


@pytest.mark.parametrize("verb", VERBS, ids=[v[0] for v in VERBS])
def test_read_only_cache_folder(read_only_folder, verb):
    r = mlxkv("cache", *verb, "--cache-dir", str(read_only_folder))
    assert_one_error_line(r, str(read_only_folder))


def test_verify_reports_a_damaged_manifest_and_fails(filled, tmp_path):
    root = copy_of(filled, tmp_path)
    ok = mlxkv("cache", "verify", "--cache-dir", str(root), "--json")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["ns-a"]["manifests_damaged"] == 0
    (man,) = (root / "ns-a" / "manifests").glob("*.man")
    data = bytearray(man.read_bytes())
    data[len(data) // 2] ^= 0xFF
    man.write_bytes(bytes(data))
    r = mlxkv("cache", "verify", "--cache-dir", str(root))
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "1 damaged manifests" in r.stdout and str(man) in r.stdout, r.stdout
    j = mlxkv("cache", "verify", "--cache-dir", str(root), "--json")
    assert j.returncode == 1
    assert list(json.loads(j.stdout)["ns-a"]["damaged_manifests"]) == [str(man)]
    assert man.exists()  # reported, not removed
    # gc cannot know what the damaged manifest keeps alive: it removes nothing there
    blocks = sorted(p.name for p in root.glob("ns-a/*/*") if p.parent.name != "manifests")
    g = mlxkv("cache", "gc", "--min-age", "0", "--cache-dir", str(root))
    assert g.returncode == 0, g.stderr
    assert "removed 0 unreferenced blocks" in g.stdout
    assert g.stderr.startswith("mlxkv: warning: ") and str(man) in g.stderr, g.stderr
    assert sorted(p.name for p in root.glob("ns-a/*/*") if p.parent.name != "manifests") == blocks


def test_missing_folder_is_not_created(tmp_path):
    r = mlxkv("cache", "stats", "--cache-dir", str(tmp_path / "nowhere"))
    assert_one_error_line(r, "no cache folder")
    assert not (tmp_path / "nowhere").exists()
