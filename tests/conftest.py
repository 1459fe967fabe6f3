"""Shared fixtures: tiny random-weight models of real mlx-lm architectures, built offline
once and cached in a git-ignored folder (``.cache/models``)."""

from __future__ import annotations

from pathlib import Path

# isort: off
from mlxkv.engine.blas import preload

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
