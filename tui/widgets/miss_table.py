"""The cache inspector's misses view: what each of the last requests found in the prefix
cache and, when it found less than its prompt, where the prompt parted from the closest
cached state (the ``lookups`` of ``engine.stats()``, one dict per request, as
``engine.lookups.LookupReport.as_dict`` gives it)."""

from __future__ import annotations

import time
from operator import itemgetter
from typing import Any

from rich.text import Text

from mlxkv.tui.widgets.entry_table import Column, VirtualTable

_OUTCOME = {"hit": "hit", "diverged": "diverged", "extends": "new text", "cold": "cold",
            "off": "cache off"}


def one_line(text: str) -> str:
    """``text`` on one line: line breaks and tabs shown as symbols."""
    return text.replace("\r", "").replace("\n", "⏎").replace("\t", "→")


def _clock(at: float | None) -> str:
    return time.strftime("%H:%M:%S", time.localtime(at)) if at else "–"


def _excerpt(r: dict[str, Any]) -> str:
    if r.get("diverged_at") is None:
        return ""
    return (f"…{one_line(r.get('before', ''))[-12:]}| "
            f"{one_line(r.get('prompt_after', ''))!r} ≠ {one_line(r.get('entry_after', ''))!r}")


def _num(key: str) -> Any:
    return lambda r: -1 if r.get(key) is None else r[key]


MISS_COLUMNS: tuple[Column, ...] = (
    Column("at", "time", 8, lambda r: _clock(r.get("at")), itemgetter("at"), False, True),
    Column("prompt_tokens", "prompt", 7, lambda r: str(r["prompt_tokens"]),
           itemgetter("prompt_tokens"), True, True),
    Column("matched", "matched", 7, lambda r: str(r["matched"]), itemgetter("matched"), True, True),
    Column("tier", "tier", 4, lambda r: (r.get("tier") or "").upper(), lambda r: r.get("tier") or ""),
    Column("outcome", "outcome", 9, lambda r: _OUTCOME.get(r["outcome"], r["outcome"]),
           itemgetter("outcome")),
    Column("diverged_at", "diverged", 8,
           lambda r: "" if r.get("diverged_at") is None else str(r["diverged_at"]),
           _num("diverged_at"), True, True),
    Column("entry", "closest entry", 14, lambda r: r.get("entry_label") or "",
           lambda r: r.get("entry_label") or ""),
    Column("excerpt", "prompt ≠ cached", 52, _excerpt, _excerpt),
)


class MissTable(VirtualTable):
    """The last requests' lookups (dicts), newest first until another column is picked;
    keyed by request id. Requests that matched less than their prompt are bold."""

    columns = MISS_COLUMNS
    default_sort = "at"
    default_reverse = True

    def row_key(self, row: dict[str, Any]) -> str:
        return str(row["request"])

    def marked(self, row: dict[str, Any]) -> bool:
        return row.get("outcome") in ("diverged", "cold")


def describe(r: dict[str, Any]) -> Text:
    """A request's lookup in full, for the detail pane."""
    text = Text()
    text.append(f"request {r['request']}", style="bold")
    text.append(f"  {_clock(r.get('at'))}\n")
    tier = f" from {r['tier'].upper()}" if r.get("tier") else ""
    text.append(f"{r['matched']} of {r['prompt_tokens']} prompt tokens cached{tier} · "
                f"{_OUTCOME.get(r['outcome'], r['outcome'])}\n")
    if r.get("entry"):
        text.append(f"closest entry {r.get('entry_label')} (id {r['entry']}, "
                    f"{r.get('entry_tokens', 0)} tokens, {(r.get('entry_tier') or '').upper()})\n")
    if r.get("diverged_at") is not None:
        text.append(f"the prompt parts from it at token {r['diverged_at']}, after:\n")
        text.append(f"  {one_line(r.get('before', ''))}\n", style="italic")
        text.append("prompt: ", style="bold")
        text.append(f"{one_line(r.get('prompt_after', ''))}\n")
        text.append("cached: ", style="bold")
        text.append(f"{one_line(r.get('entry_after', ''))}\n")
    elif r["outcome"] == "extends":
        text.append("the prompt holds all of it and goes on: what follows is new\n")
    elif r["outcome"] == "cold":
        text.append("no cached entry starts like this prompt\n")
    return text
