"""A reply streaming into its MessageView: tokens that leave the reply's height as it was
repaint it without laying out the screen again; a new line or a new block lays it out; at
the end only a reply with fenced code is mounted again. Counted on a real Textual app (the
screen publishes each layout it runs)."""

from __future__ import annotations

import asyncio
from typing import Any

from textual.app import App, ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Markdown

from mlxkv.tui.widgets.message import MessageView

SIZE = (80, 24)


class _Chat(App):
    CSS = ".message { height: auto; }"  # as in the chat screen: a message is as tall as its text

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="messages"):
            yield MessageView("assistant", label="demo")


async def _settle(pilot: Any) -> None:
    await pilot.pause()
    await pilot.pause(0.05)


def _layouts(app: App) -> list[Any]:
    """The screen's layouts from now on (one entry each)."""
    layouts: list[Any] = []
    app.screen.screen_layout_refresh_signal.subscribe(app.screen, layouts.append)
    return layouts


def test_tokens_on_the_same_line_do_not_lay_out_the_screen() -> None:
    async def run() -> None:
        app = _Chat()
        async with app.run_test(size=SIZE) as pilot:
            layouts = _layouts(app)
            view = app.query_one(MessageView)
            view.start_stream()
            await view.append("The cache")
            await _settle(pilot)
            paragraph = view.body.children[0]  # the reply's first paragraph
            height = view.size.height
            layouts.clear()

            for word in (" keeps", " blocks", " of", " tokens"):  # all on the first line
                await view.append(word)
                await _settle(pilot)
            assert layouts == [], "a token on the same line laid the screen out"
            assert paragraph.content.plain == "The cache keeps blocks of tokens"
            assert view.size.height == height

            await view.append(" on the SSD" * 12)  # wraps: the paragraph grows
            await _settle(pilot)
            assert layouts, "a paragraph that grew was not laid out"
            assert view.size.height > height
            assert paragraph.content.plain.endswith("on the SSD")

            layouts.clear()
            await view.append("\n\nA second paragraph.")  # a new block: a layout
            await _settle(pilot)
            assert layouts
            assert len(view.body.children) == 2

            shown = list(view.body.children)
            await view.finish(view.content + " Done.")  # the rest of the reply comes with the end
            await _settle(pilot)
            assert list(view.body.children) == shown, "a reply without fenced code was mounted again"
            assert [p.content.plain for p in view.body.children] == [
                "The cache keeps blocks of tokens" + " on the SSD" * 12, "A second paragraph. Done."]
            assert view.content.endswith("A second paragraph. Done.") and not view.streaming

    asyncio.run(run())


def test_a_reply_with_fenced_code_is_rendered_again_in_full() -> None:
    async def run() -> None:
        app = _Chat()
        async with app.run_test(size=SIZE) as pilot:
            view = app.query_one(MessageView)
            view.start_stream()
            for part in ("Run the tests:\n\n", "```sh\nmake", " test\n"):
                await view.append(part)
                await _settle(pilot)
            shown = list(view.body.children)
            await view.finish(view.content + "```\n\nThat is all.")
            await _settle(pilot)
            blocks = list(view.body.children)
            assert not set(blocks) & set(shown)
            fence = view.body.query_one(Markdown.BLOCKS["fence"])
            assert fence.code.strip() == "make test"
            assert blocks[-1].content.plain == "That is all."

    asyncio.run(run())


def test_a_status_line_of_the_same_height_does_not_lay_out_the_screen() -> None:
    # A reply's status line goes thinking… -> writing… -> its figures: a line each time.
    async def run() -> None:
        app = _Chat()
        async with app.run_test(size=SIZE) as pilot:
            layouts = _layouts(app)
            view = app.query_one(MessageView)
            status = view.query_one(".status")
            view.set_status("thinking…")
            await _settle(pilot)
            assert status.display and status.size.height == 1
            height = view.size.height
            layouts.clear()

            for text in ("writing… (Esc stops it)", "12 prompt tok · 0 cached · TTFT 0.04 s · 96 tok at 231 tok/s"):
                view.set_status(text)
                await _settle(pilot)
                assert layouts == [], f"the status {text!r} laid the screen out"
                assert str(status.render()) == text and view.size.height == height

            view.set_status("a status line too long for one line of the screen · " * 3)  # wraps
            await _settle(pilot)
            assert layouts and status.size.height > 1 and view.size.height > height
            layouts.clear()
            view.set_status("")  # hidden: the view shrinks
            await _settle(pilot)
            assert layouts and not status.display and view.size.height < height

    asyncio.run(run())
