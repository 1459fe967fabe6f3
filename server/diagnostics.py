"""Anthropic's cache diagnostics: a request names the message it follows
(``diagnostics.previous_message_id``) and the reply says why its prompt missed the cache
where that message's prompt would have hit (``diagnostics.cache_miss_reason``: ``type`` one of
``model_changed``, ``system_changed``, ``tools_changed``, ``messages_changed``,
``previous_message_not_found``, with ``cache_missed_input_tokens``), or ``null`` when nothing
diverged. Agent tooling reads it to explain a slow turn.

Each answered request leaves a :class:`Fingerprint` (hashes of its model name, system, tools
and each message, and the tokens its prompt and reply put in the cache) under its message id,
in a bounded log; the next request is compared with the one it names."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
from collections import OrderedDict
from typing import Any

from mlxkv.server.errors import ApiError
from mlxkv.server.fields import get_object, get_str

KEPT = 4096  # message fingerprints kept, most recent


def _digest(value: Any) -> str:
    return hashlib.blake2b(json.dumps(value, sort_keys=True, ensure_ascii=False, default=str).encode(),
                           digest_size=12).hexdigest()


def _strip_cache_control(value: Any) -> Any:
    # cache_control marks move between turns without changing what the model reads
    if isinstance(value, dict):
        return {k: _strip_cache_control(v) for k, v in value.items() if k != "cache_control"}
    if isinstance(value, list):
        return [_strip_cache_control(v) for v in value]
    return value


@dataclasses.dataclass(frozen=True)
class Fingerprint:
    model: str
    system: str
    tools: str
    messages: tuple[str, ...]
    tokens: int  # prompt + reply tokens this request left for the next to read


def fingerprint(body: dict, tokens: int = 0) -> Fingerprint:
    messages = body.get("messages") or []
    return Fingerprint(str(body.get("model")), _digest(_strip_cache_control(body.get("system"))),
                       _digest(_strip_cache_control(body.get("tools"))),
                       tuple(_digest(_strip_cache_control(m)) for m in messages), tokens)


def requested(body: dict) -> str | None:
    """The ``diagnostics.previous_message_id`` a body asks about (None: no diagnostics)."""
    diagnostics = get_object(body, "diagnostics")
    if diagnostics is None:
        return None
    previous = get_str(diagnostics, "previous_message_id")
    if previous is None:
        raise ApiError(400, "diagnostics.previous_message_id is required (a message id)",
                       "diagnostics.previous_message_id")
    return previous


class MessageLog:
    """The fingerprints of the last :data:`KEPT` answered messages (thread-safe)."""

    def __init__(self, kept: int = KEPT):
        self._kept = kept
        self._items: OrderedDict[str, Fingerprint] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, message_id: str, fp: Fingerprint) -> None:
        with self._lock:
            self._items[message_id] = fp
            while len(self._items) > self._kept:
                self._items.popitem(last=False)

    def get(self, message_id: str) -> Fingerprint | None:
        with self._lock:
            return self._items.get(message_id)


def miss_reason(previous: Fingerprint | None, current: Fingerprint, prompt_tokens: int,
                cached_tokens: int) -> dict[str, Any] | None:
    """The ``cache_miss_reason`` of a request whose prompt read ``cached_tokens`` of its
    ``prompt_tokens`` from the cache, following ``previous`` (None: not known here)."""
    if previous is None:
        return {"type": "previous_message_not_found", "cache_missed_input_tokens": 0}
    expected = min(previous.tokens, prompt_tokens)
    missed = max(0, expected - cached_tokens)
    for kind, changed in (("model_changed", previous.model != current.model),
                          ("system_changed", previous.system != current.system),
                          ("tools_changed", previous.tools != current.tools),
                          ("messages_changed", current.messages[:len(previous.messages)] != previous.messages)):
        if changed:
            return {"type": kind, "cache_missed_input_tokens": missed}
    return None  # the request went on as the previous one left it
