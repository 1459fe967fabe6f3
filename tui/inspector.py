"""The cache inspector: every state the prefix cache holds, in RAM and on SSD, live.

    app.push_screen(InspectorScreen(engine))

``engine`` offers the engine's cache views (``engine.api.CacheViews``: an engine, or the
app's bridge to it). Each call blocks (up to a timeout) while the engine thread serves
it, so the screen makes them only from thread workers and gets the answers back as
messages. Cache events set a dirty flag (from the engine's threads);
a 5 Hz timer turns a dirty flag into one refresh of the entry list, so a burst of
events costs one listing. The header figures (hit rate and its sparkline, bytes per
tier against their caps, dedup ratio, queue depths, last restore) come from
``engine.stats()`` once a second. The table and the block chain are virtualized
(:mod:`tui.widgets.entry_table`); the detail pane loads 150 ms after the cursor stops.
Opening an entry's conversation posts :class:`OpenConversation` for the app.

Entries are grouped by model, the loaded model's first (``G`` turns the grouping off
and on); the ``by model`` line gives each model's share of the RAM and SSD tiers. A
model is named by its label once the inspector has seen it loaded, in this run or (with
``names``: the conversation store) any run before; others by their namespace.

``m`` switches to the misses view (:mod:`tui.widgets.miss_table`): the last requests'
cache lookups from the same ``stats()`` answers, each with where its prompt parted from
the closest cached entry; ``m`` again goes back to the entries.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Literal, Protocol, TypeVar

from rich.markup import escape
from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.message import Message
from textual.screen import Screen
from textual.widgets import Footer, Input, Label, ProgressBar, Sparkline, Static

from mlxkv.engine.cache.info import CacheEntryDetail, CacheEntryInfo
from mlxkv.engine.cache.tokens import store_namespace
from mlxkv.tui.messages import CacheChanged, OpenConversation
from mlxkv.tui.widgets.cache_figures import Figures
from mlxkv.tui.widgets.entry_table import BlockTable, EntryTable, VirtualTable, age, human_bytes
from mlxkv.tui.widgets.message import short_model
from mlxkv.tui.widgets.miss_table import MissTable, describe
from mlxkv.tui.widgets.modals import Confirm

if TYPE_CHECKING:
    from textual.timer import Timer

    from mlxkv.engine.api import CacheViews, EngineStats, FlushReport, VerifyReport
    from mlxkv.engine.requests import EngineEvent

Severity = Literal["information", "warning", "error"]
T = TypeVar("T")


class ModelNames(Protocol):
    """Where models' names outlive the run (the conversation store)."""

    def namespace_names(self) -> dict[str, str]: ...

    def name_namespace(self, namespace: str, label: str) -> object: ...


CALL_TIMEOUT_S = 5.0  # listing and stats; a busy or loading engine is tried again later
ACTION_TIMEOUT_S = 120.0
VERIFY_TIMEOUT_S = 600.0
DETAIL_DEBOUNCE_S = 0.15
STATS_PERIOD_S = 1.0
PREVIEW_HEAD, PREVIEW_TAIL = 96, 256  # tokens decoded for the preview of a long entry


class _Refreshed(Message):
    def __init__(self, entries: list[CacheEntryInfo] | None, stats: EngineStats | None, error: str | None,
                 names: dict[str, str] | None = None) -> None:
        super().__init__()
        self.entries, self.stats, self.error = entries, stats, error
        self.names = names or {}


class _DetailLoaded(Message):
    def __init__(self, entry_id: str, detail: CacheEntryDetail | None, preview: str,
                 error: str | None) -> None:
        super().__init__()
        self.entry_id, self.detail, self.preview, self.error = entry_id, detail, preview, error


class _VerifyProgress(Message):
    def __init__(self, done: int, total: int) -> None:
        super().__init__()
        self.done, self.total = done, total


class _ActionDone(Message):
    def __init__(self, what: str, result: object, text: str, severity: Severity) -> None:
        super().__init__()
        self.what, self.result, self.text, self.severity = what, result, text, severity


def _summary(e: CacheEntryInfo, model: str) -> Text:
    text = Text()
    text.append(f"{e.kind}", style="bold")
    text.append(f"  {e.session or '(no conversation)'}\n")
    text.append(f"id {e.id}\nmodel {model}\n")
    text.append(f"{e.tokens} tokens in {e.blocks} blocks · {human_bytes(e.bytes)} "
                f"({human_bytes(e.unique_bytes)} unique, {human_bytes(e.shared_bytes)} shared)\n")
    kept = f"kept over others for {e.retained_s:.0f} s more" if e.retained_s > 0 else ""
    text.append(f"tier {e.tier} · {'pinned' if e.pinned else 'not pinned'} · {e.hits} hits · "
                f"used {age(e.last_used)} ago{' · ' + kept if kept else ''}\n")
    return text


class InspectorScreen(Screen):
    """The cache inspector (see the module docstring). ``live=False``: no refresh unless
    asked (``r``) or fed with :meth:`load_entries`."""

    CSS_PATH = "inspector.tcss"
    BINDINGS = [
        Binding("slash", "filter", "Filter", id="inspector.filter"),
        Binding("escape", "clear_filter", "Clear filter", show=False, id="inspector.clear_filter"),
        Binding("s", "sort(1)", "Sort", id="inspector.sort"),
        Binding("S", "sort(-1)", "Sort back", show=False, id="inspector.sort_back"),
        Binding("r", "reverse", "Reverse", id="inspector.reverse"),
        Binding("e", "evict", "Evict", id="inspector.evict"),
        Binding("d,delete", "delete", "Delete", id="inspector.delete"),
        Binding("p", "pin(True)", "Pin", id="inspector.pin"),
        Binding("u", "pin(False)", "Unpin", id="inspector.unpin"),
        Binding("v", "verify", "Verify", id="inspector.verify"),
        Binding("V", "verify_all", "Verify all", show=False, id="inspector.verify_all"),
        Binding("f", "flush", "Flush", id="inspector.flush"),
        Binding("g", "gc", "GC", id="inspector.gc"),
        Binding("o,enter", "open_conversation", "Open chat", id="inspector.open"),
        Binding("m", "toggle_misses", "Misses", show=False, id="inspector.misses"),
        Binding("G", "toggle_groups", "Group by model", show=False, id="inspector.groups"),
        Binding("ctrl+r", "refresh", "Refresh", show=False, id="inspector.refresh"),
    ]

    def __init__(self, engine: CacheViews, *, live: bool = True, names: ModelNames | None = None,
                 name: str | None = None,
                 id: str | None = None, classes: str | None = None) -> None:
        super().__init__(name=name, id=id, classes=classes)
        self.engine = engine
        self.live = live
        # where models' names outlive the run (``name_namespace`` / ``namespace_names``:
        # tui.conversations.ConversationStore); None: only the models seen loaded in this run
        self.names = names
        self._names_read = False
        self.figures = Figures()
        self.results: dict[str, object] = {}  # the last result of each action, by name
        self.detail: CacheEntryDetail | None = None
        self.verifying = False
        self._dirty = threading.Event()
        self._busy = False
        self._stats_at = 0.0
        self._unsubscribe: Callable[[], None] | None = None
        self._detail_timer: Timer | None = None

    # ------------------------------------------------------------------ layout
    def compose(self) -> ComposeResult:
        with Vertical(id="inspector-figures"):
            with Horizontal(classes="figure-row"):
                yield Label("", id="fig-hits")
                yield Sparkline([], id="fig-sparkline")
                yield Label("", id="fig-restore")
            yield Label("", id="fig-tiers")
            yield Label("", id="fig-models")
            yield Label("", id="fig-queues")
        with Horizontal(id="inspector-bar"):
            yield Input(placeholder="filter: id, model, kind, tier, session", id="filter")
            yield Label("", id="entry-count")
        yield EntryTable(id="entries")
        yield MissTable(id="misses")
        with Horizontal(id="verify-bar"):
            yield Label("verifying", id="verify-label")
            yield ProgressBar(total=None, show_eta=False, id="verify-progress")
        with Horizontal(id="detail"):
            with VerticalScroll(id="detail-text"):
                yield Static("", id="detail-summary")
                yield Static("", id="detail-preview")
            yield BlockTable(id="detail-blocks")
        yield Footer()

    @property
    def table(self) -> EntryTable:
        return self.query_one("#entries", EntryTable)

    @property
    def blocks(self) -> BlockTable:
        return self.query_one("#detail-blocks", BlockTable)

    @property
    def misses(self) -> MissTable:
        return self.query_one("#misses", MissTable)

    @property
    def showing_misses(self) -> bool:
        return self.has_class("-misses")

    def commands(self) -> list[tuple[str, str, Callable[[], object]]]:
        """(title, help, callback) of every inspector action, for the command palette."""
        return [
            ("Cache misses", "The last requests' cache lookups: what matched and where each "
             "prompt parted from the closest cached entry (m)", self.action_toggle_misses),
            ("Group by model", "Group the entries by model, the loaded one first, or not (G)",
             self.action_toggle_groups),
            ("Filter entries", "Show the entries whose text holds every word (/)", self.action_filter),
            ("Evict entry", "Drop the selected entry from RAM, keeping it on SSD (e)", self.action_evict),
            ("Delete entry", "Drop the selected entry from RAM and SSD, after asking (d)",
             self.action_delete),
            ("Pin entry", "Keep the selected entry over others in RAM (p)", lambda: self.action_pin(True)),
            ("Unpin entry", "Let the selected entry be evicted like others (u)",
             lambda: self.action_pin(False)),
            ("Verify entry", "Read the selected entry back from SSD and check it (v)", self.action_verify),
            ("Verify all entries", "Read every saved entry back and check it (V)", self.action_verify_all),
            ("Flush cache", "Write every state still in RAM only to SSD now (f)", self.action_flush),
            ("Collect SSD garbage", "Remove SSD files no entry uses, after asking (g)", self.action_gc),
            ("Open entry's chat", "Open the conversation of the selected entry (o)",
             self.action_open_conversation),
        ]

    def on_mount(self) -> None:
        self.table.focus()
        if self.live:
            self._unsubscribe = self.engine.subscribe(self._on_engine_event)
        if self.live:
            self._dirty.set()
        self.set_interval(0.2, self._tick)
        self._show_count()

    def on_unmount(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None

    # ------------------------------------------------------------------ live refresh
    def _on_engine_event(self, event: EngineEvent) -> None:
        """Engine or storage thread: note that the listing is stale."""
        from mlxkv.engine.requests import CacheEvent, LoadEvent

        if isinstance(event, (CacheEvent, LoadEvent)):
            data = (event.data if isinstance(event, CacheEvent) else None) or {}
            if isinstance(event, CacheEvent) and event.kind == "verify" and "total" in data:
                self.post_message(_VerifyProgress(int(data.get("done", 0)), int(data["total"])))
                return
            self._dirty.set()

    def on_cache_changed(self, message: CacheChanged) -> None:
        self._dirty.set()

    def _tick(self) -> None:
        if self._busy or self.engine is None or not self.is_current:
            return
        entries = self._dirty.is_set()
        now = time.monotonic()
        if not entries and (not self.live or now - self._stats_at < STATS_PERIOD_S):
            return
        self._dirty.clear()
        self._busy, self._stats_at = True, now
        self._refresh(entries)

    @work(thread=True, group="inspector-refresh", exit_on_error=False)
    def _refresh(self, entries: bool) -> None:
        listed = stats = error = None
        try:
            if entries:
                listed = self.engine.cache_entries(timeout=CALL_TIMEOUT_S)
            stats = self.engine.stats(timeout=CALL_TIMEOUT_S)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        names = self._remember_names(stats)
        self.post_message(_Refreshed(listed, stats, error, names))

    def _remember_names(self, stats: EngineStats | None) -> dict[str, str]:
        """(Worker thread.) The store namespace -> model label pairs to show: the loaded
        model's from ``stats`` (kept in ``names`` when it is new there) and, the first time,
        every one ``names`` remembers."""
        found: dict[str, str] = {}
        if self.names is not None and not self._names_read:
            self._names_read = True
            try:
                found.update({ns: short_model(label) for ns, label in self.names.namespace_names().items()})
            except Exception:  # a store that cannot be read names nothing; the table still works
                pass
        ns = stats.get("namespace") if stats is not None else None
        model = stats.get("model") if stats is not None else None
        label = model.get("model") if model else None
        if ns and label:
            try:
                store_ns = store_namespace(ns)
            except ValueError:
                return found
            found[store_ns] = short_model(str(label))
            if self.names is not None and self.table.model_names.get(store_ns) != found[store_ns]:
                try:
                    self.names.name_namespace(store_ns, str(label))
                except Exception:
                    pass
        return found

    @on(_Refreshed)
    def _refreshed(self, message: _Refreshed) -> None:
        self._busy = False
        for store_ns, label in message.names.items():
            self.table.set_model_name(store_ns, label)
        if message.stats is not None:
            self.table.set_current_model(self._store_ns(message.stats))
        if message.error is not None:
            self.query_one("#fig-hits", Label).update(Text(f"engine: {message.error}"))
            if message.entries is None:
                self._dirty.set()  # tried again at a later tick
        if message.entries is not None:
            self.load_entries(message.entries)
            if self.table.cursor_key is not None and not self.showing_misses:
                self._load_detail(self.table.cursor_key)
        if message.stats is not None:
            self._show_figures(message.stats)

    def load_entries(self, records: Iterable[CacheEntryInfo]) -> None:
        """Show ``records`` (what ``engine.cache_entries()`` answers), keeping the
        cursor on its entry, the sort and the filter."""
        self.table.set_rows(records)
        self._show_count()

    def _show_count(self) -> None:
        misses = self.showing_misses
        t = self.misses if misses else self.table
        arrow = "▼" if t.reverse else "▲"
        what = "requests" if misses else "entries"
        self.query_one("#entry-count", Label).update(
            f"{t.row_count} of {t.total_count} {what} · sort {t.sort_key} {arrow}")

    @staticmethod
    def _store_ns(stats: EngineStats) -> str | None:
        try:
            return store_namespace(stats["namespace"]) if stats.get("namespace") else None
        except ValueError:
            return None

    def _show_figures(self, stats: EngineStats) -> None:
        figs = self.figures.update(stats, self.table.model_label, self._store_ns(stats))
        for key, text in figs.items():
            self.query_one(f"#fig-{key}", Label).update(Text(text))
        self.query_one("#fig-sparkline", Sparkline).data = list(self.figures.history)
        self.misses.set_rows(stats.get("lookups") or [])
        if self.showing_misses:
            self._show_miss(self.misses.cursor_key)

    # ------------------------------------------------------------------ detail pane
    def on_virtual_table_cursor_moved(self, message: VirtualTable.CursorMoved) -> None:
        if message.table is self.misses:
            self._show_miss(message.key)
            return
        if message.table is not self.table:
            return
        if self._detail_timer is not None:
            self._detail_timer.stop()
        if message.key is None:
            self._show_detail(None, "")
            return
        self._detail_timer = self.set_timer(DETAIL_DEBOUNCE_S, self._detail_due)

    def _detail_due(self) -> None:
        self._detail_timer = None
        if self.table.cursor_key is not None and not self.showing_misses:
            self._load_detail(self.table.cursor_key)

    @work(thread=True, group="inspector-detail", exit_on_error=False)
    def _load_detail(self, entry_id: str) -> None:
        if self.engine is None:
            return
        detail, preview, error = None, "", None
        try:
            detail = self.engine.cache_entry(entry_id, timeout=CALL_TIMEOUT_S)
            if detail is not None:
                ids = detail.token_ids
                if len(ids) <= PREVIEW_HEAD + PREVIEW_TAIL:
                    preview = self.engine.decode(ids, timeout=CALL_TIMEOUT_S)
                else:
                    head = self.engine.decode(ids[:PREVIEW_HEAD], timeout=CALL_TIMEOUT_S)
                    tail = self.engine.decode(ids[-PREVIEW_TAIL:], timeout=CALL_TIMEOUT_S)
                    skipped = len(ids) - PREVIEW_HEAD - PREVIEW_TAIL
                    preview = f"{head}\n… ({skipped} tokens) …\n{tail}"
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        self.post_message(_DetailLoaded(entry_id, detail, preview, error))

    @on(_DetailLoaded)
    def _detail_loaded(self, message: _DetailLoaded) -> None:
        if message.entry_id != self.table.cursor_key or self.showing_misses:
            return  # the cursor moved on meanwhile, or the misses view is shown
        if message.error is not None:
            self.query_one("#detail-summary", Static).update(Text(f"engine: {message.error}"))
            return
        self._show_detail(message.detail, message.preview)

    def _show_detail(self, detail: CacheEntryDetail | None, preview: str) -> None:
        self.detail = detail
        summary = Text("no entry selected") if detail is None else _summary(
            detail.info, self.table.model_label(detail.info.ns))
        self.query_one("#detail-summary", Static).update(summary)
        self.query_one("#detail-preview", Static).update(Text(preview, style="italic"))
        self.blocks.set_blocks([] if detail is None else detail.blocks)

    # ------------------------------------------------------------------ misses view
    def action_toggle_misses(self) -> None:
        """Switch between the entries and the misses view (the last requests' lookups)."""
        self.toggle_class("-misses")
        if self.showing_misses:
            self.misses.focus()
            self._show_miss(self.misses.cursor_key)
        else:
            self.table.focus()
            self._show_detail(None, "")
            if self.table.cursor_key is not None:
                self._load_detail(self.table.cursor_key)
        self._show_count()

    def _show_miss(self, key: str | None) -> None:
        if not self.showing_misses:
            return
        row = None if key is None else self.misses.row(key)
        self.detail = None
        self.query_one("#detail-summary", Static).update(
            Text("no request yet") if row is None else describe(row))
        self.query_one("#detail-preview", Static).update("")
        self.blocks.set_blocks([])

    def action_toggle_groups(self) -> None:
        """Group the entries by model (the loaded one first), or not."""
        self.table.set_grouped(not self.table.grouped)
        self.notify("Entries grouped by model." if self.table.grouped else "Entries not grouped.")

    # ------------------------------------------------------------------ actions
    def _selected(self) -> CacheEntryInfo | None:
        if self.showing_misses:
            self.notify("This acts on entries: press m for the entry list.", severity="warning")
            return None
        e = self.table.selected
        if e is None:
            self.notify("No entry selected.", severity="warning")
        return e

    def _confirm(self, question: str, then: Callable[[], object]) -> None:
        def answered(yes: bool | None) -> None:
            if yes:
                then()
        self.app.push_screen(Confirm(escape(question)), answered)

    @staticmethod
    def _describe_entry(e: CacheEntryInfo) -> str:
        return f"{e.kind} {e.session or e.id[:12]} ({e.tokens} tokens)"

    @work(thread=True, group="inspector-action", exit_on_error=False)
    def _act(self, what: str, call: Callable[[], T],
             describe: Callable[[T], tuple[str, Severity]]) -> None:
        result: T | None = None
        try:
            result = call()
            text, severity = describe(result)
        except Exception as exc:
            result, text, severity = None, f"{what} failed: {type(exc).__name__}: {exc}", "error"
        self.post_message(_ActionDone(what, result, text, severity))

    @on(_VerifyProgress)
    def _verify_progress(self, message: _VerifyProgress) -> None:
        """An engine that reports verify progress (CacheEvent "verify" with done and
        total) gets a real bar instead of the indeterminate one."""
        if self.verifying:
            self.query_one("#verify-progress", ProgressBar).update(total=message.total,
                                                                   progress=message.done)

    @on(_ActionDone)
    def _action_done(self, message: _ActionDone) -> None:
        self.results[message.what] = message.result
        if message.what == "verify":
            self.verifying = False
            self.remove_class("-verifying")
        self.notify(message.text, title=f"cache {message.what}", severity=message.severity)
        self._dirty.set()

    def action_evict(self) -> None:
        e = self._selected()
        if e is None:
            return
        if e.tier == "ssd":
            self.notify(f"{self._describe_entry(e)} is only on SSD: nothing to evict from RAM.")
            return

        def run() -> None:
            self._act("evict", lambda: self.engine.cache_evict(e.id, timeout=ACTION_TIMEOUT_S),
                      lambda ok: (f"Evicted {self._describe_entry(e)} from RAM.", "information") if ok
                      else ("It was no longer in RAM.", "warning"))
        if e.tier == "ram":
            self._confirm(f"{self._describe_entry(e)} is only in RAM (not on SSD): evicting it drops it "
                          "for good. Evict it?", run)
        else:
            run()

    def action_delete(self) -> None:
        e = self._selected()
        if e is None:
            return
        self._confirm(f"Delete {self._describe_entry(e)} from RAM and SSD? Blocks other entries "
                      "share stay.", lambda: self._act(
                          "delete", lambda: self.engine.cache_delete(e.id, timeout=ACTION_TIMEOUT_S),
                          lambda ok: (f"Deleted {self._describe_entry(e)}.", "information") if ok
                          else ("It was already gone.", "warning")))

    def action_pin(self, pin: bool) -> None:
        # Explicit: an entry shows as pinned also while it is its session's latest state,
        # so a toggle on ``e.pinned`` would guess wrong.
        e = self._selected()
        if e is None:
            return
        self._act("pin", lambda: self.engine.cache_pin(e.id, pin, timeout=ACTION_TIMEOUT_S),
                  lambda ok: (f"{'Pinned' if pin else 'Unpinned'} {self._describe_entry(e)}.", "information")
                  if ok else ("It is no longer cached.", "warning"))

    def action_verify(self) -> None:
        e = self._selected()
        if e is not None:
            self._verify(e.id, self._describe_entry(e))

    def action_verify_all(self) -> None:
        self._verify(None, "every saved entry")

    def _verify(self, entry_id: str | None, label: str) -> None:
        if self.verifying:
            self.notify("A verify is already running.", severity="warning")
            return
        self.verifying = True
        self.query_one("#verify-label", Label).update(f"verifying {label}")
        self.query_one("#verify-progress", ProgressBar).update(total=None, progress=0)
        self.add_class("-verifying")

        def describe(r: VerifyReport) -> tuple[str, Severity]:
            if not r.get("checked") and not r.get("manifests_damaged"):
                return "Nothing on SSD to verify.", "warning"
            bad = len(r.get("damaged", [])) + r.get("manifests_damaged", 0)
            text = f"Checked {r['checked']} saved states: {r.get('ok', 0)} intact"
            if bad:
                return f"{text}, {bad} damaged (they will be read as misses).", "error"
            return text + ".", "information"
        self._act("verify", lambda: self.engine.cache_verify(entry_id, timeout=VERIFY_TIMEOUT_S),
                  describe)

    def action_flush(self) -> None:
        def describe(r: FlushReport) -> tuple[str, Severity]:
            text = (f"Flushed {r.get('flushed', 0)} writes: {r.get('durable', 0)} durable, "
                    f"{r.get('pending', 0)} pending, {r.get('failed', 0)} failed.")
            return text, "error" if r.get("failed") else "information"
        self._act("flush", lambda: self.engine.cache_flush(timeout=ACTION_TIMEOUT_S), describe)

    def action_gc(self) -> None:
        self._confirm("Remove the SSD tier's blocks and files that no saved entry uses?",
                      lambda: self._act("gc", lambda: self.engine.cache_gc(timeout=ACTION_TIMEOUT_S), lambda r: (
                          f"GC removed {r.get('removed', 0)} files "
                          f"({human_bytes(r.get('bytes', 0))}).", "information")))

    def action_open_conversation(self) -> None:
        e = self._selected()
        if e is None:
            return
        if not e.session:
            self.notify(f"{self._describe_entry(e)} belongs to no conversation.", severity="warning")
            return
        self.post_message(OpenConversation(e.session))

    def action_filter(self) -> None:
        self.add_class("-filtering")
        self.query_one("#filter", Input).focus()

    def action_clear_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.value = ""
        self.table.set_filter("")
        self.remove_class("-filtering")
        self.table.focus()
        self._show_count()

    def on_input_changed(self, event: Input.Changed) -> None:
        if event.input.id == "filter":
            self.table.set_filter(event.value)
            self._show_count()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if event.input.id == "filter":
            self.table.focus()

    def action_sort(self, step: int) -> None:
        (self.misses if self.showing_misses else self.table).cycle_sort(step)
        self._show_count()

    def action_reverse(self) -> None:
        (self.misses if self.showing_misses else self.table).toggle_reverse()
        self._show_count()

    def action_refresh(self) -> None:
        self._dirty.set()
