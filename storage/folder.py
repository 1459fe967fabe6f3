"""The cache folder itself: its marker, the checks made when a store opens it, the
cross-process lock, and the names of the files the store may create, read or remove.

The store touches only what it can prove is its own: a folder marked with
``<root>/MLXKV-CACHE``, and in it only files named exactly as it names them, inside real
folders (never through a symlink). :func:`open_folder` marks a new or empty folder,
adopts an unmarked one only if everything in it parses as ours, and raises
:class:`~storage.keys.CacheFolderError` otherwise. The rules in full: docs/storage.md.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from mlxkv.storage import diskio
from mlxkv.storage.format import (
    KIND_BLOCK,
    KIND_CHECKPOINT,
    KIND_LEARNED,
    KIND_MANIFEST,
    KIND_TAIL,
    PREFIX_SIZE,
    FormatError,
    UnknownVersion,
    load_json,
    parse_prefix,
)
from mlxkv.storage.keys import NS_RE, CacheFolderError

MARKER = "MLXKV-CACHE"
LOCK = ".lock"
FOLDER_FORMAT = 1
MANIFEST_DIR = "manifests"
LEARNED_DIR = "learned"  # what speculation sources learned in the namespace (storage.learned)
_MAX_MARKER = 4096

SHARD_RE = re.compile(r"^[0-9a-f]{2}$")
ENTRY_RE = re.compile(r"^([0-9a-f]{32})\.(blk|tail|ckpt)$")
ENTRY_TMP_RE = re.compile(r"^\.[0-9a-f]{32}\.[0-9]+\.[0-9]+\.tmp$")
MAN_RE = re.compile(r"^[0-9a-f]{16}\.man$")
MAN_TMP_RE = re.compile(r"^[0-9a-f]{16}\.man\.[0-9]+\.[0-9]+\.tmp$")
MARKER_TMP_RE = re.compile(r"^MLXKV-CACHE\.[0-9]+\.[0-9]+\.tmp$")
LEARNED_RE = re.compile(r"^[a-z][a-z0-9-]{0,31}\.lrn$")
LEARNED_TMP_RE = re.compile(r"^[a-z][a-z0-9-]{0,31}\.lrn\.[0-9]+\.[0-9]+\.tmp$")

_WHAT_TO_DO = ("choose another folder with --cache-dir, or run without the SSD tier "
               "with --no-ssd-cache")


def _fail(root: str, what: str) -> CacheFolderError:
    return CacheFolderError(f"cache folder {diskio.printable(root)} {what}: {_WHAT_TO_DO}")


def open_folder(root: str) -> None:
    """Create, check or adopt the cache folder ``root`` (see the module docstring);
    CacheFolderError if it cannot be used."""
    try:
        st = os.stat(root)  # the root itself may be reached through a symlink
    except FileNotFoundError:
        try:
            os.makedirs(root, mode=diskio.DIR_MODE, exist_ok=True)
        except OSError as exc:
            raise _fail(root, f"cannot be created ({exc.strerror or exc})") from exc
        st = os.stat(root)
    except OSError as exc:
        raise _fail(root, f"cannot be opened ({exc.strerror or exc})") from exc
    if not stat.S_ISDIR(st.st_mode):
        raise _fail(root, "is not a folder (a file is there)")
    if not os.access(root, os.W_OK | os.X_OK):
        raise _fail(root, "is read-only")
    if read_marker(root) is not None:
        check_lock_file(root)
        return
    # The whole check before the lock: taking it creates .lock, and a folder that is not
    # ours must be left exactly as it was.
    foreign = _first_foreign(root, shallow=False)
    if foreign is not None:
        raise _not_ours(root, foreign)
    with folder_lock(root, shared=False, marked=False):
        if read_marker(root) is not None:  # another process marked it meanwhile
            return
        foreign = _first_foreign(root, shallow=False)
        if foreign is not None:
            raise _not_ours(root, foreign)
        write_marker(root)


def _not_ours(root: str, foreign: str) -> CacheFolderError:
    return _fail(root, f"is not an mlxkv cache (no {MARKER} marker, and it holds "
                       f"{diskio.printable(foreign)})")


def read_marker(root: str) -> dict[str, Any] | None:
    """The marker's contents; None if there is none; CacheFolderError if it is damaged,
    not a regular file, or from a newer layout."""
    path = os.path.join(root, MARKER)
    try:
        fd = diskio.open_ro(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise _fail(root, f"has an unusable marker {MARKER} ({exc.strerror or exc})") from exc
    try:
        raw = os.pread(fd, _MAX_MARKER + 1, 0)
    except OSError as exc:
        raise _fail(root, f"has an unreadable marker {MARKER} ({exc.strerror or exc})") from exc
    finally:
        os.close(fd)
    try:
        if len(raw) > _MAX_MARKER:
            raise FormatError("too large")
        meta = load_json(raw, MARKER)
        if not isinstance(meta, dict) or not isinstance(meta.get("format"), int):
            raise FormatError("no format number")
    except FormatError as exc:
        raise _fail(root, f"has a damaged marker {MARKER} ({exc}); if the folder is an "
                          f"mlxkv cache, delete the folder or its marker") from exc
    if meta["format"] > FOLDER_FORMAT:
        raise _fail(root, f"was written by a newer mlxkv (layout {meta['format']}, this "
                          f"build reads {FOLDER_FORMAT})")
    return meta


def write_marker(root: str) -> None:
    data = json.dumps({"format": FOLDER_FORMAT, "what": "mlxkv prefix cache",
                       "created": time.time()}).encode()
    try:
        diskio.atomic_write(root, os.path.join(root, MARKER), data, durable=True)
    except OSError as exc:
        raise _fail(root, f"cannot be marked ({exc.strerror or exc})") from exc


def check_lock_file(root: str) -> None:
    """CacheFolderError unless ``.lock`` is absent or a regular file."""
    try:
        st = os.lstat(os.path.join(root, LOCK))
    except FileNotFoundError:
        return
    except OSError as exc:
        raise _fail(root, f"has an unusable {LOCK} ({exc.strerror or exc})") from exc
    if not stat.S_ISREG(st.st_mode):
        raise _fail(root, f"has a {LOCK} that is not a regular file (remove it)")


@contextmanager
def folder_lock(root: str, shared: bool, marked: bool = True) -> Iterator[None]:
    """flock on ``<root>/.lock`` (shared: writers; exclusive: scan/evict/gc), across
    processes. With ``marked`` the marker is checked once the lock is held."""
    path = os.path.join(root, LOCK)
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | diskio.NOFOLLOW | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags, diskio.FILE_MODE)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO, errno.EMLINK):
            raise _fail(root, f"has a {LOCK} that is not a regular file (remove it)") from exc
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise _fail(root, "is read-only") from exc
        raise _fail(root, f"cannot be locked ({exc.strerror or exc})") from exc
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _fail(root, f"has a {LOCK} that is not a regular file (remove it)")
        fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        if marked and read_marker(root) is None:
            raise _fail(root, f"lost its {MARKER} marker")
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


_KIND_OF_NAME = {"blk": KIND_BLOCK, "tail": KIND_TAIL, "ckpt": KIND_CHECKPOINT, "man": KIND_MANIFEST,
                 "lrn": KIND_LEARNED}


def _parses_as_ours(path: str, kind: int | None) -> bool:
    """The file's prefix is an mlxkv prefix of ``kind`` (None: a temp file of any kind,
    or empty)."""
    try:
        fd = diskio.open_ro(path)
    except OSError:
        return False
    try:
        head = os.pread(fd, PREFIX_SIZE, 0)
    except OSError:
        return False
    finally:
        os.close(fd)
    if kind is None and not head:
        return True
    try:
        got = parse_prefix(head)[1]
    except UnknownVersion:  # a newer mlxkv's file: ours (the kind is not checked)
        return True
    except FormatError:
        return False
    return kind is None or got == kind


def _first_foreign(root: str, shallow: bool) -> str | None:
    """The first thing under ``root`` that is not part of an mlxkv cache (None: all ours).
    ``shallow`` looks at the names of the root's entries only."""
    for dirent in diskio.scandir(root):
        if dirent.name == LOCK:
            if not dirent.is_file(follow_symlinks=False):
                return dirent.path
        elif MARKER_TMP_RE.match(dirent.name):
            if not dirent.is_file(follow_symlinks=False):
                return dirent.path
        elif not (NS_RE.match(dirent.name) and dirent.is_dir(follow_symlinks=False)):
            return dirent.path
        elif not shallow:
            bad = _foreign_in_namespace(dirent.path)
            if bad is not None:
                return bad
    return None


def _foreign_in_namespace(ns_dir: str) -> str | None:
    try:
        subs = list(os.scandir(ns_dir))
    except OSError:
        return ns_dir
    for sub in subs:
        if not sub.is_dir(follow_symlinks=False):
            return sub.path
        if sub.name == MANIFEST_DIR:
            names, temps, shard = MAN_RE, MAN_TMP_RE, None
        elif sub.name == LEARNED_DIR:
            names, temps, shard = LEARNED_RE, LEARNED_TMP_RE, None
        elif SHARD_RE.match(sub.name):
            names, temps, shard = ENTRY_RE, ENTRY_TMP_RE, sub.name
        else:
            return sub.path
        try:
            files = list(os.scandir(sub.path))
        except OSError:
            return sub.path
        for dirent in files:
            temp = bool(temps.match(dirent.name))
            if not (temp or names.match(dirent.name)) or (shard and not temp and dirent.name[:2] != shard):
                return dirent.path
            kind = None if temp else _KIND_OF_NAME[dirent.name.rsplit(".", 1)[1]]
            if not dirent.is_file(follow_symlinks=False) or not _parses_as_ours(dirent.path, kind):
                return dirent.path
    return None
