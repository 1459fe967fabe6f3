"""Small modal dialogs of the chat: ask for a line of text, confirm, edit a message,
a conversation's system prompt and sampling, and the model switcher. Each returns its
answer through ``dismiss`` (None: cancelled with Esc)."""

from __future__ import annotations

from typing import Any

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, OptionList, Static, TextArea
from textual.widgets.option_list import Option

_CANCEL = Binding("escape", "cancel", "Cancel", id="dialog.cancel")


class _Dialog(ModalScreen):
    BINDINGS = [_CANCEL]
    DEFAULT_CSS = """
    _Dialog { align: center middle; }
    _Dialog > Vertical { width: 80; max-width: 95%; height: auto; max-height: 90%;
                         border: thick $primary; background: $surface; padding: 1 2; }
    _Dialog .title { text-style: bold; margin-bottom: 1; }
    _Dialog .hint { color: $text-muted; margin-top: 1; }
    _Dialog .error { color: $error; }
    _Dialog TextArea { height: 10; }
    """

    def action_cancel(self) -> None:
        self.dismiss(None)


class AskText(_Dialog):
    """One line of text (rename, export path, search...)."""

    def __init__(self, title: str, value: str = "", placeholder: str = "", hint: str = "") -> None:
        super().__init__()
        self._title, self._value, self._placeholder, self._hint = title, value, placeholder, hint

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label(self._title, classes="title")
            yield Input(self._value, placeholder=self._placeholder, id="answer")
            yield Static(self._hint or "Enter to accept, Esc to cancel", classes="hint")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.dismiss(event.value)


class Confirm(_Dialog):
    BINDINGS = [_CANCEL, Binding("y", "answer(True)", "Yes", id="dialog.yes"),
                Binding("n", "answer(False)", "No", id="dialog.no")]

    def __init__(self, question: str) -> None:
        super().__init__()
        self._question = question

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label(self._question, classes="title")
            with Horizontal():
                yield Button("Yes (y)", variant="error", id="yes")
                yield Button("No (n)", id="no")

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)

    def action_cancel(self) -> None:
        self.dismiss(False)


class EditMessage(_Dialog):
    """Edit a message's text; Ctrl+S (or F10) sends it into a new branch."""

    BINDINGS = [_CANCEL, Binding("ctrl+s,f10", "save", "Branch", id="dialog.save", priority=True)]

    def __init__(self, title: str, text: str) -> None:
        super().__init__()
        self._title, self._text = title, text

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label(self._title, classes="title")
            yield TextArea(self._text, id="text", soft_wrap=True)
            yield Static("Ctrl+S: branch with this text · Esc: cancel", classes="hint")

    def on_mount(self) -> None:
        self.query_one("#text", TextArea).focus()

    def action_save(self) -> None:
        text = self.query_one("#text", TextArea).text
        if text.strip():
            self.dismiss(text)
        else:
            self.notify("The message is empty", severity="warning")


SAMPLING_FIELDS: list[tuple[str, type, str]] = [
    ("temperature", float, "0 = greedy"),
    ("top_p", float, "1 = off"),
    ("top_k", int, "0 = off"),
    ("min_p", float, "0 = off"),
    ("repetition_penalty", float, "1 = off"),
    ("max_tokens", int, "per reply"),
    ("seed", int, "empty = random"),
]


def parse_sampling(raw: dict[str, str]) -> dict[str, Any]:
    """Sampling values typed by the user; an empty field is not set. ValueError says which
    field is wrong."""
    out: dict[str, Any] = {}
    for name, kind, _ in SAMPLING_FIELDS:
        text = (raw.get(name) or "").strip()
        if not text:
            continue
        try:
            value = kind(text)
        except ValueError:
            raise ValueError(f"{name}: {text!r} is not a{'n integer' if kind is int else ' number'}") from None
        if name in ("max_tokens",) and value <= 0:
            raise ValueError(f"{name} must be positive")
        if name in ("temperature", "top_k", "min_p") and value < 0:
            raise ValueError(f"{name} must not be negative")
        if name == "top_p" and not 0 < value <= 1:
            raise ValueError("top_p must be in (0, 1]")
        out[name] = value
    return out


class ConversationSettings(_Dialog):
    """A conversation's system prompt and sampling; dismisses with
    ``{"system_prompt": str | None, "sampling": dict}``."""

    BINDINGS = [_CANCEL, Binding("ctrl+s,f10", "save", "Save", id="dialog.save", priority=True)]
    DEFAULT_CSS = """
    ConversationSettings TextArea { height: 6; margin-bottom: 1; }
    ConversationSettings Grid { grid-size: 3; grid-columns: 22 16 1fr; grid-rows: 1; height: auto;
                                grid-gutter: 0 1; }
    ConversationSettings Grid Input { width: 16; height: 1; border: none; padding: 0 1; background: $boost; }
    ConversationSettings Grid Input:focus { background: $primary 30%; }
    """

    def __init__(self, system_prompt: str | None, sampling: dict[str, Any], defaults: dict[str, Any]) -> None:
        super().__init__()
        self._system, self._sampling, self._defaults = system_prompt or "", sampling, defaults

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label("System prompt and sampling of this conversation", classes="title")
            yield TextArea(self._system, id="system", soft_wrap=True)
            with Grid():
                for name, _, hint in SAMPLING_FIELDS:
                    value = self._sampling.get(name)
                    yield Label(name)
                    yield Input("" if value is None else str(value), id=f"s-{name}",
                                placeholder=str(self._defaults.get(name, "")))
                    yield Label(hint, classes="hint")
            yield Static("", id="error", classes="error")
            yield Static("Empty fields use the defaults · Ctrl+S: save · Esc: cancel", classes="hint")

    def on_mount(self) -> None:
        self.query_one("#system", TextArea).focus()

    def action_save(self) -> None:
        raw = {name: self.query_one(f"#s-{name}", Input).value for name, _, _ in SAMPLING_FIELDS}
        try:
            sampling = parse_sampling(raw)
        except ValueError as e:
            self.query_one("#error", Static).update(str(e))
            return
        text = self.query_one("#system", TextArea).text.strip()
        self.dismiss({"system_prompt": text or None, "sampling": sampling})

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.action_save()


class ModelPicker(_Dialog):
    """The demo model, the models used before, or a folder / GGUF file / hub id the user
    types."""

    def __init__(self, current: str, choices: list[tuple[str, str]]) -> None:
        super().__init__()
        self._current, self._choices = current, choices

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label(f"Model (now: {self._current})", classes="title")
            yield OptionList(*[Option(label, id=spec) for label, spec in self._choices], id="choices")
            yield Input(placeholder="or type a model folder, a .gguf file or a Hugging Face id, then Enter",
                        id="spec")
            yield Static("Enter: switch · Esc: cancel · the model loads in the background", classes="hint")

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        self.dismiss(event.option.id)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        if event.value.strip():
            self.dismiss(event.value.strip())
