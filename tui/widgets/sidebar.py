"""The conversation list: a search box (titles and message text) over the conversations,
newest first. Selecting one posts :class:`ConversationList.Open`."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import Input, Label, ListItem, ListView

from mlxkv.tui.widgets.message import printable

if TYPE_CHECKING:
    from mlxkv.tui.conversations import Conversation


def _when(ts: float) -> str:
    age = time.time() - ts
    if age < 86400:
        return time.strftime("%H:%M", time.localtime(ts))
    return time.strftime("%d %b", time.localtime(ts))


class ConversationItem(ListItem):
    def __init__(self, conversation: Conversation) -> None:
        super().__init__(classes="conversation")
        self.conversation = conversation

    def compose(self) -> ComposeResult:
        c = self.conversation
        prefix = "↳ " if c.parent_id is not None else ""
        yield Label(f"{prefix}{printable(c.title)}", classes="title", markup=False)
        yield Label(_when(c.updated), classes="when")


class ConversationList(Vertical):
    BINDINGS = [Binding("escape", "clear_search", "Clear search", show=False, id="sidebar.clear")]

    class Open(Message):
        def __init__(self, conversation_id: int) -> None:
            super().__init__()
            self.conversation_id = conversation_id

    class Search(Message):
        def __init__(self, text: str) -> None:
            super().__init__()
            self.text = text

    def compose(self) -> ComposeResult:
        yield Input(placeholder="Search conversations", id="search")
        yield ListView(id="conversations")

    @property
    def list_view(self) -> ListView:
        return self.query_one("#conversations", ListView)

    async def show(self, conversations: list[Conversation], current: int | None) -> None:
        view = self.list_view
        await view.clear()
        items = [ConversationItem(c) for c in conversations]
        if items:
            await view.extend(items)
        for i, item in enumerate(items):
            if item.conversation.id == current:
                view.index = i
                break
        else:
            view.index = 0 if items else None

    def on_input_changed(self, event: Input.Changed) -> None:
        event.stop()
        self.post_message(self.Search(event.value))

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.list_view.focus()

    def on_list_view_selected(self, event: ListView.Selected) -> None:
        event.stop()
        item = event.item
        if isinstance(item, ConversationItem):
            self.post_message(self.Open(item.conversation.id))

    def action_clear_search(self) -> None:
        box = self.query_one("#search", Input)
        box.value = ""
        self.screen.query_one("#prompt").focus()
