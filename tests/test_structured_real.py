"""Structured output on the real model: ``response_format`` (chat completions), ``text.format``
(Responses) and ``output_config.format`` (Anthropic) hold the reply to a JSON schema token by
token, sampled at temperature 1; a schema the grammar engine cannot enforce is a 400 naming
the keyword; a forced call stays lossless with speculation."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest
from common import T
from server_support import LoopbackServer

from mlxkv.engine.engine import Engine
from mlxkv.server.context import ServerConfig
from support.formats import JSON_SCHEMAS
from support.real_model import real_model_path

REAL = real_model_path()
pytestmark = pytest.mark.skipif(REAL is None, reason="the real model is not fetched: run `make fixtures`")
SCHEMAS = JSON_SCHEMAS[:2]
ASK = [{"role": "user", "content": "Describe a person as JSON."}]


@pytest.fixture(scope="module")
def srv():
    with Engine(str(REAL)).start(timeout=T) as engine, LoopbackServer(engine, ServerConfig(open_ended=True)) as s:
        yield s


def test_json_schema_on_every_route_sampled(srv):
    oai = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=T)
    claude = anthropic.Anthropic(base_url=srv.url, api_key="none", max_retries=0, timeout=T)
    for i, schema in enumerate(SCHEMAS):
        for seed in (1, 2):
            r = oai.chat.completions.create(model="m", messages=ASK, temperature=1.0, seed=seed, max_tokens=120,
                                            response_format={"type": "json_schema", "json_schema": {
                                                "name": f"s{i}", "schema": schema}})
            jsonschema.validate(json.loads(r.choices[0].message.content), schema)
        resp = oai.responses.create(model="m", input="Describe a person as JSON.", temperature=1.0,
                                    max_output_tokens=120, extra_body={"seed": 3},
                                    text={"format": {"type": "json_schema", "name": f"s{i}", "schema": schema}})
        jsonschema.validate(json.loads(resp.output_text), schema)
        m = claude.messages.create(model="m", max_tokens=120, messages=ASK, extra_body={
            "temperature": 1.0, "seed": 4, "output_config": {"format": {"type": "json_schema", "schema": schema}}})
        jsonschema.validate(json.loads(m.content[0].text), schema)
    obj = oai.chat.completions.create(model="m", messages=ASK, temperature=1.0, seed=5, max_tokens=60,
                                      response_format={"type": "json_object"})
    assert isinstance(json.loads(obj.choices[0].message.content), dict)


def test_an_unsupported_keyword_is_a_400_naming_it(srv):
    oai = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=T)
    bad = {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="m", messages=ASK, max_tokens=8, response_format={
            "type": "json_schema", "json_schema": {"name": "bad", "schema": bad}})
    assert e.value.body["param"] == "response_format.json_schema.schema" and "not" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        oai.chat.completions.create(model="m", messages=ASK, max_tokens=8, tool_choice={
            "type": "function", "function": {"name": "nope"}}, tools=[{"type": "function", "function": {
                "name": "get_weather", "parameters": {"type": "object"}}}])


def test_a_constrained_reply_is_the_same_with_and_without_speculation(srv):
    oai = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=T)
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMAS[0]}}
    replies = [oai.chat.completions.create(model="m", messages=ASK, temperature=0, max_tokens=80, response_format=fmt,
                                           extra_body={"spec": spec}).choices[0].message.content
               for spec in ("off", "auto")]
    assert replies[0] == replies[1]
    jsonschema.validate(json.loads(replies[0]), SCHEMAS[0])
