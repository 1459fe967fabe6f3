"""The wheel, installed as a user installs it: ``pip wheel .`` builds it, pip installs it
into a fresh virtual environment outside the checkout, and the installed ``mlxkv`` answers
``generate`` on its embedded demo model and ``serve`` to ``/health``. The wheel holds one
top-level name, ``mlxkv``, and none of the development-only code.

The fresh environment takes mlxkv's dependencies (mlx, mlx-lm, ...) from this test's own
environment through a ``.pth`` line (no network); that line adds the folder to ``sys.path``
without running the ``.pth`` files in it, so the checkout's editable install is not seen.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DEV_ONLY = ("bench/", "support/", "tests/", "mlxkv/bench/", "mlxkv/support/", "mlxkv/tests/")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Built from the files git tracks, copied out of the checkout, as from a fresh clone
    (the checkout's own build folders and in-place extension are not part of a release)."""
    out = tmp_path_factory.mktemp("wheel")
    src = tmp_path_factory.mktemp("src")
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True).stdout
    for name in files.decode().split("\0"):
        if name and (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                        "--no-index", "-q", "-w", str(out), str(src)],
                       capture_output=True, text=True, timeout=900, cwd=out)
    assert r.returncode == 0, r.stderr[-4000:]
    [whl] = out.glob("mlxkv-*.whl")
    return whl


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """A fresh venv (outside the checkout) with the wheel installed by pip; its bin folder."""
    venv = tmp_path_factory.mktemp("venv") / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    Path(site, "_deps_from_test_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
                        "--no-index", "-q", str(wheel)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    return venv / "bin"


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "MLXKV_CONFIG")}
    env.update(HF_HUB_OFFLINE="1", MLXKV_CACHE_DIR=str(tmp_path / "cache"), HOME=str(tmp_path),
               XDG_CONFIG_HOME=str(tmp_path / "config"), XDG_DATA_HOME=str(tmp_path / "data"))
    return env


def test_the_wheel_has_one_top_level_name_and_no_development_code(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        [top_level] = [n for n in names if n.endswith(".dist-info/top_level.txt")]
        assert z.read(top_level).decode().split() == ["mlxkv"]
    roots = {n.split("/")[0] for n in names}
    assert {r for r in roots if not r.endswith(".dist-info")} == {"mlxkv"}, sorted(roots)
    assert not [n for n in names if n.startswith(DEV_ONLY)]
    assert not [n for n in names if "/demo/train" in n or "/demo/corpus" in n or "modelgen" in n]
    assert not [n for n in names if n.endswith((".c", ".pyx", ".pxd", ".h"))]
    for must in ("mlxkv/__main__.py", "mlxkv/engine/demo/model/model.safetensors",
                 "mlxkv/engine/demo/draft/model.safetensors", "mlxkv/tui/app.tcss"):
        assert must in names, must
    assert [n for n in names if n.startswith("mlxkv/storage/_blocks") and n.endswith((".so", ".pyd"))]


def test_the_installed_command_generates_on_its_demo_model(installed, tmp_path):
    env = _env(tmp_path)
    where = subprocess.run([str(installed / "python"), "-c", "import mlxkv.engine, mlxkv.storage._blocks as b;"
                            "print(mlxkv.engine.__file__); print(b.__file__)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert where.returncode == 0, where.stderr
    for line in where.stdout.split():
        assert str(installed.parent) in line and str(ROOT) not in line, where.stdout
    r = subprocess.run([str(installed / "mlxkv"), "generate", "-p", "What is mlxkv?", "--max-tokens", "12",
                        "--temp", "0", "--json"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["text"].strip() and out["stats"]["generated_tokens"] > 0
    assert str(ROOT) not in json.dumps(out["model"])
    mod = subprocess.run([str(installed / "python"), "-m", "mlxkv", "--version"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert mod.returncode == 0 and mod.stdout.startswith("mlxkv "), mod.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_installed_command_serves(installed, tmp_path):
    port = _free_port()
    proc = subprocess.Popen([str(installed / "mlxkv"), "serve", "--port", str(port)], cwd=tmp_path,
                            env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        health = None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as resp:
                    health = (resp.status, json.loads(resp.read()))
                    break
            except OSError:
                time.sleep(0.5)
        assert health is not None, proc.communicate(timeout=30)
        assert health[0] == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert proc.returncode == 0, proc.stderr.read()[-3000:] if proc.stderr else ""
