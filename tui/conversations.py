"""The conversation store: every chat the TUI shows, persisted in one SQLite file.

``$MLXKV_DATA_DIR/conversations.db``, else ``$XDG_DATA_HOME/mlxkv/conversations.db``, else
``~/.local/share/mlxkv/conversations.db``. The folder is created 0700 and the file 0600 (SQLite
gives its ``-wal``/``-shm`` files the database file's mode): conversations are private.

The schema carries its version in ``PRAGMA user_version``; opening a file applies the
migrations it lacks, in order, each in its own transaction, so an older file is upgraded in
place and a failure leaves it at its last complete version. A file written by a newer mlxkv,
a file that is not SQLite and an SQLite file of another program are refused with a
:class:`StoreError` that says so; :func:`move_aside` renames such a file (nothing is deleted)
so that a fresh store can start in its place.

WAL journal (readers never wait for the writer), ``synchronous=FULL`` (a committed message
survives a power cut), foreign keys on (deleting a conversation deletes its messages).
One connection serves every thread, behind a lock: the UI calls the store from thread
workers, and every call is one short transaction. Two stores (or processes) on one file
wait for each other's write lock for up to ``busy_timeout_s``.

No Textual here: the API takes and returns plain values and dataclasses.
"""

from __future__ import annotations

import builtins
import json
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

APPLICATION_ID = 0x6D6C6B76  # "mlkv": marks the file as ours in its SQLite header
ROLES = ("system", "user", "assistant")
DB_NAME = "conversations.db"


class StoreError(Exception):
    """The store cannot be used: the message says what is wrong and what to do."""

    def __init__(self, message: str, path: Path | None = None, unreadable: bool = False):
        super().__init__(message)
        self.path = path
        self.unreadable = unreadable  # True: the file is not (or no longer) ours to read


class NotFoundError(StoreError, LookupError):
    """No conversation or message with that id."""


@dataclass
class Conversation:
    id: int
    title: str
    created: float  # unix time
    updated: float  # unix time of the last change to it or its messages
    model: str | None
    system_prompt: str | None
    sampling: dict = field(default_factory=dict)
    parent_id: int | None = None  # the conversation it was branched from
    branched_from_message: int | None = None  # the message of the parent it branched at


@dataclass
class Message:
    id: int
    conversation_id: int
    role: str
    content: str
    created: float
    stats: dict | None
    position: int  # 0, 1, 2 ... within the conversation


# Ordered migrations: MIGRATIONS[i] brings a file from version i to version i + 1.
# Never edit a released step; append a new one.
_V1 = [
    f"PRAGMA application_id = {APPLICATION_ID}",
    """CREATE TABLE conversations (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        title TEXT NOT NULL,
        created REAL NOT NULL,
        updated REAL NOT NULL,
        model TEXT,
        system_prompt TEXT)""",
    """CREATE TABLE messages (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
        role TEXT NOT NULL,
        content TEXT NOT NULL,
        created REAL NOT NULL,
        position INTEGER NOT NULL)""",
    "CREATE INDEX messages_by_conversation ON messages(conversation_id, position)",
]
_V2 = [  # sampling settings, branches, per-reply stats; one position per message
    "ALTER TABLE conversations ADD COLUMN sampling TEXT NOT NULL DEFAULT '{}'",
    "ALTER TABLE conversations ADD COLUMN parent_id INTEGER "
    "REFERENCES conversations(id) ON DELETE SET NULL",
    "ALTER TABLE conversations ADD COLUMN branched_from_message INTEGER "
    "REFERENCES messages(id) ON DELETE SET NULL",
    "ALTER TABLE messages ADD COLUMN stats TEXT",
    "DROP INDEX messages_by_conversation",
    "CREATE UNIQUE INDEX messages_by_conversation ON messages(conversation_id, position)",
    "CREATE INDEX conversations_by_updated ON conversations(updated DESC, id DESC)",
]
_V3 = [  # the model each prefix-cache namespace belongs to, for the inspector
    """CREATE TABLE model_namespaces (
        ns TEXT PRIMARY KEY,
        label TEXT NOT NULL,
        seen REAL NOT NULL)""",
]
MIGRATIONS: list[list[str]] = [_V1, _V2, _V3]
SCHEMA_VERSION = len(MIGRATIONS)


def default_path(env: Mapping[str, str] | None = None) -> Path:
    """Where the conversations live: see the module docstring."""
    found: Mapping[str, str] = os.environ if env is None else env
    folder = found.get("MLXKV_DATA_DIR")
    if folder:
        return Path(os.path.expanduser(folder)) / DB_NAME
    base = found.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "mlxkv" / DB_NAME


def move_aside(path: str | os.PathLike[str]) -> Path:
    """Rename an unusable database (and its -wal/-shm files) to ``<name>.unreadable-<time>``
    next to it, so that a fresh store can be created at ``path``. Returns the new name."""
    path = Path(path)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = path.with_name(f"{path.name}.unreadable-{stamp}")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.unreadable-{stamp}-{n}")
    for suffix in ("-wal", "-shm"):
        side = path.with_name(path.name + suffix)
        if side.exists():
            os.replace(side, target.with_name(target.name + suffix))
    os.replace(path, target)
    return target


def _private_folder(folder: Path) -> None:
    if folder.is_dir():
        return
    try:
        folder.mkdir(mode=0o700, parents=True)
        os.chmod(folder, 0o700)  # mkdir's mode is masked by the umask
    except FileExistsError:
        if not folder.is_dir():
            raise StoreError(f"cannot keep conversations in {folder}: it is not a folder; "
                             "set MLXKV_DATA_DIR to another folder", folder) from None
    except OSError as e:
        raise StoreError(f"cannot create the conversations folder {folder}: {e.strerror}; "
                         "set MLXKV_DATA_DIR to a writable folder", folder) from None


def _private_file(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        os.close(fd)
        if os.stat(path).st_mode & 0o077:
            os.chmod(path, 0o600)
    except OSError as e:
        raise StoreError(f"cannot open the conversations file {path}: {e.strerror}; "
                         "set MLXKV_DATA_DIR to a writable folder", path) from None


def _json(value: Any, what: str) -> str:
    try:
        return json.dumps(value, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what} must be JSON data (numbers, strings, lists, dicts): {e}") from None


def _conversation(row: sqlite3.Row) -> Conversation:
    return Conversation(id=row["id"], title=row["title"], created=row["created"],
                        updated=row["updated"], model=row["model"],
                        system_prompt=row["system_prompt"], sampling=json.loads(row["sampling"]),
                        parent_id=row["parent_id"],
                        branched_from_message=row["branched_from_message"])


def _message(row: sqlite3.Row) -> Message:
    stats = row["stats"]
    return Message(id=row["id"], conversation_id=row["conversation_id"], role=row["role"],
                   content=row["content"], created=row["created"],
                   stats=json.loads(stats) if stats is not None else None, position=row["position"])


def _rollback(db: sqlite3.Connection) -> None:
    if db.in_transaction:
        try:
            db.execute("ROLLBACK")
        except sqlite3.Error:
            pass  # the error being raised says what went wrong


def _contains(haystack: str | None, needle: str) -> bool:
    """SQL ``contains(text, needle)``: ``needle`` (casefolded) is in ``text`` ignoring case,
    in every script (SQLite's LIKE folds ASCII letters only)."""
    return haystack is not None and needle in haystack.casefold()


def _inserted(cur: sqlite3.Cursor) -> int:
    """The id of the row an INSERT just added (SQLite always gives one)."""
    rowid = cur.lastrowid
    if rowid is None:
        raise StoreError("the database gave no id for the row just added")
    return rowid


class ConversationStore:
    """Conversations and their messages in one SQLite file (see the module docstring).

    ``clock`` (an attribute too) gives the times stored in ``created``/``updated``
    (``time.time`` unless a caller needs fixed ones, e.g. for screenshots). Raises
    :class:`StoreError` when the file cannot be used.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, *,
                 clock: Callable[[], float] = time.time, busy_timeout_s: float = 10.0):
        self.path = Path(path) if path is not None else default_path()
        self.clock = clock
        self._busy_timeout_s = busy_timeout_s
        self._lock = threading.RLock()
        _private_folder(self.path.parent)
        _private_file(self.path)
        try:
            self._db: sqlite3.Connection | None = sqlite3.connect(
                self.path, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False)
        except sqlite3.Error as e:
            raise StoreError(f"cannot open the conversations file {self.path}: {e}", self.path) from None
        self._db.row_factory = sqlite3.Row
        self._db.create_function("contains", 2, _contains, deterministic=True)
        try:
            self._open()
        except sqlite3.Error as e:
            self._db.close()
            self._db = None
            raise self._unreadable(e) from None
        except BaseException:
            self._db.close()
            self._db = None
            raise

    def _unreadable(self, e: sqlite3.Error) -> StoreError:
        text = str(e)
        if "locked" in text or "busy" in text:
            return StoreError(f"the conversations file {self.path} is locked by another program ({text}); "
                              "close it and try again", self.path)
        if isinstance(e, sqlite3.DatabaseError) and any(
                w in text for w in ("not a database", "malformed", "corrupt", "encrypted")):
            return StoreError(f"{self.path} is not a readable conversations database ({text}); "
                              "move it away (nothing is deleted) to start with a fresh one",
                              self.path, unreadable=True)
        return StoreError(f"the conversations file {self.path} cannot be used: {text}", self.path)

    def _open(self) -> None:
        db = self._db
        assert db is not None
        db.execute("PRAGMA foreign_keys = ON")
        # One read transaction: another process may be creating the schema right now, and
        # reading the version before and the tables after its commit would call our own
        # fresh file foreign (and the TUI would move it aside).
        db.execute("BEGIN")
        try:
            # The SELECT takes the read snapshot; the pragmas then read the same one.
            tables = db.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]
            version = db.execute("PRAGMA user_version").fetchone()[0]
            app_id = db.execute("PRAGMA application_id").fetchone()[0]
        finally:
            _rollback(db)
        if app_id not in (0, APPLICATION_ID) or (version == 0 and tables):
            raise StoreError(f"{self.path} is an SQLite file of another program, not mlxkv's "
                             "conversations; set MLXKV_DATA_DIR to another folder or move it away",
                             self.path, unreadable=True)
        if version > SCHEMA_VERSION:
            raise StoreError(f"{self.path} was written by a newer mlxkv (schema version {version}, "
                             f"this one knows up to {SCHEMA_VERSION}); upgrade mlxkv, or set "
                             "MLXKV_DATA_DIR to another folder", self.path)
        mode = self._journal_wal(db)
        if mode.lower() != "wal":  # e.g. a file system without shared memory: still correct
            db.execute("PRAGMA journal_mode = DELETE")
        db.execute("PRAGMA synchronous = FULL")
        for step in range(version, SCHEMA_VERSION):
            # Each step is atomic: DDL is transactional in SQLite, user_version too.
            db.execute("BEGIN IMMEDIATE")
            try:
                if db.execute("PRAGMA user_version").fetchone()[0] != step:
                    db.execute("ROLLBACK")  # another process migrated it meanwhile
                    continue
                for statement in MIGRATIONS[step]:
                    db.execute(statement)
                db.execute(f"PRAGMA user_version = {step + 1}")
                db.execute("COMMIT")
            except BaseException:
                _rollback(db)
                raise

    def _journal_wal(self, db: sqlite3.Connection) -> str:
        # SQLite answers a journal-mode change with "database is locked" at once, without
        # its busy handler, while another connection is switching the same file: wait for
        # it here (bounded by the busy timeout) as the busy handler would.
        deadline = time.monotonic() + self._busy_timeout_s
        delay = 0.001
        while True:
            try:
                return db.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            except sqlite3.OperationalError as e:
                if "locked" not in str(e) or time.monotonic() >= deadline:
                    raise
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    # --- plumbing -------------------------------------------------------------------------
    @contextmanager
    def _tx(self, write: bool = True) -> Iterator[sqlite3.Connection]:
        with self._lock:
            db = self._db
            if db is None:
                raise StoreError("the conversation store is closed", self.path)
            try:
                db.execute("BEGIN IMMEDIATE" if write else "BEGIN")
            except sqlite3.Error as e:
                raise self._unreadable(e) from None
            try:
                yield db
            except sqlite3.Error as e:
                _rollback(db)
                raise self._unreadable(e) from None
            except BaseException:
                _rollback(db)
                raise
            try:
                db.execute("COMMIT")
            except sqlite3.Error as e:
                _rollback(db)
                raise self._unreadable(e) from None

    @staticmethod
    def _row(db: sqlite3.Connection, cid: int) -> sqlite3.Row:
        row = db.execute("SELECT * FROM conversations WHERE id = ?", (cid,)).fetchone()
        if row is None:
            raise NotFoundError(f"no conversation with id {cid!r}")
        return row

    def _touch(self, db: sqlite3.Connection, cid: int) -> None:
        db.execute("UPDATE conversations SET updated = ? WHERE id = ?", (self.clock(), cid))

    def _insert_message(self, db: sqlite3.Connection, cid: int, role: str, content: str,
                        stats: dict | None) -> int:
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, not {role!r}")
        if not isinstance(content, str):
            raise ValueError(f"message content must be text, not {type(content).__name__}")
        stats_json = None if stats is None else _json(stats, "stats")
        position = db.execute("SELECT coalesce(max(position) + 1, 0) FROM messages "
                              "WHERE conversation_id = ?", (cid,)).fetchone()[0]
        cur = db.execute("INSERT INTO messages (conversation_id, role, content, created, position, stats) "
                         "VALUES (?, ?, ?, ?, ?, ?)", (cid, role, content, self.clock(), position, stats_json))
        return _inserted(cur)

    # --- conversations --------------------------------------------------------------------
    def create(self, title: str = "New chat", model: str | None = None, system_prompt: str | None = None,
               sampling: dict | None = None) -> Conversation:
        """A new, empty conversation."""
        sampling_json = _json(dict(sampling or {}), "sampling")
        with self._tx() as db:
            now = self.clock()
            cur = db.execute("INSERT INTO conversations (title, created, updated, model, system_prompt, sampling) "
                             "VALUES (?, ?, ?, ?, ?, ?)", (title, now, now, model, system_prompt, sampling_json))
            return _conversation(self._row(db, _inserted(cur)))

    def list(self, search: str | None = None) -> list[Conversation]:
        """Every conversation, most recently updated first; with ``search``, only those whose
        title or some message contains it, ignoring case (in every script)."""
        with self._tx(write=False) as db:
            if not search:
                rows = db.execute("SELECT * FROM conversations ORDER BY updated DESC, id DESC").fetchall()
            else:
                rows = db.execute(
                    "SELECT * FROM conversations c WHERE contains(c.title, ?1) OR EXISTS "
                    "(SELECT 1 FROM messages m WHERE m.conversation_id = c.id AND contains(m.content, ?1)) "
                    "ORDER BY updated DESC, id DESC", (search.casefold(),)).fetchall()
            return [_conversation(r) for r in rows]

    def get(self, cid: int) -> Conversation:
        """The conversation ``cid``; :class:`NotFoundError` if there is none."""
        with self._tx(write=False) as db:
            return _conversation(self._row(db, cid))

    def _set(self, cid: int, column: str, value: Any) -> Conversation:
        with self._tx() as db:
            self._row(db, cid)
            db.execute(f"UPDATE conversations SET {column} = ?, updated = ? WHERE id = ?",
                       (value, self.clock(), cid))
            return _conversation(self._row(db, cid))

    def rename(self, cid: int, title: str) -> Conversation:
        title = title.strip() if isinstance(title, str) else title
        if not title or not isinstance(title, str):
            raise ValueError("a conversation title must be non-empty text")
        return self._set(cid, "title", title)

    def set_system_prompt(self, cid: int, text: str | None) -> Conversation:
        return self._set(cid, "system_prompt", text or None)

    def set_sampling(self, cid: int, sampling: dict) -> Conversation:
        if not isinstance(sampling, dict):
            raise ValueError(f"sampling must be a dict of settings, not {type(sampling).__name__}")
        return self._set(cid, "sampling", _json(sampling, "sampling"))

    def set_model(self, cid: int, model: str | None) -> Conversation:
        return self._set(cid, "model", model)

    # --- models -----------------------------------------------------------------------------
    def name_namespace(self, ns: str, label: str) -> None:
        """Remember that the prefix cache's namespace ``ns`` holds model ``label``'s states
        (the inspector names the entries of models not loaded now by it)."""
        if not (isinstance(ns, str) and ns and isinstance(label, str) and label):
            raise ValueError("a namespace and a model label must be non-empty strings")
        with self._tx() as db:
            db.execute("INSERT INTO model_namespaces (ns, label, seen) VALUES (?, ?, ?) "
                       "ON CONFLICT(ns) DO UPDATE SET label = excluded.label, seen = excluded.seen",
                       (ns, label, self.clock()))

    def namespace_names(self) -> dict[str, str]:
        """Every namespace :meth:`name_namespace` was told of -> its model's label."""
        with self._tx(write=False) as db:
            return {r["ns"]: r["label"] for r in db.execute("SELECT ns, label FROM model_namespaces")}

    def delete(self, cid: int) -> None:
        """Delete the conversation and its messages (its branches stay, unlinked)."""
        with self._tx() as db:
            self._row(db, cid)
            db.execute("DELETE FROM conversations WHERE id = ?", (cid,))

    # --- messages -------------------------------------------------------------------------
    def messages(self, cid: int) -> builtins.list[Message]:
        with self._tx(write=False) as db:
            self._row(db, cid)
            rows = db.execute("SELECT * FROM messages WHERE conversation_id = ? ORDER BY position",
                              (cid,)).fetchall()
            return [_message(r) for r in rows]

    def add_message(self, cid: int, role: str, content: str, stats: dict | None = None) -> Message:
        """Append a message at the next position."""
        with self._tx() as db:
            self._row(db, cid)
            mid = self._insert_message(db, cid, role, content, stats)
            self._touch(db, cid)
            return _message(db.execute("SELECT * FROM messages WHERE id = ?", (mid,)).fetchone())

    def update_message(self, mid: int, content: str, stats: dict | None = None) -> Message:
        """Replace a message's text (a reply as it streams or when it ends); ``stats`` too when
        given (None keeps the stored ones)."""
        if not isinstance(content, str):
            raise ValueError(f"message content must be text, not {type(content).__name__}")
        stats_json = None if stats is None else _json(stats, "stats")
        with self._tx() as db:
            row = db.execute("SELECT conversation_id FROM messages WHERE id = ?", (mid,)).fetchone()
            if row is None:
                raise NotFoundError(f"no message with id {mid!r}")
            if stats is None:
                db.execute("UPDATE messages SET content = ? WHERE id = ?", (content, mid))
            else:
                db.execute("UPDATE messages SET content = ?, stats = ? WHERE id = ?", (content, stats_json, mid))
            self._touch(db, row["conversation_id"])
            return _message(db.execute("SELECT * FROM messages WHERE id = ?", (mid,)).fetchone())

    def truncate_after(self, cid: int, position: int) -> int:
        """Drop the messages after ``position`` (to regenerate a reply: truncate after the
        user's message, then add the new reply). Returns how many were dropped."""
        with self._tx() as db:
            self._row(db, cid)
            cur = db.execute("DELETE FROM messages WHERE conversation_id = ? AND position > ?", (cid, position))
            self._touch(db, cid)
            return cur.rowcount

    def branch(self, cid: int, message_id: int, new_content: str | None = None) -> Conversation:
        """A new conversation holding the messages of ``cid`` before ``message_id`` and, when
        ``new_content`` is given, that message edited (same role): edit and resend. Its title,
        model, system prompt and sampling are copied; ``parent_id`` and
        ``branched_from_message`` say where it came from."""
        with self._tx() as db:
            parent = self._row(db, cid)
            at = db.execute("SELECT * FROM messages WHERE id = ? AND conversation_id = ?",
                            (message_id, cid)).fetchone()
            if at is None:
                raise NotFoundError(f"conversation {cid} has no message with id {message_id!r}")
            now = self.clock()
            cur = db.execute(
                "INSERT INTO conversations (title, created, updated, model, system_prompt, sampling, "
                "parent_id, branched_from_message) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (parent["title"], now, now, parent["model"], parent["system_prompt"], parent["sampling"],
                 cid, message_id))
            new_id = _inserted(cur)
            db.execute("INSERT INTO messages (conversation_id, role, content, created, position, stats) "
                       "SELECT ?, role, content, created, position, stats FROM messages "
                       "WHERE conversation_id = ? AND position < ? ORDER BY position",
                       (new_id, cid, at["position"]))
            if new_content is not None:
                self._insert_message(db, new_id, at["role"], new_content, None)
            return _conversation(self._row(db, new_id))

    def export_markdown(self, cid: int) -> str:
        """The conversation as a Markdown document: title, model, system prompt, then each
        message under a heading for its role."""
        with self._tx(write=False) as db:
            conv = _conversation(self._row(db, cid))
            rows = db.execute("SELECT * FROM messages WHERE conversation_id = ? ORDER BY position",
                              (cid,)).fetchall()
        lines = [f"# {conv.title}", ""]
        created = time.strftime("%Y-%m-%d %H:%M", time.localtime(conv.created))
        lines += [f"*{conv.model or 'default model'} · started {created}*", ""]
        if conv.system_prompt:
            lines += ["## System prompt", "", conv.system_prompt.rstrip(), ""]
        for row in rows:
            lines += [f"## {row['role'].capitalize()}", "", row["content"].rstrip(), ""]
        return "\n".join(lines)

    def close(self) -> None:
        """Close the file (idempotent); later calls raise :class:`StoreError`."""
        with self._lock:
            if self._db is not None:
                try:
                    self._db.close()
                finally:
                    self._db = None

    def __enter__(self) -> ConversationStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
