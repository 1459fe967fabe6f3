"""Shared fixtures: tiny random-weight models of real mlx-lm architectures, built offline
once and cached in a git-ignored folder (``.cache/models``)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path


def _worker_setup(worker: str) -> None:
    """A pytest-xdist worker (``make test`` runs one per core) set up as a plain pytest
    process: without the 80 x 24 terminal size xdist puts in COLUMNS and LINES (a TUI the
    tests start in a pseudo-terminal takes that size, not the terminal's), and with MLX
    building its CPU kernels in a temporary folder of the worker's own, seeded with the
    kernels already built in the shared one: MLX takes a kernel's library as built once its
    file exists, so a worker could load a library another is still linking. The kernels a
    worker builds go back into the shared folder when it ends, each renamed into place whole."""
    for name in ("COLUMNS", "LINES"):
        os.environ.pop(name, None)
    shared = Path(tempfile.gettempdir()) / "mlx"
    mine = Path(__file__).resolve().parent.parent / ".cache" / "xdist" / worker
    for lib in shared.glob("*/cpu/*.so"):
        dest = mine / "mlx" / lib.relative_to(shared)
        if not dest.exists():
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(lib, dest)
    mine.mkdir(parents=True, exist_ok=True)
    os.environ["TMPDIR"] = str(mine)  # read by MLX for each new kernel, and by subprocesses
    tempfile.tempdir = None

    def give_back() -> None:
        for lib in (mine / "mlx").glob("*/cpu/*.so"):
            dest = shared / lib.relative_to(mine / "mlx")
            if not dest.exists():
                dest.parent.mkdir(parents=True, exist_ok=True)
                part = dest.with_name(f".part-{worker}")  # (a kernel's own name may be at the length limit)
                shutil.copyfile(lib, part)
                os.replace(part, dest)

    atexit.register(give_back)


if os.environ.get("PYTEST_XDIST_WORKER"):
    _worker_setup(os.environ["PYTEST_XDIST_WORKER"])

# isort: off
from mlxkv.engine.blas import preload  # noqa: E402

preload()  # the system OpenBLAS before anything imports mlx.core, as the command line does
import pytest  # noqa: E402

from support.modelgen import tiny_model  # noqa: E402
# isort: on


@pytest.fixture(scope="session")
def tiny_qwen3() -> Path:
    return tiny_model("qwen3")


@pytest.fixture(scope="session")
def tiny_llama() -> Path:
    return tiny_model("llama")


@pytest.fixture
def data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The TUI's data and config folders under tmp_path (conversations, keys, theme)."""
    folder = tmp_path / "data"
    monkeypatch.setenv("MLXKV_DATA_DIR", str(folder))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    return folder
