"""The PyInstaller executable (build/mlxkv.spec), built and run as a user would.

Building takes minutes, so this is opt-in: ``MLXKV_TEST_BINARY=1 python -m pytest -q
tests/test_binary.py`` (needs ``pip install "pyinstaller>=6.10"`` and the built Cython
extension, ``make ext``). The build goes to a temporary dist/work folder, never build/.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "build" / "mlxkv.spec"
PROMPT = "What is mlxkv?"

pytestmark = pytest.mark.skipif(os.environ.get("MLXKV_TEST_BINARY") != "1",
                                reason="building the executable takes minutes: "
                                       "set MLXKV_TEST_BINARY=1")


@pytest.fixture(scope="module")
def binary(tmp_path_factory) -> Path:
    try:
        import PyInstaller  # noqa: F401
    except ImportError:
        pytest.fail('MLXKV_TEST_BINARY=1 needs PyInstaller: pip install "pyinstaller>=6.10"')
    tmp = tmp_path_factory.mktemp("pyinstaller")
    cmd = [sys.executable, "-m", "PyInstaller", "--noconfirm", "--log-level", "WARN",
           "--distpath", str(tmp / "dist"), "--workpath", str(tmp / "work"), str(SPEC)]
    r = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True,
                       timeout=3600)
    assert r.returncode == 0, r.stderr[-4000:]
    exe = tmp / "dist" / "mlxkv"
    assert exe.is_file() and os.access(exe, os.X_OK), sorted(p.name for p in tmp.iterdir())
    return exe


def _env(tmp_path: Path) -> dict:
    # Offline, no user config, a private prefix cache, and no way to reach the checkout's
    # sources: the executable must carry everything it needs.
    env = {k: v for k, v in os.environ.items()
           if k not in ("MLXKV_CONFIG", "PYTHONPATH", "PYTHONHOME")}
    env.update(HF_HUB_OFFLINE="1", MLXKV_CACHE_DIR=str(tmp_path / "cache"),
               XDG_CONFIG_HOME=str(tmp_path / "no-config"))
    return env


def _run(cmd: list, tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=False, cwd=tmp_path, env=_env(tmp_path),
                          capture_output=True, text=True, timeout=300)


def test_version(binary, tmp_path):
    r = _run([str(binary), "--version"], tmp_path)
    source = _run([sys.executable, "-m", "mlxkv", "--version"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == source.stdout.strip() and r.stdout.startswith("mlxkv ")


def test_generate_offline_with_demo_model_and_ssd_cache(binary, tmp_path):
    args = ["generate", "--prompt", PROMPT, "--temp", "0", "--max-tokens", "24", "--json"]
    first = _run([str(binary), *args], tmp_path)
    assert first.returncode == 0, first.stderr
    one = json.loads(first.stdout.strip().splitlines()[-1])
    assert one["stats"]["generated_tokens"] > 0 and one["text"].strip()
    assert one["stats"]["cached_tokens"] == 0
    # The demo model was found inside the bundle (sys._MEIPASS), not in the checkout.
    assert str(ROOT) not in json.dumps(one["model"]), one["model"]

    # A new process: the prompt's blocks come back from the SSD tier, same greedy reply.
    second = _run([str(binary), *args], tmp_path)
    assert second.returncode == 0, second.stderr
    two = json.loads(second.stdout.strip().splitlines()[-1])
    assert two["stats"]["cached_tokens"] > 0
    assert two["tokens"] == one["tokens"]

    # And the bundle computes what the sources compute.
    source = _run([sys.executable, "-m", "mlxkv", *args, "--no-prefix-cache"],
                  tmp_path)
    assert source.returncode == 0, source.stderr
    assert json.loads(source.stdout.strip().splitlines()[-1])["tokens"] == one["tokens"]
