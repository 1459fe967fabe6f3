"""Tool calls and reasoning in every model family's own format (``server.formats``), on the
real chat templates in ``tests/fixtures/templates``: the format is told from the template, and
each family's replies split into text, reasoning and calls however the stream cuts them."""

from __future__ import annotations

import pytest

from mlxkv.server.formats import CALL, REASONING, TEXT, detect, split_reply
from mlxkv.server.formats.families import parse_deepseek
from support.formats import ARGS, FAMILIES, WEATHER_TOOL
from support.formats import REASONING as THOUGHT

TOOLS = [WEATHER_TOOL]


def pieces_of(parser, text: str, cut: int) -> list:
    """``text`` fed ``cut`` characters at a time, then finished; runs of a kind joined."""
    out = []
    for i in range(0, len(text), cut):
        out += parser.feed(text[i:i + cut])
    out += parser.finish()
    joined: list = []
    for kind, piece in out:
        if joined and kind == joined[-1][0] != CALL:
            joined[-1] = (kind, joined[-1][1] + piece)
        else:
            joined.append((kind, piece))
    return joined


def fmt_of(family):
    return detect(family.template_path.read_text(encoding="utf-8"))


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_each_family_is_told_from_its_template(family):
    assert fmt_of(family).family == family.parser


@pytest.mark.parametrize("cut", [1, 3, 1000])
@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_a_call_in_the_family_syntax_comes_back_structured(family, cut):
    out = pieces_of(fmt_of(family).parser(TOOLS, True, family.opens_reasoning), family.call, cut)
    assert [k for k, _ in out] == [CALL], out
    assert (out[0][1].name, out[0][1].arguments) == ("get_weather", ARGS)


@pytest.mark.parametrize("cut", [1, 4, 1000])
@pytest.mark.parametrize("family", [f for f in FAMILIES if f.thinking], ids=lambda f: f.name)
def test_reasoning_comes_apart_from_the_answer(family, cut):
    out = pieces_of(fmt_of(family).parser(TOOLS, True, family.opens_reasoning), family.thinking, cut)
    assert out == [(REASONING, THOUGHT), (TEXT, "Sunny.")]
    assert fmt_of(family).reasoning


def test_text_before_several_calls_with_nested_multiline_and_non_ascii_arguments():
    fmt = detect((FAMILIES[0].template_path).read_text())  # qwen3
    args1 = {"path": "café/naïve.py", "edits": [{"old": "a\nb", "new": "ç\n\"q\""}], "opts": {"n": 2}}
    import json

    text = ("Let me check.\n<tool_call>\n" + json.dumps({"name": "edit", "arguments": args1}, ensure_ascii=False)
            + "\n</tool_call>\n<tool_call>\n" + json.dumps({"name": "get_weather", "arguments": ARGS})
            + "\n</tool_call>")
    for cut in (1, 7, 10000):
        out = pieces_of(fmt.parser(TOOLS, True), text, cut)
        assert [k for k, _ in out] == [TEXT, CALL, CALL]
        assert out[0][1] == "Let me check.\n" and out[1][1].arguments == args1 and out[2][1].arguments == ARGS


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_a_call_cut_short_comes_back_as_the_text_it_was(family):
    """A reply that ends inside a call (max_tokens): nothing the model wrote is lost."""
    cut = family.call[:family.call.index("Paris") + 2]
    for step in (1, 1000):
        out = pieces_of(fmt_of(family).parser(TOOLS, True), "Hi " + cut, step)
        assert [k for k, _ in out] == [TEXT] and out[0][1] == "Hi " + cut


def test_an_unclosed_call_and_a_partial_marker_are_given_back():
    fmt = detect(FAMILIES[1].template_path.read_text())  # qwen3-coder
    text, _, calls = split_reply(fmt.parser(TOOLS, True), "see <tool_call>\n<function=get_weather>\n")
    assert not calls and text == "see <tool_call>\n<function=get_weather>\n"
    parser = fmt.parser(TOOLS, True)
    assert parser.feed("a <tool_") == [(TEXT, "a ")]  # held: it may be a call
    assert parser.finish() == [(TEXT, "<tool_")]


def test_no_calls_are_parsed_when_the_request_has_no_tools():
    fmt = fmt_of(FAMILIES[0])
    text, reasoning, calls = split_reply(fmt.parser(None, False), "<think>x</think>" + FAMILIES[0].call)
    assert (text, reasoning, calls) == (FAMILIES[0].call, "x", [])


def test_reasoning_opened_by_the_prompt():
    fmt = fmt_of(FAMILIES[0])
    out = pieces_of(fmt.parser(None, False, reasoning_open=True), "\nweighing it\n</think>\n\nYes.", 2)
    assert out == [(REASONING, "weighing it"), (TEXT, "Yes.")]


def test_deepseek_v3_fenced_calls_parse_too():
    text = ("<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Paris\"}\n```"
            "<｜tool▁call▁end｜>")
    assert parse_deepseek(text) == [{"name": "get_weather", "arguments": ARGS}]


def test_harmony_preamble_then_call_and_plain_text_fall_back():
    fmt = detect((FAMILIES[8].template_path).read_text())  # gpt-oss
    text = ("<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>commentary<|message|>"
            "Checking.<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
            '{"city": "Paris"}')
    out = pieces_of(fmt.parser(TOOLS, True), text, 5)
    assert [k for k, _ in out] == [REASONING, TEXT, CALL] and out[1][1] == "Checking."
    assert out[2][1].arguments == ARGS
    assert split_reply(fmt.parser(TOOLS, True), "Just text.") == ("Just text.", "", [])


def test_llama3_several_calls_and_plain_text():
    fmt = fmt_of(FAMILIES[9])
    text, _, calls = split_reply(fmt.parser(TOOLS, True), '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                                                         '{"name": "get_weather", "parameters": {"city": "Oslo"}}')
    assert [c.arguments["city"] for c in calls] == ["Paris", "Oslo"] and text == ""
    assert split_reply(fmt.parser(TOOLS, True), "{not a call} ok") == ("{not a call} ok", "", [])
