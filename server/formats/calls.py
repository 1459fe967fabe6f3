"""A tool call as the server hands it to clients, and the call syntaxes that find calls in a
reply: where a call starts and ends in the text, and how its body becomes calls.

A :class:`CallSyntax` wraps one parser: mlx-lm's own (``mlx_lm.tool_parsers``) wherever mlx-lm
has one, else one of this package's (``server.formats.families``). Parsers disagree on what
they return (a dict, a list of dicts, arguments as an object or a JSON string) and on how they
fail; :meth:`CallSyntax.parse` gives :class:`ToolCall` s or None, never raises."""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import uuid
from collections.abc import Callable
from typing import Any

log = logging.getLogger("mlxkv.server")

ParseFn = Callable[[str, "list[dict[str, Any]] | None"], Any]


@dataclasses.dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: dict[str, Any]

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def as_call(data: Any) -> ToolCall | None:
    """One parser result (``{"name": ..., "arguments": ...}``; ``parameters`` as Llama writes
    it; arguments as an object or a JSON string) as a call, or None."""
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"].strip():
        return None
    args = data.get("arguments", data.get("parameters", {}))
    if args is None:
        args = {}
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    # glm47's last fallback names an unparsed body "unknown": that is text, not a call
    if data["name"] == "unknown" and set(args) == {"raw"}:
        return None
    return ToolCall(new_call_id(), data["name"].strip(), args)


@dataclasses.dataclass(frozen=True)
class CallSyntax:
    """Calls in a reply: the text from ``start`` to ``end`` is handed to ``parse_fn`` (an
    empty ``end``: to the end of the reply, as Mistral writes them). ``name`` says whose
    parser it is (``mlx_lm.<module>`` or this package's)."""

    name: str
    start: str
    end: str
    parse_fn: ParseFn
    # how to call a tool in this syntax, for the tool list the server writes into the system
    # prompt when the template renders the family's calls but not the list (None: the
    # server's default format is written instead)
    instructions: str | None = None

    def parse(self, body: str, tools: list[dict[str, Any]] | None) -> list[ToolCall] | None:
        """The calls in ``body`` (the text between the markers), or None when it holds none
        that parse: the caller keeps it as text."""
        try:
            result = self.parse_fn(body, tools)
        except Exception as e:  # parsers raise ValueError, JSONDecodeError, KeyError, ...
            log.debug("%s: the tool call does not parse (%s: %s)", self.name, type(e).__name__, e)
            return None
        items = result if isinstance(result, list) else [result]
        calls = [as_call(item) for item in items]
        if not calls or any(c is None for c in calls):
            return None
        return [c for c in calls if c is not None]


def mlx_lm_syntax(module: str) -> CallSyntax:
    """mlx-lm's parser ``mlx_lm.tool_parsers.<module>`` with its markers."""
    mod = importlib.import_module(f"mlx_lm.tool_parsers.{module}")
    return CallSyntax(f"mlx_lm.{module}", mod.tool_call_start, mod.tool_call_end, mod.parse_tool_call)
