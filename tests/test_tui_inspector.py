"""The cache inspector screen on a real engine: a tiny random-weight qwen3, a real cache
folder under tmp_path, driven with Textual's Pilot inside a minimal host app."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from common import T
from textual.app import App

from mlxkv.engine.cache.info import BlockInfo, CacheEntryInfo
from mlxkv.engine.engine import Engine, Request
from mlxkv.engine.generate import SamplingParams
from mlxkv.engine.settings import Settings
from mlxkv.tui.inspector import InspectorScreen
from mlxkv.tui.messages import CacheChanged, OpenConversation
from mlxkv.tui.widgets.modals import Confirm
from support.modelgen import tiny_model

SIZE = (120, 40)


class Host(App):
    """Pushes the inspector; records the conversations it is asked to open."""

    def __init__(self, engine: Any, live: bool = True) -> None:
        super().__init__()
        self.engine, self.live = engine, live
        self.opened: list[str] = []

    def on_mount(self) -> None:
        self.push_screen(InspectorScreen(self.engine, live=self.live))

    def on_open_conversation(self, message: OpenConversation) -> None:
        self.opened.append(message.session)


@pytest.fixture
def engine(tmp_path: Path):
    settings = Settings.load({"model": str(tiny_model("qwen3")), "cache_dir": str(tmp_path / "cache"),
                              "block_tokens": 16, "ram_cache_bytes": 256 << 20}, env={})
    eng = Engine.from_settings(settings).start(timeout=T)
    yield eng
    eng.shutdown(timeout=T)


def ask(engine: Engine, text: str, session: str, max_tokens: int = 4) -> None:
    handle = engine.submit(Request(messages=[{"role": "user", "content": text}], session=session,
                                   params=SamplingParams(max_tokens=max_tokens)))
    handle.result(timeout=T)
    engine.sync(T)  # the state is stored after the answer


def cache_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.suffix in (".blk", ".tail", ".ckpt", ".man"))


async def until(pilot: Any, cond: Callable[[], Any], what: str) -> Any:
    deadline = time.monotonic() + T
    while not (value := cond()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.05)
    return value


def run(coro_fn: Callable[..., Any], engine: Any, live: bool = True) -> Host:
    app = Host(engine, live)

    async def main() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: isinstance(app.screen, InspectorScreen), "the inspector")
            await coro_fn(pilot, app.screen)
    asyncio.run(main())
    return app


def test_lists_the_entry_and_its_blocks(engine):
    ask(engine, "Tell me about the cache inspector screen, please.", "s1")
    [info] = engine.cache_entries()

    async def check(pilot, screen: InspectorScreen) -> None:
        await until(pilot, lambda: screen.table.keys == [info.id], "the entry in the table")
        detail = await until(pilot, lambda: screen.detail, "the detail pane")
        assert detail.info.id == info.id and detail.info.session == "s1"
        assert len(detail.blocks) == info.blocks >= 2
        assert screen.blocks.row_count == len(detail.blocks)
        assert "cache inspector" in str(screen.query_one("#detail-preview").render())
        await until(pilot, lambda: "hit rate" in str(screen.query_one("#fig-hits").render()),
                    "the header figures")
        await pilot.press("o")
        await until(pilot, lambda: pilot.app.opened == ["s1"], "OpenConversation")
    run(check, engine)


def test_evict_pin_and_verify_act_on_the_store(engine, tmp_path):
    ask(engine, "A conversation that goes to SSD and back.", "s1")
    engine.cache_flush(timeout=T)
    [info] = engine.cache_entries()
    assert info.tier == "both"

    async def check(pilot, screen: InspectorScreen) -> None:
        await until(pilot, lambda: screen.table.keys == [info.id], "the entry")
        await pilot.press("p")
        await until(pilot, lambda: "pin" in screen.results, "pin")
        assert screen.results["pin"] is True and engine.stats()["cache"]["pinned"] == 1

        await pilot.press("e")  # on SSD too: no confirmation
        await until(pilot, lambda: "evict" in screen.results, "evict")
        assert screen.results["evict"] is True
        assert engine.cache_entries()[0].tier == "ssd"
        assert engine.stats()["cache"]["ram_entries"] == 0
        await until(pilot, lambda: screen.table.selected.tier == "ssd", "the table to show SSD")
        assert screen.table.selected.pinned  # kept pinned on SSD: it comes back pinned

        await pilot.press("u")
        await until(pilot, lambda: not screen.table.selected.pinned, "the table to show the unpin")
        assert engine.stats()["cache"]["pinned"] == 0

        await pilot.press("v")
        await until(pilot, lambda: "verify" in screen.results, "verify")
        assert screen.results["verify"]["ok"] == 1 and not screen.results["verify"]["damaged"]
        await until(pilot, lambda: screen.detail and all(b.verified for b in screen.detail.blocks),
                    "the blocks shown as verified")

        del screen.results["verify"]
        await pilot.press("V")  # every saved entry, and the manifests
        await until(pilot, lambda: "verify" in screen.results, "verify all")
        assert screen.results["verify"] == {"checked": 1, "ok": 1, "damaged": [],
                                            "manifests_damaged": 0}

        # Damage one block file on disk: verify finds it.
        block = next(p for p in cache_files(tmp_path / "cache") if p.suffix == ".blk")
        data = bytearray(block.read_bytes())
        data[-1] ^= 0xFF
        block.write_bytes(bytes(data))
        del screen.results["verify"]
        await pilot.press("v")
        await until(pilot, lambda: "verify" in screen.results, "the second verify")
        assert screen.results["verify"]["damaged"] == [info.id]
        assert not block.exists()  # the damaged block is gone from the store
        await until(pilot, lambda: "verify" in screen.results and not screen.verifying,
                    "the verify indicator to go")
        assert not screen.has_class("-verifying")
    run(check, engine)


def test_delete_asks_first_and_removes_the_files(engine, tmp_path):
    ask(engine, "Something to delete from both tiers.", "gone")
    engine.cache_flush(timeout=T)
    [info] = engine.cache_entries()
    assert cache_files(tmp_path / "cache")

    async def check(pilot, screen: InspectorScreen) -> None:
        await until(pilot, lambda: screen.table.keys == [info.id], "the entry")
        await pilot.press("d")
        await until(pilot, lambda: isinstance(pilot.app.screen, Confirm), "the question")
        await pilot.press("n")
        await until(pilot, lambda: pilot.app.screen is screen, "the answer")
        await pilot.pause()
        assert "delete" not in screen.results
        assert [e.id for e in engine.cache_entries()] == [info.id]

        await pilot.press("d")
        await until(pilot, lambda: isinstance(pilot.app.screen, Confirm), "the question")
        await pilot.press("y")
        await until(pilot, lambda: "delete" in screen.results, "delete")
        assert screen.results["delete"] is True
        assert engine.cache_entries() == []
        await until(pilot, lambda: screen.table.row_count == 0, "the table to empty")
        # the emptied table's cursor message clears the pane after the rows are gone
        await until(pilot, lambda: screen.detail is None, "the detail pane to clear")
    run(check, engine)
    assert cache_files(tmp_path / "cache") == []


def test_filter_and_sort(engine):
    ask(engine, "alpha: a short one", "alpha")
    ask(engine, "beta: a longer question that takes rather more tokens than the first", "beta")
    ask(engine, "gamma: a middle sized question here", "gamma")
    by_session = {e.session: e for e in engine.cache_entries()}
    assert set(by_session) == {"alpha", "beta", "gamma"}

    async def check(pilot, screen: InspectorScreen) -> None:
        table = screen.table
        await until(pilot, lambda: table.row_count == 3, "three entries")
        await pilot.press("slash", *"beta")
        await until(pilot, lambda: table.keys == [by_session["beta"].id], "the filter")
        await pilot.press("escape")
        await until(pilot, lambda: table.row_count == 3, "the filter cleared")
        assert screen.focused is table

        for _ in range(len(table.columns)):
            if table.sort_key == "tokens":
                break
            await pilot.press("s")
        assert table.sort_key == "tokens"
        tokens = [table.row(k).tokens for k in table.keys]
        assert tokens == sorted(tokens, reverse=True) and len(set(tokens)) == 3
        await pilot.press("r")
        assert [table.row(k).tokens for k in table.keys] == sorted(tokens)
        await pilot.click("#entries", offset=(2, 0))  # the header's first label: "what"
        assert table.sort_key == "kind"
        await pilot.click("#entries", offset=(48, 0))  # "tokens"
        assert table.sort_key == "tokens" and [table.row(k).tokens for k in table.keys] == tokens
        # The cursor stays on its entry when the order changes.
        await pilot.press("end")
        last = table.cursor_key
        await pilot.press("r")
        assert table.cursor_key == last and table.keys[0] == last
    run(check, engine)


def test_header_figures_follow_a_restore_from_ssd(engine):
    ask(engine, "Restore me from the SSD tier, if you would.", "r1")
    engine.cache_flush(timeout=T)
    [info] = engine.cache_entries()
    assert engine.cache_evict(info.id)

    async def check(pilot, screen: InspectorScreen) -> None:
        restore = screen.query_one("#fig-restore")
        await until(pilot, lambda: "no restore" in str(restore.render()), "the first figures")
        assert "SSD" in str(screen.query_one("#fig-tiers").render())
        # The same conversation again: its prefix comes back from SSD.
        await asyncio.to_thread(ask, engine, "Restore me from the SSD tier, if you would.", "r1")
        assert engine.stats()["cache"]["ssd_hits"] == 1
        await until(pilot, lambda: "last restore" in str(restore.render()), "the restore figure")
        assert screen.figures.last_restore[0] > 0 and screen.figures.history
        assert "1 SSD" in str(screen.query_one("#fig-hits").render())
    run(check, engine)


def test_flush_and_gc(engine, tmp_path):
    ask(engine, "Written to SSD by the flush.", "f1")

    async def check(pilot, screen: InspectorScreen) -> None:
        await until(pilot, lambda: screen.table.row_count == 1, "the entry")
        await pilot.press("f")
        await until(pilot, lambda: "flush" in screen.results, "flush")
        assert screen.results["flush"]["pending"] == 0 and screen.results["flush"]["failed"] == 0
        assert engine.cache_entries()[0].tier == "both" and cache_files(tmp_path / "cache")
        await until(pilot, lambda: screen.table.selected.tier == "both", "the table to show SSD")

        await pilot.press("g")
        await until(pilot, lambda: isinstance(pilot.app.screen, Confirm), "the question")
        await pilot.press("y")
        await until(pilot, lambda: "gc" in screen.results, "gc")
        if getattr(engine, "cache_gc", None) is None:  # said plainly, nothing touched
            assert screen.results["gc"] is None
            assert any("mlxkv cache gc" in n.message for n in pilot.app._notifications)
        assert [e.tier for e in engine.cache_entries()] == ["both"]  # in use: kept
    run(check, engine)


class Bridge:
    """A front end's view of the engine: the cache views forwarded, and no engine events
    (its subscribe hears nothing: the app posts CacheChanged instead)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        if not name.startswith(("cache_", "stats", "decode")):
            raise AttributeError(name)
        return getattr(self._engine, name)

    def subscribe(self, callback: Callable[[Any], None]) -> Callable[[], None]:
        return lambda: None


def test_works_through_a_bridge_and_cache_changed_messages(engine):
    async def check(pilot, screen: InspectorScreen) -> None:
        await until(pilot, lambda: "hit rate" in str(screen.query_one("#fig-hits").render()),
                    "the first refresh")
        assert screen.table.row_count == 0
        await asyncio.to_thread(ask, engine, "Stored while the inspector is open.", "b1")
        screen.post_message(CacheChanged({"store": 1}))
        await until(pilot, lambda: screen.table.row_count == 1, "the refresh on CacheChanged")
        assert screen.table.selected.session == "b1"
        await until(pilot, lambda: screen.detail, "the detail through the bridge")
    run(check, Bridge(engine))


def synthetic(n: int) -> list[CacheEntryInfo]:
    now = time.time()
    return [CacheEntryInfo(id=f"{i:032x}", ns=f"model-{i % 7}", kind=("conversation", "prefix")[i % 2],
                           tokens=(i * 7919) % 30000, blocks=1 + i % 120, bytes=i * 4096,
                           unique_bytes=i * 1024, shared_bytes=i * 3072,
                           tier=("ram", "ssd", "both")[i % 3], pinned=i % 50 == 0,
                           last_used=now - i, hits=i % 13, session=f"chat-{i}" if i % 4 else None)
            for i in range(n)]


def test_ten_thousand_entries_render_and_scroll(engine):
    records = synthetic(10_000)

    async def check(pilot, screen: InspectorScreen) -> None:
        table = screen.table
        t0 = time.perf_counter()
        screen.load_entries(records)
        t1 = time.perf_counter()
        await pilot.pause()
        print(f"inspector_10k_refresh_ms {(time.perf_counter() - t0) * 1e3:.1f} "
              f"(load_entries {(t1 - t0) * 1e3:.1f})")
        # grouped by model (no model loaded: by name), newest first in each
        expected = [r.id for r in sorted(records, key=lambda r: (r.ns, -r.last_used))]
        assert table.row_count == 10_000 and table.keys == expected and expected[0] == records[0].id
        assert records[0].id[:11] in "\n".join(str(s.text) for s in
                                               [table.render_line(y) for y in range(3)])
        await pilot.press("pagedown", "pagedown", "end")
        assert table.cursor_key == expected[-1]
        assert table.scroll_y == table.max_scroll_y > 0
        lines = [table.render_line(y).text for y in range(table.size.height)]
        assert expected[-1][:11] in "".join(lines)
        await pilot.press("home")
        assert table.cursor_key == records[0].id and table.scroll_y == 0

        await pilot.press("slash", *"chat-999")
        expected = [r.id for r in sorted(records, key=lambda r: (r.ns, -r.last_used))
                    if r.session and "chat-999" in r.session]
        await until(pilot, lambda: table.keys == expected, "the filter over 10,000")
        await pilot.press("escape")
        for _ in range(3):
            await pilot.press("s")
        blocks = [BlockInfo(key=f"{i:032x}", tokens=16, bytes=8192, tier="ssd", shared_by=1 + i % 3,
                            verified=(None, True, False)[i % 3]) for i in range(10_000)]
        screen.blocks.set_blocks(blocks)
        screen.blocks.focus()
        await pilot.press("end")
        assert screen.blocks.row_count == 10_000 and screen.blocks.cursor_key == "9999"
        shown = [screen.blocks.render_line(y).text for y in range(screen.blocks.size.height)]
        assert shown[-1].split()[0] == "9999" and "DAMAGED" in "".join(shown)
        table.focus()
        before = table.cursor_key
        screen.load_entries(records[::-1])  # a live refresh in another order
        assert table.cursor_key == before and before is not None
        await pilot.pause()
    run(check, engine, live=False)


def test_the_misses_view_shows_where_each_prompt_parted_from_the_cache(engine):
    """``m`` shows the last requests' lookups: a new conversation whose system prompt
    differs in one line parts from the cached one there; its row says where, and the
    detail pane shows both sides."""
    system = "build: {v}\nYou are a careful assistant. Read the files before answering."
    for v in ("alpha-17", "omega-42"):
        handle = engine.submit(Request(messages=[
            {"role": "system", "content": system.format(v=v)},
            {"role": "user", "content": "which file defines the server?"}],
            params=SamplingParams(max_tokens=2)))
        handle.result(timeout=T)
    engine.sync(T)
    parted = handle.cache_report
    assert parted.outcome == "diverged" and parted.diverged_at > 0

    async def check(pilot, screen: InspectorScreen) -> None:
        await until(pilot, lambda: screen.table.row_count >= 1, "the entries")
        await pilot.press("m")
        assert screen.showing_misses and screen.focused is screen.misses
        await until(pilot, lambda: str(handle.id) in screen.misses.keys, "the lookups")
        screen.misses.select(str(handle.id))
        await pilot.pause()
        row = screen.misses.row(str(handle.id))
        line = screen.misses._line(row)
        assert "diverged" in line and str(parted.diverged_at) in line
        summary = str(screen.query_one("#detail-summary").render())
        assert f"at token {parted.diverged_at}" in summary
        assert "omega" in summary and "alpha" in summary  # this prompt's and the cached one's
        assert "requests" in str(screen.query_one("#entry-count").render())
        await pilot.press("e")  # entry actions are for the entry list
        await until(pilot, lambda: any("press m" in n.message for n in pilot.app._notifications),
                    "the notice")
        await pilot.press("m")
        assert not screen.showing_misses and screen.focused is screen.table
    run(check, engine)


def test_entries_grouped_by_model_with_each_models_share(tmp_path):
    """Two real models' states in one cache folder: the inspector on the second names the
    first's entries by the label it remembered from an earlier run, lists the loaded
    model's entries first, and gives each model's RAM and SSD share."""
    from mlxkv.engine.cache.tokens import store_namespace
    from mlxkv.tui.conversations import ConversationStore

    names = ConversationStore(tmp_path / "conversations.db")
    cache = str(tmp_path / "cache")

    def start(arch: str) -> Engine:
        settings = Settings.load({"model": str(tiny_model(arch)), "cache_dir": cache, "block_tokens": 16,
                                  "ram_cache_bytes": 256 << 20}, env={})
        return Engine.from_settings(settings).start(timeout=T)

    def label(eng: Engine) -> str:
        return str(eng.stats()["model"]["model"]).rstrip("/").rsplit("/", 1)[-1]

    class Named(App):  # not a Host: Textual would run Host's on_mount as well
        def __init__(self, engine: Engine) -> None:
            super().__init__()
            self.engine = engine

        def on_mount(self) -> None:
            self.push_screen(InspectorScreen(self.engine, names=names))

    def inspect(eng: Engine, check: Callable[..., Any]) -> None:
        app = Named(eng)

        async def main() -> None:
            async with app.run_test(size=SIZE) as pilot:
                await until(pilot, lambda: isinstance(app.screen, InspectorScreen), "the inspector")
                await check(pilot, app.screen)
        asyncio.run(main())

    first = start("qwen3")
    try:
        ask(first, "A first model's conversation, kept on SSD, longer than the second model's two "
                   "so that by size it would come first if the entries were not grouped by model.", "a1")
        first.cache_flush(timeout=T)
        first_label, first_ns = label(first), first.stats()["namespace"]

        async def seen(pilot, screen: InspectorScreen) -> None:  # the first run learns its name
            await until(pilot, lambda: first_label in screen.table.model_names.values(), "the model's name")
        inspect(first, seen)
    finally:
        first.shutdown(timeout=T)
    assert [v.rsplit("/", 1)[-1] for v in names.namespace_names().values()] == [first_label]

    second = start("llama")
    try:
        ask(second, "The second model answers this one.", "b1")
        ask(second, "And this one too, a second conversation.", "b2")
        second_label = label(second)
        assert second_label != first_label and second.stats()["namespace"] != first_ns
        entries = second.cache_entries()
        theirs = {e.id for e in entries if e.ns == store_namespace(first_ns)}  # on SSD, from the first run
        mine = {e.id for e in entries} - theirs
        assert len(mine) == 2 and len(theirs) == 1

        async def check(pilot, screen: InspectorScreen) -> None:
            await until(pilot, lambda: set(screen.table.keys) == mine | theirs, "both models' entries")
            await until(pilot, lambda: screen.table.current_ns is not None, "the loaded model")
            assert set(screen.table.keys[:2]) == mine  # the loaded model's group first
            [other] = [screen.table.row(k) for k in theirs]
            assert screen.table.model_label(other.ns) == first_label  # named from the earlier run
            line = await until(pilot, lambda: str(screen.query_one("#fig-models").render()), "the share line")
            assert line.startswith(f"by model: {second_label} RAM ") and first_label in line
            shares = second.stats()["cache"]["namespaces"]
            assert shares[other.ns]["ram_bytes"] == 0 and shares[other.ns]["ssd_bytes"] > 0
            own = shares[screen.table.current_ns]
            assert own["ram_bytes"] > 0  # the loaded model's states are in RAM
            screen.table.sort_by("tokens", reverse=True)  # the largest first, inside each group
            assert screen.table.keys[2] == other.id
            await pilot.press("G")  # ungrouped: the largest first, whichever model
            await until(pilot, lambda: not screen.table.grouped, "ungrouped")
            assert screen.table.keys[0] == other.id
        inspect(second, check)
    finally:
        second.shutdown(timeout=T)
        names.close()
