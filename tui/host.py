"""What the chat screen uses of the app that hosts it (:class:`ChatHost`), and the app's
:class:`Metrics`: kept apart from ``tui.app`` so the screen can name them without importing
the app."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    from textual.widget import Widget

    from mlxkv.tui.conversations import ConversationStore

T = TypeVar("T")


class Metrics:
    """Timestamps (``time.perf_counter``) for benchmarks and tests: ``started`` (app
    constructed, or the process start given), ``interactive_at`` (first screen painted and
    taking keys; ``interactive`` is set then), ``model_ready_at``, and ``token_lag_s``:
    for each burst of reply text, engine produced -> screen refreshed with it."""

    def __init__(self, started: float | None = None) -> None:
        self.started = time.perf_counter() if started is None else started
        self.interactive_at: float | None = None
        self.interactive = threading.Event()
        self.model_ready_at: float | None = None
        self.model_ready = threading.Event()
        self.token_lag_s: collections.deque[float] = collections.deque(maxlen=100_000)
        self.replies = 0  # replies ended (finished, stopped or failed)
        self.prefill_updates = 0  # prefill chunks shown on the progress bar
        self.prefetched: list[tuple[int, int | None]] = []  # (conversation, tokens warmed) on opening
        self.load_stages: list[str] = []  # model loading stages shown on the progress bar
        self.last_stats: dict[str, Any] | None = None

    def token_shown(self, produced: float, widget: Widget) -> None:
        widget.call_after_refresh(lambda: self.token_lag_s.append(time.perf_counter() - produced))

    def reply_done(self, stats: dict[str, Any]) -> None:
        self.replies += 1
        self.last_stats = stats


class ChatHost(Protocol):
    """The app, as the chat screen uses it: the conversation store, called on the app's one
    store thread (:meth:`db`, in submission order), thread workers for blocking engine calls
    (:meth:`background`) and the metrics."""

    @property
    def store(self) -> ConversationStore: ...

    @property
    def metrics(self) -> Metrics: ...

    async def db(self, fn: Callable[..., T], *args: Any) -> T: ...

    def background(self, fn: Callable[[], object], what: str, quiet: bool = ...) -> None: ...
