"""The app shell on the real app, engine and demo model: start-up (the screen takes keys
while the model loads; importing the app imports no mlx), keys with ids and the F1 list,
a key map file, the command palette, themes kept across runs, the model switcher, the
conversations file when it is unreadable, export, copy, and conversations opened from
the cache inspector."""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from textual.binding import Binding
from tui_pilot import drive, make_settings, pick_model, send, wait_for

from mlxkv.engine.settings import DEMO_MODEL
from mlxkv.tui.app import MlxkvApp
from mlxkv.tui.chat import ChatScreen, session_for
from mlxkv.tui.messages import OpenConversation
from mlxkv.tui.widgets.message import MessageView
from mlxkv.tui.widgets.modals import AskText, ConversationSettings, ModelPicker
from mlxkv.tui.widgets.prompt import PromptArea
from mlxkv.tui.widgets.sidebar import ConversationList

ROOT = Path(__file__).resolve().parent.parent


def notices(app: MlxkvApp, severity: str | None = None) -> list[str]:
    return [n.message for n in app._notifications if severity is None or n.severity == severity]


def test_importing_the_app_imports_neither_mlx_nor_the_engine() -> None:
    code = ("import sys, mlxkv.tui.app, mlxkv.tui.chat, mlxkv.tui.bridge\n"
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm', 'transformers')\n"
            "               or m.startswith('mlxkv.engine'))\n"
            "print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_screen_takes_keys_while_the_model_loads(tmp_path: Path, data_dir: Path) -> None:
    app = MlxkvApp(make_settings(tmp_path))

    async def scenario(pilot: Any) -> None:
        await wait_for(pilot, app.metrics.interactive.is_set, "first screen")
        assert app.focused is app.chat.prompt
        await pilot.press("h", "i")
        assert app.chat.prompt.text == "hi"
        await wait_for(pilot, app.metrics.model_ready.is_set, "model")
        # The engine is started after the first paint: the screen was up before the model.
        assert app.metrics.interactive_at < app.metrics.model_ready_at
        assert app.metrics.load_stages[0] == "starting" and "ready" in app.metrics.load_stages
        assert app.bridge.error is None and app.bridge.info["context_tokens"] > 0
        await pilot.pause()
        assert app.chat.query_one("#progress").display is False
    drive(app, scenario)


def test_what_the_load_built_is_frozen_out_of_the_collector_while_the_engine_runs(
        tmp_path: Path, data_dir: Path) -> None:
    # A full collection walked every object of mlx-lm, the tokenizer and the model (~100 ms
    # with every thread held, the UI's too) every few replies.
    gc.unfreeze()  # objects another test's start-up froze
    app = MlxkvApp(make_settings(tmp_path))

    async def scenario(pilot: Any) -> None:
        await wait_for(pilot, app.metrics.model_ready.is_set, "model")
        assert app.bridge.error is None
        assert gc.isenabled() and gc.get_freeze_count() > 10_000
    drive(app, scenario)
    assert gc.get_freeze_count() == 0  # the stopped engine's objects can be collected again


def test_every_binding_has_an_id_and_f1_lists_them(tmp_path: Path, data_dir: Path) -> None:
    for cls in (MlxkvApp, ChatScreen, PromptArea, MessageView, ConversationList):
        for b in cls.BINDINGS:
            assert isinstance(b, Binding) and b.id, f"{cls.__name__}: {b}"
    app = MlxkvApp(make_settings(tmp_path))

    async def scenario(pilot: Any) -> None:
        app.chat.query_one("#messages").focus()  # "?" outside the message box
        await pilot.press("question_mark")
        # the help screen fills its Markdown after it is mounted: wait for the text itself
        text = await wait_for(pilot, lambda: type(app.screen).__name__ == "HelpScreen"
                              and app.screen.query("Markdown") and app.screen.query_one("Markdown").source,
                              "help")
        for bid in ("app.quit", "chat.new", "chat.cancel", "prompt.send", "prompt.newline", "message.copy"):
            assert f"`{bid}`" in text
        await pilot.press("escape")
        await wait_for(pilot, lambda: app.screen is app.chat, "chat again")
        await pilot.press("f1")
        await wait_for(pilot, lambda: type(app.screen).__name__ == "HelpScreen", "help on F1")
    drive(app, scenario)


def test_a_key_map_file_remaps_a_binding_by_id(tmp_path: Path, data_dir: Path) -> None:
    keys = tmp_path / "config" / "mlxkv" / "keys.toml"
    keys.parent.mkdir(parents=True)
    keys.write_text('"chat.new" = "f9"\n')
    app = MlxkvApp(make_settings(tmp_path))

    async def scenario(pilot: Any) -> None:
        await send(pilot, "What is mlxkv?")
        assert app.chat.conversation is not None
        await pilot.press("f9")
        await wait_for(pilot, lambda: app.chat.conversation is None, "new chat on f9")
    drive(app, scenario)


def test_every_chat_action_is_in_the_command_palette(tmp_path: Path, data_dir: Path) -> None:
    app = MlxkvApp(make_settings(tmp_path))

    async def scenario(pilot: Any) -> None:
        titles = [c.title for c in app.get_system_commands(app.chat)]
        for title in ("New chat", "Rename conversation", "Delete conversation", "Export conversation",
                      "Search conversations", "System prompt and sampling", "Regenerate reply",
                      "Edit and branch", "Stop reply", "Copy reply", "Copy code", "Switch model",
                      "Cache inspector", "Help: keys", "Theme"):
            assert title in titles
        await send(pilot, "What is mlxkv?")
        await pilot.press("ctrl+p")
        await wait_for(pilot, lambda: type(app.screen).__name__ == "CommandPalette", "palette")
        await pilot.press(*"Rename conversation")
        await pilot.pause(0.3)  # the palette searches in a worker: wait for its list
        await wait_for(pilot, lambda: app.screen.query("CommandList") and
                       app.screen.query_one("CommandList").option_count > 0, "matches")
        await pilot.press("enter")
        await wait_for(pilot, lambda: isinstance(app.screen, AskText), "rename dialog")
        app.screen.query_one("#answer").value = "[b]Renamed[/b"  # shown as typed, not as markup
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.chat.conversation.title == "[b]Renamed[/b", "renamed")
        stored = await app.db(app.store.get, app.chat.conversation.id)
        assert stored.title == "[b]Renamed[/b"
        await pilot.pause()
        assert "[b]Renamed[/b" in str(app.chat.query_one("#model-bar").render())
    drive(app, scenario)


def test_the_theme_is_kept_across_runs(tmp_path: Path, data_dir: Path) -> None:
    app = MlxkvApp(make_settings(tmp_path))

    async def scenario(pilot: Any) -> None:
        app.theme = "nord"
        await pilot.pause()
    drive(app, scenario)
    assert json.loads((data_dir / "tui.json").read_text())["theme"] == "nord"
    again = MlxkvApp(make_settings(tmp_path))
    try:
        assert again.theme == "nord"
    finally:
        again.close_engine()


def test_model_switcher_reports_a_bad_folder_and_loads_the_demo_model(tmp_path: Path, data_dir: Path) -> None:
    app = MlxkvApp(make_settings(tmp_path))

    async def scenario(pilot: Any) -> None:
        await wait_for(pilot, app.metrics.model_ready.is_set, "model")
        await pick_model(pilot, str(tmp_path / "missing-model"))
        await wait_for(pilot, lambda: app.bridge.error is not None, "load failure")
        await wait_for(pilot, lambda: any("F3" in m for m in notices(app, "error")), "notification")
        await pilot.press("f3")
        await wait_for(pilot, lambda: isinstance(app.screen, ModelPicker), "model picker again")
        options = app.screen.query_one("#choices")
        options.focus()
        options.highlighted = 0
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.bridge.ready.is_set() and app.bridge.error is None
                       and app.bridge.info, "demo model")
        assert app.bridge.model_spec == str(DEMO_MODEL)
        await send(pilot, "What is mlxkv?")
        assert "mlxkv" in app.chat.query(MessageView).last().content
    drive(app, scenario)


def test_an_unreadable_conversations_file_is_moved_aside(tmp_path: Path, data_dir: Path) -> None:
    data_dir.mkdir(mode=0o700)
    (data_dir / "conversations.db").write_bytes(b"not a database at all" * 100)
    app = MlxkvApp(make_settings(tmp_path))

    async def scenario(pilot: Any) -> None:
        await wait_for(pilot, lambda: any("moved" in m for m in notices(app, "warning")), "notice")
        await send(pilot, "What is mlxkv?")
    drive(app, scenario)
    assert [p.name for p in data_dir.iterdir() if "unreadable" in p.name]
    assert (data_dir / "conversations.db").stat().st_size > 0


def test_export_copy_and_conversation_settings(tmp_path: Path, data_dir: Path) -> None:
    app = MlxkvApp(make_settings(tmp_path))
    target = tmp_path / "out" / "chat.md"

    async def scenario(pilot: Any) -> None:
        await send(pilot, "What is mlxkv?")
        reply = app.chat.query(MessageView).last()
        await pilot.press("ctrl+y")
        assert app.clipboard == reply.content
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: isinstance(app.screen, AskText), "export dialog")
        assert app.screen.query_one("#answer").value.startswith(str(data_dir / "exports"))
        app.screen.query_one("#answer").value = str(target)
        await pilot.press("enter")
        await wait_for(pilot, lambda: any(str(target) in m for m in notices(app)), "where it went")
        assert "What is mlxkv?" in target.read_text() and reply.content.strip()[:20] in target.read_text()
        await pilot.press("ctrl+t")
        await wait_for(pilot, lambda: isinstance(app.screen, ConversationSettings), "settings dialog")
        app.screen.query_one("#system").load_text("Answer briefly.")
        app.screen.query_one("#s-temperature").value = "warm"
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert isinstance(app.screen, ConversationSettings)  # refused, saying why
        assert "temperature" in str(app.screen.query_one("#error").render())
        app.screen.query_one("#s-temperature").value = "0"
        app.screen.query_one("#s-max_tokens").value = "32"
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: app.screen is app.chat, "saved")
        stored = await wait_for(pilot, lambda: app.chat.conversation.sampling and app.chat.conversation,
                                "sampling saved")
        assert stored.sampling == {"temperature": 0.0, "max_tokens": 32}
        assert stored.system_prompt == "Answer briefly."
        assert app.chat.sampling()["max_tokens"] == 32
        assert app.chat._payload()[0] == {"role": "system", "content": "Answer briefly."}
    drive(app, scenario)


def test_open_conversation_from_the_inspector(tmp_path: Path, data_dir: Path) -> None:
    app = MlxkvApp(make_settings(tmp_path))

    async def scenario(pilot: Any) -> None:
        heard: list[Any] = []
        app.bridge.subscribe(heard.append)  # what the inspector listens to
        await send(pilot, "What is mlxkv?")
        await wait_for(pilot, lambda: any(type(e).__name__ == "CacheEvent" for e in heard), "cache event")
        first = app.chat.conversation
        await pilot.press("ctrl+n")
        await wait_for(pilot, lambda: app.chat.conversation is None, "new chat")
        await pilot.press("f2")
        await wait_for(pilot, lambda: type(app.screen).__name__ == "InspectorScreen", "inspector")
        # the inspector's actions are in the palette while it is open, its keys in F1
        titles = [c.title for c in app.get_system_commands(app.screen)]
        assert "Cache misses" in titles and "Evict entry" in titles
        inspector = app.screen
        await pilot.press("f1")
        await wait_for(pilot, lambda: type(app.screen).__name__ == "HelpScreen", "help")
        assert "`inspector.misses`" in app.screen.query_one("Markdown").source
        await pilot.press("escape")
        await wait_for(pilot, lambda: app.screen is inspector, "the inspector again")
        app.screen.post_message(OpenConversation(session_for(first.id)))
        await wait_for(pilot, lambda: app.screen is app.chat and app.chat.conversation is not None
                       and app.chat.conversation.id == first.id, "conversation opened")
        app.post_message(OpenConversation("not-a-chat-session"))
        await wait_for(pilot, lambda: any("not from a saved conversation" in m for m in notices(app)), "notice")
    drive(app, scenario)


def test_the_model_picker_offers_the_models_of_the_stores(tmp_path: Path, tiny_llama: Path) -> None:
    from mlxkv.tui.app import local_models

    hub = tmp_path / "hf" / "hub"
    snap = hub / "models--mlx-community--Qwen3-0.6B-4bit" / "snapshots" / "abc"
    shutil.copytree(tiny_llama, snap)
    (hub / "models--mlx-community--Qwen3-0.6B-4bit" / "refs").mkdir()
    (hub / "models--mlx-community--Qwen3-0.6B-4bit" / "refs" / "main").write_text("abc")
    (hub / "models--someone--empty").mkdir()  # no snapshot: nothing to load
    (hub / "datasets--someone--data").mkdir()
    home = {"HOME": str(tmp_path / "home")}
    [(label, name)] = local_models(env={**home, "HF_HOME": str(tmp_path / "hf")})
    assert name == "hf:mlx-community/Qwen3-0.6B-4bit" and "hf, " in label and "llama" in label
    assert local_models(env={**home, "HF_HUB_CACHE": str(tmp_path / "nowhere")}) == []


def test_bare_mlxkv_without_a_terminal_answers_as_the_line_chat(tmp_path: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MLXKV_CACHE_DIR": str(tmp_path / "cache"),
           "MLXKV_DATA_DIR": str(tmp_path / "data"), "XDG_CONFIG_HOME": str(tmp_path / "config")}
    env.pop("MLXKV_CONFIG", None)
    out = subprocess.run([sys.executable, "-m", "mlxkv"], input="What is mlxkv?\n", cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "local LLM engine" in out.stdout and "\x1b[" not in out.stdout


def test_the_app_leaves_when_its_terminal_goes_away(tmp_path: Path) -> None:
    # The pty is not the child's controlling terminal, so closing it sends no SIGHUP, as
    # when a wrapper that survives the hangup (`make run`) holds the session. The app must
    # notice the dead terminal and exit instead of spinning on it forever.
    import pty
    import select

    root = ROOT
    master, slave = pty.openpty()
    env = {**os.environ, "MLXKV_DATA_DIR": str(tmp_path / "data"), "MLXKV_CACHE_DIR": str(tmp_path / "cache"),
           "XDG_CONFIG_HOME": str(tmp_path / "cfg"), "HF_HUB_OFFLINE": "1", "TERM": "xterm-256color"}
    proc = subprocess.Popen([sys.executable, "-m", "mlxkv"], stdin=slave, stdout=slave, stderr=slave,
                            cwd=root, env=env, start_new_session=True)
    os.close(slave)
    try:
        seen = b""
        deadline = time.monotonic() + 60
        while b"demo model" not in seen and time.monotonic() < deadline:  # the screen is drawn
            if select.select([master], [], [], 1.0)[0]:
                seen += os.read(master, 65536)
        assert b"demo model" in seen, seen[-500:]
        os.close(master)
        master = -1
        assert proc.wait(timeout=60) in (129, 0)
    finally:
        if master >= 0:
            os.close(master)
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def test_switching_model_keeps_the_conversation_and_names_who_answered(tmp_path: Path, data_dir: Path) -> None:
    """F3 to another model mid-conversation: the messages stay, the next reply comes from the
    new model (which prefills the whole conversation), and each reply's status line and
    label name the model that wrote it, after the conversation is opened again too."""
    from support.modelgen import tiny_model

    other = tiny_model("qwen3")
    app = MlxkvApp(make_settings(tmp_path, max_tokens=8, temperature=0))

    def statuses() -> list[str]:
        return [str(v.query_one(".status").render()) for v in app.chat.query(MessageView) if v.role == "assistant"]

    async def scenario(pilot: Any) -> None:
        await wait_for(pilot, app.metrics.model_ready.is_set, "model")
        demo = str(app.bridge.info["model"]).rstrip("/").rsplit("/", 1)[-1]
        await send(pilot, "What is mlxkv?")
        await pick_model(pilot, str(other))
        await wait_for(pilot, lambda: app.bridge.ready.is_set() and app.bridge.model_spec == str(other)
                       and app.bridge.info, "the other model")
        assert [v.role for v in app.chat.query(MessageView)] == ["user", "assistant"]  # kept
        await send(pilot, "And what does it keep?")
        first, second = statuses()
        assert first.startswith(f"{demo} · ") and second.startswith(f"{other.name} · ")
        prompt = int(second.split(" · ")[1].split()[0])
        assert prompt > 10  # the new model read the whole conversation, not the last line alone
        cid = app.chat.conversation.id
        await app.chat.open_conversation(cid)
        await wait_for(pilot, lambda: len(statuses()) == 2, "the conversation again")
        again = statuses()
        assert again[0].startswith(f"{demo} · ") and again[1].startswith(f"{other.name} · ")
        labels = [str(v.query_one(".role").render()) for v in app.chat.query(MessageView) if v.role == "assistant"]
        assert labels[0].endswith(demo) and labels[1].endswith(other.name)
    drive(app, scenario)
