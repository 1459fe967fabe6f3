"""F1 / ?: every key of the screen, where it applies, and the binding id to remap it."""

from __future__ import annotations

from typing import Any

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Markdown


def binding_rows(classes: list[tuple[str, Any]]) -> list[tuple[str, str, str, str]]:
    """(where, keys, description, id) of each binding with an id of ``classes``."""
    rows = []
    for where, cls in classes:
        for b in getattr(cls, "BINDINGS", []):
            if isinstance(b, Binding) and b.id:
                rows.append((where, b.key, b.description or b.action, b.id))
    return rows


class HelpScreen(ModalScreen):
    BINDINGS = [Binding("escape,f1,q,question_mark", "dismiss", "Close", id="help.close")]
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll { width: 96; max-width: 95%; height: 85%; border: thick $primary;
                                  background: $surface; padding: 0 1; }
    """

    def __init__(self, rows: list[tuple[str, str, str, str]], keymap_path: str) -> None:
        super().__init__()
        self._rows, self._keymap_path = rows, keymap_path

    def compose(self) -> ComposeResult:
        lines = ["# Keys", "", "| Where | Keys | Does | Binding id |", "|---|---|---|---|"]
        for where, keys, what, bid in self._rows:
            lines.append(f"| {where} | `{keys}` | {what} | `{bid}` |")
        lines += ["", "Every action is also in the command palette (**Ctrl+P**).", "",
                  f"Remap keys in `{self._keymap_path}`, one line per binding id, e.g. "
                  '`"chat.new" = "ctrl+n"`.', "", "Esc closes this."]
        with VerticalScroll():
            yield Markdown("\n".join(lines))

    async def action_dismiss(self, result: Any = None) -> None:
        self.dismiss(result)
