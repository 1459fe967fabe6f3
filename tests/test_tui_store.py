"""The TUI's conversation store on real SQLite files: CRUD, search, branches, regenerate,
export, persistence across reopen, migration of a version-1 file, unusable files, threads."""

from __future__ import annotations

import os
import sqlite3
import stat
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from mlxkv.tui.conversations import (
    APPLICATION_ID,
    SCHEMA_VERSION,
    ConversationStore,
    NotFoundError,
    StoreError,
    default_path,
    move_aside,
)


@pytest.fixture
def store(tmp_path):
    with ConversationStore(tmp_path / "data" / "conversations.db") as s:
        yield s


def test_default_path_follows_the_environment(tmp_path):
    home = os.path.expanduser("~")
    assert default_path({}) == default_path({"HOME": home})
    assert str(default_path({})).endswith(os.path.join(".local", "share", "mlxkv", "conversations.db"))
    assert default_path({"XDG_DATA_HOME": str(tmp_path)}) == tmp_path / "mlxkv" / "conversations.db"
    assert default_path({"XDG_DATA_HOME": "/x", "MLXKV_DATA_DIR": str(tmp_path)}) == tmp_path / "conversations.db"


def test_env_data_dir_is_used_and_the_files_are_private(tmp_path, monkeypatch):
    monkeypatch.setenv("MLXKV_DATA_DIR", str(tmp_path / "d"))
    old = os.umask(0o022)
    try:
        with ConversationStore() as s:
            s.create("x")
            path = s.path
    finally:
        os.umask(old)
    assert path == tmp_path / "d" / "conversations.db"
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    db = sqlite3.connect(path)
    try:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert db.execute("PRAGMA application_id").fetchone()[0] == APPLICATION_ID
    finally:
        db.close()


def test_crud(store):
    c = store.create(model="demo", system_prompt="Be brief.", sampling={"temp": 0.0})
    assert (c.title, c.model, c.system_prompt, c.sampling) == ("New chat", "demo", "Be brief.", {"temp": 0.0})
    assert c.parent_id is None and c.branched_from_message is None
    assert store.get(c.id) == c
    m1 = store.add_message(c.id, "user", "What is mlxkv?")
    m2 = store.add_message(c.id, "assistant", "")
    assert (m1.position, m2.position) == (0, 1) and m2.stats is None
    m2 = store.update_message(m2.id, "A local LLM engine.", stats={"prompt_tokens": 12, "cached_tokens": 0})
    assert store.update_message(m2.id, "A local LLM engine on MLX.").stats == {"prompt_tokens": 12,
                                                                              "cached_tokens": 0}
    assert [(m.role, m.content) for m in store.messages(c.id)] == [
        ("user", "What is mlxkv?"), ("assistant", "A local LLM engine on MLX.")]
    assert store.rename(c.id, "  About mlxkv ").title == "About mlxkv"
    assert store.set_system_prompt(c.id, None).system_prompt is None
    assert store.set_sampling(c.id, {"temp": 0.7, "top_p": 0.9}).sampling == {"temp": 0.7, "top_p": 0.9}
    assert store.set_model(c.id, "~/models/x").model == "~/models/x"
    store.delete(c.id)
    assert store.list() == []
    with pytest.raises(NotFoundError, match="no conversation with id"):
        store.get(c.id)
    with pytest.raises(NotFoundError):
        store.messages(c.id)
    with pytest.raises(NotFoundError, match="no message"):
        store.update_message(m1.id, "gone")  # deleted with its conversation


def test_bad_input_is_refused_and_changes_nothing(store):
    c = store.create()
    with pytest.raises(ValueError, match="role must be one of"):
        store.add_message(c.id, "robot", "hi")
    with pytest.raises(ValueError, match="title"):
        store.rename(c.id, "   ")
    with pytest.raises(ValueError, match="JSON"):
        store.set_sampling(c.id, {"temp": object()})
    with pytest.raises(ValueError, match="sampling must be a dict"):
        store.set_sampling(c.id, [("temp", 0)])
    with pytest.raises(NotFoundError):
        store.add_message(c.id + 1, "user", "hi")
    assert store.messages(c.id) == [] and store.get(c.id) == c


def test_list_is_newest_first_and_search_matches_titles_and_messages(tmp_path):
    t = [1000.0]

    def clock() -> float:
        t[0] += 1
        return t[0]

    with ConversationStore(tmp_path / "c.db", clock=clock) as store:
        a = store.create("Cooking")
        b = store.create("Travel")
        store.add_message(a.id, "user", "How long do I boil an EGG?")
        assert [c.id for c in store.list()] == [a.id, b.id]  # a message makes it the newest
        store.add_message(b.id, "user", "100% sure about_this")
        assert [c.id for c in store.list()] == [b.id, a.id]
        assert [c.id for c in store.list("egg")] == [a.id]
        assert [c.id for c in store.list("TRAV")] == [b.id]
        assert [c.id for c in store.list("100%")] == [b.id]
        assert store.list("0%s") == []  # % and _ are literal, not wildcards
        assert store.list("t_is") == []
        assert [c.id for c in store.list("about_this")] == [b.id]
        assert [c.id for c in store.list("")] == [b.id, a.id]


def test_truncate_after_is_regenerate(store):
    c = store.create()
    for role, text in [("user", "q1"), ("assistant", "a1"), ("user", "q2"), ("assistant", "a2")]:
        store.add_message(c.id, role, text)
    assert store.truncate_after(c.id, 2) == 1
    new = store.add_message(c.id, "assistant", "a2 again")
    assert new.position == 3
    assert [m.content for m in store.messages(c.id)] == ["q1", "a1", "q2", "a2 again"]
    assert store.truncate_after(c.id, -1) == 4 and store.messages(c.id) == []


def test_branch_copies_the_messages_before_and_the_edit(store):
    c = store.create("Trip", model="demo", system_prompt="sys", sampling={"temp": 0.5})
    msgs = [store.add_message(c.id, r, t, stats={"n": i} if r == "assistant" else None)
            for i, (r, t) in enumerate([("user", "q1"), ("assistant", "a1"), ("user", "q2"), ("assistant", "a2")])]
    b = store.branch(c.id, msgs[2].id, new_content="q2, edited")
    assert (b.title, b.model, b.system_prompt, b.sampling) == ("Trip", "demo", "sys", {"temp": 0.5})
    assert (b.parent_id, b.branched_from_message) == (c.id, msgs[2].id)
    got = store.messages(b.id)
    assert [(m.role, m.content, m.position, m.stats) for m in got] == [
        ("user", "q1", 0, None), ("assistant", "a1", 1, {"n": 1}), ("user", "q2, edited", 2, None)]
    assert all(m.conversation_id == b.id for m in got)
    assert len(store.messages(c.id)) == 4  # the original is untouched
    plain = store.branch(c.id, msgs[1].id)
    assert [m.content for m in store.messages(plain.id)] == ["q1"]
    with pytest.raises(NotFoundError, match="has no message"):
        store.branch(b.id, msgs[0].id)  # a message of another conversation
    store.delete(c.id)  # the branch survives its parent, unlinked
    assert store.get(b.id).parent_id is None and store.get(b.id).branched_from_message is None
    assert len(store.messages(b.id)) == 3


def test_export_markdown(store):
    c = store.create("Fenced", model="demo", system_prompt="Answer in code.")
    store.add_message(c.id, "user", "Print hi")
    store.add_message(c.id, "assistant", "```python\nprint('hi')\n```\n")
    md = store.export_markdown(c.id)
    assert md.startswith("# Fenced\n\n*demo · started ")
    assert "## System prompt\n\nAnswer in code.\n" in md
    assert md.endswith("## User\n\nPrint hi\n\n## Assistant\n\n```python\nprint('hi')\n```\n")


def test_reopen_finds_everything(tmp_path):
    path = tmp_path / "c.db"
    s = ConversationStore(path)
    c = s.create("kept", sampling={"max_tokens": 64})
    s.add_message(c.id, "user", "hello")
    s.add_message(c.id, "assistant", "hi there", stats={"ttft_s": 0.01})
    c = s.get(c.id)
    s.close()
    s.close()  # idempotent
    with pytest.raises(StoreError, match="closed"):
        s.list()
    with ConversationStore(path) as again:
        assert again.get(c.id) == c
        assert [(m.content, m.stats) for m in again.messages(c.id)] == [
            ("hello", None), ("hi there", {"ttft_s": 0.01})]
        assert again.create().id > c.id


def _write_v1(path) -> None:
    """A conversations file exactly as schema version 1 left it."""
    db = sqlite3.connect(path)
    db.executescript(f"""
        PRAGMA application_id = {APPLICATION_ID};
        CREATE TABLE conversations (
            id INTEGER PRIMARY KEY AUTOINCREMENT, title TEXT NOT NULL, created REAL NOT NULL,
            updated REAL NOT NULL, model TEXT, system_prompt TEXT);
        CREATE TABLE messages (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
            role TEXT NOT NULL, content TEXT NOT NULL, created REAL NOT NULL, position INTEGER NOT NULL);
        CREATE INDEX messages_by_conversation ON messages(conversation_id, position);
        INSERT INTO conversations VALUES (7, 'Old chat', 10.0, 20.0, 'demo', 'Be kind.');
        INSERT INTO messages VALUES (1, 7, 'user', 'old question', 11.0, 0);
        INSERT INTO messages VALUES (2, 7, 'assistant', 'old answer', 12.0, 1);
        PRAGMA user_version = 1;
    """)
    db.close()


def test_a_version_1_file_is_migrated(tmp_path):
    path = tmp_path / "old.db"
    _write_v1(path)
    with ConversationStore(path) as s:
        c = s.get(7)
        assert (c.title, c.created, c.updated, c.model, c.system_prompt) == ("Old chat", 10.0, 20.0, "demo",
                                                                             "Be kind.")
        assert (c.sampling, c.parent_id, c.branched_from_message) == ({}, None, None)
        assert [(m.id, m.content, m.position, m.stats) for m in s.messages(7)] == [
            (1, "old question", 0, None), (2, "old answer", 1, None)]
        m = s.add_message(7, "user", "new question", stats={"x": 1})
        assert (m.position, m.stats) == (2, {"x": 1})
        b = s.branch(7, 2, "edited answer")
        assert b.parent_id == 7
    db = sqlite3.connect(path)
    try:
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        # version 2 made positions unique per conversation
        with pytest.raises(sqlite3.IntegrityError):
            db.execute("INSERT INTO messages (conversation_id, role, content, created, position) "
                       "VALUES (7, 'user', 'dup', 0, 0)")
    finally:
        db.close()


def test_a_file_from_a_newer_mlxkv_is_refused_untouched(tmp_path):
    path = tmp_path / "new.db"
    _write_v1(path)
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 5}")
    db.close()
    before = path.read_bytes()
    with pytest.raises(StoreError, match="newer mlxkv") as e:
        ConversationStore(path)
    assert not e.value.unreadable
    assert path.read_bytes() == before


def test_a_file_that_is_not_a_database_is_a_clear_error_and_a_fresh_store_can_start(tmp_path):
    path = tmp_path / "conversations.db"
    junk = b"this is not SQLite at all, just some text that was here before\n" * 100
    path.write_bytes(junk)
    with pytest.raises(StoreError, match="not a readable conversations database") as e:
        ConversationStore(path)
    assert e.value.unreadable and e.value.path == path
    assert "move it away" in str(e.value)
    assert path.read_bytes() == junk  # nothing lost
    kept = move_aside(path)
    assert kept.read_bytes() == junk and kept.parent == tmp_path and kept.name.startswith(
        "conversations.db.unreadable-")
    with ConversationStore(path) as fresh:
        assert fresh.list() == []
        fresh.create("new start")


def test_another_programs_sqlite_file_is_refused(tmp_path):
    path = tmp_path / "other.db"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE things (x)")
    db.commit()
    db.close()
    with pytest.raises(StoreError, match="another program") as e:
        ConversationStore(path)
    assert e.value.unreadable


def test_an_unusable_folder_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(StoreError, match="MLXKV_DATA_DIR"):
        ConversationStore(blocker / "sub" / "conversations.db")


def test_two_threads_share_one_store(store):
    a, b = store.create("a"), store.create("b")
    barrier = threading.Barrier(2, timeout=30)

    def work(name: str) -> list[int]:
        barrier.wait()
        positions = []
        for i in range(150):
            cid = (a.id, b.id)[i % 2]
            positions.append(store.add_message(cid, "user", f"{name}-{i}").position)
            store.list("-1")
        return positions

    with ThreadPoolExecutor(2) as pool:
        results = [f.result(timeout=120) for f in [pool.submit(work, "x"), pool.submit(work, "y")]]
    assert sum(len(r) for r in results) == 300
    for cid in (a.id, b.id):
        msgs = store.messages(cid)
        assert [m.position for m in msgs] == list(range(150))
        assert sorted(m.content for m in msgs) == sorted(
            f"{n}-{i}" for n in "xy" for i in range(150) if (a.id, b.id)[i % 2] == cid)


def test_two_stores_on_one_file(tmp_path):
    path = tmp_path / "c.db"
    with ConversationStore(path) as one, ConversationStore(path) as two:
        c = one.create("shared")

        def add(s: ConversationStore, tag: str) -> None:
            for i in range(50):
                s.add_message(c.id, "user", f"{tag}{i}")

        with ThreadPoolExecutor(2) as pool:
            for f in [pool.submit(add, one, "a"), pool.submit(add, two, "b")]:
                f.result(timeout=120)
        assert [m.position for m in two.messages(c.id)] == list(range(100))


def test_a_damaged_file_is_a_store_error_not_a_traceback(tmp_path):
    path = tmp_path / "c.db"
    with ConversationStore(path) as s:
        c = s.create("long")
        for i in range(200):
            s.add_message(c.id, "user", f"message {i} " + "x" * 500)
    db = sqlite3.connect(path)
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.close()
    page = 4096
    with open(path, "r+b") as fh:  # overwrite pages of the messages table, keep the header page
        fh.seek(page * 3)
        fh.write(b"\xa5" * page * 6)
    with pytest.raises(StoreError) as e:
        with ConversationStore(path) as s:
            s.list("message 199")
            s.messages(c.id)
    assert e.value.unreadable and "move it away" in str(e.value)


def test_search_ignores_case_beyond_ascii(store):
    a = store.create("Über den Cache")
    b = store.create("Straße")
    store.add_message(b.id, "user", "ΣΟΦΙΑ and ÉCOLE")
    assert [c.id for c in store.list("über")] == [a.id]
    assert [c.id for c in store.list("STRASSE")] == [b.id]  # casefold: ß is ss
    assert [c.id for c in store.list("σοφια")] == [b.id]
    assert [c.id for c in store.list("école")] == [b.id]


def _open_together(path, barrier, errors) -> None:
    barrier.wait(timeout=30)
    try:
        ConversationStore(path).close()
    except StoreError as e:
        errors.append(str(e))


def test_processes_opening_a_fresh_file_at_once_never_call_it_foreign(tmp_path):
    # Several front ends starting together on a new machine: one creates the schema while
    # the others check what the file is. The check must read one snapshot, or a file whose
    # schema was committed between two of its reads looks like another program's (and the
    # TUI would move the user's conversations aside); the switch to WAL must wait too.
    for round_ in range(20):
        path, barrier, errors = tmp_path / f"c{round_}.sqlite3", threading.Barrier(6), []
        with ThreadPoolExecutor(6) as pool:
            for f in [pool.submit(_open_together, path, barrier, errors) for _ in range(6)]:
                f.result(timeout=60)
        assert errors == [], f"round {round_}: {errors[0]}"
