"""The chat prompt a request sends the model, built one way for a reply and for
``count_tokens`` alike (so the count is what will be prefilled):

1. the agent churn rules on system text (``server.churn``, unless turned off);
2. tools: to the chat template when it renders them; otherwise in the default tool format
   (``server.tool_prompt``), earlier tool calls and results with them;
3. ``system`` entries after the start of the conversation: rendered where they stand when
   the template renders such a turn; otherwise merged into the adjacent user turn (see
   :func:`place_system_entries`).

What the template can do is found out once per engine by rendering small probe
conversations (:class:`TemplateProbe`): no list of model families to keep up to date.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

from starlette.concurrency import run_in_threadpool

from mlxkv.engine.requests import EngineError
from mlxkv.server.churn import normalise_messages
from mlxkv.server.errors import ApiError
from mlxkv.server.tool_prompt import with_default_tools

Encode = Callable[[list[dict[str, Any]], "list[dict[str, Any]] | None"], list[int]]
_PROBE_TOOL = {"type": "function", "function": {
    "name": "probe_tool", "description": "A tool.",
    "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}


@dataclasses.dataclass(frozen=True)
class TemplateCaps:
    """What a model's chat template renders."""

    tools: bool  # a ``tools`` list (else: the default tool format)
    system_turns: bool  # a system turn after the user's (else: merged into a user turn)


def probe_template(encode: Encode) -> TemplateCaps:
    """The template's abilities, from the token ids ``encode(messages, tools)`` gives: a
    template that ignores a part renders the same tokens with and without it, and one that
    refuses a part raises. An :class:`EngineError` (the engine did not answer) is raised."""
    base = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]

    def differs(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> bool:
        try:
            return encode(messages, tools) != encode(base, None)
        except EngineError:
            raise
        except Exception:  # the template refused it (a jinja error, most often)
            return False

    return TemplateCaps(tools=differs(base, [_PROBE_TOOL]),
                        system_turns=differs(base + [{"role": "system", "content": "E"}], None))


class TemplateProbe:
    """One engine's :class:`TemplateCaps`, probed on first use (the engine's model is loaded
    by then) and kept."""

    def __init__(self, engine: Any):
        self._engine = engine
        self._caps: TemplateCaps | None = None
        self._lock = threading.Lock()

    def caps(self, timeout: float = 30.0) -> TemplateCaps:
        """Blocking (it may wait for the engine thread): call it from a worker thread."""
        with self._lock:
            if self._caps is None:
                self._caps = probe_template(
                    lambda messages, tools: self._engine.encode_chat(messages, timeout, tools))
            return self._caps


@dataclasses.dataclass(frozen=True)
class ChatPrompt:
    """What goes into the engine's ``Request``: the messages, the tools for the template
    (None when none, or when they are in the messages in the default format), and whether
    the reply is parsed for tool calls."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    parse_calls: bool


def _join(*texts: str) -> str:
    return "\n\n".join(t for t in texts if t)


def place_system_entries(messages: list[dict[str, Any]], system_turns: bool) -> list[dict[str, Any]]:
    """``system`` messages where the template can render them. With ``system_turns`` they
    stay where they are. Otherwise the system messages that open the conversation become one
    system message (joined by a blank line), and every later one is merged into the adjacent
    user turn: appended to the user turn right before it, else put in front of the user turn
    right after it, else (between two assistant turns, or last after one) it becomes a user
    turn of its own. Claude Code's environment section, sent after the user's prompt, thus
    ends that prompt's turn."""
    lead = 0
    while lead < len(messages) and messages[lead].get("role") == "system":
        lead += 1
    rest = messages[lead:]
    if system_turns or (lead <= 1 and not any(m.get("role") == "system" for m in rest)):
        return messages
    out: list[dict[str, Any]] = []
    if lead:
        out.append({"role": "system", "content": _join(*(m.get("content") or "" for m in messages[:lead]))})
    waiting: list[str] = []  # system text for the next user turn
    for m in rest:
        role, text = m.get("role"), m.get("content") or ""
        if role == "system":
            if out and out[-1].get("role") == "user" and not waiting:
                out[-1] = {**out[-1], "content": _join(out[-1].get("content") or "", text)}
            else:
                waiting.append(text)
        elif role == "user" and waiting:
            out.append({**m, "content": _join(*waiting, text)})
            waiting = []
        else:
            if waiting:
                out.append({"role": "user", "content": _join(*waiting)})
                waiting = []
            out.append(m)
    if waiting:
        out.append({"role": "user", "content": _join(*waiting)})
    return out


def build_prompt(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                 caps: TemplateCaps, churn_rules: bool = True) -> ChatPrompt:
    """The prompt for chat-template ``messages`` and OpenAI function ``tools`` (see the
    module docstring for the steps)."""
    if churn_rules:
        messages = normalise_messages(messages)
    template_tools = tools or None
    if not caps.tools:
        messages = with_default_tools(messages, tools)
        template_tools = None
    messages = place_system_entries(messages, caps.system_turns)
    return ChatPrompt(messages, template_tools, parse_calls=bool(tools))


async def chat_prompt(probe: TemplateProbe, messages: list[dict[str, Any]],
                      tools: list[dict[str, Any]] | None, churn_rules: bool = True) -> ChatPrompt:
    """:func:`build_prompt` with the engine's template abilities (a 503 when the engine
    does not answer the probe)."""
    try:
        caps = await run_in_threadpool(probe.caps)
    except EngineError as e:
        raise ApiError(503, f"the engine is not serving: {e}") from None
    return build_prompt(messages, tools, caps, churn_rules)
