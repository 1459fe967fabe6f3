"""Shared fixtures: tiny random-weight models of real mlx-lm architectures, built offline
once and cached in a git-ignored folder (``.cache/models``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MODEL_CACHE = Path(os.environ.get("MLXKV_TEST_MODELS", ROOT / ".cache" / "models"))


def tiny_model(arch: str, **overrides) -> Path:
    from engine.modelgen import build_random_model

    suffix = "-".join(f"{k}{v}" for k, v in sorted(overrides.items()))
    name = f"{arch}-tiny" + (f"-{suffix}" if suffix else "")
    return build_random_model(MODEL_CACHE / name, arch=arch, **overrides)


@pytest.fixture(scope="session")
def tiny_qwen3() -> Path:
    return tiny_model("qwen3")


@pytest.fixture(scope="session")
def tiny_llama() -> Path:
    return tiny_model("llama")
