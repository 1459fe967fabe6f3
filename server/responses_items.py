"""Responses API input as chat-template messages.

``input`` is a string or a list of items: ``message`` items (role user, assistant, system or
developer; text parts), ``function_call`` and ``function_call_output`` items, and
``reasoning`` items. A reasoning item's ``reasoning_text`` content (what this server returns)
goes back to the template with the assistant turn after it, for templates that keep earlier
reasoning; encrypted content and summaries (another model's) are left out.
``tools``: function tools, and the function tools inside ``namespace`` tools (offered to the
model as ``namespace.name``). Hosted and client-side built-in tools (web search, file search,
code interpreter, computer use, image generation, MCP, shell, apply_patch, tool search) and
free-form ``custom`` tools are accepted and not offered: they need call item types a chat
template has no form for, or run on OpenAI's side.

Chat templates that render ``tools`` get them as OpenAI chat function tools, and the history's
calls and results as assistant ``tool_calls`` and ``tool`` messages. Templates that ignore
``tools`` (SmolLM2's, for one) would drop them without a word; for those the route builds
its prompt as every chat route does (``server.chat_prompt``), which writes them in the
server's default tool format (``server.tool_prompt``).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from mlxkv.server.errors import ApiError

ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
# tool types accepted and not offered to the model (the module docstring says why)
IGNORED_TOOLS = ("web_search", "web_search_preview", "web_search_2025_08_26",
                 "web_search_preview_2025_03_11", "file_search", "code_interpreter",
                 "computer", "computer_use", "computer_use_preview", "image_generation", "mcp",
                 "local_shell", "shell", "apply_patch", "tool_search", "custom")


def _kind(value: Any) -> str:
    return "null" if value is None else {dict: "object", list: "array", str: "string",
                                         bool: "boolean"}.get(type(value), type(value).__name__)


def _str(obj: dict, key: str, where: str, required: bool = True) -> Any:
    value = obj.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str):
        raise ApiError(400, f"{where}.{key} must be a string, not {_kind(value)}", f"{where}.{key}")
    return value


# ------------------------------------------------------------------------------- tools
@dataclasses.dataclass
class Tools:
    """The request's tools as the model is offered them."""

    chat: list[dict[str, Any]]  # OpenAI chat function tools (what templates render)
    namespaced: dict[str, tuple[str, str]]  # offered name -> (namespace, name)


def _function(t: dict, where: str, name: str) -> dict[str, Any]:
    # the key order OpenAI chat clients send: templates render the tool JSON as given
    fn: dict[str, Any] = {"name": name}
    description = _str(t, "description", where, required=False)
    if description is not None:
        fn["description"] = description
    params = t.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise ApiError(400, f"{where}.parameters must be an object (a JSON schema)",
                       f"{where}.parameters")
    fn["parameters"] = params if params is not None else {"type": "object", "properties": {}}
    if t.get("strict") is not None and not isinstance(t["strict"], bool):
        raise ApiError(400, f"{where}.strict must be true or false", f"{where}.strict")
    return {"type": "function", "function": fn}


def parse_tools(raw: Any) -> Tools:
    """``tools`` of a request (validated; see the module docstring for what is offered)."""
    out = Tools([], {})
    if raw is None:
        return out
    if not isinstance(raw, list):
        raise ApiError(400, f"tools must be an array, not {_kind(raw)}", "tools")
    for i, t in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or not isinstance(t.get("type"), str):
            raise ApiError(400, f"{where} must be an object with a type", where)
        kind = t["type"]
        if kind == "function":
            name = _str(t, "name", where)
            out.chat.append(_function(t, where, name))
        elif kind == "namespace":
            space = _str(t, "name", where)
            inner = t.get("tools")
            if not isinstance(inner, list):
                raise ApiError(400, f"{where}.tools must be an array", f"{where}.tools")
            for j, f in enumerate(inner):
                at = f"{where}.tools[{j}]"
                if not isinstance(f, dict) or not isinstance(f.get("type"), str):
                    raise ApiError(400, f"{at} must be an object with a type", at)
                if f["type"] != "function":
                    continue  # custom tools: no form in a chat template (module docstring)
                name = _str(f, "name", at)
                offered = f"{space}.{name}"
                out.chat.append(_function(f, at, offered))
                out.namespaced[offered] = (space, name)
        elif kind not in IGNORED_TOOLS:
            raise ApiError(400, f"{where}.type {kind!r} is not a tool type this server knows "
                                "(function and namespace tools are offered to the model; built-in "
                                f"ones are accepted and not offered: {', '.join(IGNORED_TOOLS)})",
                           f"{where}.type")
    return out


def check_tool_choice(value: Any) -> bool:
    """Validates ``tool_choice``; False when it turns the tools off (``"none"``).
    ``required`` and a named function force a call (``server.grammars``); other objects
    (allowed tools) offer the tools as ``auto`` does."""
    if value is None:
        return True
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise ApiError(400, f"tool_choice must be none, auto, required or an object; got {value!r}",
                           "tool_choice")
        return value != "none"
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise ApiError(400, "tool_choice must be none, auto, required or an object with a type",
                       "tool_choice")
    return True


# ------------------------------------------------------------------------------- input
def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where} must be a string or an array of content parts, not "
                            f"{_kind(content)}", where)
    out = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise ApiError(400, f"{at} must be a content part object with a type", at)
        if part["type"] not in _TEXT_PARTS:
            raise ApiError(400, f"{at}: content parts of type {part['type']!r} are not supported "
                                "(text only: input_text, output_text)", f"{at}.type")
        key = "refusal" if part["type"] == "refusal" else "text"
        out.append(_str(part, key, at))
    return "".join(out)


def parse_input(raw: Any) -> list[dict[str, Any]]:
    """``input`` as a list of validated items (a string is one user message)."""
    if isinstance(raw, str):
        return [{"type": "message", "role": "user", "content": raw}]
    if not isinstance(raw, list):
        raise ApiError(400, f"input must be a string or an array of items, not {_kind(raw)}", "input")
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ApiError(400, f"{where} must be an object", where)
        kind = item.get("type", "message")  # a message may leave its type out
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise ApiError(400, f"{where}.role must be one of {', '.join(_ROLES)}; got {role!r}",
                               f"{where}.role")
            _text(item.get("content"), f"{where}.content")
        elif kind == "function_call":
            _str(item, "call_id", where)
            _str(item, "name", where)
            _str(item, "namespace", where, required=False)
            _arguments(_str(item, "arguments", where), f"{where}.arguments")
        elif kind == "function_call_output":
            _str(item, "call_id", where)
            _text(item.get("output"), f"{where}.output")
        elif kind != "reasoning":
            raise ApiError(400, f"{where}.type {kind!r} is not supported (items: "
                                f"{', '.join(ITEM_TYPES)})", f"{where}.type")
    return list(raw)


def _arguments(text: str, where: str) -> Any:
    try:
        return json.loads(text) if text.strip() else {}
    except ValueError:
        raise ApiError(400, f"{where} is not JSON", where) from None


def reasoning_text(item: dict) -> str:
    """The readable reasoning of a ``reasoning`` item (its ``reasoning_text`` parts)."""
    parts = item.get("content")
    if not isinstance(parts, list):
        return ""
    return "".join(p["text"] for p in parts if isinstance(p, dict) and p.get("type") == "reasoning_text"
                   and isinstance(p.get("text"), str))


def _call_name(item: dict) -> str:
    space = item.get("namespace")
    return f"{space}.{item['name']}" if space else item["name"]


def to_messages(items: list[dict[str, Any]], instructions: str | None) -> list[dict[str, Any]]:
    """Validated items as chat messages: ``instructions`` and the system and developer
    messages before the first turn make one system message (templates differ in what they
    do with several); later ones stay system messages where they are. Function calls join
    the assistant message before them; outputs are ``tool`` messages."""
    system = [instructions] if instructions else []
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # call_id -> function name, for the tool messages
    reasoning = ""  # a reasoning item's text, for the assistant turn after it
    for item in items:
        kind = item.get("type", "message")
        if kind == "reasoning":
            reasoning += reasoning_text(item)
            continue
        if kind == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            text = _text(item["content"], "input")
            if role == "system" and not out:
                system.append(text)
            else:
                msg = {"role": role, "content": text}
                if role == "assistant" and reasoning:
                    msg["reasoning"], reasoning = reasoning, ""
                out.append(msg)
        elif kind == "function_call":
            name = _call_name(item)
            names[item["call_id"]] = name
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": name, "arguments": _arguments(item["arguments"], "input")}}
            if out and out[-1]["role"] == "assistant" and not reasoning:
                out[-1] = {**out[-1], "tool_calls": [*out[-1].get("tool_calls", ()), call]}
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
                if reasoning:
                    out[-1]["reasoning"], reasoning = reasoning, ""
        elif kind == "function_call_output":
            msg = {"role": "tool", "tool_call_id": item["call_id"],
                   "content": _text(item["output"], "input")}
            if item["call_id"] in names:
                msg["name"] = names[item["call_id"]]
            out.append(msg)
    if system:
        out.insert(0, {"role": "system", "content": "\n\n".join(system)})
    return out
