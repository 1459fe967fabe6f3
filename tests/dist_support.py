"""What the distributed tests share: launching ``mlxkv`` on 2 ranks of this machine over
the ring backend, through ``mlx.launch`` (what users run) or rank by rank with the
environment mlx.launch gives each rank (so a test can stop or kill one rank and watch the
other cope alone), and reading what they print.

Every process runs in its own session and is killed with its group when the test ends;
every wait has a timeout.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.distributed import free_ports, http_json
from bench.distributed import rank_pids as _rank_pids

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
LAUNCH = str(Path(PYTHON).with_name("mlx.launch"))


def base_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MLXKV_", "MLX_RANK", "MLX_HOSTFILE", "OMPI_", "PMI_"))}
    env.update({"OPENBLAS_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
                "XDG_CONFIG_HOME": str(ROOT / ".cache" / "no-config")})
    env.update(extra)
    return env


def launch(args: list[str], n: int = 2, **env: str) -> subprocess.Popen:
    """``mlx.launch --backend ring -n N -- -m mlxkv ARGS`` on free loopback ports."""
    cmd = [LAUNCH, "--backend", "ring", "-n", str(n), "--starting-port", str(free_ports(n)),
           "--python", PYTHON, "--", "-m", "mlxkv", *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=base_env(**env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                            start_new_session=True)


def run_launch(args: list[str], timeout: float = 120.0, **env: str) -> tuple[str, str]:
    """Launch, wait (at most ``timeout``) and return (stdout, stderr)."""
    proc = launch(args, **env)
    try:
        return proc.communicate(timeout=timeout)
    finally:
        kill(proc)


def start_ranks(args: list[str], folder: Path, n: int = 2, **env: str) -> list[subprocess.Popen]:
    """Each rank started here with what mlx.launch would give it (MLX_RANK, a ring host
    file written into ``folder``), without the launcher that stops every rank when one
    fails."""
    first = free_ports(n)
    hostfile = folder / f"hosts-{first}.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{first + r}"] for r in range(n)]))
    procs = []
    for rank in range(n):
        procs.append(subprocess.Popen(
            [PYTHON, "-m", "mlxkv", *args], cwd=ROOT,
            env=base_env(MLX_RANK=str(rank), MLX_HOSTFILE=str(hostfile), **env),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
            start_new_session=True))
    return procs


def kill(proc: subprocess.Popen) -> None:
    """Kill ``proc`` and everything in its session (a stopped process too)."""
    for sig in (signal.SIGKILL, signal.SIGCONT):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        proc.communicate(timeout=10)
    except (subprocess.TimeoutExpired, ValueError):
        pass


def rank_pids(launcher: subprocess.Popen, n: int = 2, timeout: float = 60.0) -> dict[int, int]:
    """rank -> pid of the rank processes mlx.launch started."""
    return _rank_pids(launcher.pid, n, timeout)


def last_json(stdout: str) -> dict[str, Any]:
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    assert lines, f"no JSON line in {stdout!r}"
    return json.loads(lines[-1])


def http(port: int, path: str, body: dict | None = None, timeout: float = 60.0) -> dict:
    return http_json(port, path, body, timeout)


def leave_stream(port: int, body: dict, lines: int = 3) -> None:
    """Start a streamed completion, read ``lines`` lines of it, and go away."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                 data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        for _ in range(lines):
            resp.readline()


def wait_http(port: int, proc: subprocess.Popen, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {proc.communicate(timeout=10)}")
        try:
            http(port, "/health", timeout=2)
            return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"no server on port {port} after {timeout} s")


def wait_exit(proc: subprocess.Popen, timeout: float) -> tuple[int, str, str]:
    """(status, stdout, stderr) once ``proc`` exits (TimeoutExpired if it does not)."""
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err
