"""Helpers shared by the TUI tests: settings under tmp_path, and driving the real app with
Textual's Pilot until a condition holds (bounded: a failing test fails, it never hangs)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import T

from mlxkv.engine.settings import Settings

DEADLINE_S = T  # a bound that fails a stuck test, not a speed check: a loaded machine is slow
SIZE = (120, 40)


def make_settings(tmp_path: Path, **flags: Any) -> Settings:
    return Settings.load({"cache_dir": str(tmp_path / "cache"), **flags},
                         env={"XDG_CONFIG_HOME": str(tmp_path / "config")})


async def wait_for(pilot: Any, condition: Callable[[], Any], what: str,
                   timeout: float = DEADLINE_S) -> Any:
    """Let the app run until ``condition()`` is true; fails after ``timeout``."""
    end = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < end, f"no {what} within {timeout} s"
        await pilot.pause(0.02)


async def send(pilot: Any, text: str) -> None:
    """Type ``text`` into the chat prompt, press Enter, and wait for the whole reply."""
    app = pilot.app
    before = app.metrics.replies
    app.chat.prompt.focus()
    app.chat.prompt.load_text(text)
    await pilot.press("enter")
    await wait_for(pilot, lambda: app.metrics.replies > before and app.chat.pending is None, "reply")


async def pick_model(pilot: Any, spec: str) -> None:
    """F3, ``spec`` typed into the model picker, Enter (the load is not waited for)."""
    from mlxkv.tui.widgets.modals import ModelPicker

    app = pilot.app
    await pilot.press("f3")
    await wait_for(pilot, lambda: isinstance(app.screen, ModelPicker), "model picker")
    app.screen.query_one("#spec").value = spec
    app.screen.query_one("#spec").focus()
    await pilot.press("enter")


def drive(app: Any, scenario: Callable[[Any], Any]) -> None:
    """Run the real app headless at SIZE, play ``scenario(pilot)``, then stop its engine
    (which flushes its cache), whatever happened."""
    async def main() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await scenario(pilot)
    try:
        asyncio.run(main())
    finally:
        app.close_engine()
