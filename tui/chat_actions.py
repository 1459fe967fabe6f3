"""What the chat screen does to conversations beyond sending: rename, delete, export to
Markdown, system prompt and sampling, regenerate, branch (edit and resend), copy.

:class:`ConversationActions` is a part of :class:`tui.chat.ChatScreen`: the screen holds
one, binds its keys to it and hands it itself as a :class:`Chat`, the calls the actions make
on the screen (kept apart so each module stays short).
"""

from __future__ import annotations

import os
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from mlxkv.tui.widgets.message import MessageView, code_blocks
from mlxkv.tui.widgets.modals import AskText, Confirm, ConversationSettings, EditMessage

if TYPE_CHECKING:
    from textual.notifications import SeverityLevel
    from textual.screen import Screen

    from mlxkv.engine.settings import Settings
    from mlxkv.tui.conversations import Conversation, Message
    from mlxkv.tui.host import ChatHost

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens", "seed")


def _slug(title: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", title).strip("-").lower()[:40] or "chat"


class Chat(Protocol):
    """What the actions use of the chat screen: the open conversation and its stored
    messages, the app's store thread, the message views, and the screen's own steps."""

    conversation: Conversation | None

    @property
    def history(self) -> list[Message]: ...

    @property
    def settings(self) -> Settings: ...

    @property
    def host(self) -> ChatHost: ...

    @property
    def replying(self) -> bool:
        """A reply is being written."""
        ...

    def views(self) -> list[MessageView]:
        """The message views, in order."""
        ...

    def focused_view(self) -> MessageView | None: ...

    def ask(self, modal: Screen[Any], then: Callable[[Any], Awaitable[None]]) -> None:
        """Show ``modal``; ``then`` gets its answer."""
        ...

    def notify(self, message: str, *, title: str = ..., severity: SeverityLevel = ...,
               timeout: float | None = ..., markup: bool = ...) -> None: ...

    def show_model_state(self, text: str | None = ...) -> None: ...

    async def refresh_list(self, *, only_if_moved: bool = ...) -> None: ...

    async def new_conversation(self) -> None: ...

    async def ensure_conversation(self, first_text: str = ...) -> Conversation: ...

    def open_conversation(self, cid: int, *, focus_prompt: bool = ...) -> Awaitable[None]: ...

    async def generate(self, question: MessageView | None = ...) -> None: ...


class ConversationActions:
    """The conversation actions of the chat ``chat`` (see the module docstring)."""

    def __init__(self, chat: Chat) -> None:
        self.chat = chat

    def _need_conversation(self) -> Conversation | None:
        conversation = self.chat.conversation
        if conversation is None:
            self.chat.notify("No conversation is open: send a message first", severity="warning")
        return conversation

    def rename(self) -> None:
        conversation = self._need_conversation()
        if conversation is None:
            return
        chat, host = self.chat, self.chat.host

        async def done(title: str | None) -> None:
            if title and title.strip():
                renamed = await host.db(host.store.rename, conversation.id, title.strip())
                if chat.conversation is not None and chat.conversation.id == renamed.id:
                    chat.conversation = renamed
                chat.show_model_state()
                await chat.refresh_list()
        chat.ask(AskText("Rename conversation", conversation.title), self._safe(done))

    def delete(self) -> None:
        conversation = self._need_conversation()
        if conversation is None:
            return
        chat, host = self.chat, self.chat.host

        async def done(yes: bool | None) -> None:
            if yes:
                await host.db(host.store.delete, conversation.id)
                if chat.conversation is not None and chat.conversation.id == conversation.id:
                    await chat.new_conversation()
                else:
                    await chat.refresh_list()
                chat.notify(f"Deleted “{conversation.title}”")
        chat.ask(Confirm(f"Delete “{conversation.title}” and its messages?"), self._safe(done))

    def export(self) -> None:
        conversation = self._need_conversation()
        if conversation is None:
            return
        chat, host = self.chat, self.chat.host
        default = Path(host.store.path).parent / "exports" / f"{_slug(conversation.title)}-{conversation.id}.md"

        async def done(path: str | None) -> None:
            if not path or not path.strip():
                return
            target = Path(os.path.expanduser(path.strip()))
            text = await host.db(host.store.export_markdown, conversation.id)

            def write() -> None:
                target.parent.mkdir(parents=True, exist_ok=True)
                with open(target, "x", encoding="utf-8") as f:  # never over a file that exists
                    f.write(text)
            try:
                await host.db(write)
            except FileExistsError:
                chat.notify(f"{target} exists already: choose another path.", severity="warning")
                return
            except OSError as e:
                chat.notify(f"Could not write {target}: {e.strerror or e}. Choose another path.",
                            title="Export failed", severity="error", timeout=10)
                return
            chat.notify(f"Exported to {target}", title="Exported")
        chat.ask(AskText("Export to Markdown: file", str(default)), self._safe(done))

    def conversation_settings(self) -> None:
        chat, host = self.chat, self.chat.host
        s = chat.settings
        defaults = {k: getattr(s, k) for k in SAMPLING_KEYS}
        current = chat.conversation

        async def done(result: dict | None) -> None:
            if result is None:
                return
            conversation = current or await chat.ensure_conversation("New chat")
            await host.db(host.store.set_system_prompt, conversation.id, result["system_prompt"])
            updated = await host.db(host.store.set_sampling, conversation.id, result["sampling"])
            if chat.conversation is not None and chat.conversation.id == updated.id:
                chat.conversation = updated
            await chat.refresh_list()
            chat.notify("Saved the system prompt and sampling of this conversation")
        chat.ask(ConversationSettings(current.system_prompt if current else None,
                                      dict(current.sampling or {}) if current else {}, defaults),
                 self._safe(done))

    async def regenerate_last(self) -> None:
        last = self._last_reply()
        if last is None:
            history = self.chat.history
            if history and history[-1].role == "user" and not self.chat.replying:
                await self.chat.generate()
                return
            self.chat.notify("There is no reply to regenerate", severity="warning")
            return
        await self.regenerate(last)

    async def regenerate(self, view: MessageView) -> None:
        """Write reply ``view`` again: the last one in place, an earlier one in a new branch."""
        chat, host = self.chat, self.chat.host
        if chat.replying:
            chat.notify("A reply is still being written: Esc stops it", severity="warning")
            return
        if view.role != "assistant" or view.message_id is None:
            chat.notify("Only a finished reply can be regenerated", severity="warning")
            return
        history = chat.history
        index = next((i for i, m in enumerate(history) if m.id == view.message_id), None)
        conversation = chat.conversation
        if index is None or conversation is None:
            return
        if index == len(history) - 1:
            before = history[index - 1].position if index > 0 else -1
            await host.db(host.store.truncate_after, conversation.id, before)
            del history[index:]
            await view.remove()
            await chat.generate()
        else:
            branch = await host.db(host.store.branch, conversation.id, view.message_id)
            await chat.open_conversation(branch.id)
            await chat.generate()
        await chat.refresh_list()

    async def branch_last(self) -> None:
        last = next((v for v in reversed(self.chat.views()) if v.role == "user"), None)
        if last is None:
            self.chat.notify("There is no message of yours to edit", severity="warning")
            return
        await self.branch_from(last)

    async def branch_from(self, view: MessageView) -> None:
        """Edit ``view``'s text into a new conversation holding the messages before it; a
        message of the user's is then answered."""
        chat, host = self.chat, self.chat.host
        if chat.replying:  # its reply would be lost, and two would run at once
            chat.notify("A reply is still being written: Esc stops it", severity="warning")
            return
        conversation, mid, role = chat.conversation, view.message_id, view.role
        if mid is None or conversation is None:
            chat.notify("This message is not saved yet", severity="warning")
            return

        async def done(text: str | None) -> None:
            if text is None:
                return
            if chat.replying:
                chat.notify("A reply is still being written: Esc stops it", severity="warning")
                return
            branch = await host.db(host.store.branch, conversation.id, mid, text)
            await chat.open_conversation(branch.id)
            if role == "user":
                await chat.generate()
            chat.notify(f"Branched from “{conversation.title}”")
        chat.ask(EditMessage("Edit and branch (the original stays as it is)", view.content), self._safe(done))

    def _last_reply(self) -> MessageView | None:
        return next((v for v in reversed(self.chat.views()) if v.role == "assistant"), None)

    def copy_reply(self) -> None:
        focused = self.chat.focused_view()
        if focused is None:
            focused = self._last_reply()
        if focused is None:
            self.chat.notify("There is no reply to copy", severity="warning")
            return
        focused.action_copy()

    def copy_code(self) -> None:
        view = self.chat.focused_view()
        if view is None:
            view = self._last_reply()
        if view is None or not code_blocks(view.content):
            self.chat.notify("The last reply has no code blocks", severity="warning")
            return
        view.action_copy_code()

    def _safe(self, fn: Callable[[Any], Awaitable[None]]) -> Callable[[Any], Awaitable[None]]:
        async def run(result: Any) -> None:
            try:
                await fn(result)
            except Exception as e:
                self.chat.notify(str(e), title="Something went wrong", severity="error", timeout=10)
        return run
