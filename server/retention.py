"""Retention hints from the wire: Anthropic ``cache_control`` breakpoints and OpenAI
``prompt_cache_key`` / ``prompt_cache_retention`` become the engine's
``Request.retain_s``: the state the request leaves in the prefix cache is evicted only
after every state without a hint, for that many seconds, in RAM and on SSD.

What is kept is the whole prompt (and the reply after it), not the prompt up to the last
breakpoint: the cache stores a state where a request ends, and every block of the marked
prefix is part of it (shared with any other state that starts the same way), so keeping
that state keeps the marked prefix; where a breakpoint falls in tokens would take a
second rendering of the chat template up to it. Clients mark the end of their prompt
anyway (Claude Code its last message, the automatic form the last block). With several
breakpoints the longest TTL counts.
"""

from __future__ import annotations

from typing import Any

from mlxkv.server.errors import ApiError

ANTHROPIC_TTLS = {"5m": 300.0, "1h": 3600.0}  # cache_control's ttl; absent: 5 minutes
OPENAI_RETENTION = {"in-memory": 300.0, "in_memory": 300.0, "24h": 86400.0}
OPENAI_DEFAULT_S = 300.0  # a prompt_cache_key without prompt_cache_retention


def _ttl(control: Any, where: str) -> float:
    if not isinstance(control, dict):
        raise ApiError(400, f"{where} must be an object like {{\"type\": \"ephemeral\"}}", where)
    if control.get("type") != "ephemeral":
        raise ApiError(400, f"{where}.type must be \"ephemeral\", got {control.get('type')!r}",
                       f"{where}.type")
    ttl = control.get("ttl", "5m")
    if not isinstance(ttl, str) or ttl not in ANTHROPIC_TTLS:
        raise ApiError(400, f"{where}.ttl must be \"5m\" or \"1h\", got {ttl!r}", f"{where}.ttl")
    return ANTHROPIC_TTLS[ttl]


def _blocks(value: Any, where: str) -> list[tuple[Any, str]]:
    """(cache_control, its field path) of each block of a list of content blocks."""
    if not isinstance(value, list):
        return []
    return [(b["cache_control"], f"{where}[{i}].cache_control") for i, b in enumerate(value)
            if isinstance(b, dict) and b.get("cache_control") is not None]


def anthropic_retain_s(body: dict) -> float | None:
    """The longest TTL of the body's ``cache_control`` breakpoints (top level, system
    blocks, message content blocks, tools); None when it has none. A malformed one is a
    400 naming it."""
    marks: list[tuple[Any, str]] = []
    if body.get("cache_control") is not None:
        marks.append((body["cache_control"], "cache_control"))
    marks += _blocks(body.get("system"), "system")
    marks += _blocks(body.get("tools"), "tools")
    messages = body.get("messages")
    for i, m in enumerate(messages if isinstance(messages, list) else []):
        if isinstance(m, dict):
            marks += _blocks(m.get("content"), f"messages[{i}].content")
    return max((_ttl(c, where) for c, where in marks), default=None)


def openai_retain_s(body: dict) -> float | None:
    """``prompt_cache_key`` (a string) asks to keep the prompt's state for 5 minutes,
    ``prompt_cache_retention`` (``in-memory`` or ``24h``) for that long; None without
    either. A malformed one is a 400 naming it."""
    key, retention = body.get("prompt_cache_key"), body.get("prompt_cache_retention")
    if key is not None and (not isinstance(key, str) or len(key) > 1024):
        raise ApiError(400, "prompt_cache_key must be a string of at most 1024 characters",
                       "prompt_cache_key")
    if retention is not None:
        if not isinstance(retention, str) or retention not in OPENAI_RETENTION:
            raise ApiError(400, "prompt_cache_retention must be \"in-memory\" or \"24h\", got "
                                f"{retention!r}", "prompt_cache_retention")
        return OPENAI_RETENTION[retention]
    return OPENAI_DEFAULT_S if key is not None else None
