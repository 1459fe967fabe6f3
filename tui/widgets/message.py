"""One message of a conversation: who said it, the text as Markdown (streamed while a
reply is generated; a reply with fenced code is rendered once more in full at its end, so
the code is right), and for a reply its status line (thinking…, writing…, then prompt and
cached tokens and where they came from, TTFT, speed).

A message takes focus (Tab, or Up/Down in the message list), and its keys act on it:
copy it, copy its code blocks, branch from it (edit and resend), regenerate."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.content import Content
from textual.message import Message
from textual.widgets import Markdown, Static

_FENCE = re.compile(r"^([ \t]*)(`{3,}|~{3,})[^\n]*\n(.*?)^\1\2[ \t]*$", re.M | re.S)


_FENCE_OPEN = re.compile(r"^[ \t]{0,3}(`{3,}|~{3,})", re.M)  # a line that opens (or closes) fenced code
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _picture(m: re.Match) -> str:
    code = ord(m.group())
    return chr(0x2400 + code) if code < 0x20 else "\u2421" if code == 0x7F else "\ufffd"


def printable(text: str) -> str:
    """``text`` safe to draw: control characters (a model's or a paste's ESC would reach
    the terminal as an escape sequence) are shown as their symbols (ESC as ␛)."""
    return _CONTROL.sub(_picture, text)


def code_blocks(markdown: str) -> list[str]:
    """The contents of the fenced code blocks of ``markdown``, in order."""
    return [m.group(3) for m in _FENCE.finditer(markdown)]


def _tps(value: float) -> str:
    return f"{value:.0f}" if value >= 10 else f"{value:.1f}"


def short_model(label: str) -> str:
    """A model's label as the narrow places show it: a folder's name, not its path."""
    return label.rstrip("/").rsplit("/", 1)[-1] or label


def format_status(stats: dict[str, Any] | None, reason: str | None = None) -> str:
    """The status line of a reply, e.g. ``SmolLM2-135M · 412 prompt tok · 384 cached
    (RAM 384) · TTFT 0.04 s · 96 tok at 231 tok/s``: the model that answered first (a
    folder's name, not its path), when the stats name it."""
    if not stats:
        return reason or ""
    parts = [f"{stats.get('prompt_tokens', 0)} prompt tok"]
    if stats.get("model"):
        parts.insert(0, short_model(str(stats["model"])))
    cached = int(stats.get("cached_tokens") or 0)
    ram, ssd = stats.get("cached_ram_tokens"), stats.get("cached_ssd_tokens")
    where = []
    if ram:
        where.append(f"RAM {ram}")
    if ssd:
        restore = stats.get("restore_ms")
        where.append(f"SSD {ssd}" + (f", read in {restore:.0f} ms" if restore else ""))
    parts.append(f"{cached} cached" + (f" ({' · '.join(where)})" if cached and where else ""))
    if stats.get("load_s"):
        parts.append(f"model load {stats['load_s']:.2f} s")
    parts.append(f"TTFT {stats.get('ttft_s', 0.0):.2f} s")
    parts.append(f"{stats.get('generated_tokens', 0)} tok at {_tps(stats.get('decode_tps', 0.0))} tok/s")
    accepted = stats.get("accepted_tokens") or stats.get("acceptance")
    if accepted:
        parts.append(f"accepted {accepted}")
    if stats.get("retried"):
        parts.append("cache retried")
    if reason and reason != "stop":
        parts.append(reason)
    return " · ".join(parts)


def update_in_place(widget: Static, content: Content | str) -> None:
    """Show ``content`` in ``widget``, laying the screen out only when its height changes.

    ``Static.update`` asks for a layout of the whole screen every time: a reflow of every
    widget on it, and a repaint of every message when the view moves. Text that keeps the
    widget's height (a reply's next tokens on the same line, the next status) needs a
    repaint of the widget alone."""
    width, height = widget.content_size
    if not (widget.is_mounted and widget.display and width and height):
        widget.update(content)  # not laid out yet: its first layout measures it
        return
    widget.update(content, layout=False)
    if widget.get_content_height(widget.content_size, widget.app.size, width) != height:
        widget.refresh(layout=True)


if TYPE_CHECKING:
    from textual.widgets._markdown import MarkdownParagraph as _Paragraph
    from textual.widgets.markdown import MarkdownStream
else:
    _Paragraph = Markdown.BLOCKS["paragraph_open"]  # Textual's paragraph (not exported)


class StreamedParagraph(_Paragraph):
    """A paragraph whose new text (the next tokens of a reply) repaints it alone while its
    height stays the same (Textual's paragraph lays the screen out on every update)."""

    def set_content(self, content: Content) -> None:
        self._content = content
        update_in_place(self, content)


class ReplyMarkdown(Markdown):
    """A message's Markdown, its paragraphs :class:`StreamedParagraph` s."""

    BLOCKS = {**Markdown.BLOCKS, "paragraph_open": StreamedParagraph}


class MessageView(Vertical, can_focus=True):
    """A message; ``message_id`` is its id in the store (None until it is saved)."""

    BINDINGS = [
        Binding("c,y", "copy", "Copy", id="message.copy"),
        Binding("k", "copy_code", "Copy code", id="message.copy_code"),
        Binding("e", "branch", "Edit & branch", id="message.branch"),
        Binding("r", "regenerate", "Regenerate", id="message.regenerate"),
        Binding("up", "neighbour(-1)", "Previous", show=False, id="message.previous"),
        Binding("down", "neighbour(1)", "Next", show=False, id="message.next"),
    ]

    class Action(Message):
        """The user asked for ``action`` (branch, regenerate) on ``view``."""

        def __init__(self, view: MessageView, action: str) -> None:
            super().__init__()
            self.view, self.action = view, action

    def __init__(self, role: str, content: str = "", *, message_id: int | None = None,
                 stats: dict[str, Any] | None = None, label: str | None = None,
                 status: str = "", streaming: bool = False) -> None:
        """``status``: the status line to show until stats come; ``streaming``: a reply
        about to stream, drawn as one from its first frame (:meth:`start_stream` once
        mounted), not restyled after it."""
        super().__init__(classes=f"message {role}" + " streaming" * streaming)
        self.role = role
        self.content = content
        self.message_id = message_id
        self.stats = stats
        self._label = label or {"user": "You", "assistant": "Assistant", "system": "System"}.get(role, role)
        self._status = status
        self._stream: MarkdownStream | None = None
        self.streaming = False

    def compose(self) -> ComposeResult:
        yield Static(printable(self._label), classes="role", markup=False)
        yield ReplyMarkdown(printable(self.content), classes="body")
        status = Static(self._status_text(), classes="status", markup=False)
        status.display = bool(self._status_text())  # set before the first layout, not after it
        yield status

    def _status_text(self) -> str:
        if self.stats is None:
            return self._status
        return format_status(self.stats, self.stats.get("finish_reason"))

    @property
    def body(self) -> Markdown:
        return self.query_one(".body", Markdown)

    def set_status(self, text: str) -> None:
        """Show ``text`` on the status line (none: hide it); a text of the same height as the
        one shown repaints the line alone."""
        status = self.query_one(".status", Static)
        if text and status.display:
            update_in_place(status, text)
        else:
            status.update(text)
            status.display = bool(text)

    def start_stream(self) -> None:
        self.streaming = True
        self.add_class("streaming")
        self._stream = Markdown.get_stream(self.body)

    async def append(self, text: str) -> None:
        self.content += text
        if self._stream is not None:
            await self._stream.write(printable(text))

    async def finish(self, text: str | None = None) -> None:
        """End the stream with the rest of ``text`` (the whole reply). A reply with fenced
        code is rendered once more in full (its code blocks render right then); any other
        is already shown as a full render would show it, and re-mounting every block of it
        held up the UI, and the reply's last tokens, for a frame or more."""
        full = self.content if text is None else text
        stream, self._stream = self._stream, None
        if stream is not None and full.startswith(self.content) and not _FENCE_OPEN.search(full):
            rest, self.content = full[len(self.content):], full
            if rest:
                await stream.write(printable(rest))
            await stream.stop()  # appends what it still holds
        else:
            self.content = full
            if stream is not None:
                await stream.stop()
            await self.body.update(printable(full))
        self.streaming = False
        self.remove_class("streaming")

    def action_copy(self) -> None:
        self.app.copy_to_clipboard(self.content)
        self.notify(f"Copied the message ({len(self.content)} characters)")

    def action_copy_code(self) -> None:
        blocks = code_blocks(self.content)
        if not blocks:
            self.notify("This message has no code blocks", severity="warning")
            return
        self.app.copy_to_clipboard("\n".join(blocks))
        self.notify(f"Copied {len(blocks)} code block{'s' * (len(blocks) != 1)}")

    def action_branch(self) -> None:
        self.post_message(self.Action(self, "branch"))

    def action_regenerate(self) -> None:
        self.post_message(self.Action(self, "regenerate"))

    def action_neighbour(self, step: int) -> None:
        views = [v for v in self.parent.children if isinstance(v, MessageView)] if self.parent else []
        if self in views:
            i = views.index(self) + step
            if 0 <= i < len(views):
                views[i].focus()
                views[i].scroll_visible()
            elif i >= len(views):
                self.post_message(self.Action(self, "leave"))
