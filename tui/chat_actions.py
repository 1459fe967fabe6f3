"""What the chat screen does to conversations beyond sending: rename, delete, search,
export to Markdown, system prompt and sampling, regenerate, branch (edit and resend),
copy; and the command palette's list of all of them. A mixin of
:class:`tui.chat.ChatScreen` (kept apart so each module stays short)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from mlxkv.tui.widgets.message import MessageView, code_blocks
from mlxkv.tui.widgets.modals import AskText, Confirm, ConversationSettings, EditMessage


def _slug(title: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", title).strip("-").lower()[:40] or "chat"


class ConversationActions:
    """Mixin: needs ``conversation``, ``history``, ``pending``, ``store``, ``bridge``,
    ``generate``, ``open_conversation``, ``refresh_list`` and the widgets of ChatScreen."""

    def commands(self) -> list[tuple[str, str, Any]]:
        """(title, help, callback) of every chat action, for the command palette."""
        return [
            ("New chat", "Start a new conversation (Ctrl+N)", self.action_new_conversation),
            ("Search conversations", "Filter the sidebar by title and text (Ctrl+F)", self.action_search),
            ("Rename conversation", "Give the open conversation a title (Ctrl+R)", self.action_rename),
            ("Delete conversation", "Delete the open conversation, after asking (F8)", self.action_delete),
            ("Export conversation", "Save it as a Markdown file (Ctrl+S)", self.action_export),
            ("System prompt and sampling", "Of the open conversation (Ctrl+T)",
             self.action_conversation_settings),
            ("Regenerate reply", "Write the last reply again (Ctrl+G)", self.action_regenerate),
            ("Edit and branch", "Edit your last message into a new branch (Ctrl+E)", self.action_branch_last),
            ("Stop reply", "Stop the reply being written (Esc)", self.action_cancel),
            ("Copy reply", "Copy the last reply to the clipboard (Ctrl+Y)", self.action_copy_reply),
            ("Copy code", "Copy the code blocks of the last reply (F7)", self.action_copy_code),
            ("Toggle sidebar", "Show or hide the conversation list (Ctrl+B)", self.action_toggle_sidebar),
            ("Focus messages", "Move through messages with Up/Down; c copies, k copies code, "
             "e branches, r regenerates (Ctrl+Up)", self.action_focus_messages),
        ]

    def _need_conversation(self) -> bool:
        if self.conversation is None:
            self.notify("No conversation is open: send a message first", severity="warning")
            return False
        return True

    async def action_new_conversation(self) -> None:
        await self.new_conversation()

    def action_search(self) -> None:
        self.query_one("#sidebar").display = True
        self.query_one("#search").focus()

    def action_toggle_sidebar(self) -> None:
        sidebar = self.query_one("#sidebar")
        sidebar.display = not sidebar.display

    def action_focus_messages(self) -> None:
        views = list(self.query(MessageView))
        if views:
            views[-1].focus()
            views[-1].scroll_visible()

    def action_rename(self) -> None:
        if not self._need_conversation():
            return
        conversation = self.conversation

        async def done(title: str | None) -> None:
            if title and title.strip():
                renamed = await self.app.db(self.store.rename, conversation.id, title.strip())
                if self.conversation is not None and self.conversation.id == renamed.id:
                    self.conversation = renamed
                self.show_model_state()
                await self.refresh_list()
        self.app.push_screen(AskText("Rename conversation", conversation.title), self._safe(done))

    def action_delete(self) -> None:
        if not self._need_conversation():
            return
        conversation = self.conversation

        async def done(yes: bool | None) -> None:
            if yes:
                await self.app.db(self.store.delete, conversation.id)
                if self.conversation is not None and self.conversation.id == conversation.id:
                    await self.new_conversation()
                else:
                    await self.refresh_list()
                self.notify(f"Deleted “{conversation.title}”")
        self.app.push_screen(Confirm(f"Delete “{conversation.title}” and its messages?"), self._safe(done))

    def action_export(self) -> None:
        if not self._need_conversation():
            return
        conversation = self.conversation
        default = Path(self.store.path).parent / "exports" / f"{_slug(conversation.title)}-{conversation.id}.md"

        async def done(path: str | None) -> None:
            if not path or not path.strip():
                return
            target = Path(os.path.expanduser(path.strip()))
            text = await self.app.db(self.store.export_markdown, conversation.id)

            def write() -> None:
                target.parent.mkdir(parents=True, exist_ok=True)
                with open(target, "x", encoding="utf-8") as f:  # never over a file that exists
                    f.write(text)
            try:
                await self.app.db(write)
            except FileExistsError:
                self.notify(f"{target} exists already: choose another path.", severity="warning")
                return
            except OSError as e:
                self.notify(f"Could not write {target}: {e.strerror or e}. Choose another path.",
                            title="Export failed", severity="error", timeout=10)
                return
            self.notify(f"Exported to {target}", title="Exported")
        self.app.push_screen(AskText("Export to Markdown: file", str(default)), self._safe(done))

    def action_conversation_settings(self) -> None:
        s = self.settings
        defaults = {k: getattr(s, k) for k in ("temperature", "top_p", "top_k", "min_p",
                                               "repetition_penalty", "max_tokens", "seed")}
        current = self.conversation

        async def done(result: dict | None) -> None:
            if result is None:
                return
            conversation = current or await self.ensure_conversation("New chat")
            await self.app.db(self.store.set_system_prompt, conversation.id, result["system_prompt"])
            updated = await self.app.db(self.store.set_sampling, conversation.id, result["sampling"])
            if self.conversation is not None and self.conversation.id == updated.id:
                self.conversation = updated
            await self.refresh_list()
            self.notify("Saved the system prompt and sampling of this conversation")
        self.app.push_screen(ConversationSettings(current.system_prompt if current else None,
                                                  dict(current.sampling or {}) if current else {}, defaults),
                             self._safe(done))

    async def action_regenerate(self) -> None:
        last = next((v for v in reversed(list(self.query(MessageView))) if v.role == "assistant"), None)
        if last is None:
            if self.history and self.history[-1].role == "user" and self.pending is None:
                await self.generate()
                return
            self.notify("There is no reply to regenerate", severity="warning")
            return
        await self.regenerate(last)

    async def regenerate(self, view: MessageView) -> None:
        """Write reply ``view`` again: the last one in place, an earlier one in a new branch."""
        if self.pending is not None:
            self.notify("A reply is still being written: Esc stops it", severity="warning")
            return
        if view.role != "assistant" or view.message_id is None:
            self.notify("Only a finished reply can be regenerated", severity="warning")
            return
        index = next((i for i, m in enumerate(self.history) if m.id == view.message_id), None)
        if index is None:
            return
        if index == len(self.history) - 1:
            before = self.history[index - 1].position if index > 0 else -1
            await self.app.db(self.store.truncate_after, self.conversation.id, before)
            del self.history[index:]
            await view.remove()
            await self.generate()
        else:
            branch = await self.app.db(self.store.branch, self.conversation.id, view.message_id)
            await self.open_conversation(branch.id)
            await self.generate()
        await self.refresh_list()

    async def action_branch_last(self) -> None:
        last = next((v for v in reversed(list(self.query(MessageView))) if v.role == "user"), None)
        if last is None:
            self.notify("There is no message of yours to edit", severity="warning")
            return
        await self.branch_from(last)

    async def branch_from(self, view: MessageView) -> None:
        """Edit ``view``'s text into a new conversation holding the messages before it; a
        message of the user's is then answered."""
        if self.pending is not None:  # its reply would be lost, and two would run at once
            self.notify("A reply is still being written: Esc stops it", severity="warning")
            return
        if view.message_id is None or self.conversation is None:
            self.notify("This message is not saved yet", severity="warning")
            return
        conversation, mid, role = self.conversation, view.message_id, view.role

        async def done(text: str | None) -> None:
            if text is None:
                return
            if self.pending is not None:
                self.notify("A reply is still being written: Esc stops it", severity="warning")
                return
            branch = await self.app.db(self.store.branch, conversation.id, mid, text)
            await self.open_conversation(branch.id)
            if role == "user":
                await self.generate()
            self.notify(f"Branched from “{conversation.title}”")
        self.app.push_screen(EditMessage("Edit and branch (the original stays as it is)", view.content),
                             self._safe(done))

    def _last_reply(self) -> MessageView | None:
        return next((v for v in reversed(list(self.query(MessageView))) if v.role == "assistant"), None)

    def action_copy_reply(self) -> None:
        focused = self.focused if isinstance(self.focused, MessageView) else self._last_reply()
        if focused is None:
            self.notify("There is no reply to copy", severity="warning")
            return
        focused.action_copy()

    def action_copy_code(self) -> None:
        view = self.focused if isinstance(self.focused, MessageView) else self._last_reply()
        if view is None or not code_blocks(view.content):
            self.notify("The last reply has no code blocks", severity="warning")
            return
        view.action_copy_code()

    def _safe(self, fn: Any) -> Any:
        async def run(result: Any) -> None:
            try:
                await fn(result)
            except Exception as e:
                self.notify(str(e), title="Something went wrong", severity="error", timeout=10)
        return run
