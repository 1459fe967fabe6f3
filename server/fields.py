"""Typed reads of a JSON request body: each says which field was wrong and why (400), so a
string where a number belongs never reaches the engine as a confusing failure."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from mlxkv.server.errors import ApiError

_MISSING = object()


def parse_body(raw: bytes) -> dict[str, Any]:
    """The JSON object in ``raw`` (400 when it is not JSON, or not an object)."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, not {type(body).__name__}")
    return body


def _kind(value: Any) -> str:
    return "null" if value is None else {dict: "object", list: "array", str: "string",
                                         bool: "boolean"}.get(type(value), type(value).__name__)


def get_str(body: dict, name: str, default: Any = None, required: bool = False) -> Any:
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        if required:
            raise ApiError(400, f"{name} is required", name)
        return default
    if not isinstance(value, str):
        raise ApiError(400, f"{name} must be a string, not {_kind(value)}", name)
    return value


def get_bool(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"{name} must be true or false, not {_kind(value)}", name)
    return value


def get_int(body: dict, name: str, default: Any = None, lo: int | None = None,
            hi: int | None = None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"{name} must be an integer, not {_kind(value)}", name)
    if lo is not None and value < lo:
        raise ApiError(400, f"{name} must be >= {lo}, got {value}", name)
    if hi is not None and value > hi:
        raise ApiError(400, f"{name} must be <= {hi}, got {value}", name)
    return value


def get_float(body: dict, name: str, default: Any = None, lo: float | None = None,
              hi: float | None = None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ApiError(400, f"{name} must be a number, not {_kind(value)}", name)
    if isinstance(value, int) and value.bit_length() > 1000 or not math.isfinite(value):
        raise ApiError(400, f"{name} must be a finite number", name)  # (huge ints: no float)
    if lo is not None and value < lo:
        raise ApiError(400, f"{name} must be >= {lo}, got {value}", name)
    if hi is not None and value > hi:
        raise ApiError(400, f"{name} must be <= {hi}, got {value}", name)
    return float(value)


def get_list(body: dict, name: str, required: bool = False) -> list | None:
    value = body.get(name)
    if value is None:
        if required:
            raise ApiError(400, f"{name} is required", name)
        return None
    if not isinstance(value, list):
        raise ApiError(400, f"{name} must be an array, not {_kind(value)}", name)
    return value


def get_object(body: dict, name: str) -> dict | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ApiError(400, f"{name} must be an object, not {_kind(value)}", name)
    return value


def get_stop(body: dict, name: str) -> tuple[str, ...]:
    """``stop``: a string or an array of (at most 16) non-empty strings."""
    value = body.get(name)
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise ApiError(400, f"{name} must be a string or an array of strings", name)
    if len(items) > 16:
        raise ApiError(400, f"{name} takes at most 16 strings, got {len(items)}", name)
    if any(not s for s in items):
        raise ApiError(400, f"{name} strings must not be empty", name)
    return tuple(items)


@dataclasses.dataclass(frozen=True)
class Limits:
    """The server's bounds on what one request may ask for."""

    max_tokens_limit: int | None = None  # None: the model's context
    context_tokens: int | None = None


def sampling(body: dict, defaults: Any, limits: Limits, max_names: tuple[str, ...],
             stop_name: str = "stop", required_max: bool = False) -> Any:
    """SamplingParams from the body's sampling fields over the server's ``defaults``."""
    max_tokens = None
    for name in max_names:
        max_tokens = get_int(body, name, None, lo=1)
        if max_tokens is not None:
            break
    if max_tokens is None and required_max:
        raise ApiError(400, f"{max_names[0]} is required", max_names[0])
    cap = limits.max_tokens_limit or limits.context_tokens
    if max_tokens is not None and cap is not None and max_tokens > cap:
        raise ApiError(400, f"{max_names[0]} is {max_tokens}; this server allows at most {cap}",
                       max_names[0])
    changes: dict[str, Any] = {
        "temperature": get_float(body, "temperature", defaults.temperature, lo=0.0, hi=100.0),
        "top_p": get_float(body, "top_p", defaults.top_p, lo=0.0, hi=1.0),
        "top_k": get_int(body, "top_k", defaults.top_k, lo=0),
        "min_p": get_float(body, "min_p", defaults.min_p, lo=0.0, hi=1.0),
        "seed": get_int(body, "seed", defaults.seed),
        "stop": get_stop(body, stop_name),
    }
    if max_tokens is not None:
        changes["max_tokens"] = max_tokens
    if changes["top_p"] == 0.0:
        raise ApiError(400, "top_p must be > 0", "top_p")
    try:
        return dataclasses.replace(defaults, **changes)
    except ValueError as e:
        raise ApiError(400, str(e)) from None
