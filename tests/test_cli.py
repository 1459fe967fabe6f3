"""The command line, run as a user would (subprocesses): errors, config, generate, chat."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def mlxkv(*args, stdin=None, **env):
    # No network, no user config, and a private prefix-cache folder.
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1",
                "MLXKV_CACHE_DIR": str(ROOT / ".cache" / "test-cli-prefix-cache"), **env}
    full_env.pop("MLXKV_CONFIG", None)
    full_env.setdefault("XDG_CONFIG_HOME", str(ROOT / ".cache" / "no-config"))
    return subprocess.run([sys.executable, "-m", "mlxkv", *args], cwd=ROOT,
                          input=stdin, capture_output=True, text=True, env=full_env,
                          timeout=120)


def one_line_error(r, code, needle):
    assert r.returncode == code, (r.returncode, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if "PyTorch was not found" not in ln]
    assert len(lines) == 1 and lines[0].startswith("mlxkv: error:"), r.stderr
    assert needle in lines[0], lines[0]
    assert r.stdout == ""


def test_version():
    r = mlxkv("--version")
    assert r.returncode == 0 and r.stdout.strip() == "mlxkv 0.1.0"


def test_invalid_flag_and_value():
    one_line_error(mlxkv("--bogus"), 2, "unrecognized arguments: --bogus")
    one_line_error(mlxkv("generate", "--prompt", "x", "--temp", "hot"), 2, "invalid float")
    one_line_error(mlxkv("generate"), 2, "--prompt")


def test_missing_model_folder(tmp_path):
    one_line_error(mlxkv("generate", "--prompt", "hi", "--model", str(tmp_path / "nope")),
                   1, "model folder not found")


def test_unknown_hub_id_offline(tmp_path):
    one_line_error(mlxkv("generate", "--prompt", "hi", "--model", "mlxkv-test/no-such-model",
                         HF_HUB_CACHE=str(tmp_path)), 1, "offline")


def test_bad_setting_from_env():
    one_line_error(mlxkv("config", MLXKV_MAX_TOKENS="many"), 1, "MLXKV_MAX_TOKENS")


def test_config_shows_values_and_sources(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("top_k = 9\nmax_tokens = 5\n")
    r = mlxkv("config", "--max-tokens", "7", "--config", str(cfg), MLXKV_TEMPERATURE="0.3")
    assert r.returncode == 0, r.stderr
    rows = {ln.split()[0]: ln for ln in r.stdout.splitlines()}
    assert "7" in rows["max_tokens"] and "flag --max-tokens" in rows["max_tokens"]
    assert "0.3" in rows["temperature"] and "env MLXKV_TEMPERATURE" in rows["temperature"]
    assert "9" in rows["top_k"] and str(cfg) in rows["top_k"]
    assert "(default)" in rows["block_tokens"]
    assert "BLAS in use" in r.stdout
    j = json.loads(mlxkv("config", "--json", "--blas", "off").stdout)
    assert j["settings"]["blas"] == {"value": "off", "source": "flag --blas"}
    assert j["blas"]["name"].startswith("reference")


def test_config_names_the_model_as_users_know_it():
    """The default model is the demo model: shown by name beside its folder (which, in a
    one-file binary, is a temporary path); --json keeps the raw value."""
    from mlxkv.engine.demo import DEMO_MODEL_DIR

    r = mlxkv("config")
    assert r.returncode == 0, r.stderr
    row = next(ln for ln in r.stdout.splitlines() if ln.startswith("model "))
    assert "demo model (" in row and str(DEMO_MODEL_DIR) in row
    j = json.loads(mlxkv("config", "--json").stdout)["settings"]["model"]
    assert j["value"] == str(DEMO_MODEL_DIR) and j["label"].startswith("demo model (")


def test_cache_command_is_wired(tmp_path):
    r = mlxkv("cache", "--cache-dir", str(tmp_path), "--json", "stats")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["blocks"] == 0


def test_generate_json_and_stream(tiny_qwen3):
    args = ("generate", "--model", str(tiny_qwen3), "--prompt", "hello", "--max-tokens", "12",
            "--temp", "1.0", "--seed", "7")
    r = mlxkv(*args, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["finish_reason"] in ("length", "stop") and 0 < len(out["tokens"]) <= 12
    assert out["stats"]["prompt_tokens"] > 0 and out["model"]["fingerprint"]
    streamed = mlxkv(*args)
    assert streamed.returncode == 0
    assert streamed.stdout == out["text"] + "\n"  # same seed, same text, streamed
    assert "[prompt" in streamed.stderr and "TTFT" in streamed.stderr


def test_chat_repl(tiny_qwen3, tmp_path):
    # Two turns, then end of input (Ctrl-D) leaves cleanly; the second turn reuses the
    # first turn's KV state through the prefix cache. `//` sends a message starting with /.
    r = mlxkv("chat", "--model", str(tiny_qwen3), "--max-tokens", "5", "--temp", "0",
              stdin="hello\n//a message, not a command\n", MLXKV_CACHE_DIR=str(tmp_path))
    assert r.returncode == 0, r.stderr
    stats = [ln for ln in r.stdout.splitlines() if ln.startswith("[prompt")]
    assert len(stats) == 2
    assert "cached 0," in stats[0] and "cached 0," not in stats[1], stats


def test_chat_ctrl_c_cancels_the_reply(tiny_qwen3):
    """SIGINT while a reply streams stops that reply; the REPL stays usable."""
    import re
    import select
    import signal
    import time

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MLXKV_PREFIX_CACHE": "false",
           "XDG_CONFIG_HOME": str(ROOT / ".cache" / "no-config")}
    env.pop("MLXKV_CONFIG", None)
    # A shell ignores SIGINT in the jobs it starts in the background (`make test &`), and the
    # chat would inherit that: the terminal's default, as a user's chat has it.
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlxkv", "chat", "--model", str(tiny_qwen3),
         "--max-tokens", "1000000", "--temp", "1.0", "--seed", "1"],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env=env, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))

    def read_until(pattern: bytes, timeout: float = 60.0) -> bytes:
        """Output up to a match of ``pattern``; fails, never hangs, when it does not come."""
        buf, deadline = b"", time.monotonic() + timeout
        while not re.search(pattern, buf):
            ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            assert ready, (buf, f"no {pattern!r} within {timeout} s")
            chunk = os.read(proc.stdout.fileno(), 4096)
            assert chunk, (buf, proc.stderr.read())
            buf += chunk
        return buf

    def drain(quiet: float = 0.3) -> None:
        """Read whatever comes until the output has been quiet for ``quiet`` seconds."""
        while select.select([proc.stdout], [], [], quiet)[0]:
            if not os.read(proc.stdout.fileno(), 4096):
                return

    try:
        read_until(rb"> ")  # the prompt: the model is loaded
        # The tiny model's reply ends by itself after about half a second (461 tokens for
        # this seed); a signal that lands after it reaches the prompt, which shrugs it off:
        # then ask again.
        for _attempt in range(5):
            proc.stdin.write(b"tell me everything\n")
            proc.stdin.flush()
            read_until(rb".")  # the reply has started streaming
            proc.send_signal(signal.SIGINT)
            stats = re.search(rb"\[prompt [^\]]*\]", read_until(rb"\[prompt [^\]]*\]"))
            assert stats is not None
            if stats.group().endswith(b"cancelled]"):
                break
            drain()  # the signal reached the prompt: its new line and the prompt again
        else:
            pytest.fail("no reply was cancelled in 5 tries")
        proc.stdin.write(b"/quit\n")
        proc.stdin.flush()
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_chat_sigterm_flushes_the_cache_and_exits(tiny_qwen3, tmp_path):
    """SIGTERM unwinds through the engine's shutdown: the turn's KV state is durable on
    disk afterwards (a new process is served from it) and the exit code is 143."""
    import signal

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MLXKV_CACHE_DIR": str(tmp_path),
           "XDG_CONFIG_HOME": str(ROOT / ".cache" / "no-config")}
    env.pop("MLXKV_CONFIG", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlxkv", "chat", "--model", str(tiny_qwen3),
         "--max-tokens", "5", "--temp", "0"],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env=env)
    try:
        def read_until(buf: bytes, marker: bytes, count: int = 1) -> bytes:
            while buf.count(marker) < count:
                chunk = os.read(proc.stdout.fileno(), 4096)
                assert chunk, (buf, proc.stderr.read())
                buf += chunk
            return buf

        buf = read_until(b"", b"> ")  # the model is loaded
        proc.stdin.write(b"hello\n")
        proc.stdin.flush()
        buf = read_until(buf, b"> ", 2)  # the reply, its stats line, the next prompt
        assert b"[prompt" in buf
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 143, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stats = mlxkv("cache", "--cache-dir", str(tmp_path), "--json", "stats")
    assert stats.returncode == 0, stats.stderr
    on_disk = json.loads(stats.stdout)
    assert on_disk["blocks"] + on_disk["tails"] > 0, on_disk
    again = mlxkv("generate", "--model", str(tiny_qwen3), "--prompt", "hello", "--json",
                  "--max-tokens", "2", "--temp", "0", MLXKV_CACHE_DIR=str(tmp_path))
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout.splitlines()[-1])["stats"]["cached_tokens"] > 0


def test_the_reference_blas_is_a_warning_that_says_how_to_fix_it():
    """Without a system OpenBLAS on Linux, mlx's float32 matmuls on the CPU use the
    reference BLAS it bundles: one warning says so and what to do; MLXKV_BLAS=off (a choice)
    is silent."""
    if not sys.platform.startswith("linux"):
        pytest.skip("mlx brings its own BLAS off Linux")
    args = ("generate", "--model", "demo", "--max-tokens", "2", "--prompt", "hi")
    r = mlxkv(*args, MLXKV_BLAS="/nonexistent/libopenblas.so.0")
    assert r.returncode == 0, r.stderr
    [line] = [ln for ln in r.stderr.splitlines() if "reference BLAS" in ln]
    assert line.startswith("mlxkv: warning: could not load /nonexistent/libopenblas.so.0") and "MLXKV_BLAS=off" in line
    quiet = mlxkv(*args, MLXKV_BLAS="off")
    assert quiet.returncode == 0 and "reference BLAS" not in quiet.stderr, quiet.stderr
