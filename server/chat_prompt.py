"""The chat prompt a request sends the model, built one way for a reply and for
``count_tokens`` alike (so the count is what will be prefilled):

1. the agent churn rules on system text (``server.churn``, unless turned off);
2. tools: to the chat template when it renders them; otherwise in the default tool format
   (``server.tool_prompt``), earlier tool calls and results with them;
3. ``system`` entries after the start of the conversation: in front of the user's text
   right before them, else where they stand when the template renders such a turn, else
   merged into the next user turn (see :func:`place_system_entries`).

What the template can do is found out once per engine by rendering small probe
conversations (:class:`TemplateProbe`); how its replies are written (calls, reasoning) is
told from the template text and vocabulary (``server.formats``).
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from starlette.concurrency import run_in_threadpool

from mlxkv.engine.requests import EngineError
from mlxkv.server.churn import normalise_messages
from mlxkv.server.errors import ApiError
from mlxkv.server.formats import DEFAULT_SYNTAX, VOCAB_MARKERS, CallSyntax, ReplyFormat, detect
from mlxkv.server.tool_prompt import with_default_tools, with_tool_list

if TYPE_CHECKING:
    from mlxkv.engine.api import EngineAPI

Encode = Callable[[list[dict[str, Any]], "list[dict[str, Any]] | None"], list[int]]
_PROBE_TOOL = {"type": "function", "function": {
    "name": "probe_tool", "description": "A tool.",
    "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}


@dataclasses.dataclass(frozen=True)
class TemplateCaps:
    """What a model's chat template renders, and how its replies are written."""

    tools: bool  # a ``tools`` list (else: the default tool format)
    system_turns: bool  # a system turn after the user's (else: merged into a user turn)
    calls: bool = False  # an assistant turn's ``tool_calls`` and ``tool`` results
    format: ReplyFormat = dataclasses.field(default_factory=lambda: ReplyFormat(None, None, None))
    # an earlier call's arguments go to the template as a JSON string (it writes a dict's
    # Python repr, not JSON, where the model wrote JSON)
    string_arguments: bool = False
    # the generation prompt opens the reasoning (``...<think>``), by template_kwargs
    opens_reasoning: dict[str, bool] = dataclasses.field(default_factory=dict)


def _kwargs_key(kwargs: dict[str, Any] | None) -> str:
    return json.dumps(kwargs or {}, sort_keys=True, default=str)


def probe_template(encode: Encode, decode: Callable[[list[int]], str] | None = None,
                   template: tuple[Any, ...] = (None, [])) -> TemplateCaps:
    """The template's abilities, from the token ids ``encode(messages, tools)`` gives: a
    template that ignores a part renders the same tokens with and without it, and one that
    refuses a part raises. ``decode`` and ``template`` (``Engine.chat_template``'s answer:
    the text, the reply markers the vocabulary holds as tokens, the tool parser the
    tokenizer config names) tell the reply format and how calls render back. An
    :class:`EngineError` (the engine did not answer) is raised."""
    base = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]

    def differs(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> bool:
        try:
            return encode(messages, tools) != encode(base, None)
        except EngineError:
            raise
        except Exception:  # the template refused it (a jinja error, most often)
            return False

    def loop(arguments: Any, decode: Callable[[list[int]], str]) -> str | None:
        """A conversation with a call and its result as the template renders it (None: it
        refuses it)."""
        call = {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
                "function": {"name": "probe_tool", "arguments": arguments}}]}
        try:
            return decode(encode(base + [call, {"role": "tool", "tool_call_id": "call_1",
                                                "content": "R"}, {"role": "user", "content": "V"}],
                                 [_PROBE_TOOL]))
        except EngineError:
            raise
        except Exception:
            return None

    string_arguments = calls = False
    if decode is not None:
        as_dict = loop({"x": "probe"}, decode)
        # a template that writes the value as it is wants the JSON string (a dict comes out
        # as its Python repr, or does not concatenate at all)
        string_arguments = as_dict is None or "{'x': 'probe'}" in as_dict
        text = loop('{"x": "probe"}', decode) if string_arguments else as_dict
        calls = text is not None and "probe_tool" in text and "probe" in text.split("probe_tool", 1)[-1]
    return TemplateCaps(tools=differs(base, [_PROBE_TOOL]),
                        system_turns=differs(base + [{"role": "system", "content": "E"}], None),
                        calls=calls, format=detect(*template), string_arguments=string_arguments)


def opens_reasoning(fmt: ReplyFormat, prompt_text: str) -> bool:
    """Whether a prompt ending ``prompt_text`` leaves the reasoning open for the reply."""
    if fmt.think is None:
        return False
    start, end = fmt.think
    return prompt_text.rfind(start) > prompt_text.rfind(end)


class TemplateProbe:
    """One engine's :class:`TemplateCaps`, probed on first use (the engine's model is loaded
    by then) and kept; whether the reasoning opens, per set of template kwargs."""

    def __init__(self, engine: EngineAPI):
        self._engine = engine
        self._caps: TemplateCaps | None = None
        self._lock = threading.Lock()

    def caps(self, template_kwargs: dict[str, Any] | None = None, timeout: float = 30.0) -> TemplateCaps:
        """Blocking (it may wait for the engine thread): call it from a worker thread."""
        engine = self._engine
        with self._lock:
            if self._caps is None:
                self._caps = probe_template(
                    lambda messages, tools: engine.encode_chat(messages, timeout, tools),
                    lambda tokens: engine.decode(tokens, timeout),
                    engine.chat_template(VOCAB_MARKERS, timeout))
            caps = self._caps
            key = _kwargs_key(template_kwargs)
            if caps.format.think is not None and key not in caps.opens_reasoning:
                tokens = engine.encode_chat([{"role": "user", "content": "U"}], timeout, None,
                                            template_kwargs)
                caps.opens_reasoning[key] = opens_reasoning(caps.format, engine.decode(tokens[-24:], timeout))
            return caps


@dataclasses.dataclass(frozen=True)
class ChatPrompt:
    """What goes into the engine's ``Request``: the messages, the tools for the template
    (None when none, or when they are in the messages in the default format), and whether
    the reply is parsed for tool calls."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    parse_calls: bool
    caps: TemplateCaps = dataclasses.field(default_factory=lambda: TemplateCaps(False, False))
    template_kwargs: dict[str, Any] | None = None
    all_tools: list[dict[str, Any]] | None = None  # the request's tools (parsers read their schemas)
    syntax: CallSyntax = DEFAULT_SYNTAX  # the call syntax the prompt asks for

    def parser(self) -> Any:
        """A parser for the reply to this prompt: text, reasoning and tool calls apart."""
        return self.caps.format.parser(self.all_tools, self.parse_calls, self.reasoning_open, self.syntax)

    @property
    def reasoning_open(self) -> bool:
        return self.caps.opens_reasoning.get(_kwargs_key(self.template_kwargs), False)


def _join(*texts: str) -> str:
    return "\n\n".join(t for t in texts if t)


def place_system_entries(messages: list[dict[str, Any]], system_turns: bool) -> list[dict[str, Any]]:
    """``system`` messages where the prompt still ends on the user's words and the cache
    still hits. System entries right after a user turn go into that turn, in front of the
    user's text, always: as a turn of their own, or after the text, they would end the prompt
    (Claude Code sends its environment section after the question, and a small model
    answers the environment instead), and the turn renders the same as later turns are
    added. With ``system_turns`` the other entries stay where they are. Otherwise the system
    messages that open the conversation become one system message (joined by a blank line),
    and every later one is put in front of the user turn right after it, else (between two
    assistant turns, or last after one) it becomes a user turn of its own."""
    lead = 0
    while lead < len(messages) and messages[lead].get("role") == "system":
        lead += 1
    rest = messages[lead:]
    if not any(m.get("role") == "system" for m in rest) and (system_turns or lead <= 1):
        return messages
    out: list[dict[str, Any]] = []
    if lead:
        out.extend(messages[:lead]) if system_turns else out.append(
            {"role": "system", "content": _join(*(m.get("content") or "" for m in messages[:lead]))})
    ahead: list[str] = []  # entries right after the user turn out[user_at], for its front
    user_at = -1
    waiting: list[str] = []  # system text for the next user turn
    for m in rest:
        role, text = m.get("role"), m.get("content") or ""
        if role == "system" and user_at == len(out) - 1 and user_at >= 0:
            ahead.append(text)
            continue
        if ahead:
            turn = out[user_at]
            out[user_at] = {**turn, "content": _join(*ahead, turn.get("content") or "")}
            ahead = []
        if role == "system":
            if system_turns:
                out.append(m)
            else:
                waiting.append(text)
            continue
        if role == "user" and waiting:
            m = {**m, "content": _join(*waiting, text)}
            waiting = []
        elif waiting:
            out.append({"role": "user", "content": _join(*waiting)})
            waiting = []
        out.append(m)
        user_at = len(out) - 1 if role == "user" else -1
    if ahead:
        turn = out[user_at]
        out[user_at] = {**turn, "content": _join(*ahead, turn.get("content") or "")}
    if waiting:
        out.append({"role": "user", "content": _join(*waiting)})
    return out


def _calls_for_template(messages: list[dict[str, Any]], string_arguments: bool) -> list[dict[str, Any]]:
    """Earlier calls' arguments in the shape the template renders as JSON (a string for
    templates that write the value as it is), and earlier reasoning under both names
    templates read (``reasoning_content``: Qwen3, GLM; ``thinking``: gpt-oss)."""
    out = []
    for m in messages:
        if m.get("role") == "assistant" and (m.get("tool_calls") or m.get("reasoning")):
            m = dict(m)
            if string_arguments and m.get("tool_calls"):
                m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.dumps(
                    c["function"]["arguments"], ensure_ascii=False)}}
                    if not isinstance(c["function"].get("arguments"), str) else c for c in m["tool_calls"]]
            reasoning = m.pop("reasoning", None)
            if reasoning:
                m["reasoning_content"] = m["thinking"] = reasoning
        out.append(m)
    return out


def _complete(tool: dict[str, Any]) -> dict[str, Any]:
    """A function tool with the fields templates read whether or not the client sent them
    (a ``description``, ``parameters`` with ``properties``): templates index them without a
    default, and a client may leave them out."""
    fn = dict(tool.get("function") or {})
    if fn.get("description") is None:
        fn["description"] = ""
    params = fn.get("parameters")
    if not isinstance(params, dict) or not params:
        params = {"type": "object", "properties": {}}
    elif params.get("type") == "object" and "properties" not in params:
        params = {**params, "properties": {}}
    fn["parameters"] = params
    return {**tool, "type": tool.get("type", "function"), "function": fn}


def build_prompt(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                 caps: TemplateCaps, churn_rules: bool = True,
                 template_kwargs: dict[str, Any] | None = None) -> ChatPrompt:
    """The prompt for chat-template ``messages`` and OpenAI function ``tools`` (see the
    module docstring for the steps)."""
    if churn_rules:
        messages = normalise_messages(messages)
    tools = [_complete(t) for t in tools] if tools else tools
    template_tools = tools or None
    family = caps.format.syntax
    syntax = family if family is not None else DEFAULT_SYNTAX
    if caps.tools:
        messages = _calls_for_template(messages, caps.string_arguments)
    elif caps.calls and family is not None and family.instructions:
        # the template renders the family's calls, not the list: the list in its own words
        messages = with_tool_list(_calls_for_template(messages, caps.string_arguments), tools,
                                  family.instructions)
        template_tools = None
    else:
        messages = with_default_tools(messages, tools)
        template_tools, syntax = None, DEFAULT_SYNTAX
    messages = place_system_entries(messages, caps.system_turns)
    return ChatPrompt(messages, template_tools, parse_calls=bool(tools), caps=caps,
                      template_kwargs=template_kwargs or None, all_tools=tools or None, syntax=syntax)


async def chat_prompt(probe: TemplateProbe, messages: list[dict[str, Any]],
                      tools: list[dict[str, Any]] | None, churn_rules: bool = True,
                      template_kwargs: dict[str, Any] | None = None) -> ChatPrompt:
    """:func:`build_prompt` with the engine's template abilities (a 503 when the engine
    does not answer the probe)."""
    try:
        caps = await run_in_threadpool(probe.caps, template_kwargs)
    except EngineError as e:
        raise ApiError(503, f"the engine is not serving: {e}") from None
    return build_prompt(messages, tools, caps, churn_rules, template_kwargs)
