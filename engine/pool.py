"""Several models behind one front end: each its own :class:`~engine.engine.Engine`, loaded
on demand, kept under a memory budget, unloaded when idle or least recently used.

Every model is a whole engine (its own thread, prefix cache, speculation state and
batching); the models share the cache folder, where each has its own namespace (the model
fingerprint), so an unloaded model's conversations come back from the SSD tier when it is
loaded again. Two models with work decode at the same time on their own threads: on a CPU
they share its cores (each thread's matrix products use the BLAS threads, and the OS
divides the cores between the two), on a GPU their streams share the device.

:class:`ModelPool` is thread-safe: front ends call :meth:`ModelPool.lease` from worker
threads. A lease holds its model loaded until it is released (a reply in flight is never
cut by an unload); a model that is loading makes its leases wait for the load. Before a
load the pool unloads the least recently used models that are not pinned and not leased
until the budget holds the new one (its size measured when it was loaded before, else the
size of its weight files); once loaded its size is measured (weights, the RAM tier's
bytes, the KV of the requests in flight) and the budget enforced again. A model that does
not fit even alone is loaded anyway, with a warning: the budget bounds what is kept, not
what is asked for. Unloading flushes the model's cache to the SSD tier first.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlxkv.engine.arrays import named_parameters
from mlxkv.engine.settings import DEMO_MODEL, Settings, SettingsError, model_tables
from mlxkv.engine.side_table import SideTable

if TYPE_CHECKING:
    from mlxkv.engine.api import EngineAPI, FlushReport
    from mlxkv.engine.engine import Engine
    from mlxkv.engine.model_stores import FoundModel
    from mlxkv.engine.requests import EngineEvent

log = logging.getLogger("mlxkv.engine")

_WEIGHTS: SideTable[dict[str, int]] = SideTable()  # each measured engine's weight bytes (measure)
UNLOAD_FLUSH_S = 60.0  # the longest an unload waits for its cache to reach the SSD tier


class UnknownModel(LookupError):
    """A request named a model the pool does not serve; ``known`` are the names it does."""

    def __init__(self, name: str, known: Sequence[str]):
        self.name, self.known = name, list(known)
        super().__init__(f"model {name!r} is not served here; the models are: {', '.join(self.known)}")


@dataclasses.dataclass(frozen=True)
class ModelEntry:
    """One model the pool serves: ``name`` (what requests and ``/v1/models`` call it),
    ``spec`` (a folder, GGUF file, hub id or store name), ``aliases`` (more names, or
    shell-style patterns such as ``claude-*haiku*``), ``pin`` (never unloaded) and the
    settings it sets for itself (``settings``: names of :data:`PER_MODEL`)."""

    name: str
    spec: str
    aliases: tuple[str, ...] = ()
    pin: bool = False
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)

    def answers(self, name: str) -> bool:
        """Whether a request naming ``name`` means this model (its name, an alias, or a
        pattern among the aliases)."""
        if name == self.name or name in self.aliases:
            return True
        return any(any(ch in a for ch in "*?[") and fnmatch.fnmatchcase(name, a) for a in self.aliases)


def entry_name(spec: str) -> str:
    """The name a model given only by its spec is served under: ``demo`` for the demo
    model, a local folder or GGUF file by its name, a hub id or store name as it is."""
    if spec == "demo" or _same_path(spec, DEMO_MODEL):
        return "demo"
    if spec.startswith(("/", "~", ".")) or spec.endswith(".gguf") or spec.count("/") > 1:
        name = spec.rstrip("/\\").replace("\\", "/").rsplit("/", 1)[-1]
        return name.removesuffix(".gguf") or spec
    return spec


def _same_path(a: str, b: str | Path) -> bool:
    try:
        return Path(os.path.expanduser(a)).resolve() == Path(b).resolve()
    except (OSError, ValueError):
        return False


def parse_cli_model(value: str) -> ModelEntry:
    """``--model SPEC`` or ``--model NAME=SPEC`` (a name of letters, digits and ``._:-``
    before the first ``=``); ``demo`` is the embedded demo model."""
    name, eq, spec = value.partition("=")
    if eq and name and spec and all(c.isalnum() or c in "._:-" for c in name):
        return ModelEntry(name, _spec(spec))
    return ModelEntry(entry_name(value), _spec(value))


def _spec(spec: str) -> str:
    return str(DEMO_MODEL) if spec == "demo" else spec


def entries_from_config(items: Any, where: str = "models") -> list[ModelEntry]:
    """The config file's ``[[models]]`` tables as entries (checked by
    :func:`engine.settings.model_tables`: a bad table is a :class:`SettingsError` naming it)."""
    return entries_from_tables(model_tables(items, where) or ())


def entries_from_tables(tables: Sequence[dict[str, Any]]) -> list[ModelEntry]:
    """Entries of tables :func:`engine.settings.model_tables` checked (``settings.models``)."""
    return [ModelEntry(t["name"] or entry_name(t["path"]), _spec(t["path"]), t["aliases"], t["pin"],
                       dict(t["settings"])) for t in tables]


def check_entries(entries: Sequence[ModelEntry], default: str | None) -> None:
    """Names are unique (no name or alias given twice) and ``default`` is one of them."""
    if not entries:
        raise SettingsError("no model to serve")
    owner: dict[str, str] = {}
    for e in entries:
        for n in (e.name, *e.aliases):
            if n in owner:
                raise SettingsError(f"the model name {n!r} is given twice (to {owner[n]} and {e.name})")
            owner[n] = e.name
    if default is not None and default not in owner:
        raise SettingsError(f"--default-model {default!r} is not one of the models "
                            f"({', '.join(e.name for e in entries)})")


class _Slot:
    """One entry's state: its engine while loaded, and who holds it."""

    def __init__(self, entry: ModelEntry):
        self.entry = entry
        self.engine: EngineAPI | None = None
        self.state = "unloaded"  # loading | ready | unloading | unloaded | failed
        self.leases = 0
        self.last_used = 0.0
        self.loaded_at = 0.0
        self.measured: int | None = None  # bytes, measured at its last load
        self.parts: dict[str, int] = {}
        self.loads = self.unloads = 0
        self.load_s: float | None = None
        self.error: str | None = None
        self.stage: dict[str, Any] | None = None  # the load's last stage while loading

    @functools.cached_property
    def on_disk(self) -> FoundModel | None:
        """What the stores know of it, read once (None: not a local model)."""
        return _on_disk(self.entry.spec)

    def file_bytes(self) -> int:
        """The size of its weight files (0 when not local): what a first load is taken to need."""
        return self.on_disk.size_bytes if self.on_disk is not None else 0


class Lease:
    """A model held loaded for one use (a request): ``engine`` serves it; :meth:`release`
    (or leaving the ``with`` block) lets the pool unload it again. Releasing twice is a
    no-op; :meth:`hold` adds a holder that releases on its own."""

    def __init__(self, pool: ModelPool, slot: _Slot):
        self._pool, self._slot = pool, slot
        self._held = 1
        self._lock = threading.Lock()

    @property
    def engine(self) -> EngineAPI:
        engine = self._slot.engine
        if engine is None:  # a lease is only handed out for a loaded model
            raise RuntimeError(f"{self._slot.entry.name} is not loaded")
        return engine

    @property
    def entry(self) -> ModelEntry:
        return self._slot.entry

    def hold(self) -> None:
        with self._lock:
            if self._held <= 0:
                raise RuntimeError("the lease was released")
            self._held += 1

    def release(self) -> None:
        with self._lock:
            if self._held <= 0:
                return
            self._held -= 1
            last = self._held == 0
        if last:
            self._pool._released(self._slot)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _on_disk(spec: str) -> FoundModel | None:
    """What the stores know of ``spec`` without loading it (``model_stores.FoundModel``), or None."""
    from mlxkv.engine.model_stores import describe_spec

    return describe_spec(spec)


def weigh(engine: Engine) -> dict[str, int]:
    """The bytes of a loaded model's weights and of its KV per token, asked of its engine
    thread once and kept beside the engine (what :func:`measure` adds the rest to)."""
    weights = _WEIGHTS.get(engine)
    if weights is None:
        weights = engine.call(_model_bytes, engine).result(timeout=60)
        _WEIGHTS.put(engine, weights)
    return weights


def measure(engine: EngineAPI, weights: dict[str, int]) -> dict[str, int]:
    """What a loaded model holds now, in bytes: its ``weights`` (and a draft model's, from
    :func:`weigh`), the RAM tier of its prefix cache, and the KV of the requests it serves
    (their tokens at the model's bytes per token), from the figures the engine published."""
    figures = engine.stats()
    cache = figures.get("cache") or {}
    tokens = sum((r.get("prompt_tokens") or 0) + (r.get("generated") or 0) for r in figures.get("running") or [])
    return {"weights": weights["weights"], "ram_tier": int(cache.get("ram_bytes") or 0),
            "kv_in_flight": tokens * weights["kv_per_token"]}


def _model_bytes(engine: Engine) -> dict[str, int]:
    """On the engine thread: the bytes of the model's (and any draft model's) parameters,
    and its KV bytes per token (one token through a fresh cache)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    runtime = engine.runtime
    assert runtime is not None  # on the engine thread, the model loaded
    model = runtime.loaded.model
    seen = {id(model)}
    total = sum(v.nbytes for _, v in named_parameters(model))
    for provider in runtime.providers.values():
        source_model = getattr(provider, "model", None)
        if source_model is not None and id(source_model) not in seen and hasattr(source_model, "parameters"):
            seen.add(id(source_model))
            total += sum(v.nbytes for _, v in named_parameters(source_model))
    per_token = 0
    try:
        cache = make_prompt_cache(model)
        model(mx.array([[0]]), cache=cache)
        for c in cache:
            for a in (getattr(c, "keys", None), getattr(c, "values", None)):
                if a is not None and a.ndim == 4:
                    per_token += a.shape[1] * a.shape[3] * a.dtype.size
    except Exception:  # an architecture without plain KV: its state is counted by the RAM tier
        per_token = 0
    return {"weights": int(total), "kv_per_token": int(per_token)}


class ModelPool:
    """The models a front end serves (see the module docstring). ``make_engine(entry)``
    builds an engine for an entry (default: :meth:`Engine.from_settings` with the entry's
    settings over ``settings``); ``memory_bytes``: the budget of loaded models (None: no
    budget); ``idle_s``: unload a model no request used for this long (None: never);
    ``default``: the model a request that names none, or (``answer_any``) an unknown name,
    gets. With one entry every name is answered by it, as a one-model server does."""

    def __init__(self, entries: Sequence[ModelEntry], settings: Settings | None = None, *,
                 memory_bytes: int | None = None, idle_s: float | None = None,
                 default: str | None = None, answer_any: bool | None = None,
                 make_engine: Callable[[ModelEntry], Engine] | None = None,
                 flush_timeout_s: float = UNLOAD_FLUSH_S):
        check_entries(entries, default)
        self.settings = settings if settings is not None else Settings.defaults()
        self.entries = list(entries)
        self.memory_bytes = memory_bytes
        self.idle_s = idle_s
        self.default = self._find(default).name if default is not None else self.entries[0].name
        self.answer_any = (len(self.entries) == 1 or default is not None) if answer_any is None else answer_any
        self._make = make_engine or self._engine_for
        self.flush_timeout_s = flush_timeout_s
        self._slots = {e.name: _Slot(e) for e in self.entries}
        self._cond = threading.Condition()
        self._closed = False
        self._idle_thread: threading.Thread | None = None
        self._wake = threading.Event()
        self.events: list[dict[str, Any]] = []  # loads and unloads, the last 64
        if idle_s is not None:
            self._idle_thread = threading.Thread(target=self._idle_loop, name="mlxkv-model-idle", daemon=True)
            self._idle_thread.start()

    @classmethod
    def of_engine(cls, engine: EngineAPI, name: str) -> ModelPool:
        """A pool of one model whose engine is already made (and maybe started): it is never
        unloaded, and every model name gets it."""
        entry = ModelEntry(name, engine.model_spec, pin=True)
        pool = cls([entry], getattr(engine, "settings", None))
        slot = pool._slots[name]
        slot.engine, slot.state, slot.loaded_at = engine, "ready", time.time()
        return pool

    def _engine_for(self, entry: ModelEntry) -> Engine:
        from mlxkv.engine.engine import Engine

        return Engine.from_settings(self.settings.replace(model=entry.spec, **entry.settings))

    # names
    def _find(self, name: str) -> ModelEntry:
        for e in self.entries:
            if e.name == name:
                return e
        for e in self.entries:
            if e.answers(name):
                return e
        raise UnknownModel(name, [e.name for e in self.entries])

    def resolve(self, name: str | None) -> ModelEntry:
        """The entry a request naming ``name`` gets (None or "": the default)."""
        if not name:
            return self._slots[self.default].entry
        try:
            return self._find(name)
        except UnknownModel:
            if self.answer_any:
                return self._slots[self.default].entry
            raise

    # loading
    def lease(self, name: str | None, timeout: float | None = None) -> Lease:
        """Hold the model ``name`` resolves to, loading it first when it is not (waiting for
        a load in progress); raises :class:`UnknownModel`, or the load's error."""
        entry = self.resolve(name)
        slot = self._slots[entry.name]
        with self._cond:
            if self._closed:
                raise RuntimeError("the model pool is closed")
            while slot.state == "unloading":
                self._cond.wait()
            slot.leases += 1
            slot.last_used = time.monotonic()
            load = slot.state in ("unloaded", "failed")
            if load:
                slot.state, slot.error = "loading", None
        lease = Lease(self, slot)
        try:
            if load:
                self._load(slot, timeout)
            else:
                self._wait_loaded(slot, timeout)
        except BaseException:
            lease.release()
            raise
        return lease

    def _wait_loaded(self, slot: _Slot, timeout: float | None) -> None:
        with self._cond:
            ok = self._cond.wait_for(lambda: slot.state != "loading", timeout)
            if not ok:
                raise TimeoutError(f"model {slot.entry.name} is still loading after {timeout} s")
            if slot.state == "failed":
                raise RuntimeError(f"model {slot.entry.name} failed to load: {slot.error}")

    def _load(self, slot: _Slot, timeout: float | None) -> None:
        started = time.perf_counter()
        try:
            self._make_room(slot, slot.measured or slot.file_bytes())
            engine = self._make(slot.entry)
            with self._cond:
                slot.engine = engine
            engine.subscribe(lambda event: self._on_load_event(slot, event))
            if not engine.is_alive():
                engine.start(wait=False)
            engine.wait_ready(timeout)
        except BaseException as e:
            made = slot.engine
            with self._cond:
                slot.state, slot.error, slot.engine = "failed", f"{type(e).__name__}: {e}", None
                self._cond.notify_all()
            if made is not None:
                made.shutdown(wait=False)
            raise
        load_s = time.perf_counter() - started
        try:
            parts = measure(engine, weigh(engine))
        except Exception as e:  # the model serves without its figures
            log.warning("model %s: could not measure its memory: %s", slot.entry.name, e)
            parts = {}
        with self._cond:
            slot.state, slot.loaded_at, slot.load_s = "ready", time.time(), load_s
            slot.loads += 1
            slot.parts, slot.measured = parts, sum(parts.values()) or None
            self._note("load", slot.entry.name, load_s=round(load_s, 3), bytes=slot.measured)
            self._cond.notify_all()
        self._make_room(slot, 0)

    @staticmethod
    def _on_load_event(slot: _Slot, event: EngineEvent) -> None:
        from mlxkv.engine.requests import LoadEvent

        if isinstance(event, LoadEvent):
            slot.stage = {"stage": event.stage, "done": event.done, "total": event.total}

    @staticmethod
    def _footprint(slot: _Slot) -> int:
        return slot.measured or slot.file_bytes()

    def _make_room(self, keep: _Slot, need: int) -> None:
        """Unload least recently used models (not ``keep``, not pinned, not leased) until the
        loaded ones and ``need`` more bytes fit the budget."""
        if self.memory_bytes is None:
            return
        while True:
            with self._cond:
                loaded = [s for s in self._slots.values() if s.state in ("ready", "loading") and s is not keep]
                total = sum(self._footprint(s) for s in loaded) + (need or self._footprint(keep))
                if total <= self.memory_bytes:
                    return
                victims = sorted((s for s in loaded if s.state == "ready" and not s.entry.pin and s.leases == 0),
                                 key=lambda s: s.last_used)
                if not victims:
                    log.warning("models: %s needs %.1f MB more than --models-memory-bytes allows, and "
                                "every other loaded model is pinned or busy: loaded over the budget",
                                keep.entry.name, (total - self.memory_bytes) / 1e6)
                    return
                victim = victims[0]
                victim.state = "unloading"
            self._unload(victim, "memory budget")

    def _unload(self, slot: _Slot, why: str) -> FlushReport | None:
        """Flush ``slot``'s cache to the SSD tier and stop its engine (its state is
        "unloading", set by the caller under the lock); the flush's report (None: it failed)."""
        engine, report = slot.engine, None
        try:
            if engine is not None:
                report = engine.cache_flush(timeout=self.flush_timeout_s)
        except Exception as e:  # lose nothing else: the engine still stops
            log.warning("model %s: its cache could not be flushed before unloading: %s", slot.entry.name, e)
        try:
            if engine is not None:
                engine.shutdown()
        finally:
            with self._cond:
                slot.engine, slot.state = None, "unloaded"
                slot.unloads += 1
                self._note("unload", slot.entry.name, why=why,
                           flushed=report["durable"] if report is not None else None)
                self._cond.notify_all()
        log.info("model %s unloaded (%s)", slot.entry.name, why)
        return report

    def unload(self, name: str, why: str = "asked") -> bool:
        """Unload a model now unless it is leased (False then, or when it is not loaded)."""
        slot = self._slots[self._find(name).name]
        with self._cond:
            if slot.state != "ready" or slot.leases:
                return False
            slot.state = "unloading"
        self._unload(slot, why)
        return True

    def _released(self, slot: _Slot) -> None:
        with self._cond:
            slot.leases -= 1
            slot.last_used = time.monotonic()
            self._cond.notify_all()

    def _note(self, what: str, name: str, **info: Any) -> None:
        self.events.append({"event": what, "model": name, "at": time.time(), **info})
        del self.events[:-64]

    def _idle_loop(self) -> None:
        assert self.idle_s is not None
        period = max(0.05, min(5.0, self.idle_s / 4))
        while not self._wake.wait(period):
            now = time.monotonic()
            with self._cond:
                idle = [s for s in self._slots.values() if s.state == "ready" and not s.entry.pin
                        and s.leases == 0 and now - s.last_used >= self.idle_s]
                for s in idle:
                    s.state = "unloading"
            for s in idle:
                try:
                    self._unload(s, f"idle {self.idle_s:g} s")
                except Exception as e:  # keep watching the others
                    log.warning("model %s: unloading failed: %s", s.entry.name, e)

    # what front ends show
    def loaded(self) -> list[tuple[ModelEntry, EngineAPI]]:
        """The loaded models and their engines."""
        with self._cond:
            return [(s.entry, s.engine) for s in self._slots.values()
                    if s.state == "ready" and s.engine is not None]

    def engine(self, name: str | None = None) -> EngineAPI | None:
        """The engine of a model if it is loaded (default: the default model), else None."""
        slot = self._slots[self.resolve(name).name]
        return slot.engine if slot.state == "ready" else None

    def describe(self) -> list[dict[str, Any]]:
        """Per model: name, aliases, spec, state, leases, bytes (and their parts), loads,
        unloads, load time, the load's stage while loading, its error."""
        out = []
        with self._cond:
            slots = list(self._slots.values())
        for s in slots:
            e = s.entry
            row: dict[str, Any] = {
                "name": e.name, "aliases": list(e.aliases), "spec": e.spec, "pinned": e.pin,
                "state": s.state, "loaded": s.state == "ready", "leases": s.leases,
                "bytes": s.measured, "bytes_parts": dict(s.parts), "loads": s.loads, "unloads": s.unloads,
                "load_s": s.load_s, "error": s.error, "default": e.name == self.default}
            if s.state == "loading":
                row["load"] = s.stage
            out.append(row)
        return out

    def context_of(self, name: str) -> int | None:
        """A model's context as its files say (before it is loaded), or None."""
        entry = self.resolve(name)
        ctx = entry.settings.get("context_tokens")
        if ctx is not None:
            return ctx
        disk = self._slots[entry.name].on_disk
        return disk.context_tokens if disk is not None else None

    def refresh(self, name: str) -> None:
        """Measure a loaded model's bytes again (its RAM tier and requests change them); a
        model the pool did not load (:meth:`of_engine`) is not measured."""
        slot = self._slots[self._find(name).name]
        engine = slot.engine
        # (never waits for the engine thread: the weights were measured at the load, the rest
        # is what the engine published last)
        weights = _WEIGHTS.get(engine)
        if slot.state == "ready" and engine is not None and weights is not None:
            parts = measure(engine, weights)
            with self._cond:
                slot.parts, slot.measured = parts, sum(parts.values()) or None

    @contextmanager
    def each_loaded(self) -> Iterator[list[Lease]]:
        """Leases on every loaded model (none unloads meanwhile), released after the block."""
        leases = []
        with self._cond:
            for s in self._slots.values():
                if s.state == "ready":
                    s.leases += 1
                    leases.append(Lease(self, s))
        try:
            yield leases
        finally:
            for lease in leases:
                lease.release()

    def close(self) -> dict[str, FlushReport | None]:
        """Flush and stop every loaded model; the flush reports by model name (None: the
        flush failed)."""
        with self._cond:
            self._closed = True
            self._wake.set()
            slots = [s for s in self._slots.values() if s.state == "ready"]
            for s in slots:
                s.state = "unloading"
        reports: dict[str, FlushReport | None] = {}
        for s in slots:
            try:
                reports[s.entry.name] = self._unload(s, "shutdown")
            except Exception as e:
                log.warning("model %s: %s", s.entry.name, e)
        return reports
