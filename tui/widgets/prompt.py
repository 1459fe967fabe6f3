"""The message box: Enter sends, Shift+Enter or Ctrl+J inserts a newline (both are
priority bindings with ids, so they win over the text area's own Enter and can be
remapped). Up on an empty box recalls the last message sent."""

from __future__ import annotations

from textual.binding import Binding
from textual.message import Message
from textual.widgets import TextArea


class PromptArea(TextArea):
    BINDINGS = [
        Binding("enter", "submit", "Send", id="prompt.send", priority=True),
        Binding("shift+enter,ctrl+j", "newline", "Newline", id="prompt.newline", priority=True,
                show=False),
    ]

    class Submitted(Message):
        def __init__(self, area: PromptArea, text: str) -> None:
            super().__init__()
            self.area, self.text = area, text

        @property
        def control(self) -> PromptArea:
            return self.area

    def __init__(self, **kwargs) -> None:
        super().__init__(soft_wrap=True, show_line_numbers=False, tab_behavior="focus", **kwargs)
        self.sent: list[str] = []

    # Priority bindings run as the app receives the key, possibly before this widget has
    # handled the keys typed just before it (a terminal sends "text\r" in one read): act
    # from this widget's own queue, after them.
    def action_submit(self) -> None:
        self.call_later(self._submit)

    def action_newline(self) -> None:
        self.call_later(self.insert, "\n")

    def _submit(self) -> None:
        text = self.text
        if text.strip():
            self.sent.append(text)
            self.post_message(self.Submitted(self, text))

    def action_cursor_up(self, select: bool = False) -> None:
        if select or not self.recall():
            super().action_cursor_up(select)

    def recall(self) -> bool:
        """Put the last message sent back in an empty box (True if it did)."""
        if self.text or not self.sent:
            return False
        self.load_text(self.sent[-1])
        self.move_cursor(self.document.end)
        return True
