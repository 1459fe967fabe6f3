"""The command line's one logging handler: `mlxkv: warning: <message>`, each condition
once per process, no traceback unless MLXKV_DEBUG=1."""

from __future__ import annotations

import io
import logging

import pytest

from mlxkv.cli import logs


@pytest.fixture(autouse=True)
def restore_mlxkv_logger():
    """install() configures the process-wide `mlxkv` logger: put it back for other tests."""
    logger = logging.getLogger("mlxkv")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    yield
    logger.handlers[:] = saved[0]
    logger.setLevel(saved[1])
    logger.propagate = saved[2]


@pytest.fixture
def handler_output(monkeypatch):
    monkeypatch.delenv("MLXKV_DEBUG", raising=False)
    out = io.StringIO()
    logs.install(out)
    return out


def test_each_condition_is_one_line(handler_output):
    log = logging.getLogger("mlxkv.storage")
    for n in (29, 65, 12, 7):  # a full disk: every write fails, each with its own size
        log.warning("write of %d tokens failed: %s", n, "No space left on device")
    log.warning("mlxkv cache: cache folder /x is read-only")
    log.warning("mlxkv cache: cache folder /x is read-only")
    logging.getLogger("mlxkv.engine").info("not for the user")
    try:
        raise OSError(28, "No space left on device")
    except OSError:
        logging.getLogger("mlxkv.prefix").exception("persisting failed")
    assert handler_output.getvalue().splitlines() == [
        "mlxkv: warning: write of 29 tokens failed: No space left on device",
        "mlxkv: warning: cache: cache folder /x is read-only",
        "mlxkv: warning: persisting failed",
    ]


def test_debug_shows_tracebacks(monkeypatch):
    monkeypatch.setenv("MLXKV_DEBUG", "1")
    out = io.StringIO()
    logs.install(out)
    try:
        raise OSError(28, "No space left on device")
    except OSError:
        logging.getLogger("mlxkv.prefix").exception("persisting failed")
    text = out.getvalue()
    assert text.startswith("mlxkv: error: persisting failed [mlxkv.prefix]")
    assert "Traceback" in text and "No space left on device" in text
