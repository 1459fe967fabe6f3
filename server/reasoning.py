"""The clients' reasoning switches as the chat template's variables.

Templates name their switch differently: Qwen3, GLM and most others read
``enable_thinking``, DeepSeek V3.1 reads ``thinking``, gpt-oss reads ``reasoning_effort``.
A request sets what it asks for under every name (a template ignores variables it does not
read), and ``chat_template_kwargs`` (vLLM's and mlx_lm.server's field) passes any variable
as it is, over the mapped ones:

- OpenAI chat ``reasoning_effort`` / Responses ``reasoning.effort``: ``none`` turns
  thinking off; any other effort is handed on as ``reasoning_effort``.
- Anthropic ``thinking``: ``{"type": "disabled"}`` turns it off, ``enabled`` on;
  ``adaptive`` (Claude Code's) leaves the template's default.
"""

from __future__ import annotations

from typing import Any

from mlxkv.server.errors import ApiError
from mlxkv.server.fields import get_object, get_str

EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
_OFF = {"enable_thinking": False, "thinking": False}
_ON = {"enable_thinking": True, "thinking": True}


def _passed(body: dict) -> dict[str, Any]:
    kwargs = get_object(body, "chat_template_kwargs") or {}
    for key in kwargs:
        if not key.isidentifier():
            raise ApiError(400, f"chat_template_kwargs: {key!r} is not a template variable name",
                           "chat_template_kwargs")
    return dict(kwargs)


def effort_kwargs(effort: str | None, field: str) -> dict[str, Any]:
    if effort is None:
        return {}
    if effort not in EFFORTS:
        raise ApiError(400, f"{field} must be one of {', '.join(EFFORTS)}; got {effort!r}", field)
    return dict(_OFF) if effort == "none" else {"reasoning_effort": effort}


def openai_kwargs(body: dict) -> dict[str, Any] | None:
    """Chat completions: ``reasoning_effort`` and ``chat_template_kwargs``."""
    out = effort_kwargs(get_str(body, "reasoning_effort"), "reasoning_effort")
    return {**out, **_passed(body)} or None


def responses_kwargs(body: dict) -> dict[str, Any] | None:
    """Responses: ``reasoning.effort`` and ``chat_template_kwargs``."""
    reasoning = get_object(body, "reasoning") or {}
    effort = reasoning.get("effort")
    if effort is not None and not isinstance(effort, str):
        raise ApiError(400, "reasoning.effort must be a string", "reasoning.effort")
    return {**effort_kwargs(effort, "reasoning.effort"), **_passed(body)} or None


def anthropic_kwargs(body: dict) -> dict[str, Any] | None:
    """Messages: ``thinking`` and ``chat_template_kwargs``."""
    thinking = get_object(body, "thinking")
    out: dict[str, Any] = {}
    if thinking is not None:
        kind = thinking.get("type")
        if kind not in ("enabled", "disabled", "adaptive"):
            raise ApiError(400, f"thinking.type must be enabled, disabled or adaptive; got {kind!r}",
                           "thinking.type")
        out = dict(_OFF) if kind == "disabled" else dict(_ON) if kind == "enabled" else {}
    return {**out, **_passed(body)} or None
