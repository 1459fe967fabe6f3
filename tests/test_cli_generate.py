"""`mlxkv generate` as a user runs it: bad prompts and unsupported flags are refused before
a model loads; an unusable cache folder still gets an answer (RAM only, one warning); a
prompt longer than the context is refused or (--truncate) cut; a terminal sees prefill
progress and the model load apart from TTFT."""

from __future__ import annotations

import json
import os
import pty
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def mlxkv(*args, stdin=None, timeout=120, **env):
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1",
                "XDG_CONFIG_HOME": str(ROOT / ".cache" / "no-config"), **env}
    full_env.pop("MLXKV_CONFIG", None)
    full_env.pop("MLXKV_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "mlxkv", *args], cwd=ROOT, input=stdin,
                          capture_output=True, text=True, env=full_env, timeout=timeout)


def stderr_lines(r) -> list[str]:
    return [ln for ln in r.stderr.splitlines() if "PyTorch was not found" not in ln]


def one_line_error(r, code, needle):
    assert r.returncode == code, (r.returncode, r.stderr)
    lines = stderr_lines(r)
    assert len(lines) == 1 and lines[0].startswith("mlxkv: error: "), r.stderr
    assert needle in lines[0], lines[0]
    assert r.stdout == ""


def test_empty_prompt_is_refused_before_a_model_loads(tmp_path):
    # The model folder does not exist: an error about the prompt proves nothing loaded.
    nowhere = str(tmp_path / "no-model")
    one_line_error(mlxkv("generate", "--prompt", "", "--model", nowhere), 2, "the prompt is empty")
    one_line_error(mlxkv("generate", "--prompt", " \n\t ", "--model", nowhere), 2, "the prompt is empty")
    one_line_error(mlxkv("generate", "--prompt", "-", "--model", nowhere, stdin="\n\n"), 2,
                   "the prompt is empty")


def test_a_missing_draft_model_is_one_clear_error(tmp_path):
    # --draft-model is read: a folder that is not there stops the start with one line that
    # names the draft model (the flag, and the environment variable alike).
    nowhere = str(tmp_path / "no-draft")
    r = mlxkv("generate", "-p", "hi", "--draft-model", nowhere, "--max-tokens", "2")
    one_line_error(r, 1, "draft model")
    assert nowhere in stderr_lines(r)[0]
    one_line_error(mlxkv("generate", "-p", "hi", "--max-tokens", "2", MLXKV_DRAFT_MODEL=nowhere), 1,
                   "draft model")


def _answers(r) -> dict:
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["tokens"], out
    return out


@pytest.fixture
def unusable(request, tmp_path):
    """A cache folder that cannot be used: a file, a folder whose .lock is a folder (both
    break even for root), or a read-only bind mount of a folder (root with mount)."""
    kind = request.param
    if kind == "file":
        path = tmp_path / "cache-is-a-file"
        path.write_text("not a folder\n")
        yield path
        assert path.read_text() == "not a folder\n"
        return
    path = tmp_path / "cache"
    path.mkdir()
    if kind == "lock-is-a-folder":
        (path / ".lock").mkdir()  # cannot be opened as the lock file, even by root
        yield path
        return
    view = tmp_path / "read-only"
    view.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "--bind", str(path), str(view)],
                                           capture_output=True, timeout=30).returncode != 0:
        pytest.skip("a read-only folder for root needs mount")
    try:
        if subprocess.run(["mount", "-o", "remount,bind,ro", str(view)], capture_output=True,
                          timeout=30).returncode != 0:
            pytest.skip("cannot remount read-only")
        yield view
    finally:
        subprocess.run(["umount", str(view)], capture_output=True, timeout=30)


@pytest.mark.parametrize("unusable", ["file", "lock-is-a-folder", "read-only"], indirect=True)
def test_unusable_cache_folder_still_answers(tiny_qwen3, unusable):
    r = mlxkv("generate", "--model", str(tiny_qwen3), "-p", "hello", "--max-tokens", "3",
              "--temp", "0", "--json", "--cache-dir", str(unusable))
    _answers(r)
    warnings = [ln for ln in stderr_lines(r) if ln.startswith("mlxkv: warning: ")]
    assert stderr_lines(r) == warnings and len(warnings) == 1, r.stderr
    assert str(unusable) in warnings[0] and "--no-ssd-cache" in warnings[0], warnings


def test_no_ssd_cache_answers_without_touching_the_folder(tiny_qwen3, tmp_path):
    folder = tmp_path / "never-created"
    r = mlxkv("generate", "--model", str(tiny_qwen3), "-p", "hello", "--max-tokens", "3",
              "--temp", "0", "--json", "--no-ssd-cache", MLXKV_CACHE_DIR=str(folder))
    _answers(r)
    assert stderr_lines(r) == [], r.stderr
    assert not folder.exists()


@pytest.fixture(scope="module")
def short_context_model(tiny_qwen3, tmp_path_factory) -> Path:
    """The tiny model with a 48-token context (max_position_embeddings)."""
    dst = tmp_path_factory.mktemp("short") / "model"
    shutil.copytree(tiny_qwen3, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["max_position_embeddings"] = 48
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_prompt_longer_than_the_context(short_context_model, tmp_path):
    args = ("generate", "--model", str(short_context_model), "--raw", "-p", "mlxkv " * 80,
            "--max-tokens", "4", "--temp", "0", "--no-ssd-cache")
    r = mlxkv(*args)
    one_line_error(r, 1, "--truncate")
    assert "context is 48 tokens" in r.stderr, r.stderr
    out = _answers(mlxkv(*args, "--truncate", "--json"))
    assert out["stats"]["prompt_tokens"] <= 48 - 4, out["stats"]


def test_terminal_sees_prefill_progress_and_load_time(tiny_qwen3, tmp_path):
    """stderr on a terminal (a pty): a prompt of many prefill chunks shows `prefill i/n`;
    the stats line shows the model load apart from TTFT."""
    master, slave = pty.openpty()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MLXKV_CACHE_DIR": str(tmp_path),
           "XDG_CONFIG_HOME": str(ROOT / ".cache" / "no-config")}
    env.pop("MLXKV_CONFIG", None)
    try:
        r = subprocess.run(
            [sys.executable, "-m", "mlxkv", "generate", "--model", str(tiny_qwen3), "--raw",
             "-p", "mlxkv " * 300, "--max-tokens", "2", "--temp", "0", "--prefill-step-size", "32"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=slave, env=env, timeout=120)
        os.close(slave)
        slave = -1
        err = b""
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child's end is closed and everything was read
                break
            if not chunk:
                break
            err += chunk
    finally:
        if slave >= 0:
            os.close(slave)
        os.close(master)
    text = err.decode(errors="replace")
    assert r.returncode == 0, text
    assert "mlxkv: prefill 32/" in text or "mlxkv: prefill 0/" in text, text
    assert "\x1b[K" in text  # the progress line is cleared before the reply
    stats = [ln for ln in text.splitlines() if "[prompt" in ln]
    assert len(stats) == 1 and "model load " in stats[0] and "TTFT" in stats[0], text


@pytest.fixture
def full_disk(tmp_path):
    """A cache folder on a 64 KiB tmpfs (root with mount only): the first block write fills it."""
    mnt = tmp_path / "small-disk"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True,
            timeout=30).returncode != 0:
        pytest.skip("a full disk needs a small tmpfs (root and mount)")
    try:
        yield mnt / "cache"
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True, timeout=30)


def test_full_disk_is_one_warning(tiny_qwen3, full_disk):
    r = mlxkv("generate", "--model", str(tiny_qwen3), "--raw", "-p", "word " * 700, "--max-tokens", "3",
              "--temp", "0", "--json", "--block-tokens", "64", "--cache-dir", str(full_disk))
    _answers(r)
    lines = stderr_lines(r)
    assert len(lines) == 1 and lines[0].startswith("mlxkv: warning: "), r.stderr
    assert "No space left on device" in lines[0], lines
