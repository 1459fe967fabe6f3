"""Typed reads of a JSON request body: each says which field was wrong and why (400), so a
string where a number belongs never reaches the engine as a confusing failure."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable
from typing import Any, Literal, overload

from mlxkv.server.errors import ApiError

_MISSING = object()
# JSON may spell a lone UTF-16 surrogate ("\\ud800"); Python keeps it in the str, and it
# fails far away, when the text is encoded (tokenizer, log, reply)
_SURROGATE = re.compile("[\ud800-\udfff]")
SEED_RANGE = (0, 2**64 - 1)  # what mlx's random.seed takes
INT_MAX = 2**31 - 1  # bound on counts such as top_k: beyond it, arrays cannot be indexed


def parse_body(raw: bytes) -> dict[str, Any]:
    """The JSON object in ``raw`` (400 when it is not JSON, or not an object, or when a
    string in it holds a lone UTF-16 surrogate: the message names where)."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, (bytes, bytearray)) else raw
    except UnicodeDecodeError as e:  # JSON on the wire is UTF-8 (RFC 8259); Python would guess UTF-16 too
        raise ApiError(400, f"the request body is not UTF-8 text (byte {e.start}): JSON is sent as UTF-8") from None
    try:
        # Python's parser takes NaN, Infinity and 1e999 (inf), which JSON has no numbers
        # for and no reply can write back: kept as the text they were, then refused by path
        body = json.loads(text, parse_constant=_NonFinite, parse_float=_finite_float)
    except json.JSONDecodeError as e:
        key = _path_at(e.doc, e.pos) if e.pos <= PATH_SCAN_CHARS else None
        where = f" (in {key})" if key else ""
        raise ApiError(400, f"the request body is not valid JSON{where}: {e}", key) from None
    except (ValueError, RecursionError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, not {type(body).__name__}")
    bad, what = _first_bad(body)
    if bad is not None:
        raise ApiError(400, f"{bad}: {what}", bad)
    return body


PATH_SCAN_CHARS = 256 * 1024  # past this a syntax error is told by position alone (the scan
# runs on the event loop: about 30 ms for this much)
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"?|[{}\[\],]')  # a string (maybe cut at pos) or structure


def _path_at(doc: str, pos: int) -> str | None:
    """The path (``messages[1].content``) of the value a JSON syntax error at ``pos`` is
    in, read from the text before it (strings skipped, containers counted); None at the
    top level. Iterative, and the scanning is the regex engine's: the text may be long."""
    stack: list[list] = []  # per open container: [is_object, key or index, expecting a key]
    for m in _TOKEN.finditer(doc, 0, pos):
        t = m.group()
        if t[0] == '"':
            if stack and stack[-1][0] and stack[-1][2]:
                stack[-1][1], stack[-1][2] = t[1:-1], False
        elif t in "{[":
            stack.append([t == "{", None if t == "{" else 0, t == "{"])
        elif t in "}]":
            if stack:
                stack.pop()
        elif stack:  # ","
            if stack[-1][0]:
                stack[-1][2] = True
            else:
                stack[-1][1] += 1
    path = ""
    for is_object, key, _ in stack:
        if key is None:
            continue
        path += (f".{key}" if path else str(key)) if is_object else f"[{key}]"
    return path or None


class _NonFinite(str):
    """A number JSON does not have (``NaN``, ``Infinity``, ``1e999``), as it was written."""


def _finite_float(text: str) -> float | _NonFinite:
    value = float(text)
    return value if math.isfinite(value) else _NonFinite(text)


def lone_surrogate(value: Any) -> str | None:
    """The path (``messages[0].content``) of the first string, key or value, holding a lone
    surrogate, or None."""
    where, what = _first_bad(value)
    return where if what is not None and what.startswith("the text") else None


def _first_bad(value: Any) -> tuple[str | None, str | None]:
    """(path, what is wrong) of the first string, key or value holding a lone surrogate or
    number JSON has not, or (None, None). Walked without recursion: JSON may nest as deep
    as the parser allows."""
    surrogate = "the text holds a lone UTF-16 surrogate (not a character)"
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, _NonFinite):
            return path or "the request body", f"{item} is not a number JSON has (finite numbers only)"
        if isinstance(item, str):
            if not item.isascii() and _SURROGATE.search(item):
                return path or "the request body", surrogate
        elif isinstance(item, dict):
            for key, child in reversed(list(item.items())):
                # the key as it can be written back (a surrogate in it as its escape)
                name = key.encode("utf-8", "backslashreplace").decode("utf-8")
                name = f"{path}.{name}" if path else name
                if not key.isascii() and _SURROGATE.search(key):
                    return name, surrogate
                stack.append((name, child))
        elif isinstance(item, list):
            stack.extend((f"{path}[{i}]", child) for i, child in reversed(list(enumerate(item))))
    return None, None


def _kind(value: Any) -> str:
    return "null" if value is None else {dict: "object", list: "array", str: "string",
                                         bool: "boolean"}.get(type(value), type(value).__name__)


def within(prefix: str, read: Callable[[], Any]) -> Any:
    """``read()`` of a field of the object ``prefix`` names: its 400 names ``prefix.field``."""
    try:
        return read()
    except ApiError as e:
        param = f"{prefix}.{e.param}" if e.param else prefix
        raise ApiError(e.status, f"{prefix}.{e.message}", param) from None


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


@overload
def get_list(body: dict, name: str, required: Literal[True]) -> list: ...
@overload
def get_list(body: dict, name: str, required: bool = False) -> list | None: ...
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
    open_ended: bool = False  # no max_tokens asked: up to ``cap`` (else the server's default)

    @property
    def cap(self) -> int | None:
        """The most tokens a reply may ask for (more is clamped to it)."""
        return self.max_tokens_limit or self.context_tokens


def requested_max_tokens(body: dict, max_names: tuple[str, ...]) -> int | None:
    """The value of the first of ``max_names`` the body sets (None: none)."""
    for name in max_names:
        value = get_int(body, name, None, lo=1)
        if value is not None:
            return value
    return None


def max_tokens_header(body: dict, limits: Limits, max_names: tuple[str, ...]) -> dict[str, str]:
    """The response header that says a request's ``max_tokens`` was clamped to the server's
    limit (agents ask for more than a local model's context as a matter of course, e.g.
    Claude Code's 32000): ``x-mlxkv-max-tokens: requested 32000, clamped to 8192``."""
    asked = requested_max_tokens(body, max_names)
    cap = limits.cap
    if asked is None or cap is None or asked <= cap:
        return {}
    return {"x-mlxkv-max-tokens": f"requested {asked}, clamped to {cap}"}


def sampling(body: dict, defaults: Any, limits: Limits, max_names: tuple[str, ...],
             stop_name: str = "stop", required_max: bool = False) -> Any:
    """SamplingParams from the body's sampling fields over the server's ``defaults``. A
    ``max_tokens`` above the server's limit is clamped to it (:func:`max_tokens_header`
    says so to the client)."""
    max_tokens = requested_max_tokens(body, max_names)
    if max_tokens is None and required_max:
        raise ApiError(400, f"{max_names[0]} is required", max_names[0])
    cap = limits.cap
    if max_tokens is not None and cap is not None:
        max_tokens = min(max_tokens, cap)
    changes: dict[str, Any] = {
        "temperature": get_float(body, "temperature", defaults.temperature, lo=0.0, hi=100.0),
        "top_p": get_float(body, "top_p", defaults.top_p, lo=0.0, hi=1.0),
        "top_k": get_int(body, "top_k", defaults.top_k, lo=0, hi=INT_MAX),
        "min_p": get_float(body, "min_p", defaults.min_p, lo=0.0, hi=1.0),
        "seed": get_int(body, "seed", defaults.seed, lo=SEED_RANGE[0], hi=SEED_RANGE[1]),
        "stop": get_stop(body, stop_name),
    }
    if max_tokens is None and limits.open_ended:
        # no max_tokens: the reply may run to the end of the context (as OpenAI's do; aider
        # sends none and expects the model's end of turn), within the server's limit
        max_tokens = cap
    if max_tokens is not None:
        changes["max_tokens"] = max_tokens
    if changes["top_p"] == 0.0:
        raise ApiError(400, "top_p must be > 0", "top_p")
    try:
        return dataclasses.replace(defaults, **changes)
    except ValueError as e:
        raise ApiError(400, str(e)) from None


def extension_fields(body: dict) -> dict[str, Any]:
    """The fields beyond the APIs' own that every route takes (as ``extra_body`` in the
    SDKs): ``guided_choice`` (the reply is exactly one of these strings, as vLLM spells
    it) and ``spec`` (this request's speculation)."""
    from mlxkv.engine.settings import SPEC_CHOICES

    out: dict[str, Any] = {}
    choices = get_list(body, "guided_choice")
    if choices is not None:
        if not choices or len(choices) > 256 or not all(isinstance(c, str) and c for c in choices):
            raise ApiError(400, "guided_choice must be an array of 1 to 256 non-empty strings",
                           "guided_choice")
        out["guided_choice"] = tuple(choices)
    spec = get_str(body, "spec")
    if spec is not None:
        if spec not in SPEC_CHOICES:
            raise ApiError(400, f"spec must be one of {', '.join(SPEC_CHOICES)}; got {spec!r}", "spec")
        out["spec"] = spec
    return out
