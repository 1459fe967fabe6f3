"""Virtualized tables of the cache inspector: :class:`EntryTable` (one row per cached
state) and :class:`BlockTable` (the block chain of one state).

Both are Line-API :class:`~textual.scroll_view.ScrollView` s: they keep their rows in a
dict and a sorted, filtered list of row keys, and render only the lines on screen, so
10,000 rows cost what 40 do once sorted. The cursor follows a row *key*, not a
position: a live refresh that reorders the rows keeps the same row selected. The first
line is a fixed header (click a label to sort by it).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

from rich.cells import cell_len, set_cell_size
from rich.segment import Segment
from rich.style import Style
from textual import events
from textual.binding import Binding
from textual.geometry import Size
from textual.message import Message
from textual.scroll_view import ScrollView
from textual.strip import Strip

from mlxkv.engine.cache.info import (
    SCOPE_MARK,
    BlockInfo,
    CacheEntryInfo,
    draft_base,
    model_namespace,
    scope_base,
)

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def human_bytes(n: float | None) -> str:
    """``1536`` -> ``"1.5 KiB"``; None -> ``"–"``."""
    if n is None:
        return "–"
    value, unit = float(n), 0
    while abs(value) >= 1024 and unit < len(_UNITS) - 1:
        value, unit = value / 1024, unit + 1
    return f"{int(value)} B" if unit == 0 else f"{value:.1f} {_UNITS[unit]}"


def age(when: float | None, now: float | None = None) -> str:
    """How long ago ``when`` (unix time) was: ``"12s"``, ``"5m"``, ``"3h"``, ``"2d"``."""
    if not when:
        return "–"
    s = max(0.0, (time.time() if now is None else now) - when)
    for size, unit in ((86400, "d"), (3600, "h"), (60, "m")):
        if s >= size:
            return f"{int(s // size)}{unit}"
    return f"{int(s)}s"


def fit(text: str, width: int, right: bool = False) -> str:
    """``text`` cut (with an ellipsis) or padded to ``width`` cells."""
    if cell_len(text) > width:
        return set_cell_size(text, width - 1) + "…" if width > 1 else set_cell_size(text, width)
    pad = " " * (width - cell_len(text))
    return pad + text if right else text + pad


@dataclass(frozen=True)
class Column:
    """One column: ``key`` names it for sorting, ``text`` formats a row, ``sort`` gives
    a row's sort value; numbers sort largest first when the column is picked."""

    key: str
    label: str
    width: int
    text: Callable[[Any], str]
    sort: Callable[[Any], Any]
    right: bool = False
    descending: bool = False


class VirtualTable(ScrollView, can_focus=True):
    """A sortable, filterable table of many rows, rendered line by line."""

    COMPONENT_CLASSES = {"virtual-table--header", "virtual-table--cursor",
                         "virtual-table--marked"}
    DEFAULT_CSS = """
    VirtualTable { background: $surface; }
    VirtualTable > .virtual-table--header { text-style: bold; background: $panel; }
    VirtualTable > .virtual-table--cursor { background: $accent 40%; }
    VirtualTable:focus > .virtual-table--cursor { background: $accent; color: $text; }
    VirtualTable > .virtual-table--marked { text-style: bold; }
    """
    BINDINGS = [
        Binding("up,k", "cursor(-1)", "Up", show=False, id="table.up"),
        Binding("down,j", "cursor(1)", "Down", show=False, id="table.down"),
        Binding("pageup", "page(-1)", "Page up", show=False, id="table.page_up"),
        Binding("pagedown", "page(1)", "Page down", show=False, id="table.page_down"),
        Binding("home", "edge(0)", "First", show=False, id="table.first"),
        Binding("end", "edge(1)", "Last", show=False, id="table.last"),
    ]

    class CursorMoved(Message):
        """The cursor is on another row (``key`` None: the table is empty)."""

        def __init__(self, table: VirtualTable, key: str | None) -> None:
            super().__init__()
            self.table, self.key = table, key

        @property
        def control(self) -> VirtualTable:
            return self.table

    columns: Sequence[Column] = ()
    default_sort: str | None = None
    default_reverse = False
    grouped = False  # rows kept together by ``group`` (ascending), sorted within a group

    def __init__(self, *, name: str | None = None, id: str | None = None,
                 classes: str | None = None) -> None:
        super().__init__(name=name, id=id, classes=classes)
        self._rows: dict[str, Any] = {}
        self._view: list[str] = []
        self._cursor_key: str | None = None
        self._cursor_row = 0
        self._sort_key = self.default_sort
        self._reverse = self.default_reverse
        self._terms: tuple[str, ...] = ()
        self._hay: dict[str, str] | None = None  # haystacks of the rows, built on first filter
        self._width = 1 + sum(c.width + 1 for c in self.columns)
        self.virtual_size = Size(self._width, 1)

    # ------------------------------------------------------------------ row model
    def row_key(self, row: Any) -> str:
        raise NotImplementedError

    def haystack(self, row: Any) -> str:
        """What the filter searches in (lower case)."""
        return " ".join(c.text(row) for c in self.columns).lower()

    def marked(self, row: Any) -> bool:
        return False

    def cell(self, column: Column, row: Any) -> str:
        return column.text(row)

    def group(self, row: Any) -> Any:
        """The group of ``row`` when :attr:`grouped` (groups in ascending order)."""
        return 0

    def set_grouped(self, grouped: bool) -> None:
        if grouped != self.grouped:
            self.grouped = grouped
            self._rebuild()

    @property
    def row_count(self) -> int:
        return len(self._view)

    @property
    def total_count(self) -> int:
        """Rows held, shown or filtered out."""
        return len(self._rows)

    @property
    def keys(self) -> list[str]:
        """The row keys shown, in order."""
        return list(self._view)

    @property
    def cursor_key(self) -> str | None:
        return self._cursor_key

    @property
    def selected(self) -> Any:
        return None if self._cursor_key is None else self._rows.get(self._cursor_key)

    @property
    def sort_key(self) -> str | None:
        return self._sort_key

    @property
    def reverse(self) -> bool:
        return self._reverse

    def row(self, key: str) -> Any:
        return self._rows.get(key)

    def set_rows(self, rows: Iterable[Any]) -> None:
        """Replace every row; the cursor stays on its row if that is still shown."""
        self._rows = {self.row_key(r): r for r in rows}
        self._hay = None
        self._rebuild()

    def set_filter(self, text: str) -> None:
        """Show the rows whose text holds every word of ``text`` (any case)."""
        terms = tuple(text.lower().split())
        if terms != self._terms:
            self._terms = terms
            self._rebuild()

    def sort_by(self, key: str, reverse: bool | None = None) -> None:
        """Sort by column ``key``; ``reverse`` None: the column's natural order, or the
        other way round when it is already the sort column."""
        col = self._column(key)
        if reverse is None:
            reverse = (not self._reverse) if key == self._sort_key else col.descending
        self._sort_key, self._reverse = key, reverse
        self._rebuild()

    def cycle_sort(self, step: int = 1) -> None:
        keys = [c.key for c in self.columns]
        i = keys.index(self._sort_key) if self._sort_key in keys else -1
        key = keys[(i + step) % len(keys)]
        self.sort_by(key, reverse=self._column(key).descending)

    def toggle_reverse(self) -> None:
        if self._sort_key is not None:
            self.sort_by(self._sort_key, reverse=not self._reverse)

    def _column(self, key: str) -> Column:
        for c in self.columns:
            if c.key == key:
                return c
        raise ValueError(f"no column {key!r}; columns: {', '.join(c.key for c in self.columns)}")

    def _rebuild(self) -> None:
        # Sorted as rows (a column's sort is often a C-level attrgetter), then keyed.
        rows = self._rows
        if self._terms:
            if self._hay is None:
                self._hay = {k: self.haystack(r) for k, r in rows.items()}
            terms = self._terms
            if len(terms) == 1:
                keys = [k for k, h in self._hay.items() if terms[0] in h]
            else:
                keys = [k for k, h in self._hay.items() if all(t in h for t in terms)]
            chosen: Iterable[Any] = [rows[k] for k in keys]
        else:
            keys, chosen = list(rows), rows.values()
        if self._sort_key is not None or self.grouped:
            ordered = chosen
            if self._sort_key is not None:
                ordered = sorted(ordered, key=self._column(self._sort_key).sort, reverse=self._reverse)
            if self.grouped:  # stable: the column's order holds inside each group
                ordered = sorted(ordered, key=self.group)
            row_key = self.row_key
            keys = [row_key(r) for r in ordered]
        self._view = keys
        old = self._cursor_key
        if old is not None and old in rows:
            try:
                self._cursor_row = keys.index(old)
            except ValueError:
                self._cursor_row = min(self._cursor_row, max(0, len(keys) - 1))
        else:
            self._cursor_row = min(self._cursor_row, max(0, len(keys) - 1))
        self._cursor_key = keys[self._cursor_row] if keys else None
        self.virtual_size = Size(self._width, len(keys) + 1)
        self.refresh()
        if self._cursor_key != old:
            self.post_message(self.CursorMoved(self, self._cursor_key))

    # ------------------------------------------------------------------ cursor
    @property
    def _visible_rows(self) -> int:
        return max(1, self.scrollable_content_region.height - 1)

    def move_cursor(self, row: int) -> None:
        if not self._view:
            return
        row = max(0, min(row, len(self._view) - 1))
        old = self._cursor_row
        self._cursor_row, key = row, self._view[row]
        self.refresh_lines(old + 1)
        self.refresh_lines(row + 1)
        top, n = round(self.scroll_y), self._visible_rows
        if row < top:
            self.scroll_to(y=row, animate=False)
        elif row >= top + n:
            self.scroll_to(y=row - n + 1, animate=False)
        if key != self._cursor_key:
            self._cursor_key = key
            self.post_message(self.CursorMoved(self, key))

    def select(self, key: str) -> bool:
        """Put the cursor on row ``key`` if it is shown."""
        try:
            self.move_cursor(self._view.index(key))
        except ValueError:
            return False
        return True

    def action_cursor(self, step: int) -> None:
        self.move_cursor(self._cursor_row + step)

    def action_page(self, step: int) -> None:
        self.move_cursor(self._cursor_row + step * self._visible_rows)

    def action_edge(self, last: int) -> None:
        self.move_cursor(len(self._view) - 1 if last else 0)

    def on_click(self, event: events.Click) -> None:
        offset = event.get_content_offset(self)
        if offset is None:
            return
        if offset.y == 0:
            x = offset.x + round(self.scroll_x) - 1
            for c in self.columns:
                if x < c.width + 1:
                    self.sort_by(c.key)
                    break
                x -= c.width + 1
        else:
            self.move_cursor(round(self.scroll_y) + offset.y - 1)

    # ------------------------------------------------------------------ rendering
    def notify_style_update(self) -> None:
        super().notify_style_update()
        self.refresh()

    def _line(self, row: Any | None) -> str:
        if row is None:
            cells = []
            for c in self.columns:
                arrow = ("▼" if self._reverse else "▲") if c.key == self._sort_key else ""
                cells.append(fit(c.label + arrow, c.width, c.right))
        else:
            cells = [fit(self.cell(c, row), c.width, c.right) for c in self.columns]
        return " " + " ".join(cells) + " "

    def render_line(self, y: int) -> Strip:
        scroll_x, scroll_y = self.scroll_offset
        width = self.scrollable_content_region.width
        base = self.rich_style
        style: Style
        if y == 0:
            style = base + self.get_component_rich_style("virtual-table--header")
            text = self._line(None)
        else:
            i = scroll_y + y - 1
            if i >= len(self._view):
                return Strip.blank(width, base)
            row = self._rows[self._view[i]]
            style = base
            if self.marked(row):
                style += self.get_component_rich_style("virtual-table--marked")
            if i == self._cursor_row:
                style += self.get_component_rich_style("virtual-table--cursor")
            text = self._line(row)
        strip = Strip([Segment(text, style)], cell_len(text))
        return strip.crop_extend(scroll_x, scroll_x + width, style)


_KIND = {"conversation": "conversation", "prefix": "prefix", "checkpoint": "checkpoint"}
_TIER = {"ram": "RAM", "ssd": "SSD", "both": "both"}

ENTRY_COLUMNS: tuple[Column, ...] = (
    Column("kind", "what", 12, lambda e: _KIND.get(e.kind, e.kind), attrgetter("kind")),
    Column("entry", "entry", 14, lambda e: e.session or e.id[:12],
           lambda e: (e.session or "\uffff", e.id)),
    Column("ns", "model", 16, lambda e: e.ns, attrgetter("ns")),
    Column("tokens", "tokens", 7, lambda e: str(e.tokens), attrgetter("tokens"), True, True),
    Column("blocks", "blocks", 6, lambda e: str(e.blocks), attrgetter("blocks"), True, True),
    Column("bytes", "bytes", 9, lambda e: human_bytes(e.bytes), attrgetter("bytes"), True, True),
    Column("unique", "unique", 9, lambda e: human_bytes(e.unique_bytes),
           attrgetter("unique_bytes"), True, True),
    Column("shared", "shared", 9, lambda e: human_bytes(e.shared_bytes),
           attrgetter("shared_bytes"), True, True),
    Column("tier", "tier", 4, lambda e: _TIER.get(e.tier, e.tier), attrgetter("tier")),
    Column("pinned", "pin", 3, lambda e: "●" if e.pinned else "", attrgetter("pinned"), False, True),
    Column("last_used", "used", 5, lambda e: age(e.last_used), attrgetter("last_used"), True, True),
    Column("hits", "hits", 5, lambda e: str(e.hits), attrgetter("hits"), True, True),
)


class EntryTable(VirtualTable):
    """Cached states (:class:`~engine.cache.info.CacheEntryInfo`), keyed by entry id;
    grouped by model (the loaded model's first, then by name), most recently used first in
    each until another column is picked. Pinned rows are bold."""

    columns = ENTRY_COLUMNS
    default_sort = "last_used"
    default_reverse = True
    grouped = True

    def __init__(self, *, name: str | None = None, id: str | None = None,
                 classes: str | None = None) -> None:
        super().__init__(name=name, id=id, classes=classes)
        self.model_names: dict[str, str] = {}  # store namespace -> model label
        self.current_ns: str | None = None  # the loaded model's store namespace

    def set_model_name(self, ns: str, label: str) -> None:
        """Show ``label`` for the entries of namespace ``ns``."""
        if self.model_names.get(ns) != label:
            self.model_names[ns] = label
            self._hay = None
            self._rebuild()
            self.refresh()

    def set_current_model(self, ns: str | None) -> None:
        """The loaded model's namespace: its entries come first."""
        if ns != self.current_ns:
            self.current_ns = ns
            self._rebuild()
            self.refresh()

    def model_label(self, ns: str) -> str:
        """What the model column shows for namespace ``ns``: the model's label when known
        (a draft model's namespace: its target's, marked), else the namespace itself."""
        name = self.model_names.get(ns)
        if name is None and (base := draft_base(ns)) is not None:
            name = f"{self.model_label(base)} (draft)"
        elif name is None and (model := scope_base(ns)) != ns:
            name = f"{self.model_names.get(model, model)} (tenant {ns[len(model) + len(SCOPE_MARK):][:8]})"
        return ns if name is None else name

    def group(self, row: CacheEntryInfo) -> tuple[bool, str, str]:
        model = model_namespace(row.ns)
        return (model != self.current_ns, self.model_names.get(model, model), row.ns)

    def cell(self, column: Column, row: CacheEntryInfo) -> str:
        if column.key == "ns":
            return self.model_label(row.ns)
        return column.text(row)

    def row_key(self, row: CacheEntryInfo) -> str:
        return row.id

    def haystack(self, e: CacheEntryInfo) -> str:
        return (f"{e.id} {e.ns} {self.model_names.get(e.ns, '')} {e.kind} {e.tier} "
                f"{_TIER.get(e.tier, '')} {e.session or ''}"
                f"{' pinned' if e.pinned else ''}").lower()

    def marked(self, row: CacheEntryInfo) -> bool:
        return row.pinned


def _verified(b: BlockInfo) -> str:
    return "–" if b.verified is None else ("ok" if b.verified else "DAMAGED")


BLOCK_COLUMNS: tuple[Column, ...] = (
    Column("index", "#", 4, lambda r: str(r[0]), lambda r: r[0], True),
    Column("key", "key", 18, lambda r: r[1].key, lambda r: r[1].key),
    Column("tokens", "tokens", 6, lambda r: str(r[1].tokens), lambda r: r[1].tokens, True, True),
    Column("bytes", "bytes", 9, lambda r: human_bytes(r[1].bytes), lambda r: r[1].bytes, True, True),
    Column("tier", "tier", 4, lambda r: _TIER.get(r[1].tier, r[1].tier), lambda r: r[1].tier),
    Column("shared_by", "used by", 7, lambda r: str(r[1].shared_by), lambda r: r[1].shared_by,
           True, True),
    Column("verified", "verified", 8, lambda r: _verified(r[1]),
           lambda r: {None: 0, True: 1, False: 2}[r[1].verified]),
)


class BlockTable(VirtualTable):
    """The block chain of one entry: rows ``(position, BlockInfo)`` keyed by position."""

    columns = BLOCK_COLUMNS
    default_sort = "index"

    def row_key(self, row: tuple[int, BlockInfo]) -> str:
        return str(row[0])

    def set_blocks(self, blocks: Sequence[BlockInfo]) -> None:
        self.set_rows(enumerate(blocks))

    def marked(self, row: tuple[int, BlockInfo]) -> bool:
        return row[1].verified is False
