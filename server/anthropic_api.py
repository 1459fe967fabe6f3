"""Anthropic Messages API: ``POST /v1/messages``, JSON or server-sent events
(``message_start``, one ``content_block_start``/``_delta``/``_stop`` run per text or tool_use
block, ``message_delta`` with the stop reason and usage, ``message_stop``; ``ping`` events
while nothing else is sent).

The body is read as Claude Code sends it: ``system`` entries anywhere in ``messages``,
``cache_control`` on blocks, tools and the body, and the fields ``server.claude_fields``
accepts without acting on them. Usage follows the hosted API's sum: ``input_tokens`` +
``cache_creation_input_tokens`` (the prompt tokens this request stores into the prefix
cache) + ``cache_read_input_tokens`` (read from it) = the prompt."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response

from mlxkv.engine.requests import EngineError, ErrorEvent, Event, FinishedEvent, Request, TokenEvent
from mlxkv.server.bridge import EventStream, SseResponse, Waiting, all_events, ending, error_status, first_event
from mlxkv.server.chat_prompt import ChatPrompt, chat_prompt
from mlxkv.server.claude_fields import check_cache_control, check_ignored_fields
from mlxkv.server.context import Context, dumps, model_name, new_id, read_json, session_of, stored_count, usage_counts
from mlxkv.server.diagnostics import fingerprint, miss_reason, requested
from mlxkv.server.errors import ApiError, anthropic_body
from mlxkv.server.fields import extension_fields, get_list, get_object, get_str, max_tokens_header, sampling
from mlxkv.server.formats import CALL, REASONING, TEXT, ToolCall, split_reply
from mlxkv.server.grammars import json_reply, reply_grammar
from mlxkv.server.keepalive import ANTHROPIC_PING, PROGRESS_EVERY, keep_alive
from mlxkv.server.reasoning import anthropic_kwargs
from mlxkv.server.retention import anthropic_retain_s
from mlxkv.server.tenants import cache_scope


# ------------------------------------------------------------------------- the request
def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise ApiError(400, f"{where} must be a string or an array of content blocks", where)
    for j, b in enumerate(content):
        if not isinstance(b, dict) or not isinstance(b.get("type"), str):
            raise ApiError(400, f"{where}[{j}] must be a content block object", f"{where}[{j}]")
        check_cache_control(b, f"{where}[{j}]")
    return content


def _text_block(b: dict, where: str) -> str:
    if b["type"] != "text":
        raise ApiError(400, f"{where}: blocks of type {b['type']!r} are not supported here (text only; "
                            "this server runs a text model)", where)
    if not isinstance(b.get("text"), str):
        raise ApiError(400, f"{where}.text must be a string", f"{where}.text")
    return b["text"]


def _text(content: Any, where: str) -> str:
    """A string, or the text of an array of text blocks (joined as they are)."""
    return "".join(_text_block(b, f"{where}[{j}]") for j, b in enumerate(_blocks(content, where)))


def _tool_use(b: dict, where: str) -> dict[str, Any]:
    if not isinstance(b.get("name"), str) or not b["name"]:
        raise ApiError(400, f"{where}.name must be a non-empty string", f"{where}.name")
    if b.get("id") is not None and not isinstance(b["id"], str):
        raise ApiError(400, f"{where}.id must be a string", f"{where}.id")
    arguments = b.get("input")
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        raise ApiError(400, f"{where}.input must be an object", f"{where}.input")
    return {"id": b.get("id"), "type": "function", "function": {"name": b["name"], "arguments": arguments}}


def _tool_result(b: dict, where: str) -> dict[str, Any]:
    if not isinstance(b.get("tool_use_id"), str):
        raise ApiError(400, f"{where}.tool_use_id must be a string", f"{where}.tool_use_id")
    result = b.get("content")
    text = "" if result is None else _text(result, f"{where}.content")
    return {"role": "tool", "tool_call_id": b["tool_use_id"], "content": text}


def claude_messages(raw: list, system: Any) -> list[dict[str, Any]]:
    """Anthropic turns as chat-template messages: text blocks joined, ``tool_use`` blocks as
    the assistant's tool calls, ``tool_result`` blocks as ``tool`` messages, ``system``
    entries as system messages where they stand (``server.chat_prompt`` places them)."""
    if not raw:
        raise ApiError(400, "messages must not be empty", "messages")
    out: list[dict[str, Any]] = []
    sys_text = _text(system, "system") if system is not None else ""
    if sys_text:
        out.append({"role": "system", "content": sys_text})
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant", "system"):
            raise ApiError(400, f"{where} must be an object with role user, assistant or system", where)
        if m["role"] == "system":
            out.append({"role": "system", "content": _text(m.get("content"), f"{where}.content")})
            continue
        text, calls, thinking = [], [], []
        for j, b in enumerate(_blocks(m.get("content"), f"{where}.content")):
            kind, at = b["type"], f"{where}.content[{j}]"
            if kind == "text":
                text.append(_text_block(b, at))
            elif kind == "tool_use" and m["role"] == "assistant":
                calls.append(_tool_use(b, at))
            elif kind == "tool_result" and m["role"] == "user":
                out.append(_tool_result(b, at))
            elif kind == "thinking" and m["role"] == "assistant":
                # earlier reasoning: templates that keep it render it (the cache stays hit)
                if isinstance(b.get("thinking"), str):
                    thinking.append(b["thinking"])
            elif kind in ("thinking", "redacted_thinking"):
                continue  # another model's (encrypted) reasoning: this one cannot read it
            elif kind in ("tool_use", "tool_result"):
                turn = "assistant" if kind == "tool_use" else "user"
                raise ApiError(400, f"{at}: {kind} blocks belong in {turn} turns", at)
            else:
                raise ApiError(400, f"{at}: blocks of type {kind!r} are not supported (text, tool_use, "
                                    "tool_result and thinking only: this server runs a text model)", at)
        if text or calls or not any(b.get("type") == "tool_result" for b in _blocks(m.get("content"), where)):
            msg: dict[str, Any] = {"role": m["role"], "content": "".join(text)}
            if thinking:
                msg["reasoning"] = "".join(thinking)
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    return out


_TOOL_CHOICES = ("auto", "any", "tool", "none")


def _tool_choice(body: dict) -> str | None:
    choice = get_object(body, "tool_choice")
    if choice is None:
        return None
    if choice.get("type") not in _TOOL_CHOICES:
        raise ApiError(400, f"tool_choice.type must be one of {', '.join(_TOOL_CHOICES)}, got "
                            f"{choice.get('type')!r}", "tool_choice.type")
    if choice["type"] == "tool" and not isinstance(choice.get("name"), str):
        raise ApiError(400, "tool_choice.name is required with type tool", "tool_choice.name")
    return choice["type"]


def forced_tools(body: dict) -> list[str] | bool:
    """What ``tool_choice`` demands of the reply: True (``any``: a call of any tool), the
    name (``tool``), or False (``auto``, ``none``)."""
    kind = _tool_choice(body)
    if kind == "any":
        return True
    if kind == "tool":
        name = body["tool_choice"]["name"]
        names = [t.get("name") for t in get_list(body, "tools") or () if isinstance(t, dict)]
        if name not in names:
            raise ApiError(400, f"tool_choice.name {name!r} is not in tools", "tool_choice.name")
        return [name]
    return False


def output_schema(body: dict) -> Any:
    """``output_config.format`` (structured outputs): its JSON schema, or None."""
    output = get_object(body, "output_config") or {}
    fmt = output.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise ApiError(400, "output_config.format must be {\"type\": \"json_schema\", \"schema\": {...}}",
                       "output_config.format")
    return fmt["schema"]


def claude_tools(body: dict) -> list[dict[str, Any]] | None:
    """Anthropic tools as OpenAI function tools (what chat templates are written for).
    A tool with ``defer_loading`` is left out of the prompt, as the hosted API leaves it out
    of the model's context until the client's tool search loads it."""
    tools = get_list(body, "tools")
    if _tool_choice(body) == "none" or not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or not isinstance(t.get("name"), str) or not t["name"]:
            raise ApiError(400, f"{where} needs a name", where)
        if t.get("type") not in (None, "custom"):
            raise ApiError(400, f"{where}: tools of type {t['type']!r} are not supported (the hosted "
                                "API's own tools; this server runs the client's tools)", f"{where}.type")
        if t.get("description") is not None and not isinstance(t["description"], str):
            raise ApiError(400, f"{where}.description must be a string", f"{where}.description")
        schema = t.get("input_schema")
        if schema is not None and not isinstance(schema, dict):
            raise ApiError(400, f"{where}.input_schema must be an object", f"{where}.input_schema")
        deferred = t.get("defer_loading")
        if deferred is not None and not isinstance(deferred, bool):
            raise ApiError(400, f"{where}.defer_loading must be true or false", f"{where}.defer_loading")
        check_cache_control(t, where)
        if deferred:
            continue
        # the order OpenAI clients send (templates render the tool JSON as given)
        fn: dict[str, Any] = {"name": t["name"]}
        if t.get("description"):
            fn["description"] = t["description"]
        fn["parameters"] = schema or {"type": "object"}
        out.append({"type": "function", "function": fn})
    return out or None


async def claude_prompt(body: dict, ctx: Context) -> ChatPrompt:
    """The prompt a Messages body sends the model (the same for ``count_tokens``)."""
    check_ignored_fields(body)
    get_str(body, "model")
    msgs = claude_messages(get_list(body, "messages", required=True), body.get("system"))
    forced_tools(body)  # checked on count_tokens too: the same body is a 400 on both
    schema = output_schema(body)
    if schema is not None:
        json_reply(schema, "output_config.format.schema")
    return await chat_prompt(ctx.template, msgs, claude_tools(body), ctx.config.churn_rules,
                             anthropic_kwargs(body))


# ------------------------------------------------------------------------- the answer
def _input_usage(prompt: int, cached: int, stored: int) -> dict[str, int]:
    return {"input_tokens": prompt - cached - stored, "cache_creation_input_tokens": stored,
            "cache_read_input_tokens": cached}


def _usage(events: list[Event]) -> dict[str, Any]:
    prompt, cached, generated = usage_counts(events)
    return {**_input_usage(prompt, cached, stored_count(events)), "output_tokens": generated}


def _stop(finished: FinishedEvent, calls: bool) -> tuple[str, str | None]:
    if calls:
        return "tool_use", None
    if finished.reason == "length":
        return "max_tokens", None
    if finished.reason == "stop" and finished.detail not in (None, "eos"):
        return "stop_sequence", finished.detail
    return "end_turn", None


def _thinking_block(text: str) -> dict[str, Any]:
    # no signature: nothing here signs (the block is sent back and read as it is)
    return {"type": "thinking", "thinking": text, "signature": ""}


def _tool_block(call: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name,
            "input": call.arguments}


async def count_tokens(http: HttpRequest, ctx: Context) -> Response:
    """``POST /v1/messages/count_tokens``: the input tokens a Messages request with this body
    would send the model (the same prompt, through the chat template)."""
    body = await read_json(http, ctx.config.max_body_bytes)
    ctx = await ctx.for_model(body)
    prompt = await claude_prompt(body, ctx)
    try:
        tokens = await run_in_threadpool(ctx.engine.encode_chat, prompt.messages, 30.0, prompt.tools,
                                         prompt.template_kwargs)
    except EngineError as e:
        raise ApiError(503, f"the engine is not serving: {e}") from None
    except Exception as e:  # the chat template refused the messages: 400, as for a reply
        raise error_status(ErrorEvent(f"{type(e).__name__}: {e}", e)) from None
    return JSONResponse({"input_tokens": len(tokens)})


def _stores(ctx: Context) -> bool:
    """Whether a request's prompt goes to the prefix cache once it is answered."""
    cache = ctx.engine.prefix_cache
    return cache is not None and bool(cache.enabled)


async def messages(http: HttpRequest, ctx: Context) -> Response:
    body = await read_json(http, ctx.config.max_body_bytes)
    ctx = await ctx.for_model(body)
    requested(body)  # a malformed diagnostics field is a 400 before anything runs
    prompt = await claude_prompt(body, ctx)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "stream must be true or false", "stream")
    params = sampling(body, ctx.config.defaults, ctx.limits, ("max_tokens",), stop_name="stop_sequences",
                      required_max=True)
    headers = max_tokens_header(body, ctx.limits, ("max_tokens",))
    choice = body.get("tool_choice") or {}
    grammar = reply_grammar(prompt, forced_tools(body), output_schema(body),
                            schema_field="output_config.format.schema",
                            parallel=not choice.get("disable_parallel_tool_use", False))
    try:
        req = Request(messages=prompt.messages, params=params, session=session_of(http, body),
                      tools=prompt.tools, template_kwargs=prompt.template_kwargs, grammar=grammar,
                      retain_s=anthropic_retain_s(body), cache_scope=cache_scope(http, body),
                      **extension_fields(body))
    except ValueError as e:
        raise ApiError(400, str(e)) from None
    es = EventStream(ctx.engine, req, ctx.gate, asyncio.get_running_loop(), ctx.lease)
    first = await first_event(es, http.receive, accepted=stream,
                              wait_s=ctx.config.ping_interval_s if stream else None)
    if first is None:
        return Response(status_code=499)
    if isinstance(first, ErrorEvent):
        raise error_status(first, "messages")
    mid, model = new_id("msg_"), model_name(body, ctx)
    diagnose = _Diagnose(ctx, body, mid)
    if stream:
        reply = _Stream(es, first, mid, model, prompt.parser(), _stores(ctx), diagnose)
        return SseResponse(keep_alive(reply.chunks(), ctx.config.ping_interval_s, reply.keepalive), es, headers)
    events = await all_events(es, first, http.receive)
    if events is None:
        return Response(status_code=499)
    end = ending(events)
    if isinstance(end, ErrorEvent):
        raise ApiError(500, f"the request failed: {end.message}")
    text, reasoning, calls = split_reply(prompt.parser(), "".join(e.text for e in events
                                                                  if isinstance(e, TokenEvent)))
    content: list[dict[str, Any]] = [_thinking_block(reasoning)] if reasoning else []
    content += [{"type": "text", "text": text}] if text or not (calls or reasoning) else []
    content += [_tool_block(c) for c in calls]
    reason, sequence = _stop(end, bool(calls))
    prompt_n, cached, generated = usage_counts(events)
    out = {"id": mid, "type": "message", "role": "assistant", "model": model, "content": content,
           "stop_reason": reason, "stop_sequence": sequence, "usage": _usage(events),
           **diagnose.fields(prompt_n, cached)}
    diagnose.done(prompt_n + generated)
    return JSONResponse(out, headers=headers)


class _Diagnose:
    """Cache diagnostics for one request (``server.diagnostics``): the reply's
    ``diagnostics`` when the body asks for them, and this message's fingerprint for the
    next request to name."""

    def __init__(self, ctx: Context, body: dict, mid: str):
        self.ctx, self.mid = ctx, mid
        self.previous = requested(body)
        self.fp = fingerprint(body)

    def fields(self, prompt: int, cached: int) -> dict[str, Any]:
        if self.previous is None:
            return {}
        earlier = self.ctx.messages.get(self.previous)
        return {"diagnostics": {"cache_miss_reason": miss_reason(earlier, self.fp, prompt, cached)}}

    def done(self, tokens: int) -> None:
        self.ctx.messages.put(self.mid, dataclasses.replace(self.fp, tokens=tokens))


def _event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {dumps({'type': kind, **data})}\n\n"


class _Stream:
    """One streamed reply: its content blocks (thinking, text, tool_use) as they open and
    close, and the keep-alives between them."""

    def __init__(self, es: EventStream, first: Event | Waiting, mid: str, model: str, parser: Any, stores: bool,
                 diagnose: _Diagnose):
        self.es, self.first, self.mid, self.model, self.stores = es, first, mid, model, stores
        self.diagnose = diagnose
        self.parser = parser
        self.index = -1  # the content block being written
        self.open: str | None = None  # its kind: TEXT or REASONING (None: none open)

    def keepalive(self, in_a_row: int) -> str:
        """A ``ping``; every PROGRESS_EVERY-th in a row, an empty text delta instead (in a
        text block opened for it, where the reply's text then goes), which clients count as
        progress where they stop counting pings: a prefill longer than Claude Code's 30
        pings and 300 s keeps its stream."""
        if in_a_row % PROGRESS_EVERY:
            return ANTHROPIC_PING
        if self.open is None:
            return self._open(TEXT)
        return self._delta(self.open, "")

    def _open(self, kind: str) -> str:
        out = self._close()
        self.index += 1
        self.open = kind
        block = {"type": "text", "text": ""} if kind == TEXT else {**_thinking_block("")}
        return out + _event("content_block_start", {"index": self.index, "content_block": block})

    def _close(self) -> str:
        if self.open is None:
            return ""
        self.open = None
        return _event("content_block_stop", {"index": self.index})

    def _delta(self, kind: str, text: str) -> str:
        delta = {"type": "text_delta", "text": text} if kind == TEXT else \
            {"type": "thinking_delta", "thinking": text}
        return _event("content_block_delta", {"index": self.index, "delta": delta})

    def _pieces(self, pieces: list[tuple[str, Any]]) -> list[str]:
        out = []
        for kind, piece in pieces:
            if kind in (TEXT, REASONING):
                if self.open != kind:
                    out.append(self._open(kind))
                out.append(self._delta(kind, piece))
            elif kind == CALL:
                out.append(self._close())
                self.index += 1
                block = _tool_block(piece)
                out += [_event("content_block_start", {"index": self.index, "content_block": {**block, "input": {}}}),
                        _event("content_block_delta", {"index": self.index, "delta": {
                            "type": "input_json_delta",
                            "partial_json": json.dumps(piece.arguments, ensure_ascii=False)}}),
                        _event("content_block_stop", {"index": self.index})]
        return [o for o in out if o]

    async def _events(self) -> AsyncIterator[Event]:
        first = self.first
        if not isinstance(first, Waiting):
            yield first
            if isinstance(first, (FinishedEvent, ErrorEvent)):
                return
        async for e in self.es.events():
            yield e

    async def chunks(self) -> AsyncGenerator[str, None]:
        events: list[Event] = []
        # The prefill's first progress says the prompt's size and how much of it was cached;
        # the uncached rest is stored once the request is answered. A stream that started
        # while its request still waited in the queue knows none of it yet: message_delta
        # carries the usage in full.
        progress = self.es.first_progress
        total, cached = (progress.total, progress.done) if progress is not None else (0, 0)
        yield _event("message_start", {"message": {
            "id": self.mid, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {**_input_usage(total, cached, total - cached if self.stores else 0), "output_tokens": 0},
            **self.diagnose.fields(total, cached)}})
        async for event in self._events():
            events.append(event)
            if isinstance(event, TokenEvent):
                for chunk in self._pieces(self.parser.feed(event.text)):
                    yield chunk
            elif isinstance(event, ErrorEvent):
                # refused while the stream waited in the queue (too long, say): the same 400
                # a request that was not queued gets, inside the stream
                sent = any(isinstance(e, TokenEvent) for e in events)
                err = ApiError(500, f"the request failed: {event.message}") if sent else error_status(event)
                yield _event("error", anthropic_body(err))
                return
            elif isinstance(event, FinishedEvent):
                for chunk in self._pieces(self.parser.finish()):
                    yield chunk
                if self.open is not None:
                    yield self._close()
                reason, sequence = _stop(event, bool(self.parser.calls))
                prompt_n, _, generated = usage_counts(events)
                self.diagnose.done(prompt_n + generated)
                yield _event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                               "usage": _usage(events)})
                yield _event("message_stop", {})
