"""Every model family's reply format through `mlxkv serve`, on the real model, in one run.

    python -m bench.formats [--json] [--families qwen3,gpt_oss] [--turns 6] [--samples 4]

The real model (SmolLM2-135M-Instruct) is served once per family with that family's real
chat template swapped in (``--chat-template``; templates in ``tests/fixtures/templates``),
over loopback, through the real OpenAI and Anthropic SDKs:

- ``tool_call_families_parsed``: families whose call, forced to the family's own text
  (``guided_choice``), comes back structured on chat completions, Messages and Responses,
  streamed and not (goal: all of them).
- ``reasoning_families_separated``: thinking families whose reasoning comes back apart from
  the answer on the three routes (``reasoning_content``, ``thinking`` blocks, ``reasoning``
  items) (goal: all thinking families).
- ``tool_loop_hit_fraction_min``: a ``--turns`` tool loop (call, result, call, ...) per family;
  each turn after the first reads from the cache what it shares with the turn before it (its
  prompt, then the reply the model wrote). A family's figure is the cached tokens over what
  its template allows (the common prefix of the previous prompt + reply tokens with the new
  prompt's tokens), summed over turns; the minimum over families (goal >= 0.95). Beside it,
  per family, what the template allows of the previous turn (a template that drops earlier
  calls or reasoning allows less). Thinking families run the loop a second time with
  replies that reason before their call and the reasoning sent back
  (``reasoning_loop_hit_fraction_min``, and what each template allows then).
- ``json_schema_valid_fraction``: replies held to a JSON schema (``response_format``), sampled
  at temperature 1 with ``--samples`` seeds per schema, that parse and validate (goal 1.0).

Grammar costs and the constrained-decoding speed-up are ``bench.grammar``'s. The last line of
``--json`` is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

# isort: off
from bench.models import real_model_file
from mlxkv.engine.blas import blas_info, preload

preload()  # the system OpenBLAS before mlx.core
# isort: on

QUESTION = "What is the weather in Paris?"


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _routes_call(oai: Any, claude: Any, family: Any) -> dict[str, bool]:
    from support.formats import ARGS, WEATHER_TOOL

    forced = {"guided_choice": [family.call], "temperature": 0}
    q = [{"role": "user", "content": QUESTION}]
    ctool = {"name": "get_weather", "description": "weather", "input_schema": WEATHER_TOOL["function"]["parameters"]}
    rtool = {"type": "function", "name": "get_weather", "parameters": WEATHER_TOOL["function"]["parameters"]}
    out = {}
    r = oai.chat.completions.create(model="m", messages=q, tools=[WEATHER_TOOL], extra_body=forced)
    calls = r.choices[0].message.tool_calls or []
    out["chat"] = [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_weather", ARGS)]
    chunks = list(oai.chat.completions.create(model="m", messages=q, tools=[WEATHER_TOOL], stream=True,
                                              extra_body=forced))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    out["chat_stream"] = [(d.function.name, json.loads(d.function.arguments)) for d in deltas] == [
        ("get_weather", ARGS)]
    m = claude.messages.create(model="m", max_tokens=256, messages=q, tools=[ctool], extra_body=forced)
    out["messages"] = [(b.type, getattr(b, "input", None)) for b in m.content] == [("tool_use", ARGS)]
    with claude.messages.stream(model="m", max_tokens=256, messages=q, tools=[ctool], extra_body=forced) as s:
        final = s.get_final_message()
    out["messages_stream"] = [(b.type, getattr(b, "input", None)) for b in final.content] == [("tool_use", ARGS)]
    resp = oai.responses.create(model="m", input=QUESTION, tools=[rtool], extra_body=forced)
    out["responses"] = [(i.type, json.loads(getattr(i, "arguments", "null") or "null")) for i in resp.output] == [
        ("function_call", ARGS)]
    events = list(oai.responses.create(model="m", input=QUESTION, tools=[rtool], stream=True, extra_body=forced))
    out["responses_stream"] = [i.type for i in events[-1].response.output] == ["function_call"]
    return out


def _routes_reasoning(oai: Any, claude: Any, family: Any) -> dict[str, bool]:
    from support.formats import REASONING

    forced = {"guided_choice": [family.thinking], "temperature": 0}
    q = [{"role": "user", "content": QUESTION}]
    r = oai.chat.completions.create(model="m", messages=q, extra_body=forced).choices[0].message
    out = {"chat": (r.content, (r.model_extra or {}).get("reasoning_content")) == ("Sunny.", REASONING)}
    m = claude.messages.create(model="m", max_tokens=256, messages=q, extra_body=forced)
    out["messages"] = [b.type for b in m.content] == ["thinking", "text"] and m.content[0].thinking == REASONING
    resp = oai.responses.create(model="m", input=QUESTION, extra_body=forced)
    out["responses"] = [i.type for i in resp.output] == ["reasoning", "message"] and resp.output_text == "Sunny."
    return out


def _tool_loop(srv: Any, engine: Any, family: Any, turns: int, reasoned: bool = False) -> dict[str, Any]:
    """A ``turns`` tool loop on chat completions: per turn the cached tokens, and what the
    template allows (the previous prompt + reply tokens' common prefix with this prompt).
    ``reasoned``: each reply reasons before its call, and the client sends the reasoning
    back with the call (``reasoning_content``), as clients of thinking models do."""
    import openai

    from mlxkv.server.chat_prompt import build_prompt
    from mlxkv.server.openai_api import chat_messages
    from support.formats import WEATHER_TOOL

    oai = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=600)
    caps = srv.ctx.template.caps()
    tokenizer = engine.call(lambda: engine.loaded.tokenizer).result(60)
    # what the reply leaves in the cache: the forced text's tokens, then EOS (guided_choice
    # ends the choice with the first EOS id)
    text = family.reasoned_call if reasoned else family.call
    reply = list(tokenizer.encode(text, add_special_tokens=False)) + sorted(tokenizer.eos_token_ids)[:1]
    # the reasoned loop asks its own question: the cache must not serve it from the first
    # loop's states (same calls, no reasoning), or it would read more than this loop allows
    question = QUESTION.replace("?", " today?") if reasoned else QUESTION
    messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
    previous: list[int] | None = None
    cached = allowed = prompt_total = 0
    per_turn = []
    for turn in range(turns):
        prompt = build_prompt(chat_messages(messages), [WEATHER_TOOL], caps)
        tokens = engine.encode_chat(prompt.messages, 60, prompt.tools)
        r = oai.chat.completions.create(model="m", messages=messages, tools=[WEATHER_TOOL],
                                        extra_body={"guided_choice": [text], "temperature": 0})
        assert r.usage.prompt_tokens == len(tokens), (r.usage.prompt_tokens, len(tokens))
        hit = r.usage.prompt_tokens_details.cached_tokens
        if previous is not None:
            could = min(_common(previous, tokens), len(tokens) - 1)  # the last token is always fed
            cached, allowed, prompt_total = cached + hit, allowed + could, prompt_total + len(previous)
            per_turn.append({"prompt": len(tokens), "cached": hit, "allowed": could})
        previous = tokens + reply
        (call,) = r.choices[0].message.tool_calls
        said: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]}
        if reasoned:
            said["reasoning_content"] = (r.choices[0].message.model_extra or {}).get("reasoning_content")
            assert said["reasoning_content"], r.choices[0].message
        messages += [said, {"role": "tool", "tool_call_id": call.id, "content": f"Sunny, {20 + turn} C"}]
    return {"hit_of_allowed": round(cached / allowed, 4) if allowed else 1.0,
            "allowed_of_previous": round(allowed / prompt_total, 4) if prompt_total else 1.0,
            "turns": per_turn}


def _json_valid(oai: Any, samples: int) -> tuple[int, int]:
    import jsonschema

    ok = total = 0
    from support.formats import JSON_SCHEMAS

    for i, schema in enumerate(JSON_SCHEMAS):
        for seed in range(samples):
            r = oai.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "Answer in JSON."}], temperature=1.0, seed=seed,
                max_tokens=200,
                response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}})
            total += 1
            try:
                jsonschema.validate(json.loads(r.choices[0].message.content), schema)
                ok += 1
            except (ValueError, jsonschema.ValidationError):
                pass
    return ok, total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--families", default="", help="comma-separated family names (default: all)")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--samples", type=int, default=4, help="seeds per JSON schema")
    args = ap.parse_args(argv)
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    import anthropic
    import openai
    from server_support import LoopbackServer

    from mlxkv.engine.cache.prefix_cache import PrefixCache
    from mlxkv.engine.engine import Engine
    from mlxkv.engine.settings import Settings
    from mlxkv.server.context import ServerConfig
    from support.formats import FAMILIES

    real = real_model_file()
    chosen = [f for f in FAMILIES if not args.families or f.name in args.families.split(",")]
    result: dict[str, Any] = {"blas": blas_info()["name"], "real_model": str(real),
                              "load_average_start": os.getloadavg()[0], "families": {}}
    started = time.perf_counter()
    for family in chosen:
        settings = Settings.defaults().replace(model=str(real), chat_template=str(family.template_path))
        cache = PrefixCache(ram_bytes=512 << 20, cache_dir=None, block_tokens=16)
        with Engine(str(real), settings=settings, prefix_cache=cache).start(timeout=600) as engine, \
                LoopbackServer(engine, ServerConfig(open_ended=True)) as srv:
            oai = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=600)
            claude = anthropic.Anthropic(base_url=srv.url, api_key="none", max_retries=0, timeout=600)
            fig: dict[str, Any] = {"parser": srv.ctx.template.caps().format.family}
            fig["calls"] = _routes_call(oai, claude, family)
            if family.thinking:
                fig["reasoning"] = _routes_reasoning(oai, claude, family)
            fig["tool_loop"] = _tool_loop(srv, engine, family, args.turns)
            if family.thinking:
                fig["reasoning_loop"] = _tool_loop(srv, engine, family, args.turns, reasoned=True)
            if family is chosen[0]:
                ok, total = _json_valid(oai, args.samples)
                result["json_schema_valid"], result["json_schema_samples"] = ok, total
        result["families"][family.name] = fig
        loop = fig["tool_loop"]
        print(f"{family.name:14} parser {fig['parser']:20} calls {sum(fig['calls'].values())}/{len(fig['calls'])}"
              + (f"  reasoning {sum(fig['reasoning'].values())}/{len(fig['reasoning'])}" if "reasoning" in fig else "")
              + f"  tool loop: hit {loop['hit_of_allowed']:.3f} of allowed, template allows "
              f"{loop['allowed_of_previous']:.3f} of the previous turn"
              + (f"; with reasoning: hit {fig['reasoning_loop']['hit_of_allowed']:.3f}, allows "
                 f"{fig['reasoning_loop']['allowed_of_previous']:.3f}" if "reasoning_loop" in fig else ""), flush=True)
    fams = result["families"]
    thinking = [n for n in fams if "reasoning" in fams[n]]
    result["tool_call_families_parsed"] = sum(all(f["calls"].values()) for f in fams.values())
    result["tool_call_families"] = len(fams)
    result["reasoning_families_separated"] = sum(all(fams[n]["reasoning"].values()) for n in thinking)
    result["reasoning_families"] = len(thinking)
    result["tool_loop_hit_fraction_min"] = min(f["tool_loop"]["hit_of_allowed"] for f in fams.values())
    result["reasoning_loop_hit_fraction_min"] = min(
        (fams[n]["reasoning_loop"]["hit_of_allowed"] for n in thinking), default=None)
    result["json_schema_valid_fraction"] = round(result["json_schema_valid"] / result["json_schema_samples"], 4)
    result["wall_s"] = round(time.perf_counter() - started, 1)
    result["load_average_end"] = os.getloadavg()[0]
    print(f"tool_call_families_parsed {result['tool_call_families_parsed']}/{len(fams)}; "
          f"reasoning_families_separated {result['reasoning_families_separated']}/{len(thinking)}; "
          f"tool_loop_hit_fraction_min {result['tool_loop_hit_fraction_min']} (goal >= 0.95); "
          f"json_schema_valid_fraction {result['json_schema_valid_fraction']} "
          f"({result['json_schema_valid']}/{result['json_schema_samples']}, temperature 1); "
          f"load average {result['load_average_start']:.1f} -> {result['load_average_end']:.1f}")
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
