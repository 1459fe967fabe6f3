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


def test_tokens_on_the_same_line_do_not_lay_out_the_screen() -> None:
    async def run() -> None:
        app = _Chat()
        async with app.run_test(size=SIZE) as pilot:
            layouts: list[Any] = []
            app.screen.screen_layout_refresh_signal.subscribe(app.screen, layouts.append)
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
