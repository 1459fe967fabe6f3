"""The mlxkv Textual app: ``run(settings)`` is what bare ``mlxkv`` and ``make run`` open.

The first screen takes keys at once: the engine (and mlx with it) is imported, built and
loaded on a background thread by :class:`tui.bridge.EngineBridge`, with a progress bar; a
message sent meanwhile is answered once the model is ready. The conversation store is
called on one store thread (:meth:`MlxkvApp.db`), engine calls in thread workers
(:meth:`MlxkvApp.background`); nothing blocks the UI. Failures become notifications that
say what to do, never a traceback: a model that does not load, an unusable conversations
file (moved aside, or kept in a temporary folder), engine and cache warnings from the
``mlxkv`` loggers.

Keys are bindings with ids (F1 lists them; ``keys.toml`` next to the config file remaps
them); every action is in the command palette (Ctrl+P); Textual's themes are kept across
runs. F2 opens the cache inspector (:mod:`tui.inspector`, imported when first opened).

For tests and ``bench/tui.py``: ``MlxkvApp(settings)`` works with ``run_test()``;
``app.metrics`` records start-to-interactive and token-to-screen times.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.screen import Screen

from mlxkv.tui.bridge import EngineBridge
from mlxkv.tui.host import Metrics
from mlxkv.tui.messages import (
    CacheChanged,
    EngineFailed,
    EngineLoading,
    EngineReady,
    EngineWarning,
    OpenConversation,
)

if TYPE_CHECKING:
    from textual.notifications import SeverityLevel

    from mlxkv.engine.settings import Settings
    from mlxkv.tui.chat import ChatScreen
    from mlxkv.tui.conversations import ConversationStore

T = TypeVar("T")

log = logging.getLogger("mlxkv.tui")
CACHE_REFRESH_S = 0.15  # cache events are drained (and screens told) at most this often


def _config_dir() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "mlxkv"


def local_models(model_dirs: Sequence[str] = (), env: Mapping[str, str] | None = None) -> list[tuple[str, str]]:
    """(label, name) of the models on this machine that load: the Hugging Face cache's,
    Ollama's, LM Studio's and ``model_dirs``' (``engine.model_stores``), each labelled with
    its store, size, architecture and quantization; at most 50."""
    from mlxkv.engine.model_stores import find_models
    from mlxkv.tui.widgets.entry_table import human_bytes

    out = []
    for m in find_models(model_dirs, env):
        if m.loadable:
            facts = ", ".join(x for x in (m.store, human_bytes(m.size_bytes), m.architecture, m.quantization) if x)
            out.append((f"{m.name}  ({facts})", m.name))
    return out[:50]


def open_store(path: str | os.PathLike | None) -> tuple[ConversationStore, str | None]:
    """The conversation store, and a notice when it is not the usual one: an unreadable
    file is moved aside (nothing deleted); an unusable folder gives a temporary store."""
    from mlxkv.tui.conversations import ConversationStore, StoreError, move_aside

    try:
        return ConversationStore(path), None
    except StoreError as e:
        if e.unreadable and e.path is not None:
            try:
                moved = move_aside(e.path)
                return ConversationStore(path), f"{e}\nIt was moved to {moved}; a new one was started."
            except (OSError, StoreError):
                pass
        first = str(e)
    except OSError as e:
        first = f"{e.strerror or e}: {e.filename}"
    folder = tempfile.mkdtemp(prefix="mlxkv-conversations-")
    return ConversationStore(Path(folder) / "conversations.db"), (
        f"{first}\nConversations are kept in {folder} for this run only: fix the folder, "
        "or set MLXKV_DATA_DIR to a folder you can write.")


class MlxkvApp(App):
    TITLE = "mlxkv"
    # chat.tcss too: Textual (8.2) loads a screen's CSS_PATH when the screen is pushed, not
    # for the screen get_default_screen returns.
    CSS_PATH = ["app.tcss", "chat.tcss"]
    BINDINGS = [
        Binding("ctrl+q", "quit", "Quit", id="app.quit", priority=True),
        Binding("f1", "help", "Keys", id="app.help"),
        Binding("question_mark", "help", "Keys", show=False, id="app.help_key"),
        Binding("f2", "toggle_inspector", "Cache", id="app.inspector"),
        Binding("f3,ctrl+o", "switch_model", "Model", id="app.model"),
        Binding("f4", "change_theme", "Theme", show=False, id="app.theme"),
    ]

    def __init__(self, settings: Settings, *, store_path: str | os.PathLike | None = None,
                 started: float | None = None) -> None:
        self.metrics = Metrics(started)
        self._warnings: list[str] = []
        self.settings = settings
        self.bridge = EngineBridge(settings, self.post_message)
        self._db_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mlxkv-tui-store")
        self.store, self._store_notice = open_store(store_path)
        self._prefs_path = Path(self.store.path).parent / "tui.json"
        super().__init__()
        self._load_prefs()

    # screens ----------------------------------------------------------------------------
    def get_default_screen(self) -> Screen:
        from mlxkv.tui.chat import ChatScreen

        self.chat: ChatScreen = ChatScreen(self.bridge, self.settings, self)
        return self.chat

    async def on_mount(self) -> None:
        self.set_interval(CACHE_REFRESH_S, self._drain_cache_events)
        self._apply_keymap()
        if self._store_notice:
            self.notify(self._store_notice, title="Conversations file", severity="warning", timeout=15)
        self.call_after_refresh(self._mark_interactive)

    def _mark_interactive(self) -> None:
        self.metrics.interactive_at = time.perf_counter()
        self.metrics.interactive.set()
        self.bridge.start()  # after the first paint: the screen is up before mlx is imported

    async def on_unmount(self) -> None:
        try:
            await self.chat.save_pending()
        except Exception:  # closing must not fail on it
            log.debug("saving the reply being written failed", exc_info=True)
        await asyncio.to_thread(self.close_engine)

    def close_engine(self) -> None:
        """Stop the engine (flushing its cache) and close the store; idempotent."""
        self.bridge.shutdown()
        self._db_thread.shutdown(wait=True)
        self.store.close()

    def notify(self, message: str, *, title: str = "", severity: SeverityLevel = "information",
               timeout: float | None = None, markup: bool = True) -> None:
        """Notifications are plain text: they carry titles, paths and error messages, whose
        brackets must show as typed (as markup they could fail to render) and whose control
        characters must not reach the terminal."""
        from mlxkv.tui.widgets.message import printable

        super().notify(printable(message), title=printable(title), severity=severity, timeout=timeout,
                       markup=False)

    # threads ----------------------------------------------------------------------------
    async def db(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a store call on the store thread (in submission order) and await it."""
        return await asyncio.wrap_future(self._db_thread.submit(fn, *args))

    def background(self, fn: Callable[[], object], what: str, quiet: bool = False) -> None:
        """Run a blocking engine call in a thread worker; a failure is a notification (or,
        ``quiet``, only logged: e.g. warming a cache that is not there)."""
        def work() -> None:
            try:
                fn()
            except Exception as e:
                log.debug("%s failed", what, exc_info=True)
                if not quiet:
                    self.call_from_thread(self.notify, f"Could not {what}: {e}", severity="error")
        self.run_worker(work, thread=True, group="engine", exit_on_error=False)

    # engine messages --------------------------------------------------------------------
    def on_engine_loading(self, message: EngineLoading) -> None:
        self.metrics.load_stages.append(message.stage)
        self.chat.show_progress(message.done, message.total)
        self.chat.show_model_state(f"loading: {message.stage}…")

    def on_engine_ready(self, message: EngineReady) -> None:
        self.metrics.model_ready_at = time.perf_counter()
        self.metrics.model_ready.set()
        self.chat.show_progress(None)
        self.chat.show_model_state()
        self.background(self._check_cache, "read the cache's state", quiet=True)
        conversation = self.chat.conversation
        if conversation is not None:  # after a model switch: the new engine has no sessions
            from mlxkv.tui.chat import session_for

            self.background(lambda: self.bridge.open_session(session_for(conversation.id)),
                            "open the conversation's cache session", quiet=True)

    def on_engine_failed(self, message: EngineFailed) -> None:
        self.metrics.model_ready.set()
        self.chat.show_progress(None)
        self.chat.show_model_state()
        self.notify(f"{message.message}\nPress F3 to choose another model (the demo model works offline).",
                    title="The model could not be loaded", severity="error", timeout=30)

    def on_engine_warning(self, message: EngineWarning) -> None:
        self._warnings.append(message.message)
        self.notify(message.message, title="mlxkv", severity="warning", timeout=12)

    def _check_cache(self) -> None:
        """Tell the user when the cache runs without its SSD tier: the warning is logged once
        per process, and may have been logged before this app listened."""
        stats = self.bridge.stats()
        reason = (stats.get("cache") or {}).get("ssd_disabled_reason")
        if reason and not any(reason in w for w in self._warnings):
            self.call_from_thread(self.post_message, EngineWarning(
                f"prefix cache: running without the SSD tier (RAM only): {reason}"))

    def _drain_cache_events(self) -> None:
        kinds = self.bridge.take_cache_changes()
        if kinds:
            for screen in self.screen_stack:
                screen.post_message(CacheChanged(kinds))

    async def on_open_conversation(self, message: OpenConversation) -> None:
        from mlxkv.tui.chat import conversation_for

        cid = conversation_for(message.session)
        if cid is None:
            self.notify("That cache entry is not from a saved conversation", severity="warning")
            return
        while self.screen is not self.chat and len(self.screen_stack) > 1:
            self.pop_screen()
        await self.chat.open_conversation(cid)

    # actions ----------------------------------------------------------------------------
    def action_toggle_inspector(self) -> None:
        if type(self.screen).__name__ == "InspectorScreen":
            self.pop_screen()
            return
        try:
            from mlxkv.tui.inspector import InspectorScreen
        except ImportError as e:
            self.notify(f"The cache inspector is not available: {e}", severity="warning")
            return
        self.push_screen(InspectorScreen(self.bridge, names=self.store))

    def action_switch_model(self) -> None:
        from mlxkv.engine.settings import DEMO_MODEL
        from mlxkv.tui.widgets.modals import ModelPicker

        choices = [("Demo model (built in, offline)", str(DEMO_MODEL))]
        if str(self.settings.model) != str(DEMO_MODEL):
            choices.append((f"From the settings: {self.settings.model}", str(self.settings.model)))
        found = local_models(self.settings.model_dirs or ())
        for label, spec in [*((r, r) for r in self._prefs.get("recent_models", [])), *found]:
            if spec not in [c[1] for c in choices]:
                choices.append((label, spec))
        from mlxkv.tui.chat import model_label

        self.push_screen(ModelPicker(self.bridge.info.get("model") or model_label(self.bridge.model_spec),
                                     choices), self.switch_model)

    def switch_model(self, spec: str | None) -> None:
        """Shut the engine down and load ``spec`` (a folder, a GGUF file or a hub id) in the
        background."""
        if not spec:
            return
        if not self.bridge.ready.is_set():  # a second load would leave the first one running
            self.notify("The model is still loading: switch when it is ready.", severity="warning")
            return
        if self.chat.pending is not None:
            self.chat.pending.stream.cancel()
        self.bridge.start(spec)
        self.chat.show_model_state("loading…")
        self.chat.show_progress(0, 3)
        recent = [s for s in self._prefs.get("recent_models", []) if s != spec]
        self._prefs["recent_models"] = [spec, *recent][:8]
        self._save_prefs()

    def action_help(self) -> None:
        from mlxkv.tui.chat import ChatScreen
        from mlxkv.tui.widgets.help import HelpScreen, binding_rows
        from mlxkv.tui.widgets.message import MessageView
        from mlxkv.tui.widgets.prompt import PromptArea
        from mlxkv.tui.widgets.sidebar import ConversationList

        if type(self.screen).__name__ == "HelpScreen":
            self.pop_screen()
            return
        classes: list[tuple[str, Any]] = [("everywhere", type(self)), ("chat", ChatScreen),
                                          ("message box", PromptArea), ("a message", MessageView),
                                          ("sidebar", ConversationList)]
        if type(self.screen).__name__ == "InspectorScreen":
            classes.insert(1, ("inspector", type(self.screen)))
        self.push_screen(HelpScreen(binding_rows(classes), str(_config_dir() / "keys.toml")))

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        yield SystemCommand("Switch model", "Load another model: the demo model, a folder, a .gguf file, a hub id (F3)",
                            self.action_switch_model)
        yield SystemCommand("Cache inspector", "What the prefix cache holds, live (F2)",
                            self.action_toggle_inspector)
        yield SystemCommand("Help: keys", "Every key and its binding id (F1)", self.action_help)
        for title, help_text, callback in self.chat.commands():
            yield SystemCommand(title, help_text, callback)
        if type(screen).__name__ == "InspectorScreen":  # its actions, while it is open
            from mlxkv.tui.inspector import InspectorScreen

            if isinstance(screen, InspectorScreen):
                for title, help_text, callback in screen.commands():
                    yield SystemCommand(title, help_text, callback)

    # keymap and preferences -------------------------------------------------------------
    def _apply_keymap(self) -> None:
        path = _config_dir() / "keys.toml"
        if not path.exists():
            return
        try:
            import tomllib
        except ModuleNotFoundError:  # Python 3.10
            import tomli as tomllib

        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
            keymap = {str(k): str(v) for k, v in data.get("keys", data).items()}
            self.set_keymap(keymap)
        except (OSError, ValueError, AttributeError) as e:
            self.notify(f"{path}: {e}\nThe default keys are used.", title="Key map not used",
                        severity="warning", timeout=12)

    def _load_prefs(self) -> None:
        try:
            self._prefs: dict[str, Any] = json.loads(self._prefs_path.read_text(encoding="utf-8"))
            if not isinstance(self._prefs, dict):
                self._prefs = {}
        except (OSError, ValueError):
            self._prefs = {}
        theme = self._prefs.get("theme")
        if isinstance(theme, str) and theme in self.available_themes:
            self.theme = theme

    def _save_prefs(self) -> None:
        try:
            tmp = self._prefs_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self._prefs), encoding="utf-8")
            os.replace(tmp, self._prefs_path)
        except OSError:
            log.debug("could not save %s", self._prefs_path, exc_info=True)

    def watch_theme(self, theme: str) -> None:
        if getattr(self, "_prefs", None) is not None and self._prefs.get("theme") != theme:
            self._prefs["theme"] = theme
            self._save_prefs()


HANGUP_POLL_S = 1.0
HANGUP_GRACE_S = 15.0


def _watch_terminal(app: MlxkvApp, fd: int, done: threading.Event) -> None:
    """Leave when the terminal goes away. A closed terminal window sends SIGHUP only to
    its session leader: under a wrapper that survives it (``make run``) or with SIGHUP
    ignored, nothing tells the app, and Textual's input thread spins on the dead tty (and
    the app no longer answers SIGTERM). ``tcgetattr`` fails with EIO once the terminal is
    hung up: then exit as on quit (the engine flushes its cache), and if the app cannot
    get there in time, stop the engine from here and leave with 129 (128 + SIGHUP)."""
    import termios

    while not done.wait(HANGUP_POLL_S):
        try:
            termios.tcgetattr(fd)
        except (termios.error, OSError):
            break
    else:
        return
    log.warning("the terminal went away; closing")
    try:
        app.call_from_thread(app.exit, 129)
    except Exception:  # the app already stopped, or its loop is gone
        pass
    if not done.wait(HANGUP_GRACE_S):
        try:
            app.close_engine()
        finally:
            os._exit(129)


def run(settings: Settings) -> int:
    """Open the TUI on ``settings`` (bare ``mlxkv`` on a terminal); returns the exit status."""
    app = MlxkvApp(settings)
    done = threading.Event()
    threading.Thread(target=_watch_terminal, args=(app, sys.stdin.fileno(), done),
                     name="mlxkv-hangup", daemon=True).start()
    try:
        app.run()
    finally:
        done.set()
        app.close_engine()
    return int(app.return_code or 0)
