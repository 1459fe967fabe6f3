"""gpt-oss replies in OpenAI's harmony format, which mlx-lm does not parse.

A reply is a run of messages, each ``<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>json]
<|message|>BODY`` ended by ``<|end|>`` (another message follows, after ``<|start|>assistant``),
``<|call|>`` (a tool call) or ``<|return|>`` (the answer is done); the last two are the
model's end-of-sequence tokens, so the engine may stop before they are written. The
``analysis`` channel is reasoning; ``final`` is the answer; ``commentary`` addressed
``to=functions.NAME`` is a call of NAME with a JSON body, and without a recipient it is text
the model shows the user (a preamble). The recipient may also stand in the header before the
channel. Text that is not in this format is the answer, as it was written.

The markup is matched on text: the engine's detokenizer writes the special tokens out."""

from __future__ import annotations

import json
import re
from typing import Any

from mlxkv.server.formats.calls import ToolCall, new_call_id
from mlxkv.server.formats.stream import CALL, REASONING, TEXT, Piece, add_piece, held_prefix

MESSAGE, START = "<|message|>", "<|start|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
HEADER_OPENERS = ("<|channel|>", START, " to=", "to=")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


class HarmonyParser:
    """The :class:`~server.formats.stream.ReplyParser` interface for harmony replies."""

    def __init__(self, tools: list[dict[str, Any]] | None = None, parse_calls: bool = True,
                 reasoning: bool = True):
        self.tools, self.parse_calls, self.reasoning = tools, parse_calls, reasoning
        self._buf = ""
        self._state = "header"  # header | body | plain
        self._kind = TEXT  # what the body being read is: text, reasoning or call
        self._recipient: str | None = None
        self._header = ""
        self._trim = False
        self.calls: list[ToolCall] = []

    def _emit(self, kind: str, text: str, out: list[Piece]) -> None:
        if kind == REASONING and not self.reasoning:
            return
        if self._trim:
            text = text.lstrip()
            self._trim = not text
        add_piece(out, kind, text)

    def _open(self, header: str) -> None:
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        self._header = header
        self._recipient = recipient.group(1) if recipient else None
        name = channel.group(1) if channel else "final"
        if self._recipient and self.parse_calls:
            self._kind = CALL
        elif name == "analysis":
            self._kind = REASONING
        else:
            self._kind = TEXT
        self._trim = True

    def _close(self, body: str, end: str, out: list[Piece]) -> None:
        if self._kind == CALL:
            call = self._call(body)
            if call is None:
                self._emit(TEXT, self._header + MESSAGE + body + end, out)
            else:
                self.calls.append(call)
                out.append((CALL, call))
        else:
            self._emit(self._kind, body.rstrip() if self._kind == REASONING else body, out)
        self._kind = TEXT

    def _call(self, body: str) -> ToolCall | None:
        assert self._recipient is not None
        name = self._recipient.removeprefix("functions.")
        try:
            args = json.loads(body) if body.strip() else {}
        except ValueError:
            return None
        if not isinstance(args, dict) or not name:
            return None
        return ToolCall(new_call_id(), name, args)

    def feed(self, text: str) -> list[Piece]:
        self._buf += text
        out: list[Piece] = []
        while self._buf:
            if self._state == "plain":
                self._emit(TEXT, self._buf, out)
                self._buf = ""
                break
            if self._state == "header":
                head = self._buf.lstrip()
                if head.startswith(START):  # between messages: <|start|>assistant ...
                    head = head[len(START):]
                    if "assistant".startswith(head):
                        break  # the role is still being written
                    head = head[len("assistant"):] if head.startswith("assistant") else head
                if head and not any(head.startswith(o) or o.startswith(head) for o in HEADER_OPENERS):
                    self._state = "plain"  # not harmony: the answer as written
                    continue
                i = self._buf.find(MESSAGE)
                if i < 0:
                    break
                header, self._buf = self._buf[:i], self._buf[i + len(MESSAGE):]
                self._open(header)
                self._state = "body"
                continue
            # body
            found = [(self._buf.find(m), m) for m in (*ENDS, START)]
            found = [(i, m) for i, m in found if i >= 0]
            if found:
                i, marker = min(found)
                self._close(self._buf[:i], marker if marker != START else "", out)
                self._buf = self._buf[i + (len(marker) if marker != START else 0):]
                self._state = "header"
                continue
            if self._kind == CALL:
                break  # a call's body is read whole
            hold = held_prefix(self._buf, [*ENDS, START])
            ready = self._buf[:len(self._buf) - hold]
            if self._kind == REASONING:
                ready = ready[:len(ready) - (len(ready) - len(ready.rstrip()))]
            self._emit(self._kind, ready, out)
            self._buf = self._buf[len(ready):]
            break
        return out

    def finish(self) -> list[Piece]:
        out: list[Piece] = []
        rest, self._buf = self._buf, ""
        if self._state == "body":
            self._close(rest, "", out)
        elif rest.strip():
            self._emit(TEXT, rest, out)
        self._state = "header"
        return out
