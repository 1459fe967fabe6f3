"""`mlxkv chat` as a user drives it: lines piped in while the pipe stays open (every line
is answered), chat commands answered locally, and a terminal (a real pty) where SIGTERM at
the prompt still ends the chat at once."""

from __future__ import annotations

import json
import os
import pty
import re
import selectors
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEADLINE_S = 60.0  # a failing test fails; it never hangs


def env_for(cache_dir: Path) -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MLXKV_CACHE_DIR": str(cache_dir),
           "XDG_CONFIG_HOME": str(ROOT / ".cache" / "no-config")}
    env.pop("MLXKV_CONFIG", None)
    return env


def read_until(fd: int, buf: bytes, done, what: str, proc) -> bytes:
    """Read ``fd`` until ``done(buf)``; fails (never hangs) after DEADLINE_S."""
    sel = selectors.DefaultSelector()
    sel.register(fd, selectors.EVENT_READ)
    end = time.monotonic() + DEADLINE_S
    try:
        while not done(buf):
            left = end - time.monotonic()
            assert left > 0, f"no {what} within {DEADLINE_S} s; output so far:\n{buf.decode(errors='replace')}"
            if not sel.select(left):
                continue
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # a pty reports EIO once the child closed it
                chunk = b""
            if not chunk:
                err = proc.stderr.read().decode(errors="replace") if proc.poll() is not None else ""
                raise AssertionError(f"output ended before {what} (exit {proc.poll()}):\n"
                                     f"{buf.decode(errors='replace')}\nstderr:\n{err}")
            buf += chunk
    finally:
        sel.close()
    return buf


def test_piped_lines_are_all_answered_and_commands_stay_local(tiny_qwen3, tmp_path):
    """Two questions arrive in one write and the pipe stays open: both are answered (the
    second one was never answered: select() cannot see lines already in Python's buffer).
    /help, /stats and an unknown command are answered here, not sent to the model; /clear
    starts over (the same question again has the first one's prompt, served from cache)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlxkv", "chat", "--model", str(tiny_qwen3),
         "--max-tokens", "4", "--temp", "0"],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env=env_for(tmp_path))
    try:
        proc.stdin.write(b"What is mlxkv?\nHow do I run the tests?\n/help\n/stats\n/nope\n"
                         b"/clear\nWhat is mlxkv?\n")
        proc.stdin.flush()  # and the pipe stays open
        out = read_until(proc.stdout.fileno(), b"", lambda b: b.count(b"> ") >= 8,
                         "answer to every line", proc)
        proc.stdin.write(b"/quit\n")
        proc.stdin.flush()
        assert proc.wait(timeout=DEADLINE_S) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = out.decode()
    stats = re.findall(r"\[prompt (\d+) tok, cached (\d+),", text)
    assert len(stats) == 3, text  # the three questions; no command reached the model
    assert stats[2][0] == stats[0][0] and int(stats[2][1]) > 0, stats
    assert "/clear" in text and "/quit" in text and "chat commands:" in text
    assert "unknown command /nope, /help lists them" in text
    assert re.search(r"cached tokens served: \d+ of \d+ prompt tokens", text), text
    assert "RAM tier:" in text and "SSD tier:" in text
    assert "conversation cleared" in text


def test_terminal_chat_sigterm_at_the_prompt(tiny_qwen3, tmp_path):
    """On a terminal (a pty: input() with line editing), a command is answered and SIGTERM
    at the next prompt ends the chat at once with status 143."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlxkv", "chat", "--model", str(tiny_qwen3),
         "--max-tokens", "3", "--temp", "0"],
        cwd=ROOT, stdin=slave, stdout=slave, stderr=subprocess.PIPE, env=env_for(tmp_path))
    os.close(slave)
    try:
        buf = read_until(master, b"", lambda b: b"> " in b, "first prompt", proc)
        os.write(master, b"/help\n")
        buf = read_until(master, buf, lambda b: b"chat commands:" in b and b.count(b"> ") >= 2,
                         "help and the next prompt", proc)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=DEADLINE_S) == 143, proc.stderr.read()
        assert b"Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)


def test_a_refused_turn_leaves_the_chat_usable(tiny_qwen3, tmp_path):
    """A message longer than the model's context is refused with one error line that says
    the way out (/clear; --truncate is generate's flag); the chat goes on."""
    model = tmp_path / "model"
    shutil.copytree(tiny_qwen3, model)
    cfg = json.loads((model / "config.json").read_text())
    cfg["max_position_embeddings"] = 48
    (model / "config.json").write_text(json.dumps(cfg))
    r = subprocess.run(
        [sys.executable, "-m", "mlxkv", "chat", "--model", str(model), "--max-tokens", "3",
         "--temp", "0", "--no-ssd-cache"],
        cwd=ROOT, input="mlxkv " * 80 + "\nhi\n", capture_output=True, text=True,
        env=env_for(tmp_path / "unused"), timeout=DEADLINE_S)
    assert r.returncode == 0, r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("mlxkv: error: ")]
    assert len(errors) == 1 and "context is 48 tokens" in errors[0], r.stderr
    assert "/clear starts a new conversation" in errors[0] and "--truncate" not in errors[0]
    assert len(re.findall(r"\[prompt \d+ tok", r.stdout)) == 1, r.stdout
