"""API keys, and the cache scope each request's states are kept in.

A prompt cache shared by several people lets one learn what another sent: a prefix in the
cache answers measurably sooner. So each key of ``--api-key-file`` is a tenant whose states
live in a namespace of their own inside the model's (``engine.cache.info.scoped_namespace``),
unless keys are declared to share one; inside a key, a request's ``cache_salt`` (vLLM's
field) and the organisation and project headers (``OpenAI-Organization``,
``OpenAI-Project``, ``anthropic-organization``) scope it further. Scoped requests' outputs
teach no speculation source that drafts for other requests (``Request.cache_scope``).

The key file holds one key a line, ``NAME KEY [share=GROUP] [admin]``; ``#`` starts a
comment. NAME names the key in the logs (never the key itself); keys with the same
``share=GROUP`` share one cache namespace; ``admin`` keys may also read ``/stats`` (it shows
every tenant's recent prompts) and flush the cache. ``--api-key KEY`` is one admin key whose
requests use the model's own namespace, as without keys.

Keys are compared in constant time, each given key against every configured one.
"""

from __future__ import annotations

import dataclasses
import hmac
import logging
import os
import re
import stat
from pathlib import Path
from typing import Any, overload

import xxhash

from mlxkv.server.access_log import KEY_SCOPE
from mlxkv.server.errors import ApiError

log = logging.getLogger("mlxkv.server")

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
MIN_KEY_CHARS = 8
HEADERS = ("openai-organization", "openai-project", "anthropic-organization")


class KeyFileError(ValueError):
    """The key file cannot be used: the message names the file, the line and what is wrong."""


@dataclasses.dataclass(frozen=True)
class Key:
    name: str
    secret: bytes = dataclasses.field(repr=False)
    scope: str | None  # the cache scope of its requests; None: the model's own namespace
    admin: bool = False


class Keys:
    """The keys a server accepts (none: every request is let in, unscoped)."""

    def __init__(self, keys: list[Key] | tuple[Key, ...] = ()):
        self.keys = tuple(keys)

    def __len__(self) -> int:
        return len(self.keys)

    @classmethod
    def single(cls, key: str | None) -> Keys:
        """``--api-key``: one admin key, its requests in the model's own namespace."""
        return cls([Key("api-key", key.encode(), None, admin=True)] if key else [])

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> Keys:
        """The keys of a key file (see the module docstring); KeyFileError when it cannot be
        read or a line is wrong."""
        path = Path(os.path.expanduser(str(path)))
        try:
            text = path.read_text(encoding="utf-8")
            mode = path.stat().st_mode
        except (OSError, UnicodeDecodeError) as e:
            raise KeyFileError(f"cannot read the API key file {path}: {getattr(e, 'strerror', None) or e}") from None
        keys: list[Key] = []
        names: set[str] = set()
        secrets: set[bytes] = set()
        for n, raw in enumerate(text.splitlines(), 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            where = f"{path}, line {n}"
            parts = line.split()
            if len(parts) < 2:
                raise KeyFileError(f"{where}: expected NAME KEY [share=GROUP] [admin]")
            name, secret, options = parts[0], parts[1], parts[2:]
            if not _NAME.match(name):
                raise KeyFileError(f"{where}: a key's name is 1-64 letters, digits, '.', '_' or '-', "
                                   f"got {name!r}")
            if len(secret) < MIN_KEY_CHARS:
                raise KeyFileError(f"{where}: the key of {name} is shorter than {MIN_KEY_CHARS} characters")
            group, admin = name, False
            for opt in options:
                if opt == "admin":
                    admin = True
                elif opt.startswith("share=") and _NAME.match(opt[6:]):
                    group = "share=" + opt[6:]
                else:
                    raise KeyFileError(f"{where}: unknown option {opt!r} (share=GROUP or admin)")
            if name in names:
                raise KeyFileError(f"{where}: the name {name} is used twice")
            if secret.encode() in secrets:
                raise KeyFileError(f"{where}: the key of {name} is also another name's key")
            names.add(name)
            secrets.add(secret.encode())
            keys.append(Key(name, secret.encode(), group, admin))
        if not keys:
            raise KeyFileError(f"the API key file {path} holds no key (one 'NAME KEY' a line)")
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning("the API key file %s can be read by other users (chmod 600 %s)", path, path)
        return cls(keys)

    def match(self, given: str) -> Key | None:
        """The key ``given`` is, or None. Every configured key is compared, in constant
        time, whichever matches."""
        found = None
        value = given.encode()
        for key in self.keys:
            if hmac.compare_digest(value, key.secret) and found is None:
                found = key
        return found


def check(http: Any, keys: Keys, admin: bool = False) -> Key | None:
    """The request's key (kept in its scope for :func:`cache_scope`); ApiError 401 without a
    valid one, 403 when the route wants an admin key and this one is not."""
    if not keys:
        return None
    given = http.headers.get("x-api-key")
    auth = http.headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        given = auth[7:].strip()
    key = None if given is None else keys.match(given)
    if key is None:
        raise ApiError(401, "invalid API key" if given else
                       "an API key is required (Authorization: Bearer KEY, or x-api-key: KEY)")
    if admin and not key.admin:
        raise ApiError(403, f"this route needs an admin key; {key.name} is not one (add 'admin' to "
                       "its line of the key file)")
    http.scope[KEY_SCOPE] = key
    return key


def cache_scope(http: Any, body: dict) -> str | None:
    """The cache scope of a request: its key's, then its organisation and project headers
    and its ``cache_salt``, each scoping it further; None when none applies (the model's
    own namespace). ApiError 400 for a ``cache_salt`` that is not a string."""
    key = http.scope.get(KEY_SCOPE)
    salt = body.get("cache_salt")
    if salt is not None and not (isinstance(salt, str) and 0 < len(salt) <= 256):
        raise ApiError(400, "cache_salt must be a string of 1 to 256 characters", "cache_salt")
    return _compose(key, [(http.headers.get(h) or "")[:256] for h in HEADERS], salt)


def key_scope(key: Key) -> str | None:
    """The cache scope of ``key``'s requests that name no organisation, project or salt
    (what ``mlxkv cache --tenant NAME`` looks at)."""
    return _compose(key, ["" for _ in HEADERS], None)


def _compose(key: Key | None, headers: list[str], salt: str | None) -> str | None:
    parts = [key.scope if key is not None and key.scope else "", *headers, salt or ""]
    return "\x1f".join(parts) if any(parts) else None


@overload
def scoped_name(session: str, scope: str | None) -> str: ...
@overload
def scoped_name(session: None, scope: str | None) -> None: ...
@overload
def scoped_name(session: str | None, scope: str | None) -> str | None: ...
def scoped_name(session: str | None, scope: str | None) -> str | None:
    """A name inside its scope (a conversation's, a stored response's id): two tenants'
    "s1" are two conversations, and one's response id is unknown to the other."""
    if session is None or scope is None:
        return session
    return f"{xxhash.xxh3_64_hexdigest(scope.encode())[:12]}:{session}"
