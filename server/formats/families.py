"""Which reply format a model writes, found from its chat template and vocabulary, and the
call syntaxes mlx-lm does not have.

:func:`detect` looks, in order, for the formats this package parses itself (gpt-oss's harmony
channels, DeepSeek V3.x's call markers, Llama 3.x's JSON calls) and then asks mlx-lm's own
choice (``mlx_lm.tokenizer_utils._infer_tool_parser``: the template first, then the
vocabulary). Reasoning markers come from the vocabulary (the tokens mlx-lm knows) or, for a
template swapped onto a model whose vocabulary lacks them, from the template text."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Collection
from typing import Any

from mlxkv.server.formats.calls import CallSyntax, mlx_lm_syntax
from mlxkv.server.formats.harmony import HarmonyParser
from mlxkv.server.formats.stream import ReplyParser

# ---------------------------------------------------------------- DeepSeek V3, V3.1, R1
DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
_DS_CALL = re.compile(r"<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)<｜tool▁call▁end｜>", re.DOTALL)
_DS_FENCED = re.compile(r"^\s*([^\n]+?)\s*\n```(?:json)?\s*\n(.*?)\n```\s*$", re.DOTALL)


def parse_deepseek(text: str, tools: Any = None) -> list[dict[str, Any]]:
    """V3.1: ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{args}<｜tool▁call▁end｜>``; V3 and R1:
    ``...begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{args}\\n```<｜tool▁call▁end｜>``."""
    calls = []
    for head, rest in _DS_CALL.findall(text):
        fenced = _DS_FENCED.match(rest)
        if head.strip() == "function" and fenced:
            name, args = fenced.group(1), fenced.group(2)
        else:
            name, args = head, rest
        calls.append({"name": name.strip(), "arguments": json.loads(args)})
    if not calls:
        raise ValueError("no <｜tool▁call▁begin｜> ... <｜tool▁call▁end｜> in the call section")
    return calls


# ------------------------------------------------------------------------ Llama 3.x
LLAMA_PYTHON_TAG = "<|python_tag|>"


def parse_llama3(text: str, tools: Any = None) -> list[dict[str, Any]]:
    """``{"name": ..., "parameters": {...}}``, the whole reply (several separated by ``;`` or
    new lines, as the 3.1 and 3.2 models write them)."""
    decoder = json.JSONDecoder()
    calls, i, text = [], 0, text.strip()
    while i < len(text):
        obj, i = decoder.raw_decode(text, i)
        if not isinstance(obj, dict) or "name" not in obj:
            raise ValueError("not a {\"name\": ..., \"parameters\": ...} call")
        calls.append(obj)
        while i < len(text) and text[i] in " \t\r\n;":
            i += 1
    return calls


# DeepSeek V3.1's template renders calls and results but no tool list: the model card has
# the list described in the system prompt, with the call syntax spelled out
DEEPSEEK_HOW = (
    "## Tools\n\nYou can call the tools below. To call tools, write exactly:\n"
    f"{DS_CALLS_BEGIN}<｜tool▁call▁begin｜>TOOL_NAME<｜tool▁sep｜>{{JSON arguments}}<｜tool▁call▁end｜>"
    f"{DS_CALLS_END}\nwith one <｜tool▁call▁begin｜>...<｜tool▁call▁end｜> per call, all inside one "
    f"{DS_CALLS_BEGIN}...{DS_CALLS_END}; then stop: the results come back to you. Answer in plain "
    "text when no tool is needed.")
# harmony calls are parsed by HarmonyParser; the syntax names the family (forced calls)
HARMONY = CallSyntax("mlxkv.harmony", "<|channel|>", "", lambda text, tools: None)
DEEPSEEK = CallSyntax("mlxkv.deepseek", DS_CALLS_BEGIN, DS_CALLS_END, parse_deepseek, DEEPSEEK_HOW)
LLAMA3 = CallSyntax("mlxkv.llama3", LLAMA_PYTHON_TAG, "", parse_llama3)


# ----------------------------------------------------------------------- the format
# reasoning markers: the vocabulary tokens mlx-lm looks for, then template-only spellings
THINK_MARKERS = (("<think>", "</think>"), ("<longcat_think>", "</longcat_think>"),
                 ("<|think:start|>", "<|think:end|>"), ("[THINK]", "[/THINK]"),
                 ("<|channel>thought", "<channel|>"))
VOCAB_MARKERS = tuple({m for pair in THINK_MARKERS for m in pair} | {
    "<|channel>", "<|tool_call_start|>", "<|tool_call_end|>", "<|open|>", "<|close|>", "<|sep|>",
    "<|end_of_msg|>", "<|channel|>", "<|message|>", "<|tool_calls_section_begin|>"})


@dataclasses.dataclass(frozen=True)
class ReplyFormat:
    """What a model's replies hold and how to split them. ``family``: the parser's name
    (``mlx_lm.qwen3_coder``, ``mlxkv.harmony``, ...; ``None``: no call syntax known);
    ``think``: reasoning markers; ``bare_json``: a call may be the whole reply as JSON."""

    family: str | None
    syntax: CallSyntax | None
    think: tuple[str, str] | None
    harmony: bool = False
    bare_json: bool = False

    @property
    def reasoning(self) -> bool:
        return self.harmony or self.think is not None

    def parser(self, tools: list[dict[str, Any]] | None, parse_calls: bool,
               reasoning_open: bool = False, syntax: CallSyntax | None = None) -> Any:
        """A parser for one reply. ``syntax`` overrides the model's (the default tool format,
        for templates that render no tools)."""
        if self.harmony:
            return HarmonyParser(tools, parse_calls)
        use = (syntax or self.syntax) if parse_calls else None
        return ReplyParser(use, self.think, tools, reasoning_open,
                           bare_json=self.bare_json and use is self.syntax)


def _think(template: str, vocab: Collection[str]) -> tuple[str, str] | None:
    for start, end in THINK_MARKERS[:3]:
        if start in vocab and end in vocab:
            return start, end
    if "<|channel>" in vocab and "<channel|>" in vocab:
        return "<|channel>thought", "<channel|>"
    for start, end in THINK_MARKERS:
        if start in template and end in template:
            return start, end
    if "<|channel>" in template and "<channel|>" in template:
        return "<|channel>thought", "<channel|>"
    return None


class _TemplateView:
    """What mlx-lm's detection reads of a tokenizer."""

    def __init__(self, template: str, vocab: Collection[str]):
        self.chat_template = template
        self._vocab = {t: i for i, t in enumerate(vocab)}

    def get_vocab(self) -> dict[str, int]:
        return self._vocab


def detect(template: str | None, vocab: Collection[str] = (), named: str | None = None) -> ReplyFormat:
    """The reply format of a model with this chat template; ``vocab``: which of
    :data:`VOCAB_MARKERS` its vocabulary holds (a whole vocabulary works too); ``named``: the
    mlx-lm parser its tokenizer config names (``tool_parser_type``), which comes first, as in
    mlx-lm's loader."""
    template = template or ""
    if named:
        try:
            return ReplyFormat(f"mlx_lm.{named}", mlx_lm_syntax(named), _think(template, vocab))
        except ImportError:
            pass  # a parser this mlx-lm does not have: found from the template instead
    if "<|channel|>" in template and "<|message|>" in template or \
            "<|channel|>" in vocab and "<|message|>" in vocab and "<|channel|>" in template:
        return ReplyFormat("mlxkv.harmony", HARMONY, None, harmony=True)
    think = _think(template, vocab)
    if "tool▁calls▁begin" in template:
        return ReplyFormat(DEEPSEEK.name, DEEPSEEK, think)
    try:
        from mlx_lm.tokenizer_utils import _infer_tool_parser

        module = _infer_tool_parser(_TemplateView(template, vocab))
    except ImportError:
        module = None
    if module is None and ("<|tool_calls_section_begin|>" in vocab or "tool_declare" in template):
        # Kimi-K2's first template declares tools (``tool_declare``) but names no call
        # markers; its vocabulary has them
        module = "kimi_k2"
    if module is not None:
        return ReplyFormat(f"mlx_lm.{module}", mlx_lm_syntax(module), think)
    if LLAMA_PYTHON_TAG in template or ("<|start_header_id|>" in template and '"parameters"' in template):
        return ReplyFormat(LLAMA3.name, LLAMA3, think, bare_json=True)
    return ReplyFormat(None, None, think)


# the format server.tool_prompt tells a model with no tool template to write
DEFAULT_SYNTAX = mlx_lm_syntax("json_tools")
