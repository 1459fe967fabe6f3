"""The model families whose reply formats the server parses, as tests and bench.formats drive
them: each family's real chat template (``tests/fixtures/templates``, sources in its
SOURCES.md), the parser the server should choose for it, and a reply in the family's own
syntax that calls ``get_weather(city="Paris")`` (and, for thinking families, reasons first)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

TEMPLATES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "templates"
CITY = "Paris"
ARGS = {"city": CITY}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
REASONING = "The user wants the weather, so I call the tool."


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    template: str  # file name under TEMPLATES
    parser: str  # ReplyFormat.family the server must choose
    call: str  # a reply that calls get_weather(city="Paris")
    thinking: str | None = None  # a reply that reasons, then answers "Sunny." (thinking families)
    opens_reasoning: bool = False  # the template's generation prompt opens the reasoning

    @property
    def template_path(self) -> Path:
        return TEMPLATES / self.template

    @property
    def reasoned_call(self) -> str | None:
        """A reply that reasons, then calls the tool (thinking families)."""
        if self.thinking is None:
            return None
        if self.name == "gpt_oss":
            return self.thinking.split("<|start|>", 1)[0] + "<|start|>assistant" + self.call
        if self.opens_reasoning:
            return REASONING + "\n" + self.call
        return self.thinking.replace("Sunny.", self.call)


FAMILIES = (
    Family("qwen3", "qwen3.jinja", "mlx_lm.json_tools",
           '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
           f"<think>\n{REASONING}\n</think>\n\nSunny."),
    Family("qwen3_coder", "qwen3_coder.jinja", "mlx_lm.qwen3_coder",
           "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"),
    Family("glm4", "glm4.jinja", "mlx_lm.glm47",
           "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>",
           f"<think>{REASONING}</think>\nSunny."),
    Family("mistral_small", "mistral_small.jinja", "mlx_lm.mistral",
           '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'),
    Family("minimax_m2", "minimax_m2.jinja", "mlx_lm.minimax_m2",
           '</think>\n\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>'
           "\n</invoke>\n</minimax:tool_call>",
           f"{REASONING}\n</think>\n\nSunny.", opens_reasoning=True),
    Family("kimi_k2", "kimi_k2.jinja", "mlx_lm.kimi_k2",
           "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
           '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>'),
    Family("gemma4", "gemma.jinja", "mlx_lm.gemma4",
           '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>',
           f"<|channel>thought\n{REASONING}<channel|>Sunny."),
    Family("deepseek_v3_1", "deepseek_v3_1.jinja", "mlxkv.deepseek",
           "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
           '{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
           f"<think>{REASONING}</think>Sunny."),
    Family("gpt_oss", "gpt_oss.jinja", "mlxkv.harmony",
           '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>',
           f"<|channel|>analysis<|message|>{REASONING}<|end|><|start|>assistant<|channel|>final"
           "<|message|>Sunny.<|return|>"),
    Family("llama3", "llama3.jinja", "mlxkv.llama3",
           '{"name": "get_weather", "parameters": {"city": "Paris"}}'),
)
BY_NAME = {f.name: f for f in FAMILIES}


# JSON schemas structured output is held to (tests and bench.formats): bounds, enums, arrays,
# nested objects, no extra properties
JSON_SCHEMAS = (
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                               "minItems": 1, "maxItems": 3},
                                      "size": {"type": "number", "minimum": 0}, "ok": {"type": "boolean"}},
     "required": ["tags", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"id": {"type": "integer"}, "label": {"type": "string", "maxLength": 16}},
        "required": ["id", "label"], "additionalProperties": False}}}, "required": ["items"],
     "additionalProperties": False},
)
