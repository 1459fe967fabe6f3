"""Tool calls in generated text, for chat templates that write them as Qwen and Hermes do:
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

:class:`ToolCallParser` is fed the reply as it streams: text outside the tags comes back
at once (less a tail that may be the start of ``<tool_call>``), each complete tag as one
parsed call. A tag whose body is not a JSON call is given back as text, so nothing the
model wrote is lost.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: dict[str, Any]

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


def _parse_call(body: str) -> ToolCall | None:
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    args = data.get("arguments", data.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", data["name"], args)


class ToolCallParser:
    """Split streamed text into ("text", str) and ("call", ToolCall) pieces."""

    def __init__(self) -> None:
        self._buf = ""
        self._inside = False
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> list[tuple[str, Any]]:
        self._buf += text
        out: list[tuple[str, Any]] = []
        while True:
            if self._inside:
                end = self._buf.find(CLOSE)
                if end < 0:
                    return out
                body, self._buf = self._buf[:end], self._buf[end + len(CLOSE):]
                self._inside = False
                call = _parse_call(body.strip())
                if call is None:
                    out.append(("text", OPEN + body + CLOSE))
                else:
                    self.calls.append(call)
                    out.append(("call", call))
                continue
            start = self._buf.find(OPEN)
            if start >= 0:
                if start:
                    out.append(("text", self._buf[:start]))
                self._buf = self._buf[start + len(OPEN):]
                self._inside = True
                continue
            hold = next((k for k in range(min(len(OPEN) - 1, len(self._buf)), 0, -1)
                         if OPEN.startswith(self._buf[-k:])), 0)
            ready = self._buf[:len(self._buf) - hold]
            self._buf = self._buf[len(self._buf) - hold:]
            if ready:
                out.append(("text", ready))
            return out

    def finish(self) -> list[tuple[str, Any]]:
        """What is left at the end of the reply: an unclosed tag is text."""
        rest = (OPEN if self._inside else "") + self._buf
        self._buf, self._inside = "", False
        return [("text", rest)] if rest else []


def split_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """A whole reply: its text outside tool-call tags, and the calls."""
    parser = ToolCallParser()
    pieces = parser.feed(text) + parser.finish()
    content = "".join(p for kind, p in pieces if kind == "text")
    return content, parser.calls
