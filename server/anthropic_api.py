"""Anthropic Messages API: ``POST /v1/messages``, JSON or server-sent events
(``message_start``, one ``content_block_start``/``_delta``/``_stop`` run per text or tool_use
block, ``message_delta`` with the stop reason and usage, ``message_stop``)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response

from mlxkv.engine.requests import EngineError, ErrorEvent, FinishedEvent, Request, TokenEvent
from mlxkv.server.bridge import EventStream, SseResponse, collect, error_status, first_event
from mlxkv.server.context import Context, dumps, new_id, read_json, session_of, text_of, usage_counts
from mlxkv.server.errors import ApiError, anthropic_body
from mlxkv.server.fields import get_list, get_object, get_str, sampling
from mlxkv.server.retention import anthropic_retain_s
from mlxkv.server.tools import ToolCall, ToolCallParser


# ------------------------------------------------------------------------- the request
def _system(value: Any) -> str | None:
    if value is None:
        return None
    return text_of(value, "system")


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise ApiError(400, f"{where} must be a string or an array of content blocks", where)
    for j, b in enumerate(content):
        if not isinstance(b, dict) or not isinstance(b.get("type"), str):
            raise ApiError(400, f"{where}[{j}] must be a content block object", f"{where}[{j}]")
    return content


def claude_messages(raw: list, system: Any) -> list[dict[str, Any]]:
    """Anthropic turns as chat-template messages: text blocks joined, ``tool_use`` blocks as
    the assistant's tool calls, ``tool_result`` blocks as ``tool`` messages."""
    if not raw:
        raise ApiError(400, "messages must not be empty", "messages")
    out: list[dict[str, Any]] = []
    sys_text = _system(system)
    if sys_text:
        out.append({"role": "system", "content": sys_text})
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise ApiError(400, f"{where} must be an object with role user or assistant", where)
        text, calls = [], []
        for j, b in enumerate(_blocks(m.get("content"), f"{where}.content")):
            kind = b["type"]
            if kind == "text":
                text.append(text_of(b.get("text", ""), f"{where}.content[{j}].text"))
            elif kind == "tool_use" and m["role"] == "assistant":
                calls.append({"id": b.get("id"), "type": "function",
                              "function": {"name": str(b.get("name")), "arguments": b.get("input") or {}}})
            elif kind == "tool_result" and m["role"] == "user":
                result = b.get("content")
                result_text = text_of(result, f"{where}.content[{j}].content") \
                    if not isinstance(result, list) else text_of(
                        [p for p in result if isinstance(p, dict) and p.get("type") == "text"],
                        f"{where}.content[{j}].content")
                out.append({"role": "tool", "tool_call_id": b.get("tool_use_id"), "content": result_text})
            elif kind in ("thinking", "redacted_thinking"):
                continue
            else:
                raise ApiError(400, f"{where}.content[{j}]: blocks of type {kind!r} are not supported",
                               f"{where}.content[{j}]")
        if text or calls or not any(b.get("type") == "tool_result" for b in _blocks(m.get("content"), where)):
            msg: dict[str, Any] = {"role": m["role"], "content": "".join(text)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    return out


def claude_tools(body: dict) -> list[dict[str, Any]] | None:
    """Anthropic tools as OpenAI function tools (what chat templates are written for)."""
    tools = get_list(body, "tools")
    if not tools:
        return None
    choice = get_object(body, "tool_choice")
    if choice is not None and choice.get("type") == "none":
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise ApiError(400, f"tools[{i}] needs a name", f"tools[{i}]")
        # the order OpenAI clients send (templates render the tool JSON as given)
        fn: dict[str, Any] = {"name": t["name"]}
        if isinstance(t.get("description"), str):
            fn["description"] = t["description"]
        fn["parameters"] = t.get("input_schema") or {"type": "object"}
        out.append({"type": "function", "function": fn})
    return out


# ------------------------------------------------------------------------- the answer
def _usage(events: list[Any], with_input: bool = True) -> dict[str, Any]:
    prompt, cached, generated = usage_counts(events)
    out = {"output_tokens": generated}
    if with_input:
        out = {"input_tokens": prompt - cached, "cache_creation_input_tokens": 0,
               "cache_read_input_tokens": cached, **out}
    return out


def _stop(finished: FinishedEvent, calls: bool) -> tuple[str, str | None]:
    if calls:
        return "tool_use", None
    if finished.reason == "length":
        return "max_tokens", None
    if finished.reason == "stop" and finished.detail not in (None, "eos"):
        return "stop_sequence", finished.detail
    return "end_turn", None


def _tool_block(call: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name,
            "input": call.arguments}


async def count_tokens(http: HttpRequest, ctx: Context) -> Response:
    """``POST /v1/messages/count_tokens``: the input tokens a Messages request with this body
    would send the model (system, messages and tools through the chat template)."""
    body = await read_json(http, ctx.config.max_body_bytes)
    get_str(body, "model")
    msgs = claude_messages(get_list(body, "messages", required=True), body.get("system"))
    tools = claude_tools(body)
    try:
        tokens = await run_in_threadpool(ctx.engine.encode_chat, msgs, 30.0, tools)
    except EngineError as e:
        raise ApiError(503, f"the engine is not serving: {e}") from None
    return JSONResponse({"input_tokens": len(tokens)})


async def messages(http: HttpRequest, ctx: Context) -> Response:
    body = await read_json(http, ctx.config.max_body_bytes)
    get_str(body, "model")
    msgs = claude_messages(get_list(body, "messages", required=True), body.get("system"))
    tools = claude_tools(body)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "stream must be true or false", "stream")
    params = sampling(body, ctx.config.defaults, ctx.limits, ("max_tokens",), stop_name="stop_sequences",
                      required_max=True)
    try:
        req = Request(messages=msgs, params=params, session=session_of(http, body), tools=tools,
                      retain_s=anthropic_retain_s(body))
    except ValueError as e:
        raise ApiError(400, str(e)) from None
    es = EventStream(ctx.engine, req, ctx.gate, asyncio.get_running_loop())
    first = await first_event(es, http.receive, accepted=stream)
    if first is None:
        return Response(status_code=499)
    if isinstance(first, ErrorEvent):
        raise error_status(first)
    mid = new_id("msg_")
    if stream:
        return SseResponse(_stream(ctx, es, first, mid, bool(tools)), es)
    events = [first]
    if not isinstance(first, (FinishedEvent, ErrorEvent)):
        rest = await collect(es, http.receive)
        if rest is None:
            return Response(status_code=499)
        events += rest
    if isinstance(events[-1], ErrorEvent):
        raise ApiError(500, f"the request failed: {events[-1].message}")
    text = "".join(e.text for e in events if isinstance(e, TokenEvent))
    calls: list[ToolCall] = []
    if tools:
        parser = ToolCallParser()
        pieces = parser.feed(text) + parser.finish()
        text, calls = "".join(p for k, p in pieces if k == "text"), parser.calls
    content: list[dict[str, Any]] = [{"type": "text", "text": text}] if text or not calls else []
    content += [_tool_block(c) for c in calls]
    reason, sequence = _stop(events[-1], bool(calls))
    return JSONResponse({"id": mid, "type": "message", "role": "assistant", "model": ctx.model_id,
                         "content": content, "stop_reason": reason, "stop_sequence": sequence,
                         "usage": _usage(events)})


def _event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {dumps({'type': kind, **data})}\n\n"


async def _stream(ctx: Context, es: EventStream, first: Any, mid: str, tools: bool) -> AsyncIterator[str]:
    events: list[Any] = []
    index = -1  # the content block being written
    text_open = False
    any_call = False
    parser = ToolCallParser() if tools else None

    async def all_events() -> AsyncIterator[Any]:
        yield first
        if not isinstance(first, (FinishedEvent, ErrorEvent)):
            async for e in es.events():
                yield e

    # the prefill's first progress says the prompt's size and how much of it was cached
    progress = es.first_progress
    total, cached = (progress.total, progress.done) if progress is not None else (0, 0)
    yield _event("message_start", {"message": {
        "id": mid, "type": "message", "role": "assistant", "model": ctx.model_id, "content": [],
        "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": total - cached, "cache_creation_input_tokens": 0,
                  "cache_read_input_tokens": cached, "output_tokens": 0}}})
    async for event in all_events():
        events.append(event)
        pieces: list[tuple[str, Any]] = []
        if isinstance(event, TokenEvent):
            pieces = parser.feed(event.text) if parser else [("text", event.text)]
        elif isinstance(event, FinishedEvent) and parser:
            pieces = parser.finish()
        elif isinstance(event, ErrorEvent):
            yield _event("error", anthropic_body(ApiError(500, f"the request failed: {event.message}")))
            return
        for kind, piece in pieces:
            if kind == "text" and piece:
                if not text_open:
                    index += 1
                    text_open = True
                    yield _event("content_block_start", {"index": index,
                                                         "content_block": {"type": "text", "text": ""}})
                yield _event("content_block_delta", {"index": index,
                                                     "delta": {"type": "text_delta", "text": piece}})
            elif kind == "call":
                if text_open:
                    yield _event("content_block_stop", {"index": index})
                    text_open = False
                index += 1
                any_call = True
                block = _tool_block(piece)
                yield _event("content_block_start", {"index": index, "content_block": {**block, "input": {}}})
                yield _event("content_block_delta", {"index": index, "delta": {
                    "type": "input_json_delta", "partial_json": json.dumps(piece.arguments, ensure_ascii=False)}})
                yield _event("content_block_stop", {"index": index})
        if isinstance(event, FinishedEvent):
            if text_open:
                yield _event("content_block_stop", {"index": index})
            reason, sequence = _stop(event, any_call)
            yield _event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                           "usage": _usage(events)})
            yield _event("message_stop", {})
