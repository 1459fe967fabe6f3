"""Every way the program ends exits, on time and without a crash, with OpenBLAS threads on.

mlx-lm's decoding loop queues the next step before it hands out a token, so a generation
that ends leaves a forward pass computing on one of mlx's stream threads, which outlive
the thread that fed them. The engine thread waits for that work before it ends
(``mlxkv.engine.thread.finish_streams``); without the wait the process exits with OpenBLAS
inside a call, and OpenBLAS's exit handler either joins a worker that went back to sleep
(the process never exits) or unmaps the buffers the running kernel uses (a segmentation
fault).

The children run with ``OPENBLAS_NUM_THREADS`` unset, as a user's do (the TUI's with two
threads, see there): with one thread OpenBLAS has no worker to wait for. Always on (about
2 minutes on 2 cores): the engine check below, one ``mlxkv generate`` run, one TUI quit
and one ``serve`` SIGTERM on the bench model. ``MLXKV_TEST_EXIT_STRESS=1`` runs the stress
counts instead: 12 generate runs of 128 tokens, 3 TUI quits and 3 ``serve`` SIGTERMs (CI
runs it). Before the fix 7 of 13 generate runs hung, so 12 clean runs by chance would have
odds of about 1 in 10,000; the TUI and serve paths never showed the race, and run a few
times to keep them honest.
"""

from __future__ import annotations

import http.client
import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STRESS = os.environ.get("MLXKV_TEST_EXIT_STRESS", "") not in ("", "0")
GENERATE_RUNS, TUI_RUNS, SERVE_RUNS = (12, 3, 3) if STRESS else (1, 1, 1)
PROMPT = "Write a short story about a robot who learns to paint. Use about 150 words."
WORK_LIMIT_S = 900.0  # a contended CI machine: load + 128 tokens can take minutes
EXIT_GRACE_S = 60.0  # once its work is done, a process has this long to exit


def _openblas_present() -> bool:
    from mlxkv.engine.blas import preload

    return bool(preload()["active"])  # conftest.py preloaded it: this only reads the state


pytestmark = pytest.mark.skipif(not _openblas_present(),
                                reason="the exit race needs OpenBLAS threads "
                                       "(apt install libopenblas0-pthread)")


@dataclass
class Ending:
    """How one child ended: "ok", "hung" (its work was done and it did not exit),
    "crashed" (killed by a signal), "failed" (another exit status) or "stuck" (its work
    was not done in time)."""

    status: str
    returncode: int | None
    output: bytes

    @property
    def tail(self) -> str:
        return self.output[-1500:].decode("utf-8", "replace")


def child_env(tmp: Path) -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MLXKV_CACHE_DIR": str(tmp / "cache"),
           "MLXKV_DATA_DIR": str(tmp / "data"), "XDG_CONFIG_HOME": str(tmp / "config"),
           "PYTHONFAULTHANDLER": "1", "TERM": "xterm-256color"}
    for name in ("OPENBLAS_NUM_THREADS", "MLXKV_CONFIG", "MLXKV_BLAS"):
        env.pop(name, None)
    return env


def watch(proc: subprocess.Popen, fd: int, done: Callable[[bytes], bool],
          on_output: Callable[[bytes], None] | None = None) -> Ending:
    """Read ``fd`` (the child's output) until ``done(output)``, then give the child
    ``EXIT_GRACE_S`` to exit. ``on_output`` sees the output so far on every read (it may
    write to the child)."""
    seen = b""
    finished_at: float | None = None
    start = time.monotonic()
    while True:
        now = time.monotonic()
        if finished_at is None and done(seen):
            finished_at = now
        if proc.poll() is not None:
            break
        if finished_at is None and now - start > WORK_LIMIT_S:
            return _kill(proc, "stuck", seen)
        if finished_at is not None and now - finished_at > EXIT_GRACE_S:
            return _kill(proc, "hung", seen)
        try:
            ready = select.select([fd], [], [], 0.5)[0]
            chunk = os.read(fd, 65536) if ready else b""
        except OSError:  # a pty reads EIO once the child closed it
            chunk = b""
            time.sleep(0.1)
        if chunk:
            seen += chunk
            if on_output is not None:
                on_output(seen)
    try:  # what the child wrote as it left
        while select.select([fd], [], [], 0.2)[0]:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            seen += chunk
    except OSError:
        pass
    rc = proc.returncode
    # faulthandler re-raises the fatal signal: a crash is a negative return code
    status = "ok" if rc == 0 and done(seen) else "crashed" if rc < 0 else "failed"
    return Ending(status, rc, seen)


def _kill(proc: subprocess.Popen, status: str, seen: bytes) -> Ending:
    proc.kill()
    proc.wait(30)
    return Ending(status, None, seen)


def _reap(proc: subprocess.Popen) -> None:
    """A test that failed half-way leaves no child behind."""
    if proc.poll() is None:
        proc.kill()
        proc.wait(30)


def assert_all_ok(what: str, endings: list[Ending]) -> None:
    counts = {s: sum(e.status == s for e in endings) for s in ("ok", "hung", "crashed", "failed", "stuck")}
    print(f"{what}: {len(endings)} runs, {counts}")
    bad = [e for e in endings if e.status != "ok"]
    assert not bad, (f"{what}: {len(endings)} runs, {counts}; first: {bad[0].status} "
                     f"rc={bad[0].returncode}\n{bad[0].tail}")


@pytest.fixture(scope="module")
def bench_model() -> Path:
    from bench.models import bench_model_path

    return bench_model_path()


# An engine thread queues more float32 work than a decoding step leaves behind, ends, and
# the process exits at once: the engine must have waited for it.
ENGINE_SCRIPT = """
import sys
from mlxkv.engine.blas import preload
preload()
from mlxkv.engine.engine import Engine, Request
from mlxkv.engine.generate import SamplingParams

e = Engine(sys.argv[1]).start()
result = e.submit(Request(prompt="the exit", params=SamplingParams(max_tokens=8))).result()
assert result.tokens, result

def queue_work():
    import mlx.core as mx
    from mlx_lm.generate import generation_stream
    with mx.stream(generation_stream):
        a = mx.random.normal((1024, 1024))
        x = a
        for _ in range(16):  # ~1 s of float32 work on one quiet core: still running at exit
            x = (x @ a) * 1e-3
        mx.async_eval(x)

e.call(queue_work).result()
e.shutdown()
print("engine done", flush=True)
"""


def test_an_engine_thread_leaves_no_computation_behind_at_exit(tiny_qwen3: Path, tmp_path: Path) -> None:
    endings = []
    for _ in range(5):
        proc = subprocess.Popen([sys.executable, "-c", ENGINE_SCRIPT, str(tiny_qwen3)], cwd=ROOT,
                                env=child_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            endings.append(watch(proc, proc.stdout.fileno(), lambda seen: b"engine done" in seen))
        finally:
            _reap(proc)
            proc.stdout.close()
    assert_all_ok("engine exit", endings)


def test_generate_exits(bench_model: Path, tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "mlxkv", "generate", "--model", str(bench_model),
           "--no-prefix-cache", "--spec", "off", "--max-tokens", "128", "--json", "-p", PROMPT]
    endings = []
    for _ in range(GENERATE_RUNS):
        proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(tmp_path), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT)
        try:
            ending = watch(proc, proc.stdout.fileno(), lambda seen: b'"finish_reason"' in seen)
        finally:
            _reap(proc)
            proc.stdout.close()
        if ending.status == "ok":
            line = next(t for t in ending.output.splitlines() if t.startswith(b'{"text"'))
            assert json.loads(line)["stats"]["generated_tokens"] > 0, line
        endings.append(ending)
    assert_all_ok("generate", endings)


def _tui_quit(model: Path, tmp: Path, mid_reply: bool) -> Ending:
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    # a terminal of 40 x 120: a pty starts with no size, and the app lays out nothing
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    # The TUI gives OpenBLAS a core fewer than the machine has (unless OPENBLAS_NUM_THREADS
    # is set): on two cores one thread, no worker to race. Two threads, as on three cores.
    env = {**child_env(tmp), "OPENBLAS_NUM_THREADS": str(max(2, (os.cpu_count() or 2) - 1))}
    proc = subprocess.Popen([sys.executable, "-m", "mlxkv", "--model", str(model), "--max-tokens", "48",
                             "--no-prefix-cache", "--spec", "off"], stdin=slave, stdout=slave, stderr=slave,
                            cwd=ROOT, env=env, start_new_session=True)
    os.close(slave)
    state = {"asked": 0.0, "quit": False}

    def drive(seen: bytes) -> None:
        if not state["asked"] and b"context" in seen:  # the model bar: loaded
            os.write(master, PROMPT.encode() + b"\r")
            state["asked"] = time.monotonic()
        elif state["asked"] and not state["quit"]:
            reply_done = b"tok/s" in seen  # the reply's status line
            if reply_done or (mid_reply and time.monotonic() - state["asked"] > 4.0):
                os.write(master, b"\x11")  # Ctrl+Q
                state["quit"] = True

    try:
        return watch(proc, master, lambda seen: state["quit"], on_output=drive)
    finally:
        _reap(proc)
        os.close(master)


def test_the_tui_exits_on_ctrl_q(bench_model: Path, tmp_path: Path) -> None:
    # Quit once the reply is finished (its last step may still compute), or while it is
    # being written (the engine cancels it and stops), in turn.
    endings = [_tui_quit(bench_model, tmp_path / f"tui{run}", mid_reply=run % 2 == 1)
               for run in range(TUI_RUNS)]
    assert_all_ok("TUI quit", endings)


def _stream_chat(port: int, max_tokens: int, first_chunk: Callable[[], None] | None) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WORK_LIMIT_S)
    body = {"model": "m", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens,
            "stream": True}
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    while line := resp.readline():
        if line.startswith(b"data: ") and first_chunk is not None:
            first_chunk()
            first_chunk = None
        if line.strip() == b"data: [DONE]":
            break
    conn.close()


def _serve_sigterm(model: Path, tmp: Path, mid_reply: bool) -> Ending:
    from bench.server import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mlxkv", "serve", "--model", str(model), "--port", str(port),
                             "--spec", "off", "--cache-dir", str(tmp / "kv")],
                            cwd=ROOT, env=child_env(tmp), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    state = {"sent": False}

    def drive(seen: bytes) -> None:
        if not state["sent"] and b"Ctrl-C stops" in seen:  # listening, the model loaded
            state["sent"] = True
            _stream_chat(port, 48, proc.terminate if mid_reply else None)
            if not mid_reply:
                proc.terminate()

    try:
        return watch(proc, proc.stdout.fileno(), lambda seen: state["sent"], on_output=drive)
    finally:
        _reap(proc)
        proc.stdout.close()


def test_serve_exits_on_sigterm(bench_model: Path, tmp_path: Path) -> None:
    # SIGTERM while a reply streams (it is finished, then the process leaves), or just
    # after one finished, in turn.
    endings = [_serve_sigterm(bench_model, tmp_path / f"serve{run}", mid_reply=run % 2 == 1)
               for run in range(SERVE_RUNS)]
    assert_all_ok("serve SIGTERM", endings)
