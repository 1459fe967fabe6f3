"""The chat screen driven as a user drives it (``App.run_test`` + Pilot) on the real app,
the real engine and real models: the demo model (it answers its sample questions) and a
tiny random-weight qwen3 (it never stops on its own: replies to cancel). Conversations in
a real SQLite file, the prefix cache in a real folder, both under ``tmp_path``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tui_pilot import drive, make_settings, send, wait_for

from mlxkv.engine.settings import Settings
from mlxkv.tui.app import MlxkvApp
from mlxkv.tui.chat import session_for
from mlxkv.tui.conversations import ConversationStore
from mlxkv.tui.widgets.message import MessageView, code_blocks, format_status
from mlxkv.tui.widgets.prompt import PromptArea


def views(app: MlxkvApp) -> list[MessageView]:
    return list(app.chat.query(MessageView))


def open_app(settings: Settings) -> MlxkvApp:
    return MlxkvApp(settings)


def test_reply_streams_as_markdown_with_a_status_line(tmp_path: Path, data_dir: Path) -> None:
    app = open_app(make_settings(tmp_path))

    async def scenario(pilot: Any) -> None:
        await wait_for(pilot, app.metrics.interactive.is_set, "first screen")
        await pilot.press(*"What is mlxkv?")
        assert app.chat.prompt.text == "What is mlxkv?"
        await pilot.press("enter")
        assert app.chat.prompt.text == ""  # sent at once, even while the model loads
        await wait_for(pilot, lambda: app.metrics.replies == 1 and app.chat.pending is None, "reply")
        user, reply = views(app)
        assert (user.role, user.content) == ("user", "What is mlxkv?")
        assert reply.role == "assistant" and "mlxkv" in reply.content
        # The text reached the screen through the stream (token lag recorded per burst),
        # and the final Markdown document holds the whole reply.
        await wait_for(pilot, lambda: len(app.metrics.token_lag_s) > 0, "token shown")
        assert reply.body.source == reply.content
        status = str(reply.query_one(".status").render())
        assert "prompt tok" in status and "cached" in status and "TTFT" in status and "tok/s" in status
    drive(app, scenario)
    with ConversationStore() as store:
        (conversation,) = store.list()
        assert conversation.title == "What is mlxkv?"
        roles = [(m.role, m.content) for m in store.messages(conversation.id)]
        assert roles[0] == ("user", "What is mlxkv?") and roles[1][0] == "assistant"
        stats = store.messages(conversation.id)[1].stats
        assert stats["prompt_tokens"] > 0 and stats["finish_reason"] in ("stop", "length")


def test_a_reply_keeps_its_status_line_and_is_not_restyled_as_it_starts(
        tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Each layout reflows the whole screen and moves every message on it: the reply's view
    # comes with its status line (thinking…), which the first tokens change rather than hide
    # (then the figures replace it, same height); it is made a streaming reply, not restyled
    # into one (a class added to a mounted widget restyles all of it).
    status_at_append: list[tuple[bool, str]] = []
    restyled: list[tuple[str, bool]] = []  # (role, had text) of each message restyled
    append, update_styles = MessageView.append, MlxkvApp.update_styles

    async def watched_append(view: MessageView, text: str) -> None:
        status = view.query_one(".status")
        status_at_append.append((status.display, str(status.render())))
        await append(view, text)

    def watched_update_styles(app: MlxkvApp, node: Any, animate: bool = True) -> None:
        if isinstance(node, MessageView):
            restyled.append((node.role, bool(node.content)))
        update_styles(app, node, animate)
    monkeypatch.setattr(MessageView, "append", watched_append)
    monkeypatch.setattr(MlxkvApp, "update_styles", watched_update_styles)
    app = open_app(make_settings(tmp_path))

    async def scenario(pilot: Any) -> None:
        await wait_for(pilot, app.metrics.model_ready.is_set, "model")
        laid_out: list[int] = []  # messages on the screen at each layout
        app.screen.screen_layout_refresh_signal.subscribe(app.screen, lambda _: laid_out.append(len(views(app))))
        await send(pilot, "What is mlxkv?")
        assert 2 in laid_out and 1 not in laid_out  # the question and its reply, mounted together
        assert status_at_append and all(shown and text.startswith("writing…") for shown, text in status_at_append)
        assert "tok/s" in str(views(app)[-1].query_one(".status").render())
        assert ("assistant", False) not in restyled  # restyled once, when it ended
        assert ("assistant", True) in restyled
    drive(app, scenario)


def test_second_turn_reads_the_first_from_the_cache(tmp_path: Path, data_dir: Path) -> None:
    app = open_app(make_settings(tmp_path))

    async def scenario(pilot: Any) -> None:
        await send(pilot, "What is mlxkv?")
        await send(pilot, "How does the prefix cache work?")
        first, second = [v for v in views(app) if v.role == "assistant"]
        assert first.stats["cached_tokens"] == 0
        assert second.stats["cached_tokens"] > 0
        status = str(second.query_one(".status").render())
        assert f"{second.stats['cached_tokens']} cached (RAM {second.stats['cached_tokens']})" in status
    drive(app, scenario)


def test_esc_stops_a_reply_mid_stream_and_keeps_what_it_said(tmp_path: Path, data_dir: Path,
                                                             tiny_qwen3: Path) -> None:
    # Greedy, the random-weight model never picks its end token: only Esc ends this reply.
    app = open_app(make_settings(tmp_path, model=str(tiny_qwen3), max_tokens=20000, temperature=0))

    async def scenario(pilot: Any) -> None:
        app.chat.prompt.load_text("tell me everything")
        await pilot.press("enter")
        await wait_for(pilot, lambda: len(app.metrics.token_lag_s) >= 3, "streamed tokens")
        assert app.chat.pending is not None, ([n.message for n in app._notifications],
                                              [(v.content[:50], v.stats) for v in views(app)])
        await pilot.press("escape")
        await wait_for(pilot, lambda: app.chat.pending is None and app.metrics.replies == 1, "stop")
        reply = views(app)[-1]
        assert reply.stats["finish_reason"] == "cancelled"
        assert 0 < reply.stats["generated_tokens"] < 20000
        assert "cancelled" in str(reply.query_one(".status").render())
        conversation = app.chat.conversation
        stored = await app.db(app.store.messages, conversation.id)
        assert stored[-1].role == "assistant" and stored[-1].content == reply.content
        assert app.chat.prompt.has_focus  # the box takes the next message at once
    drive(app, scenario)


def test_switching_conversations_shows_each_ones_messages(tmp_path: Path, data_dir: Path) -> None:
    app = open_app(make_settings(tmp_path))

    async def scenario(pilot: Any) -> None:
        await send(pilot, "What is mlxkv?")
        first = app.chat.conversation
        await pilot.press("ctrl+n")
        await wait_for(pilot, lambda: app.chat.conversation is None and not views(app), "new chat")
        await send(pilot, "How does the prefix cache work?")
        second = app.chat.conversation
        assert second.id != first.id
        # The sidebar lists both, newest first; choosing the older one shows its messages.
        listed = await wait_for(pilot, lambda: [i.conversation.id for i in app.chat.query("ConversationItem")]
                                if len(app.chat.query("ConversationItem")) == 2 else None, "two listed")
        assert listed == [second.id, first.id]
        sidebar = app.chat.query_one("#conversations")
        sidebar.focus()
        sidebar.index = 1
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.chat.conversation is not None and app.chat.conversation.id == first.id,
                       "first conversation")
        assert [v.content for v in views(app)][0] == "What is mlxkv?"
        assert len(views(app)) == 2
        # Search narrows the list by message text.
        await pilot.press("ctrl+f")
        await pilot.press(*"how does")
        await wait_for(pilot, lambda: [i.conversation.id for i in app.chat.query("ConversationItem")]
                       == [second.id], "search result")
    drive(app, scenario)


def test_reopened_app_finds_the_conversation_and_its_cache(tmp_path: Path, data_dir: Path) -> None:
    settings = make_settings(tmp_path)
    first_app = open_app(settings)

    async def first_run(pilot: Any) -> None:
        await send(pilot, "What is mlxkv?")
    drive(first_app, first_run)  # closing the engine flushes the cache to its folder

    app = open_app(settings)

    async def second_run(pilot: Any) -> None:
        items = await wait_for(pilot, lambda: list(app.chat.query("ConversationItem")), "saved conversation")
        assert items[0].conversation.title == "What is mlxkv?"
        app.chat.query_one("#conversations").focus()
        await pilot.press("enter")
        await wait_for(pilot, lambda: len(views(app)) == 2, "its messages")
        assert views(app)[0].content == "What is mlxkv?"
        assert "prompt tok" in str(views(app)[1].query_one(".status").render())  # stats were kept
        # Opening it warmed its cached state from the SSD into RAM ...
        (opened, warm), = await wait_for(pilot, lambda: app.metrics.prefetched, "prefetch")
        assert opened == items[0].conversation.id and warm > 0
        await send(pilot, "How does the prefix cache work?")
        # ... so its next turn starts from RAM.
        reply = views(app)[-1]
        assert reply.stats["cached_tokens"] > 0
        assert reply.stats["cached_ram_tokens"] == reply.stats["cached_tokens"]
        assert f"(RAM {reply.stats['cached_tokens']})" in str(reply.query_one(".status").render())
    drive(app, second_run)


def test_enter_sends_and_ctrl_j_inserts_a_newline(tmp_path: Path, data_dir: Path) -> None:
    app = open_app(make_settings(tmp_path))

    async def scenario(pilot: Any) -> None:
        await pilot.press("a", "ctrl+j", "b")
        assert app.chat.prompt.text == "a\nb"
        assert app.chat.pending is None and app.chat.conversation is None
        await pilot.press("?")  # typed, not the help key, while writing
        assert app.chat.prompt.text == "a\nb?"
        app.chat.prompt.clear()
        await send(pilot, "What is mlxkv?")
        await pilot.press("up")  # on an empty box: the last message sent comes back
        assert app.chat.prompt.text == "What is mlxkv?"
    drive(app, scenario)


def test_a_model_that_does_not_load_is_a_notification(tmp_path: Path, data_dir: Path) -> None:
    app = open_app(make_settings(tmp_path, model=str(tmp_path / "no-such-model")))

    async def scenario(pilot: Any) -> None:
        await wait_for(pilot, app.metrics.model_ready.is_set, "load outcome")
        await pilot.pause()
        errors = [n for n in app._notifications if n.severity == "error"]
        assert errors and "F3" in errors[0].message and "no-such-model" in errors[0].message
        # The screen still works; a message sent says what to do and stays in the box.
        app.chat.prompt.load_text("hello")
        await pilot.press("enter")
        await wait_for(pilot, lambda: len([n for n in app._notifications if n.severity == "error"]) >= 2,
                       "second notification")
        assert "F3" in [n for n in app._notifications if n.severity == "error"][1].message
        assert app.chat.prompt.text == "hello" and app.chat.pending is None
        assert app.is_running
    drive(app, scenario)


def test_an_unusable_cache_folder_is_a_warning_and_chat_goes_on(tmp_path: Path, data_dir: Path) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder should be")
    settings = Settings.load({"cache_dir": str(blocker)}, env={"XDG_CONFIG_HOME": str(tmp_path / "config")})
    app = open_app(settings)

    async def scenario(pilot: Any) -> None:
        await wait_for(pilot, lambda: [n for n in app._notifications if "RAM only" in n.message],
                       "warning")
        await send(pilot, "What is mlxkv?")
        assert "mlxkv" in views(app)[-1].content
    drive(app, scenario)


def test_regenerate_and_branch(tmp_path: Path, data_dir: Path) -> None:
    app = open_app(make_settings(tmp_path))

    async def scenario(pilot: Any) -> None:
        await send(pilot, "What is mlxkv?")
        original = app.chat.conversation
        before = app.metrics.replies
        await pilot.press("ctrl+g")
        await wait_for(pilot, lambda: app.metrics.replies > before and app.chat.pending is None, "regenerated")
        stored = await app.db(app.store.messages, original.id)
        assert [m.role for m in stored] == ["user", "assistant"]  # replaced, not appended
        # Edit the question into a branch: the original stays, the branch is answered.
        await pilot.press("ctrl+e")
        await wait_for(pilot, lambda: type(app.screen).__name__ == "EditMessage", "editor")
        editor = app.screen.query_one("#text")
        editor.load_text("How does the prefix cache work?")
        before = app.metrics.replies
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: app.metrics.replies > before and app.chat.pending is None, "branch reply")
        branch = app.chat.conversation
        assert branch.id != original.id and branch.parent_id == original.id
        assert [v.content for v in views(app)][0] == "How does the prefix cache work?"
        kept = await app.db(app.store.messages, original.id)
        assert kept[0].content == "What is mlxkv?"
    drive(app, scenario)


def test_status_line_and_code_blocks() -> None:
    stats = {"prompt_tokens": 412, "cached_tokens": 384, "cached_ram_tokens": 256, "cached_ssd_tokens": 128,
             "ttft_s": 0.041, "generated_tokens": 96, "decode_tps": 231.4}
    line = format_status(stats, "stop")
    assert line == "412 prompt tok · 384 cached (RAM 256 · SSD 128) · TTFT 0.04 s · 96 tok at 231 tok/s"
    assert format_status({**stats, "cached_ram_tokens": 0, "cached_ssd_tokens": 0}, "cancelled").endswith("cancelled")
    # the model that answered leads (a folder's name, not its path)
    assert format_status({**stats, "model": "/models/SmolLM2-135M/"}, "stop") == "SmolLM2-135M · " + line
    assert "(SSD 384, read in 12 ms)" in format_status({**stats, "cached_ram_tokens": 0, "cached_ssd_tokens": 384,
                                                        "restore_ms": 12.3}, "stop")
    text = "Run:\n\n```sh\nmake run\n```\n\nthen\n\n~~~python\nprint(1)\n~~~\n"
    assert code_blocks(text) == ["make run\n", "print(1)\n"]


def test_where_cached_tokens_came_from() -> None:
    from mlxkv.tui.bridge import with_sources

    base = {"cached_tokens": 64, "retried": False}
    assert with_sources(base, {"tier": "ssd", "restore_ms": 4.0}) == {
        **base, "cached_ram_tokens": 0, "cached_ssd_tokens": 64, "restore_ms": 4.0}
    assert with_sources(base, {"tier": "ram", "restore_ms": 0.0})["cached_ram_tokens"] == 64
    # The engine's own split wins; the lookup adds how long the SSD read took.
    engine_split = {**base, "cached_ram_tokens": 16, "cached_ssd_tokens": 48}
    assert with_sources(engine_split, {"tier": "ssd", "restore_ms": 4.0}) == {**engine_split, "restore_ms": 4.0}
    assert with_sources({**base, "retried": True}, {"tier": "ssd"}) == {**base, "retried": True}


def test_session_ids_round_trip() -> None:
    from mlxkv.tui.chat import conversation_for

    assert conversation_for(session_for(42)) == 42
    assert conversation_for("someone-else") is None
    assert PromptArea.BINDINGS[0].id == "prompt.send"


def test_a_conversation_longer_than_the_context_is_a_notification(tmp_path: Path, data_dir: Path) -> None:
    app = open_app(make_settings(tmp_path))

    async def scenario(pilot: Any) -> None:
        await send(pilot, "word " * 5000)  # the demo model's context is 4096 tokens
        errors = [n for n in app._notifications if n.severity == "error"]
        assert errors and "too long" in errors[0].title and "Ctrl+N" in errors[0].message
        reply = views(app)[-1]
        assert "failed" in str(reply.query_one(".status").render())
        stored = await app.db(app.store.messages, app.chat.conversation.id)
        assert [m.role for m in stored] == ["user"]  # kept, to edit into a shorter branch
    drive(app, scenario)


def test_a_long_prompt_shows_prefill_progress(tmp_path: Path, data_dir: Path, tiny_qwen3: Path) -> None:
    app = open_app(make_settings(tmp_path, model=str(tiny_qwen3), prefill_step_size=32, max_tokens=4,
                                 temperature=0))

    async def scenario(pilot: Any) -> None:
        await send(pilot, " ".join(f"word{i}" for i in range(400)))
        assert app.metrics.prefill_updates >= 2  # chunk by chunk, on the bar
        assert app.chat.query_one("#progress").display is False  # gone once the reply streams
        assert views(app)[-1].stats["finish_reason"] == "length"
    drive(app, scenario)


def test_text_and_enter_in_one_terminal_read_are_sent_together(tmp_path: Path, data_dir: Path) -> None:
    # A terminal delivers "What is mlxkv?\r" (typed fast, or pasted) in one read: every key
    # is queued before the first is handled, and Enter must still send the whole text.
    from textual import events

    app = open_app(make_settings(tmp_path))

    async def scenario(pilot: Any) -> None:
        await wait_for(pilot, lambda: app.focused is app.chat.prompt, "message box")
        for ch in "What is mlxkv?":
            app._driver.process_message(events.Key(ch, ch))
        app._driver.process_message(events.Key("ctrl+j", None))
        app._driver.process_message(events.Key("x", "x"))
        app._driver.process_message(events.Key("enter", None))
        await wait_for(pilot, lambda: app.metrics.replies == 1 and app.chat.pending is None, "reply")
        assert views(app)[0].content == "What is mlxkv?\nx"
        assert app.chat.prompt.text == ""
    drive(app, scenario)


def test_quitting_mid_reply_keeps_what_it_said(tmp_path: Path, data_dir: Path, tiny_qwen3: Path) -> None:
    app = open_app(make_settings(tmp_path, model=str(tiny_qwen3), max_tokens=20000, temperature=0))

    async def scenario(pilot: Any) -> None:
        app.chat.prompt.load_text("tell me everything")
        await pilot.press("enter")
        await wait_for(pilot, lambda: len(app.metrics.token_lag_s) >= 3, "streamed tokens")
        await pilot.press("ctrl+q")
    drive(app, scenario)
    with ConversationStore() as store:
        (conversation,) = store.list()
        user, reply = store.messages(conversation.id)
        assert reply.role == "assistant" and reply.content
        assert reply.stats["finish_reason"] == "cancelled"


def test_deleting_a_conversation_mid_reply(tmp_path: Path, data_dir: Path, tiny_qwen3: Path) -> None:
    app = open_app(make_settings(tmp_path, model=str(tiny_qwen3), max_tokens=20000, temperature=0))

    async def scenario(pilot: Any) -> None:
        app.chat.prompt.load_text("tell me everything")
        await pilot.press("enter")
        await wait_for(pilot, lambda: len(app.metrics.token_lag_s) >= 3, "streamed tokens")
        await pilot.press("f8")
        await wait_for(pilot, lambda: type(app.screen).__name__ == "Confirm", "confirmation")
        await pilot.press("y")
        await wait_for(pilot, lambda: app.chat.pending is None and app.metrics.replies == 0
                       and app.chat.conversation is None, "stopped")
        await wait_for(pilot, lambda: any("Deleted" in n.message for n in app._notifications), "notice")
        await pilot.pause(0.2)
        assert not [n.message for n in app._notifications if n.severity == "error"]
        assert await app.db(app.store.list) == []
    drive(app, scenario)


def test_a_message_the_store_cannot_save_goes_back_to_the_box(tmp_path: Path, data_dir: Path) -> None:
    app = open_app(make_settings(tmp_path))

    async def scenario(pilot: Any) -> None:
        await send(pilot, "What is mlxkv?")
        app.store.close()  # the store now refuses every call, as a vanished disk would
        app.chat.prompt.load_text("How does the prefix cache work?")
        await pilot.press("enter")
        await wait_for(pilot, lambda: [n for n in app._notifications if n.severity == "error"], "error")
        assert app.chat.prompt.text == "How does the prefix cache work?"
        assert app.chat.pending is None and len(views(app)) == 2
    drive(app, scenario)


def store_long_conversation() -> None:
    """A conversation longer than the screen (16 messages), in the store of ``data_dir``."""
    with ConversationStore() as store:
        conversation = store.create("long one")
        for i in range(8):
            store.add_message(conversation.id, "user", f"question {i}")
            store.add_message(conversation.id, "assistant", "\n\n".join(f"line {j} of answer {i}" for j in range(4)))


def terminal_key(app: MlxkvApp, name: str) -> None:
    """A key as the terminal sends it (Pilot.press would wait for what it starts to end)."""
    from textual import events

    app._driver.process_message(events.Key(name, None))


async def open_listed_conversation(pilot: Any, messages: int) -> None:
    app = pilot.app
    await wait_for(pilot, lambda: list(app.chat.query("ConversationItem")), "listed")
    app.chat.query_one("#conversations").focus()
    await pilot.press("enter")
    await wait_for(pilot, lambda: len(views(app)) == messages, "its messages")


def test_the_view_follows_the_reply_unless_scrolled_up(tmp_path: Path, data_dir: Path, tiny_qwen3: Path) -> None:
    store_long_conversation()
    # Sampled with this seed, the random-weight model writes text for over 1000 tokens.
    app = open_app(make_settings(tmp_path, model=str(tiny_qwen3), max_tokens=1000, temperature=1.0, seed=3))

    async def scenario(pilot: Any) -> None:
        await open_listed_conversation(pilot, 16)
        box = app.chat.messages_box
        shown = app.metrics.token_lag_s

        async def stream_some(more: int = 5) -> None:
            start = len(shown)
            await wait_for(pilot, lambda: len(shown) >= start + more and app.chat.pending is not None,
                           "streamed text")

        def key(name: str) -> None:  # pilot.press would wait out the reply
            terminal_key(app, name)

        app.chat.prompt.load_text("tell me everything")
        key("enter")
        await stream_some()
        assert box.max_scroll_y > 0 and box.scroll_y == box.max_scroll_y  # it follows
        box.focus()
        key("home")  # the user scrolls up while it streams
        await wait_for(pilot, lambda: box.scroll_y == 0, "scrolled to the top")
        await stream_some()
        assert box.scroll_y == 0  # left where the user put it
        key("end")  # back at the end, it follows again
        await wait_for(pilot, lambda: box.scroll_y == box.max_scroll_y, "scrolled to the end")
        grown = box.max_scroll_y
        await wait_for(pilot, lambda: box.max_scroll_y > grown, "more lines")
        await pilot.pause(0.1)
        assert box.scroll_y == box.max_scroll_y
        key("escape")
        await wait_for(pilot, lambda: app.chat.pending is None, "stopped")
    drive(app, scenario)


def test_end_puts_the_view_at_the_latest_line_at_once_and_it_follows(tmp_path: Path, data_dir: Path) -> None:
    # Textual animates End for a second towards the end as it was when the key came, while
    # the anchor puts the view at the end at each layout; a reply's tokens lay the screen
    # out only when they add a line, so the animation's last step could leave the view
    # short of the reply until the next line.
    store_long_conversation()
    app = open_app(make_settings(tmp_path))

    async def scenario(pilot: Any) -> None:
        await open_listed_conversation(pilot, 16)
        box = app.chat.messages_box
        box.focus()
        await pilot.press("home")
        await wait_for(pilot, lambda: box.scroll_y == 0, "scrolled to the top")
        terminal_key(app, "end")
        await pilot.pause(0.1)
        assert box.scroll_y == box.max_scroll_y > 0
        assert not app.animator.is_being_animated(box, "scroll_y")
        reply = MessageView("assistant")  # a reply that grows from there, a line at a time
        await box.mount(reply)
        reply.start_stream()
        for i in range(4):
            end = box.max_scroll_y
            await reply.append(f"line {i} of the reply\n\n")
            await pilot.pause()
            assert box.scroll_y == box.max_scroll_y > end
        await reply.finish()
    drive(app, scenario)


def test_messages_keep_their_width_when_the_list_starts_to_scroll(tmp_path: Path, data_dir: Path) -> None:
    # The scroll bar's columns are kept for it: a conversation that outgrows the screen (a
    # reply that gets long) had every message on the screen wrapped again, narrower, and
    # repainted in one frame, the text jumping sideways.
    store_long_conversation()
    with ConversationStore() as store:
        short = store.create("short one")
        store.add_message(short.id, "user", "question")
        store.add_message(short.id, "assistant", "answer")
        (long_one,) = [c for c in store.list() if c.title == "long one"]
    app = open_app(make_settings(tmp_path))

    async def scenario(pilot: Any) -> None:
        box = app.chat.messages_box
        await app.chat.open_conversation(short.id)
        await wait_for(pilot, lambda: len(views(app)) == 2 and views(app)[0].size.width, "its messages")
        assert box.max_scroll_y == 0
        width = views(app)[0].size.width
        await app.chat.open_conversation(long_one.id)
        await wait_for(pilot, lambda: len(views(app)) == 16 and box.max_scroll_y > 0, "its messages")
        await pilot.pause()
        assert [v.size.width for v in views(app)] == [width] * 16
    drive(app, scenario)


def test_control_characters_of_a_reply_never_reach_the_terminal(tmp_path: Path, data_dir: Path,
                                                                tiny_qwen3: Path) -> None:
    # With this seed the random-weight model's reply starts with ESC: drawn raw, it would
    # be an escape sequence sent to the user's terminal.
    app = open_app(make_settings(tmp_path, model=str(tiny_qwen3), max_tokens=20, temperature=0.8, seed=2))

    async def scenario(pilot: Any) -> None:
        await send(pilot, "tell me everything")
        await pilot.pause()
        reply = views(app)[-1]
        assert "\x1b" in reply.content  # kept as the model wrote it (copy, export)
        screen = ["".join(seg.text for seg in strip) for strip in app.screen._compositor.render_strips()]
        assert not [line for line in screen if "\x1b" in line]
        assert any("\u241b" in line for line in screen)  # shown as the ESC symbol
    drive(app, scenario)
