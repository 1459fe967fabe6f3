"""Fields of an Anthropic Messages body that the server accepts without acting on them, as
agents send them (Claude Code sends most of these with every request). Each is checked for
its shape, so a malformed value is a 400 that names it, as the hosted API answers. Why each
changes nothing here (the README says the same):

- ``metadata``: identifies the end user to the hosted API's abuse checks; a local server
  has no accounts.
- ``thinking``: ``disabled`` and ``enabled`` switch the template's thinking off and on
  (``server.reasoning``); a thinking model's reasoning comes back as ``thinking`` blocks,
  and earlier turns' blocks go back to templates that keep them. ``budget_tokens`` is not
  enforced.
- ``context_management``: asks the hosted API to clear old thinking or tool results on its
  side; the conversation is prefilled as the client sends it.
- ``output_config.effort``: the hosted model's effort level; a local model has none.
  (``output_config.format``, structured outputs, is enforced: ``server.grammars``.)
- ``cache_control`` (on the body, blocks and tools, with ``ttl``): the prefix cache keeps
  every prompt it serves without being asked.
- ``service_tier``: there is one tier here.

Fields not named here and not read by the route are ignored.

Headers: ``anthropic-version``, ``anthropic-beta`` and the client's own (``x-app``, ...)
are accepted and ignored; ``?beta=true`` on the URL too.
"""

from __future__ import annotations

from mlxkv.server.errors import ApiError
from mlxkv.server.fields import get_int, get_list, get_object, get_str, within

THINKING_TYPES = ("enabled", "disabled", "adaptive")
CACHE_TTLS = ("5m", "1h")


def check_cache_control(holder: dict, where: str) -> None:
    """``holder["cache_control"]``, when set: ``{"type": "ephemeral", "ttl": "5m" | "1h"}``."""
    value = holder.get("cache_control")
    if value is None:
        return
    name = f"{where}.cache_control" if where else "cache_control"
    if not isinstance(value, dict):
        raise ApiError(400, f"{name} must be an object", name)
    if value.get("type") != "ephemeral":
        raise ApiError(400, f"{name}.type must be \"ephemeral\", got {value.get('type')!r}", f"{name}.type")
    ttl = value.get("ttl")
    if ttl is not None and ttl not in CACHE_TTLS:
        raise ApiError(400, f"{name}.ttl must be one of {', '.join(CACHE_TTLS)}, got {ttl!r}", f"{name}.ttl")


def check_ignored_fields(body: dict) -> None:
    """A 400 naming the first accepted-and-ignored field whose value has the wrong shape."""
    metadata = get_object(body, "metadata")
    if metadata is not None:
        within("metadata", lambda: get_str(metadata, "user_id"))
    thinking = get_object(body, "thinking")
    if thinking is not None:
        kind = thinking.get("type")
        if kind not in THINKING_TYPES:
            raise ApiError(400, f"thinking.type must be one of {', '.join(THINKING_TYPES)}, got {kind!r}",
                           "thinking.type")
        within("thinking", lambda: get_int(thinking, "budget_tokens", lo=0))
        within("thinking", lambda: get_str(thinking, "display"))
    management = get_object(body, "context_management")
    if management is not None:
        edits = within("context_management", lambda: get_list(management, "edits")) or []
        for i, edit in enumerate(edits):
            if not isinstance(edit, dict) or not isinstance(edit.get("type"), str):
                name = f"context_management.edits[{i}]"
                raise ApiError(400, f"{name} must be an object with a type", name)
    output = get_object(body, "output_config")
    if output is not None:
        within("output_config", lambda: get_str(output, "effort"))
    check_cache_control(body, "")
    get_str(body, "service_tier")

