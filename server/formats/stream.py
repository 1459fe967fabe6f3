"""The reply, split as it streams into text, reasoning and tool calls.

:class:`ReplyParser` is fed the reply's text piece by piece and gives back ``("text", str)``,
``("reasoning", str)`` and ``("call", ToolCall)`` pieces at once, less a tail that may be the
start of a marker (held until the next piece decides it). Nothing the model wrote is lost: a
call that does not parse, or is never closed, comes back as the text it was."""

from __future__ import annotations

from typing import Any

from mlxkv.server.formats.calls import CallSyntax

Piece = tuple[str, Any]
TEXT, REASONING, CALL = "text", "reasoning", "call"


def held_prefix(buf: str, markers: list[str]) -> int:
    """How many characters at the end of ``buf`` may begin one of ``markers``."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(buf)), best, -1):
            if m.startswith(buf[-k:]):
                best = k
                break
    return best


def add_piece(out: list[Piece], kind: str, text: str) -> None:
    """``text`` of ``kind`` at the end of ``out``, joined to a last piece of the same kind."""
    if not text:
        return
    if out and out[-1][0] == kind:
        out[-1] = (kind, out[-1][1] + text)
    else:
        out.append((kind, text))


class ReplyParser:
    """One reply's splitter. ``syntax``: where calls are (None: no calls are parsed);
    ``think``: the reasoning markers (None: no reasoning); ``reasoning_open``: the prompt
    already opened the reasoning (the template's generation prompt ends ``<think>``)."""

    def __init__(self, syntax: CallSyntax | None, think: tuple[str, str] | None,
                 tools: list[dict[str, Any]] | None = None, reasoning_open: bool = False,
                 bare_json: bool = False):
        self.syntax, self.think, self.tools = syntax, think, tools
        self.state = REASONING if think and reasoning_open else TEXT
        self.bare_json = bare_json and syntax is not None
        self._buf = ""
        self._body_start = ""  # the marker that opened the call being read
        self._started = False  # any text seen (bare JSON calls are a whole reply)
        self._trim = self.state == REASONING  # drop whitespace at the start of the next piece
        self.calls: list[Any] = []

    # ------------------------------------------------------------------ the state machine
    def _markers(self) -> list[str]:
        out = []
        if self.think:
            out.append(self.think[0])
        if self.syntax is not None and self.syntax.start:
            out.append(self.syntax.start)
        return out

    def _emit(self, kind: str, text: str, out: list[Piece]) -> None:
        if self._trim:
            text = text.lstrip()
            if not text:
                return
            self._trim = False
        add_piece(out, kind, text)

    def _call_done(self, body: str, end: str, out: list[Piece]) -> None:
        assert self.syntax is not None
        calls = self.syntax.parse(body, self.tools)
        if calls is None:
            self._emit(TEXT, self._body_start + body + end, out)
        else:
            self.calls.extend(calls)
            out.extend((CALL, c) for c in calls)
            self._trim = True
        self.state = TEXT

    def feed(self, text: str) -> list[Piece]:
        self._buf += text
        out: list[Piece] = []
        while self._buf:
            if self.state == TEXT:
                if self.bare_json and not self._started:
                    stripped = self._buf.lstrip()
                    if not stripped:
                        return out
                    self._started = True
                    if stripped.startswith("{"):
                        self.state, self._body_start = CALL, ""
                        continue
                self._started = True
                found = [(self._buf.find(m), m) for m in self._markers()]
                found = [(i, m) for i, m in found if i >= 0]
                if found:
                    i, marker = min(found)
                    self._emit(TEXT, self._buf[:i], out)
                    self._buf = self._buf[i + len(marker):]
                    if self.think and marker == self.think[0]:
                        self.state, self._trim = REASONING, True
                    else:
                        self.state, self._body_start = CALL, marker
                    continue
                hold = held_prefix(self._buf, self._markers())
                self._emit(TEXT, self._buf[:len(self._buf) - hold], out)
                self._buf = self._buf[len(self._buf) - hold:]
                return out
            if self.state == REASONING:
                assert self.think is not None
                end = self.think[1]
                i = self._buf.find(end)
                if i >= 0:
                    self._emit(REASONING, self._buf[:i].rstrip(), out)
                    self._buf = self._buf[i + len(end):]
                    self.state, self._trim = TEXT, True
                    continue
                hold = held_prefix(self._buf, [end])
                ready = self._buf[:len(self._buf) - hold]
                # trailing whitespace waits: it is dropped when the reasoning ends there
                keep = len(ready) - len(ready.rstrip())
                self._emit(REASONING, ready[:len(ready) - keep], out)
                self._buf = self._buf[len(ready) - keep:]
                return out
            # CALL
            assert self.syntax is not None
            end = self.syntax.end if self._body_start else ""
            if not end:
                return out  # to the end of the reply
            i = self._buf.find(end)
            if i < 0:
                return out
            body, self._buf = self._buf[:i], self._buf[i + len(end):]
            self._call_done(body, end, out)
        return out

    def finish(self) -> list[Piece]:
        """The end of the reply: what was held back, an unclosed call as text."""
        out: list[Piece] = []
        rest, self._buf = self._buf, ""
        if self.state == REASONING:
            self._emit(REASONING, rest.rstrip(), out)
        elif self.state == CALL:
            assert self.syntax is not None
            if self._body_start and self.syntax.end:
                self._emit(TEXT, self._body_start + rest, out)
            else:
                self._call_done(rest, "", out)
        else:
            self._emit(TEXT, rest, out)
        self.state = TEXT
        return out


def split_reply(parser: Any, text: str) -> tuple[str, str, list[Any]]:
    """A whole reply through ``parser``: (text, reasoning, calls)."""
    pieces = parser.feed(text) + parser.finish()
    return ("".join(p for k, p in pieces if k == TEXT), "".join(p for k, p in pieces if k == REASONING),
            [p for k, p in pieces if k == CALL])
