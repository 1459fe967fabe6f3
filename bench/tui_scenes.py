"""Repeatable scenes of the TUI, for the snapshot tests and the README's screenshots.

    python -m bench.tui_scenes [FOLDER]     # FOLDER/chat.svg, inspector.svg, help.svg
                                            # (default docs/screenshots)

A scene is the real app (:class:`tui.app.MlxkvApp`) on the demo model, which answers
greedily, with its conversations and its cache folder in a fresh folder, driven by keys
like a user: two questions (the second starts from the first's cached prefix), then the
cache inspector or the key help. What would differ from run to run is pinned, and only
that: the store's clock (the sidebar's dates), the timing figures of the stored replies
(TTFT and speeds; token counts stay real), "now" for the inspector's "last used" ages,
the keymap path shown in the help (``~/.config``), and the cursor blink.

Use :func:`pinned` around a scene: it sets the environment and the inspector's clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from mlxkv.engine.blas import preload

preload()  # the system OpenBLAS before mlx.core

SIZE = (120, 40)
FIXED_TIME = 1749988800.0  # 2025-06-15 12:00 UTC: "15 Jun" in the sidebar in any time zone
QUESTIONS = ("What is mlxkv?", "How does the SSD cache work?")
PINNED_TIMING = {"ttft_s": 0.04, "prefill_tps": 5200.0, "decode_tps": 240.0, "queue_s": 0.0, "load_s": 0.0}
WAIT_S = 120.0


class InspectorClock:
    """Stands in for the ``time`` module of :mod:`tui.widgets.entry_table`, whose only use
    is "now" for ages: fixed once :attr:`now` is set, the real time before."""

    def __init__(self) -> None:
        self.now: float | None = None

    def time(self) -> float:
        return time.time() if self.now is None else self.now


CLOCK = InspectorClock()


@contextlib.contextmanager
def pinned() -> Iterator[InspectorClock]:
    """The environment of a scene: keymap path ``~/.config/mlxkv/keys.toml`` (none there),
    and the inspector's clock (reset to the real time on entry)."""
    from mlxkv.tui.widgets import entry_table

    old_env = os.environ.get("XDG_CONFIG_HOME")
    old_time = entry_table.time
    os.environ["XDG_CONFIG_HOME"] = "~/.config"  # a relative path: never an existing file
    CLOCK.now = None
    entry_table.time = CLOCK
    try:
        yield CLOCK
    finally:
        entry_table.time = old_time
        if old_env is None:
            os.environ.pop("XDG_CONFIG_HOME", None)
        else:
            os.environ["XDG_CONFIG_HOME"] = old_env


def make_app(folder: Path) -> Any:
    """The app on the demo model, its store and cache under ``folder``, store clock fixed."""
    from mlxkv.engine.settings import Settings
    from mlxkv.tui.app import MlxkvApp

    # Speculation off: its adaptive policy times each round, so how far the draft model's
    # state reaches (and so the draft entries the inspector lists) varies from run to run.
    settings = Settings.load({"cache_dir": str(folder / "cache"), "spec": "off"}, env={})
    app = MlxkvApp(settings, store_path=folder / "data" / "conversations.db")
    app.store.clock = lambda: FIXED_TIME
    return app


async def wait_for(pilot: Any, test: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not test():
        if time.monotonic() > deadline:
            raise TimeoutError(f"scene: gave up waiting for {what} after {timeout:.0f} s")
        await pilot.pause(0.05)


async def _model_ready(pilot: Any) -> None:
    bridge = pilot.app.bridge
    await wait_for(pilot, bridge.ready.is_set, "the demo model to load")
    if bridge.error:
        raise RuntimeError(f"scene: the demo model did not load: {bridge.error}")


async def _settle(pilot: Any) -> None:
    """Steady cursors, drawn from the widgets' state now, then every worker finished."""
    app = pilot.app
    for screen in app.screen_stack:
        for widget in screen.query("TextArea, Input"):
            widget.cursor_blink = False
            # A text area caches its rendered lines under a key that tells a steady cursor
            # from a blinked-off one only by cursor_blink: a line rendered in an "off" half
            # of the blink (there is one for every second the scene ran) would be shown
            # again without the steady cursor. Whether one was cached depended on how long
            # the model took to load (the machine's load); drop them, draw from the state.
            widget.notify_style_update()
            widget.refresh()
    await pilot.pause()
    await app.workers.wait_for_complete()
    await pilot.pause()


async def _ask(pilot: Any) -> None:
    """The questions, typed and sent with Enter; each reply streamed to its end and stored."""
    chat = pilot.app.chat
    for i, question in enumerate(QUESTIONS):
        chat.prompt.focus()
        chat.prompt.load_text(question)
        await pilot.press("enter")
        await wait_for(pilot, lambda i=i: chat.pending is None and len(chat.history) == 2 * (i + 1),
                       f"the reply to {question!r}")


async def chat_scene(pilot: Any) -> None:
    """Two questions and their replies, each with its status line (the second shows the
    tokens it got from the cache); timings pinned, then the conversation reopened."""
    app = pilot.app
    await _model_ready(pilot)
    await _ask(pilot)
    chat, store = app.chat, app.store
    cid = chat.conversation.id
    for m in await app.db(store.messages, cid):
        if m.role == "assistant":
            await app.db(store.update_message, m.id, m.content, {**(m.stats or {}), **PINNED_TIMING})
    await chat.open_conversation(cid)
    await _settle(pilot)


async def inspector_scene(pilot: Any) -> None:
    """The same conversation, written through to the SSD tier, in the cache inspector,
    the first entry's detail (token preview, block chain) loaded."""
    app = pilot.app
    await _model_ready(pilot)
    await _ask(pilot)
    bridge = app.bridge
    await asyncio.to_thread(bridge.cache_flush, 60.0)
    entries = await asyncio.to_thread(bridge.cache_entries)
    CLOCK.now = max((e.last_used for e in entries), default=FIXED_TIME) + 3600.5  # "1h" ago
    await pilot.press("f2")
    await wait_for(pilot, lambda: type(app.screen).__name__ == "InspectorScreen", "the inspector")
    screen = app.screen
    await wait_for(pilot, lambda: screen.table.row_count == len(entries) and screen.detail is not None
                   and bool(screen.figures.history), "the entries, the detail and the figures")
    await _settle(pilot)


async def help_scene(pilot: Any) -> None:
    """F1 over the chat screen: every key with its binding id."""
    await _model_ready(pilot)
    await pilot.press("f1")
    await wait_for(pilot, lambda: type(pilot.app.screen).__name__ == "HelpScreen", "the help")
    await _settle(pilot)


SCENES = {"chat": chat_scene, "inspector": inspector_scene, "help": help_scene}


def screenshot(name: str, target: Path) -> Path:
    """Run scene ``name`` in a fresh folder and save the screen as SVG at ``target``."""
    scene = SCENES[name]
    with tempfile.TemporaryDirectory(prefix="mlxkv-scene-") as tmp, pinned():
        app = make_app(Path(tmp))

        async def auto_pilot(pilot: Any) -> None:
            await scene(pilot)
            app.save_screenshot(target.name, str(target.parent))
            app.exit()

        try:
            app.run(headless=True, size=SIZE, auto_pilot=auto_pilot)
        finally:
            app.close_engine()
    if not target.exists():
        raise RuntimeError(f"scene {name}: no screenshot was saved")
    return target


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    folder = Path(argv[0] if argv else Path(__file__).resolve().parent.parent / "docs" / "screenshots")
    folder.mkdir(parents=True, exist_ok=True)
    for name in SCENES:
        print(screenshot(name, folder / f"{name}.svg"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
