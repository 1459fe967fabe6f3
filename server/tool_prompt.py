"""The default tool format, for models whose chat template renders no tools (SmolLM2's
ChatML, say): tools are never dropped silently, they are written into the prompt as plain
text the model can read, in the same ``<tool_call>`` form ``server.formats`` parses back (mlx-lm's json_tools parser).

The tool list ends the system prompt (one is added when there is none): a ``# Tools``
section saying how to call a tool, then each tool's name, description and JSON schema.
Earlier calls follow their assistant turn's text, one ``<tool_call>`` line each; tool
results become a user turn of ``<tool_response>`` blocks (with the user's text after them).

The rendering is deterministic (the tools in the order the client sent them, JSON as given),
so an agent that resends the same tools keeps its cached prefix.
"""

from __future__ import annotations

import json
from typing import Any

_HOW = (
    "# Tools\n\n"
    "You can call the tools below. To call one, write a line of its own:\n"
    '<tool_call>{"name": "TOOL_NAME", "arguments": {...}}</tool_call>\n'
    "with the arguments as a JSON object that follows the tool's parameters. You may call "
    "several tools, one line each; then stop: each result comes back to you in a "
    "<tool_response> block. Answer in plain text when no tool is needed.")


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def tools_text(tools: list[dict[str, Any]], how: str = _HOW) -> str:
    """The ``# Tools`` section for OpenAI function tools; ``how``: how to call one (a
    family's own syntax, for templates that render its calls but not the tool list)."""
    parts = [how]
    for tool in tools:
        fn = tool["function"]
        lines = [f"## {fn['name']}"]
        if fn.get("description"):
            lines.append(str(fn["description"]))
        lines.append("Parameters (JSON schema): " + _dumps(fn.get("parameters") or {"type": "object"}))
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def call_line(name: str, arguments: Any) -> str:
    """One tool call as the model is told to write it."""
    return f"<tool_call>{_dumps({'name': name, 'arguments': arguments})}</tool_call>"


def _with_calls(message: dict[str, Any]) -> dict[str, Any]:
    lines = [call_line(c["function"]["name"], c["function"]["arguments"])
             for c in message.get("tool_calls") or ()]
    text = message.get("content") or ""
    out = {k: v for k, v in message.items() if k != "tool_calls"}
    out["content"] = "\n".join(([text] if text else []) + lines)
    return out


def with_tool_list(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                   how: str = _HOW) -> list[dict[str, Any]]:
    """``messages`` with the tool list at the end of the system prompt (none when ``tools``
    is empty); calls and results stay for the template."""
    out = list(messages)
    if tools:
        section = tools_text(tools, how)
        if out and out[0].get("role") == "system":
            system = out[0].get("content") or ""
            out[0] = {**out[0], "content": f"{system}\n\n{section}" if system else section}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out


def with_default_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
                       ) -> list[dict[str, Any]]:
    """``messages`` in the default tool format: the tool list in the system prompt (none when
    ``tools`` is empty), tool calls and results as text. Nothing is left for the template's
    own tool handling."""
    out: list[dict[str, Any]] = []
    results: list[str] = []  # tool results not yet written into a user turn

    def flush(user_text: str | None = None) -> None:
        if results:
            text = "\n".join(results + ([user_text] if user_text else []))
            out.append({"role": "user", "content": text})
            results.clear()
        elif user_text is not None:
            out.append({"role": "user", "content": user_text})

    for m in messages:
        role = m.get("role")
        if role == "tool":
            results.append(f"<tool_response>\n{m.get('content') or ''}\n</tool_response>")
        elif role == "user" and results:
            flush(m.get("content") or "")
        else:
            flush()
            out.append(_with_calls(m) if role == "assistant" else m)
    flush()
    return with_tool_list(out, tools)
