"""The chat screen: conversations in a sidebar, the open one as Markdown messages, a
message box, a model bar and a progress bar (model load, long prefills).

A reply streams into its :class:`~tui.widgets.message.MessageView` through Textual's
Markdown stream (one drain of the reply's buffer per burst of tokens); the screen is laid
out again only when a message's height changes. The message list is anchored to its end,
so it follows new text until the user scrolls up. Conversations live in :mod:`tui.conversations`
(called on the app's one store thread, so writes keep their order and never block a key);
each has its own engine session (``mlxkv-chat-<id>``), opened and prefetched when the
conversation opens, so its next turn starts from the cached prefix. Conversation actions
(rename, delete, export, branch, settings) are a part of the screen
(:class:`tui.chat_actions.ConversationActions`). What the screen uses of its app is
:class:`tui.host.ChatHost`, given to it when it is made.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.content import Content
from textual.screen import Screen
from textual.widgets import Footer, ProgressBar, Static

from mlxkv.tui.bridge import EngineBridge, ReplyStream
from mlxkv.tui.chat_actions import SAMPLING_KEYS, ConversationActions
from mlxkv.tui.messages import ReplyFinished, ReplyProgress, ReplyStats, ReplyTokens
from mlxkv.tui.widgets.message import MessageView, format_status, printable
from mlxkv.tui.widgets.message_list import MessageList
from mlxkv.tui.widgets.prompt import PromptArea
from mlxkv.tui.widgets.sidebar import ConversationList

if TYPE_CHECKING:
    from mlxkv.engine.settings import Settings
    from mlxkv.tui.conversations import Conversation, ConversationStore, Message
    from mlxkv.tui.host import ChatHost

log = logging.getLogger("mlxkv.tui")
SESSION_PREFIX = "mlxkv-chat-"
P = ParamSpec("P")
R = TypeVar("R")


def session_for(conversation_id: int) -> str:
    return f"{SESSION_PREFIX}{conversation_id}"


def conversation_for(session: str) -> int | None:
    """The conversation id of an engine session of the chat (None: not one of ours)."""
    if not session or not session.startswith(SESSION_PREFIX):
        return None
    try:
        return int(session[len(SESSION_PREFIX):])
    except ValueError:
        return None


def model_label(spec: str) -> str:
    """A short name for a model before it is loaded (its folder's name, or the hub id)."""
    spec = spec.rstrip("/")
    if spec.endswith(("demo/model", "demo\\model")):
        return "demo model"
    return spec.rsplit("/", 1)[-1] if spec.startswith(("/", ".", "~")) else spec


def title_from(text: str) -> str:
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "New chat")
    return line if len(line) <= 48 else line[:47].rstrip() + "…"


def guarded(fn: Callable[Concatenate[ChatScreen, P], Awaitable[R]]
            ) -> Callable[Concatenate[ChatScreen, P], Awaitable[R | None]]:
    """A handler whose failure becomes a notification, never a traceback on the screen."""
    @functools.wraps(fn)
    async def run(self: ChatScreen, *args: P.args, **kwargs: P.kwargs) -> R | None:
        try:
            return await fn(self, *args, **kwargs)
        except Exception as e:
            log.debug("%s failed", fn.__name__, exc_info=True)
            self.app.notify(f"{fn.__name__.strip('_').replace('_', ' ')}: {e}", severity="error",
                            title="Something went wrong", timeout=10)
            return None
    return run


@dataclass
class Pending:
    """The reply being generated (one at a time)."""

    stream: ReplyStream
    conversation_id: int
    view: MessageView | None
    stats: dict[str, Any] | None = None
    first_total: int | None = None


class ChatScreen(Screen):
    CSS_PATH = "chat.tcss"
    BINDINGS = [
        Binding("escape", "cancel", "Stop", id="chat.cancel"),
        Binding("ctrl+n", "new_conversation", "New", id="chat.new"),
        Binding("ctrl+f", "search", "Search", id="chat.search"),
        Binding("ctrl+r", "rename", "Rename", id="chat.rename"),
        Binding("f8", "delete", "Delete", id="chat.delete"),
        Binding("ctrl+s", "export", "Export", id="chat.export"),
        Binding("ctrl+t", "conversation_settings", "System & sampling", id="chat.settings"),
        Binding("ctrl+g", "regenerate", "Regenerate", id="chat.regenerate"),
        Binding("ctrl+e", "branch_last", "Edit & branch", id="chat.branch", priority=True, show=False),
        Binding("ctrl+y", "copy_reply", "Copy reply", id="chat.copy", priority=True),
        Binding("f7", "copy_code", "Copy code", id="chat.copy_code", show=False),
        Binding("ctrl+b", "toggle_sidebar", "Sidebar", id="chat.sidebar", show=False),
        Binding("ctrl+up", "focus_messages", "Messages", id="chat.messages", show=False),
    ]

    def __init__(self, bridge: EngineBridge, settings: Settings, host: ChatHost) -> None:
        super().__init__(id="chat")
        self.bridge = bridge
        self.settings = settings
        self.host = host
        self.conversation: Conversation | None = None
        self.history: list[Message] = []  # stored messages of the open conversation
        self.pending: Pending | None = None
        self.search_text = ""
        self._opening = 0
        self._listed: list[int] = []  # conversation ids as the sidebar lists them
        self.actions = ConversationActions(self)

    @property
    def store(self) -> ConversationStore:
        return self.host.store

    @property
    def replying(self) -> bool:
        return self.pending is not None

    def views(self) -> list[MessageView]:
        return list(self.query(MessageView))

    def focused_view(self) -> MessageView | None:
        return self.focused if isinstance(self.focused, MessageView) else None

    def ask(self, modal: Screen[Any], then: Callable[[Any], Awaitable[None]]) -> None:
        self.app.push_screen(modal, then)

    # actions (the keys and the command palette) -------------------------------------------
    def commands(self) -> list[tuple[str, str, Callable[[], object]]]:
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

    async def action_new_conversation(self) -> None:
        await self.new_conversation()

    def action_search(self) -> None:
        self.query_one("#sidebar").display = True
        self.query_one("#search").focus()

    def action_toggle_sidebar(self) -> None:
        sidebar = self.query_one("#sidebar")
        sidebar.display = not sidebar.display

    def action_focus_messages(self) -> None:
        views = self.views()
        if views:
            views[-1].focus()
            views[-1].scroll_visible()

    def action_rename(self) -> None:
        self.actions.rename()

    def action_delete(self) -> None:
        self.actions.delete()

    def action_export(self) -> None:
        self.actions.export()

    def action_conversation_settings(self) -> None:
        self.actions.conversation_settings()

    async def action_regenerate(self) -> None:
        await self.actions.regenerate_last()

    async def action_branch_last(self) -> None:
        await self.actions.branch_last()

    def action_copy_reply(self) -> None:
        self.actions.copy_reply()

    def action_copy_code(self) -> None:
        self.actions.copy_code()

    def compose(self) -> ComposeResult:
        with Horizontal(id="layout"):
            yield ConversationList(id="sidebar")
            with Vertical(id="main"):
                yield Static("", id="model-bar")
                yield ProgressBar(id="progress", show_eta=False)
                with MessageList(id="messages"):
                    yield Static(self._empty_text(), id="empty")
                yield PromptArea(id="prompt")
        yield Footer()

    def _empty_text(self) -> str:
        return ("Type a message and press Enter (Shift+Enter or Ctrl+J: new line).\n"
                "Ctrl+N: new chat · F2: cache inspector · Ctrl+P: every command · F1: keys")

    def on_mount(self) -> None:
        self.messages_box.anchor()
        self.query_one("#progress", ProgressBar).display = False
        self.prompt.focus()
        self.show_model_state()
        self.call_after_refresh(self.refresh_list)

    @property
    def prompt(self) -> PromptArea:
        return self.query_one("#prompt", PromptArea)

    @property
    def messages_box(self) -> MessageList:
        return self.query_one("#messages", MessageList)

    # model state (called by the app on engine messages) -----------------------------
    def show_model_state(self, text: str | None = None) -> None:
        b = self.bridge
        name = b.info.get("model") or model_label(b.model_spec)
        if text is None:
            if b.error:
                text = "not loaded: F3 chooses another model"
            elif b.ready.is_set():
                ctx = b.info.get("context_tokens")
                text = f"{b.info.get('compute_dtype', '')}" + (f" · context {ctx}" if ctx else "")
            else:
                text = "loading…"
        title = self.conversation.title if self.conversation is not None else "New chat"
        if not self._widgets_alive():
            return
        # Content, not markup: a title or a folder name may hold brackets.
        self.query_one("#model-bar", Static).update(
            Content.assemble((printable(name), "bold"), f" · {printable(text)}   ", (printable(title), "dim")))

    def _widgets_alive(self) -> bool:
        """False once the app is closing: an engine message that arrives then (the model
        finished loading as the user quit) finds the screen's widgets already removed."""
        return bool(self.query("#progress"))

    def show_progress(self, done: float | None, total: float | None = None) -> None:
        if not self._widgets_alive():
            return
        bar = self.query_one("#progress", ProgressBar)
        if done is None:
            bar.display = False
            return
        bar.display = True
        bar.update(total=total, progress=done)

    # conversations --------------------------------------------------------------------
    async def refresh_list(self, *, only_if_moved: bool = False) -> None:
        """List the conversations again; ``only_if_moved``: unless the open one is already
        listed first (a new message moves it there) and no search narrows the list."""
        current = self.conversation.id if self.conversation is not None else None
        if only_if_moved and not self.search_text and self._listed[:1] == [current]:
            return
        conversations = await self.host.db(self.store.list, self.search_text or None)
        self._listed = [c.id for c in conversations]
        await self.query_one(ConversationList).show(conversations, current)

    @guarded
    async def open_conversation(self, cid: int, *, focus_prompt: bool = True) -> None:
        """Show conversation ``cid``; a reply still running is stopped (what it said is kept)."""
        if self.pending is not None:
            self.pending.stream.cancel()
            self.pending.view = None
        self._opening += 1
        ticket = self._opening
        conversation = await self.host.db(self.store.get, cid)
        history = await self.host.db(self.store.messages, cid)
        if ticket != self._opening:  # another conversation was asked for meanwhile
            return
        previous = self.conversation
        self.conversation, self.history = conversation, history
        box = self.messages_box
        await box.remove_children()
        label = self._assistant_label()
        # each reply under the name of the model that wrote it (a switch keeps the chat)
        views = [MessageView(m.role, m.content, message_id=m.id, stats=m.stats,
                             label=((m.stats or {}).get("model") or label) if m.role == "assistant" else None)
                 for m in history if m.role != "system"]
        if views:
            await box.mount_all(views)
        else:
            await box.mount(Static(self._empty_text(), id="empty"))
        box.anchor()
        self.show_model_state()
        await self.refresh_list()
        if focus_prompt:
            self.prompt.focus()
        self._switch_session(previous.id if previous is not None else None, cid)
        if conversation.model and conversation.model != self.bridge.model_spec:
            self.notify(f"This conversation was last written with {model_label(conversation.model)}; "
                        "F3 switches models.", title="Another model")

    def _switch_session(self, old: int | None, new: int) -> None:
        if old == new:
            return
        payload = self._payload()

        def work() -> None:
            if old is not None:
                self.bridge.close_session(session_for(old))
            self.bridge.open_session(session_for(new))
            if len(payload) > 1 or (payload and payload[0]["role"] != "system"):
                warm = self.bridge.prefetch(payload, session_for(new))
                self.host.metrics.prefetched.append((new, warm))
        self.host.background(work, "open the conversation's cache session", quiet=True)

    async def new_conversation(self) -> None:
        if self.pending is not None:
            self.pending.stream.cancel()
            self.pending.view = None
        previous, self.conversation, self.history = self.conversation, None, []
        await self.messages_box.remove_children()
        await self.messages_box.mount(Static(self._empty_text(), id="empty"))
        if previous is not None:
            self.host.background(lambda: self.bridge.close_session(session_for(previous.id)),
                                "close the conversation's cache session", quiet=True)
        self.show_model_state()
        await self.refresh_list()
        self.prompt.focus()

    async def ensure_conversation(self, first_text: str = "") -> Conversation:
        if self.conversation is None:
            conversation = await self.host.db(self.store.create, title_from(first_text),
                                             self.bridge.model_spec)
            self.conversation, self.history = conversation, []
            self.host.background(lambda: self.bridge.open_session(session_for(conversation.id)),
                                "open the conversation's cache session", quiet=True)
        return self.conversation

    # sending ----------------------------------------------------------------------------
    async def on_prompt_area_submitted(self, event: PromptArea.Submitted) -> None:
        event.stop()
        await self.send(event.text)

    @guarded
    async def send(self, text: str) -> None:
        if not text.strip():
            return
        if self.pending is not None:
            self.notify("A reply is still being written: Esc stops it", severity="warning")
            return
        if self.bridge.error:  # the text stays in the box for when a model is loaded
            self.notify(f"{self.bridge.error}\nPress F3 to choose a model (the demo model works offline).",
                        title="No model is loaded", severity="error", timeout=12)
            return
        self.prompt.clear()
        try:
            conversation = await self.ensure_conversation(text)
            if conversation.model != self.bridge.model_spec:  # the model that answers from now on
                conversation = await self.host.db(self.store.set_model, conversation.id, self.bridge.model_spec)
                self.conversation = conversation
            message = await self.host.db(self.store.add_message, conversation.id, "user", text)
        except Exception:
            if not self.prompt.text:  # not saved, not sent: the text goes back to the box
                self.prompt.load_text(text)
            raise
        self.history.append(message)
        await self.refresh_list(only_if_moved=True)  # before the reply: its tokens stream undisturbed
        await self.generate(MessageView("user", text, message_id=message.id))

    async def _mount_views(self, *views: MessageView) -> None:
        """Add ``views`` at the end of the message list, in one mount."""
        box = self.messages_box
        for empty in box.query("#empty"):
            await empty.remove()
        await box.mount_all(views)
        box.anchor()

    def _assistant_label(self) -> str:
        return self.bridge.info.get("model") or "Assistant"

    def _payload(self) -> list[dict[str, str]]:
        system = self.conversation.system_prompt if self.conversation is not None else None
        system = system or self.settings.system_prompt
        messages = [{"role": "system", "content": system}] if system else []
        return messages + [{"role": m.role, "content": m.content} for m in self.history
                           if m.role != "system"]

    def sampling(self) -> dict[str, Any]:
        s = self.settings
        params = {k: getattr(s, k) for k in SAMPLING_KEYS}
        params["prefill_step_size"] = s.prefill_step_size
        if self.conversation is not None:
            params.update({k: v for k, v in (self.conversation.sampling or {}).items() if k in SAMPLING_KEYS})
        return params

    async def generate(self, question: MessageView | None = None) -> None:
        """Ask for a reply to the open conversation as it stands; ``question``: the view of
        the user's message it answers, not shown yet (both are mounted together)."""
        conversation = self.conversation
        if conversation is None:  # every caller opens one first
            raise RuntimeError("there is no conversation to answer")
        view = MessageView("assistant", label=self._assistant_label(), streaming=True,
                           status="thinking…" if self.bridge.ready.is_set() else "waiting for the model…")
        await self._mount_views(*(question, view) if question is not None else (view,))
        view.start_stream()
        stream = self.bridge.submit(self._payload(), self.sampling(), session_for(conversation.id),
                                    self.post_message)
        self.pending = Pending(stream, conversation.id, view)

    # reply events (posted by the engine thread) -----------------------------------------
    def _current(self, rid: int) -> Pending | None:
        p = self.pending
        return p if p is not None and p.stream.rid == rid else None

    async def on_reply_tokens(self, message: ReplyTokens) -> None:
        p = self._current(message.rid)
        if p is None:
            return
        text, produced = p.stream.drain()
        if p.first_total is not None:
            p.first_total = None
            self.show_progress(None)
        view = p.view
        if not text or view is None or not view.is_attached:
            return
        if not view.content:  # a line of the same height: the screen is not laid out again
            view.set_status("writing… (Esc stops it)")
        await view.append(text)
        if produced is not None:
            self.host.metrics.token_shown(produced, self)

    def on_reply_progress(self, message: ReplyProgress) -> None:
        p = self._current(message.rid)
        if p is None:
            return
        if p.first_total is None and message.done < message.total:
            if message.total - message.done <= self.settings.prefill_step_size:
                return  # one chunk: over before a bar would help
            p.first_total = message.total
        if p.first_total is not None:
            self.show_progress(message.done, message.total)
            self.host.metrics.prefill_updates += 1
            if p.view is not None and p.view.is_attached:
                p.view.set_status(f"reading the prompt: {message.done}/{message.total} tokens")

    def on_reply_stats(self, message: ReplyStats) -> None:
        p = self._current(message.rid)
        if p is not None:
            p.stats = message.stats

    @guarded
    async def on_reply_finished(self, message: ReplyFinished) -> None:
        p = self._current(message.rid)
        if p is None:
            return
        self.pending = None
        self.show_progress(None)
        text, _ = p.stream.drain()
        full = p.stream.text
        view = p.view if p.view is not None and p.view.is_attached else None
        if message.error is not None:
            await self._reply_failed(p, view, full, message)
            return
        stats = dict(p.stats or {})
        stats["finish_reason"] = message.reason
        stats["model"] = self._assistant_label()
        if view is not None:
            view.stats = stats
            await view.finish(full)
            view.set_status(format_status(stats, message.reason))
        if not full:
            if view is not None:
                view.set_status("stopped before the first token")
            return
        try:
            stored = await self.host.db(self.store.add_message, p.conversation_id, "assistant", full, stats)
        except LookupError:  # its conversation was deleted while it was written
            return
        if view is not None:
            view.message_id = stored.id
        if self.conversation is not None and self.conversation.id == p.conversation_id:
            self.history.append(stored)
        self.host.metrics.reply_done(stats)

    async def _reply_failed(self, p: Pending, view: MessageView | None, text: str,
                            message: ReplyFinished) -> None:
        error = message.error or "the reply failed"
        if message.refused and "context" in error:
            error = error.split(" (use --truncate")[0]
            advice = ("Start a new chat (Ctrl+N), or branch from an earlier message "
                      "(focus it and press e) to keep the conversation short.")
            title = "The conversation is too long for the model"
        elif not self.bridge.ready.is_set() or self.bridge.error:
            advice = "Choose a model that loads with F3 (the demo model works offline)."
            title = "No model"
        else:
            advice = "Try again with Ctrl+G, or start a new chat (Ctrl+N)."
            title = "The reply failed"
        self.notify(f"{error}\n{advice}", title=title, severity="error", timeout=12)
        self.host.metrics.reply_done({"finish_reason": "error", "error": error})
        if view is not None:
            await view.finish(text)
            view.add_class("error")
            view.set_status(f"failed: {error}")

    async def save_pending(self) -> None:
        """The app is closing: keep what the reply being written has said so far."""
        p, self.pending = self.pending, None
        if p is None:
            return
        p.stream.cancel()
        text = p.stream.text
        if text:
            stats = {**(p.stats or {}), "finish_reason": "cancelled", "model": self._assistant_label()}
            try:
                await self.host.db(self.store.add_message, p.conversation_id, "assistant", text, stats)
            except LookupError:  # its conversation was deleted
                pass

    def action_cancel(self) -> None:
        if self.pending is not None:
            self.pending.stream.cancel()
            if self.pending.view is not None and self.pending.view.is_attached:
                self.pending.view.set_status("stopping…")
        elif self.focused is not self.prompt:
            self.prompt.focus()

    async def on_message_view_action(self, event: MessageView.Action) -> None:
        event.stop()
        if event.action == "leave":
            self.prompt.focus()
        elif event.action == "branch":
            await self.actions.branch_from(event.view)
        elif event.action == "regenerate":
            await self.actions.regenerate(event.view)

    async def on_conversation_list_open(self, event: ConversationList.Open) -> None:
        event.stop()
        if self.conversation is None or self.conversation.id != event.conversation_id:
            await self.open_conversation(event.conversation_id)
        else:
            self.prompt.focus()

    async def on_conversation_list_search(self, event: ConversationList.Search) -> None:
        event.stop()
        self.search_text = event.text.strip()
        await self.refresh_list()
