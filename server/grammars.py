"""Grammars that hold a reply to what the request demands, token by token (the engine's
``Request.grammar``, llguidance's Lark syntax with ``%json`` schemas):

- :func:`json_reply`: JSON valid against a schema (OpenAI ``response_format``, Responses
  ``text.format``, Anthropic ``output_config.format``);
- :func:`forced_calls`: one or more calls of the allowed tools, with arguments valid against
  each tool's schema, written in the model family's own call syntax (OpenAI ``tool_choice``
  ``"required"`` or a named function, Anthropic ``any`` / ``tool``).

JSON is written with fixed separators (``", "``, ``": "``), so every separator, key and
closing bracket is forced and drafted together with the tokens around it. Markers are matched
as text. A schema the grammar engine does not implement is a 400 that names the keyword."""

from __future__ import annotations

import functools
import itertools
import json
from typing import Any

from mlxkv.server.errors import ApiError

_GUIDANCE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_STRING = ("string",)


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _schema(schema: Any) -> dict[str, Any]:
    return schema if isinstance(schema, dict) and schema else {"type": "object"}


def _json(schema: Any) -> str:
    return "%json " + json.dumps({**_schema(schema), "x-guidance": _GUIDANCE}, ensure_ascii=False)


@functools.lru_cache(maxsize=256)
def _problem(grammar: str) -> str | None:
    """What is wrong with ``grammar`` (None: it compiles). Kept per grammar: an agent sends
    the same tools every turn, and count_tokens and the reply check the same one."""
    from mlxkv.engine.speculation.grammar import check_grammar

    try:
        check_grammar(None, grammar)
    except ValueError as e:
        return str(e).strip().splitlines()[0] if str(e).strip() else "it does not compile"
    return None


def check(grammar: str, field: str) -> str:
    """``grammar`` when it compiles, else a 400 naming ``field`` and what is wrong."""
    problem = _problem(grammar)
    if problem is not None:
        raise ApiError(400, f"{field}: the schema cannot be enforced: {problem}", field)
    return grammar


def json_reply(schema: Any, field: str) -> str:
    """A reply that is one JSON value valid against ``schema`` (None: any JSON object)."""
    return check(f"start: {_json(schema)}\n", field)


# --------------------------------------------------------------------- forced calls
class _Rules:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self._n = itertools.count()

    def add(self, body: str, prefix: str = "r", lazy: bool = False) -> str:
        name = f"{prefix}{next(self._n)}"
        self.lines.append(f"{name}{'[lazy]' if lazy else ''}: {body}")
        return name


def _params(tool: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    schema = _schema(tool["function"].get("parameters"))
    props = schema.get("properties") or {}
    return props, [k for k in props if k in set(schema.get("required") or ())]


def _is_string(sub: Any) -> bool:
    kind = sub.get("type") if isinstance(sub, dict) else None
    return kind in _STRING or (isinstance(kind, list) and kind == ["string"])


def _value(rules: _Rules, sub: Any, end: str) -> str:
    """A parameter value then ``end``: a string as raw text (lazily up to ``end``), anything
    else as JSON."""
    if _is_string(sub):
        return rules.add(_regex_lazy(end, sub), "v", lazy=True)
    return f"{_json(sub)} {_lit(end)}"


def _regex_escape(text: str) -> str:
    out = []
    for ch in text:
        if ch in ".^$*+?()[]{}|\\/":
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        else:
            out.append(ch)
    return "".join(out)


def _xml_params(rules: _Rules, tool: dict[str, Any], head: str, mid: str, end: str) -> str:
    """Parameters written ``head K mid VALUE end`` each, required ones in order, the others
    optional."""
    props, required = _params(tool)
    parts = []
    for key, sub in props.items():
        part = f"{_lit(head + key + mid)} {_value(rules, sub, end)}"
        parts.append(f"({part})" if key in required else f"({part})?")
    return " ".join(parts) if parts else '""'


def _call_object(name: str, tool: dict[str, Any], args_key: str = "arguments") -> dict[str, Any]:
    params = _schema(tool["function"].get("parameters"))
    return {"type": "object", "properties": {"name": {"const": name}, args_key: params},
            "required": ["name", args_key], "additionalProperties": False}


def _call_rule(rules: _Rules, family: str, tool: dict[str, Any]) -> str:
    name = tool["function"]["name"]
    if family == "mlx_lm.qwen3_coder":
        params = _xml_params(rules, tool, "<parameter=", ">\n", "\n</parameter>\n")
        return rules.add(f"{_lit('<tool_call>' + chr(10) + f'<function={name}>' + chr(10))} {params} "
                         f"{_lit('</function>' + chr(10) + '</tool_call>')}", "c")
    if family == "mlx_lm.glm47":
        params = _xml_params(rules, tool, "<arg_key>", "</arg_key>\n<arg_value>", "</arg_value>\n")
        return rules.add(f"{_lit('<tool_call>' + name + chr(10))} {params} {_lit('</tool_call>')}", "c")
    if family == "mlx_lm.minimax_m2":
        params = _xml_params(rules, tool, '<parameter name="', '">', "</parameter>\n")
        return rules.add(f"{_lit(f'<invoke name={chr(34)}{name}{chr(34)}>' + chr(10))} {params} "
                         f"{_lit('</invoke>' + chr(10))}", "c")
    args = _json(tool["function"].get("parameters"))
    if family == "mlx_lm.kimi_k2":
        return rules.add(f"{_lit('<|tool_call_begin|>functions.' + name + ':')} /[0-9]/ "
                         f"{_lit('<|tool_call_argument_begin|>')} {args} {_lit('<|tool_call_end|>')}", "c")
    if family == "mlxkv.deepseek":
        return rules.add(f"{_lit('<｜tool▁call▁begin｜>' + name + '<｜tool▁sep｜>')} {args} "
                         f"{_lit('<｜tool▁call▁end｜>')}", "c")
    if family == "mlxkv.harmony":
        return rules.add(f"{_lit('<|channel|>commentary to=functions.' + name + ' <|constrain|>json<|message|>')} "
                         f"{args}", "c")
    if family == "mlx_lm.gemma4":
        props, required = _params(tool)
        parts = []
        for i, (key, sub) in enumerate(props.items()):
            sep = "" if i == 0 else ","
            # no "<" in a value: the reply's parser ends the call at the first <tool_call|>
            quote = "<|" + chr(34) + "|>"
            value = (f"{_lit(quote)} {rules.add(_regex_lazy(quote, sub, '[^<]'), 'v', lazy=True)}"
                     if _is_string(sub) else _json(sub))
            part = f"{_lit(sep + key + ':')} {value}"
            parts.append(f"({part})" if key in required else f"({part})?")
        return rules.add(f"{_lit('<|tool_call>call:' + name + '{')} {' '.join(parts) or chr(34) * 2} "
                         f"{_lit('}<tool_call|>')}", "c")
    raise KeyError(family)


def _regex_lazy(end: str, sub: Any = None, chars: str = "(?s:.)") -> str:
    """Raw text up to the first ``end`` (at most the schema's maxLength characters) made of
    ``chars``."""
    most = sub.get("maxLength") if isinstance(sub, dict) else None
    body = f"{chars}{{0,{int(most)}}}" if isinstance(most, int) and most >= 0 else f"{chars}*"
    return f"/{body}{_regex_escape(end)}/"


# families whose calls are JSON objects in a wrapper, several in one list or one after another
_JSON_FAMILIES = {"mlx_lm.json_tools": ("<tool_call>\n", "\n</tool_call>", "\n"),
                  "mlxkv.llama3": ("", "", "; ")}
_SECTIONS = {"mlx_lm.kimi_k2": ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"),
             "mlxkv.deepseek": ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"),
             "mlx_lm.minimax_m2": ("<minimax:tool_call>\n", "</minimax:tool_call>")}
FORCEABLE = {*_JSON_FAMILIES, *_SECTIONS, "mlx_lm.mistral", "mlx_lm.qwen3_coder", "mlx_lm.glm47",
             "mlxkv.harmony", "mlx_lm.gemma4"}


def _repeat(first: str, then: str, most: int) -> str:
    """``first``, then up to ``most - 1`` times ``then``."""
    return " ".join([first] + [f"({then})?"] * (most - 1))


def forced_calls(family: str, tools: list[dict[str, Any]], names: list[str] | None, field: str,
                 opens_with: str = "", most: int = 4) -> str:
    """A reply of 1 to ``most`` calls of ``names`` (None: any of ``tools``) in ``family``'s
    syntax; ``opens_with``: text the reply must start with first (``</think>`` where the
    prompt opened the reasoning: a forced call skips it, as the hosted APIs have it)."""
    chosen = [t for t in tools if names is None or t["function"]["name"] in names]
    if not chosen:
        raise ApiError(400, f"{field}: names no tool of the request", field)
    if family not in FORCEABLE:
        raise ApiError(400, f"{field}: this model's call format ({family}) cannot be forced", field)
    rules = _Rules()
    lead = f"{_lit(opens_with)} " if opens_with else ""
    if family in _JSON_FAMILIES or family == "mlx_lm.mistral":
        key = "parameters" if family == "mlxkv.llama3" else "arguments"
        one = {"anyOf": [_call_object(t["function"]["name"], t, key) for t in chosen]}
        if family == "mlx_lm.mistral":
            array = {"type": "array", "minItems": 1, "maxItems": most, "items": one}
            start = f"{lead}{_lit('[TOOL_CALLS]')} {_json(array)}"
        else:
            open_, close, sep = _JSON_FAMILIES[family]
            call = rules.add(f"{_lit(open_)} {_json(one)} {_lit(close)}", "c")
            start = lead + _repeat(call, f"{_lit(sep)} {call}", most)
    else:
        calls = [_call_rule(rules, family, t) for t in chosen]
        call = rules.add(" | ".join(calls), "calls")
        if family in _SECTIONS:
            begin, end = _SECTIONS[family]
            start = f"{lead}{_lit(begin)} {_repeat(call, call, most)} {_lit(end)}"
        elif family == "mlxkv.harmony":
            start = f"{lead}{call}"
        else:
            start = lead + _repeat(call, f"{_lit(chr(10))} {call}", most)
    return check("start: " + start + "\n" + "\n".join(rules.lines) + "\n", field)


def reply_grammar(prompt: Any, force: list[str] | None | bool, schema: Any = None, *,
                  force_field: str = "tool_choice", schema_field: str = "response_format",
                  parallel: bool = True) -> str | None:
    """The grammar of a request's reply: forced calls (``force``: True for any tool, a list
    of names, None/False when calls are not forced; only with tools), else JSON against
    ``schema`` (``False``/None: no JSON demanded; ``{}``: any JSON object), else None."""
    if force and prompt.parse_calls:
        think = prompt.caps.format.think
        opens = think[1] + "\n\n" if think and prompt.reasoning_open else ""
        return forced_calls(prompt.syntax.name, prompt.all_tools, None if force is True else list(force),
                            force_field, opens, most=4 if parallel else 1)
    if schema is not None and schema is not False:
        return json_reply(schema or None, schema_field)
    return None
