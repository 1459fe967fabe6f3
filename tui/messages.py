"""Every custom Textual message of the TUI. Engine events reach the UI as these, posted
from engine or storage threads with ``post_message`` (thread-safe); screens share them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from textual.message import Message

if TYPE_CHECKING:
    from mlxkv.engine.api import ModelInfo


class EngineLoading(Message):
    """Model loading reached ``stage`` (``done`` of ``total`` stages)."""

    def __init__(self, stage: str, done: float, total: float) -> None:
        super().__init__()
        self.stage, self.done, self.total = stage, done, total


class EngineReady(Message):
    """The model is loaded; ``info`` is ``engine.info`` (model label, context, dtype...)."""

    def __init__(self, info: ModelInfo) -> None:
        super().__init__()
        self.info = info


class EngineFailed(Message):
    """The engine could not start (``message`` says why and what to do)."""

    def __init__(self, message: str) -> None:
        super().__init__()
        self.message = message


class EngineWarning(Message):
    """A warning the engine or cache gave on the ``mlxkv`` logger (once per condition)."""

    def __init__(self, message: str) -> None:
        super().__init__()
        self.message = message


class CacheChanged(Message):
    """The prefix cache changed (coalesced: ``kinds`` counts the cache events since the last)."""

    def __init__(self, kinds: dict[str, int]) -> None:
        super().__init__()
        self.kinds = kinds


class ReplyProgress(Message):
    """Prompt tokens processed (cached ones included) of reply ``rid``."""

    def __init__(self, rid: int, done: int, total: int) -> None:
        super().__init__()
        self.rid, self.done, self.total = rid, done, total


class ReplyTokens(Message):
    """New text for reply ``rid`` is waiting in its :class:`tui.bridge.ReplyStream`
    (drained by the handler: one message per burst, not per token)."""

    def __init__(self, rid: int) -> None:
        super().__init__()
        self.rid = rid


class ReplyStats(Message):
    def __init__(self, rid: int, stats: dict[str, Any]) -> None:
        super().__init__()
        self.rid, self.stats = rid, stats


class ReplyFinished(Message):
    """Reply ``rid`` ended: ``reason`` is stop/length/cancelled, or ``error`` is set."""

    def __init__(self, rid: int, reason: str, detail: str | None = None,
                 error: str | None = None, refused: bool = False) -> None:
        super().__init__()
        self.rid, self.reason, self.detail = rid, reason, detail
        self.error, self.refused = error, refused


class OpenConversation(Message):
    """Open the conversation whose engine session is ``session`` in the chat screen."""

    def __init__(self, session: str) -> None:
        super().__init__()
        self.session = session
