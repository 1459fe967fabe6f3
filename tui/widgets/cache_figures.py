"""The header figures of the cache inspector, from successive ``engine.stats()``
answers: hit rate (and its history for a sparkline), bytes per tier against their caps,
dedup ratio, writer/reader queue depths, and the last restore from SSD. The hit rate per
interval and the last restore come from differences of the cache's counters between two
answers (the engine keeps totals only)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from mlxkv.engine.cache.info import model_namespace
from mlxkv.tui.widgets.entry_table import human_bytes

if TYPE_CHECKING:
    from mlxkv.engine.api import CacheStats, EngineStats, NamespaceBytes

MODELS_SHOWN = 4  # models named on the "by model" line; the rest are counted


def _bar(fraction: float, width: int = 8) -> str:
    filled = round(max(0.0, min(1.0, fraction)) * width)
    return "█" * filled + "░" * (width - filled)


class Figures:
    """The header figures from successive ``engine.stats()`` answers: the hit rate per
    interval (for the sparkline) and the last restore come from counter differences."""

    def __init__(self, history: int = 60) -> None:
        self.history: list[float] = []
        self._size = history
        self._prev: CacheStats | None = None
        self.last_restore: tuple[float, float] | None = None  # (ms, bytes)

    def update(self, stats: EngineStats, label: Callable[[str], str] = str,
               current: str | None = None) -> dict[str, str]:
        """The figures' texts by name; ``label`` names a store namespace's model and
        ``current`` is the loaded model's namespace (first on the "by model" line)."""
        c: CacheStats = stats.get("cache") or {}
        if not c.get("enabled"):
            return {"hits": "prefix cache off", "tiers": "", "models": "", "queues": "", "restore": ""}
        prev, self._prev = self._prev, c
        dp = c.get("prompt_tokens", 0) - (prev or {}).get("prompt_tokens", 0)
        dc = c.get("cached_tokens", 0) - (prev or {}).get("cached_tokens", 0)
        if dp > 0:
            self.history = [*self.history, dc / dp][-self._size:]
        dms = c.get("restore_ms", 0) - (prev or {}).get("restore_ms", 0)
        dbytes = c.get("restore_bytes", 0) - (prev or {}).get("restore_bytes", 0)
        if dms > 0:
            self.last_restore = (dms, dbytes)
        hits = (f"hit rate {c.get('hit_fraction', 0.0):.0%}  ·  {c.get('ram_hits', 0)} RAM  "
                f"{c.get('ssd_hits', 0)} SSD  {c.get('misses', 0)} missed")
        ram, ram_cap = c.get("ram_bytes", 0), c.get("ram_max_bytes") or 0
        tiers = (f"RAM {_bar(ram / ram_cap if ram_cap else 0)} {human_bytes(ram)} / "
                 f"{human_bytes(ram_cap) if ram_cap else '∞'}")
        if c.get("ssd"):
            ssd, ssd_cap = c.get("ssd_bytes", 0), c.get("ssd_max_bytes")
            tiers += (f"   SSD {_bar(ssd / ssd_cap if ssd_cap else 0)} {human_bytes(ssd)} / "
                      f"{human_bytes(ssd_cap) if ssd_cap else '–'}")
        else:
            reason = c.get("ssd_disabled_reason")
            tiers += "   SSD off" + (f" ({reason})" if reason else "")
        tiers += f"   dedup ×{c.get('dedup_ratio', 1.0):.2f}"
        q = c.get("queues") or {}
        queues = (f"writer {q.get('waiting', 0)} queued, {q.get('inflight', 0)} writing, "
                  f"{q.get('storage_pending_writes', 0)} in storage   "
                  f"reader {q.get('storage_pending_reads', '–')}   "
                  f"dirty {(c.get('durability') or {}).get('pending', 0)}")
        if self.last_restore is None:
            restore = "no restore from SSD yet"
        else:
            ms, nbytes = self.last_restore
            restore = f"last restore {ms:.0f} ms, {human_bytes(nbytes / ms * 1e3)}/s"
        return {"hits": hits, "tiers": tiers, "models": by_model(c.get("namespaces") or {}, label, current),
                "queues": queues, "restore": restore}


def by_model(namespaces: dict[str, NamespaceBytes], label: Callable[[str], str] = str,
             current: str | None = None) -> str:
    """Each model's share of the tiers (``stats["cache"]["namespaces"]``: store namespace
    -> RAM and SSD bytes), a draft model's and a cache scope's (a tenant's) namespaces
    counted with their model's; the loaded
    model first, then the largest."""
    shares: dict[str, list[int]] = {}
    for ns, v in namespaces.items():
        share = shares.setdefault(model_namespace(ns), [0, 0])
        share[0] += int(v.get("ram_bytes", 0))
        share[1] += int(v.get("ssd_bytes", 0))
    if not shares:
        return "by model: nothing cached yet"
    order = sorted(shares, key=lambda ns: (ns != current, -sum(shares[ns]), ns))

    def name(ns: str) -> str:
        text = label(ns)
        return text if text != ns or len(ns) <= 16 else ns[:12] + "…"
    parts = [f"{name(ns)} RAM {human_bytes(shares[ns][0])} · SSD {human_bytes(shares[ns][1])}"
             for ns in order[:MODELS_SHOWN]]
    more = len(order) - MODELS_SHOWN
    return "by model: " + "   ".join(parts) + (f"   (+{more} more)" if more > 0 else "")
