"""Shared fixtures: tiny random-weight models of real mlx-lm architectures, built offline
once and cached in a git-ignored folder (``.cache/models``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.modelgen import tiny_model


@pytest.fixture(scope="session")
def tiny_qwen3() -> Path:
    return tiny_model("qwen3")


@pytest.fixture(scope="session")
def tiny_llama() -> Path:
    return tiny_model("llama")
