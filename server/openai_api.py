"""OpenAI routes: ``POST /v1/chat/completions`` and ``POST /v1/completions``, JSON or
server-sent events (``data: {...}`` lines, ``data: [DONE]`` at the end; ``: ping`` comment
lines while nothing else is sent)."""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response

from mlxkv.engine.requests import ErrorEvent, Event, FinishedEvent, Request, TokenEvent
from mlxkv.server.bridge import (
    EventStream,
    SseResponse,
    Waiting,
    all_events,
    ending,
    error_status,
    first_event,
)
from mlxkv.server.chat_prompt import chat_prompt
from mlxkv.server.context import (
    Context,
    dumps,
    model_name,
    new_id,
    read_json,
    session_of,
    text_of,
    timings,
    usage_counts,
)
from mlxkv.server.errors import ApiError, openai_body
from mlxkv.server.fields import (
    extension_fields,
    get_bool,
    get_int,
    get_list,
    get_object,
    get_str,
    max_tokens_header,
    sampling,
    within,
)
from mlxkv.server.formats import CALL, REASONING, TEXT, ToolCall, split_reply
from mlxkv.server.grammars import reply_grammar
from mlxkv.server.keepalive import comment, keep_alive
from mlxkv.server.reasoning import openai_kwargs
from mlxkv.server.retention import openai_retain_s
from mlxkv.server.tenants import cache_scope

_ROLES = ("system", "developer", "user", "assistant", "tool")


# ------------------------------------------------------------------------- the request
def chat_messages(raw: list) -> list[dict[str, Any]]:
    """OpenAI messages as the chat template wants them: text content, ``developer`` as
    ``system``, an assistant's tool calls with their arguments as objects."""
    if not raw:
        raise ApiError(400, "messages must not be empty", "messages")
    out = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ApiError(400, f"{where} must be an object", where)
        role = m.get("role")
        if role not in _ROLES:
            raise ApiError(400, f"{where}.role must be one of {', '.join(_ROLES)}; got {role!r}",
                           f"{where}.role")
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role,
                               "content": text_of(m.get("content"), f"{where}.content")}
        if role == "assistant":
            # the reasoning a client sends back (reasoning_content, reasoning): templates that
            # keep it render it, and the turn's cache stays hit
            reasoning = m.get("reasoning_content", m.get("reasoning"))
            if isinstance(reasoning, str) and reasoning:
                msg["reasoning"] = reasoning
        if role == "assistant" and m.get("tool_calls") is not None:
            msg["tool_calls"] = _tool_calls_in(m["tool_calls"], f"{where}.tool_calls")
        if role == "tool":
            if m.get("tool_call_id") is not None:
                msg["tool_call_id"] = within(where, functools.partial(get_str, m, "tool_call_id"))
            if isinstance(m.get("name"), str):
                msg["name"] = m["name"]
        out.append(msg)
    return out


def _tool_calls_in(calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise ApiError(400, f"{where} must be an array", where)
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ApiError(400, f"{where}[{j}] needs function.name", f"{where}[{j}]")
        args = fn.get("arguments", {})
        at = f"{where}[{j}].function.arguments"
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise ApiError(400, f"{at} is not JSON", at) from None
        if not isinstance(args, dict):
            raise ApiError(400, f"{at} must be a JSON object", at)
        out.append({"id": c.get("id"), "type": "function",
                    "function": {"name": fn["name"], "arguments": args}})
    return out


def tool_choice(body: dict) -> list[str] | bool:
    """``tool_choice`` as what the reply must be: True (a call of any tool: ``"required"``),
    the names allowed (``{"type": "function", "function": {"name": ...}}``), or False (the
    model chooses: ``"auto"``, or no tools: ``"none"``)."""
    choice = body.get("tool_choice")
    if choice is None or choice in ("none", "auto"):
        return False
    if choice == "required":
        return True
    fn = choice.get("function") if isinstance(choice, dict) else None
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(fn, dict) \
            and isinstance(fn.get("name"), str):
        names = [t.get("function", {}).get("name") for t in get_list(body, "tools") or () if isinstance(t, dict)]
        if fn["name"] not in names:
            raise ApiError(400, f"tool_choice names {fn['name']!r}, which is not in tools", "tool_choice")
        return [fn["name"]]
    raise ApiError(400, "tool_choice must be none, auto, required or {\"type\": \"function\", "
                        "\"function\": {\"name\": ...}}", "tool_choice")


def response_schema(body: dict) -> Any:
    """``response_format``: None (text), ``{}`` (``json_object``: any JSON object) or the
    ``json_schema``'s schema."""
    fmt = get_object(body, "response_format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {}
    if fmt.get("type") == "json_schema":
        spec = within("response_format", lambda: get_object(fmt, "json_schema"))
        schema = spec.get("schema") if spec else None
        if not isinstance(schema, dict):
            raise ApiError(400, "response_format.json_schema.schema must be a JSON schema object",
                           "response_format.json_schema.schema")
        return schema
    raise ApiError(400, "response_format.type must be text, json_object or json_schema, not "
                        f"{fmt.get('type')!r}", "response_format.type")


def chat_tools(body: dict) -> list[dict[str, Any]] | None:
    tools = get_list(body, "tools")
    choice = body.get("tool_choice")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise ApiError(400, "tool_choice needs tools", "tool_choice")
        return None
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" \
                or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ApiError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": "
                                "{\"name\": ...}}", f"tools[{i}]")
    return None if choice == "none" else tools


def _common(body: dict, ctx: Context) -> tuple[bool, bool]:
    n = get_int(body, "n", 1)
    if n != 1:
        raise ApiError(400, f"n must be 1 (this server returns one choice), got {n}", "n")
    stream = get_bool(body, "stream")
    options = get_object(body, "stream_options") or {}
    include_usage = within("stream_options", lambda: get_bool(options, "include_usage"))
    get_str(body, "model")  # a string (which model answers it: Context.for_model)
    return include_usage, stream


def _engine_request(**kw: Any) -> Request:
    try:
        return Request(**kw)
    except ValueError as e:
        raise ApiError(400, str(e)) from None


# ------------------------------------------------------------------------- the answer
def usage(events: list[Event]) -> dict[str, Any]:
    prompt, cached, generated = usage_counts(events)
    return {"prompt_tokens": prompt, "completion_tokens": generated,
            "total_tokens": prompt + generated,
            "prompt_tokens_details": {"cached_tokens": cached}}


def finish_reason(finished: FinishedEvent, calls: bool = False) -> str:
    if calls:
        return "tool_calls"
    return "length" if finished.reason == "length" else "stop"


def _chat_logprob(ctx: Context, e: TokenEvent) -> dict[str, Any] | None:
    if e.token is None or e.logprob is None:
        return None
    text = ctx.token_text(e.token)
    top = [{"token": (t := ctx.token_text(tok)), "logprob": lp, "bytes": list(t.encode())}
           for tok, lp in (e.top_logprobs or ())]
    return {"token": text, "logprob": e.logprob, "bytes": list(text.encode()), "top_logprobs": top}


def _completion_logprobs(ctx: Context, tokens: list[TokenEvent], offset: int = 0) -> dict[str, Any]:
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in tokens:
        if e.token is None or e.logprob is None:
            continue
        text = ctx.token_text(e.token)
        out["tokens"].append(text)
        out["token_logprobs"].append(e.logprob)
        out["top_logprobs"].append({ctx.token_text(t): lp for t, lp in (e.top_logprobs or ())})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def _call_json(call: ToolCall, index: int) -> dict[str, Any]:
    return {"index": index, "id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments_json}}


class _Run:
    """Submit a request and wait for its first event: refusals (a prompt longer than the
    context) become 4xx answers before any byte of a stream is sent. A stream starts once
    the engine has taken the prompt (its first progress), not after the first token, or
    when it has not within the keep-alive interval (queued behind other requests).
    ``field``: the body's field that holds the prompt (a refusal's 400 names it)."""

    def __init__(self, ctx: Context, http: HttpRequest, req: Request, logprobs: bool,
                 stream: bool, field: str):
        self.ctx, self.http, self.req, self.logprobs = ctx, http, req, logprobs
        self.stream, self.field = stream, field

    async def start(self) -> tuple[EventStream, Event | Waiting] | Response:
        if self.logprobs:
            await run_in_threadpool(self.ctx.load_tokenizer)
        stream = EventStream(self.ctx.engine, self.req, self.ctx.gate, asyncio.get_running_loop(), self.ctx.lease)
        first = await first_event(stream, self.http.receive, accepted=self.stream,
                                  wait_s=self.ctx.config.ping_interval_s if self.stream else None)
        if first is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        if isinstance(first, ErrorEvent):
            raise error_status(first, self.field)
        return stream, first


async def _rest(stream: EventStream, first: Event | Waiting, http: HttpRequest) -> list[Event] | None:
    return await all_events(stream, first, http.receive)


def _error_answer(error: ErrorEvent, events: list[Event]) -> ApiError:
    """What a request whose ``events`` ended in ``error`` is answered: the 4xx of a refusal
    when it failed before its first token, else a 500."""
    if not any(isinstance(e, TokenEvent) for e in events):
        return error_status(error)
    return ApiError(500, f"the request failed: {error.message}")


def _sse(ctx: Context, chunks: Any, es: EventStream, headers: dict[str, str]) -> SseResponse:
    return SseResponse(keep_alive(chunks, ctx.config.ping_interval_s, comment), es, headers)


# ------------------------------------------------------------------- chat completions
async def chat_completions(http: HttpRequest, ctx: Context) -> Response:
    body = await read_json(http, ctx.config.max_body_bytes)
    ctx = await ctx.for_model(body)
    include_usage, stream = _common(body, ctx)
    prompt = await chat_prompt(ctx.template, chat_messages(get_list(body, "messages", required=True)),
                               chat_tools(body), ctx.config.churn_rules, openai_kwargs(body))
    want_logprobs = get_bool(body, "logprobs")
    top = get_int(body, "top_logprobs", None, lo=0, hi=20)
    if top is not None and not want_logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    max_names = ("max_completion_tokens", "max_tokens")
    params = sampling(body, ctx.config.defaults, ctx.limits, max_names)
    headers = max_tokens_header(body, ctx.limits, max_names)
    grammar = reply_grammar(prompt, tool_choice(body), response_schema(body),
                            schema_field="response_format.json_schema.schema",
                            parallel=get_bool(body, "parallel_tool_calls", True))
    req = _engine_request(messages=prompt.messages, params=params, session=session_of(http, body),
                          cache_scope=cache_scope(http, body),
                          tools=prompt.tools, template_kwargs=prompt.template_kwargs, grammar=grammar,
                          logprobs=(top or 0) if want_logprobs else None,
                          retain_s=openai_retain_s(body), **extension_fields(body))
    started = await _Run(ctx, http, req, want_logprobs, stream, "messages").start()
    if isinstance(started, Response):
        return started
    es, first = started
    rid, created, model = new_id("chatcmpl-"), int(time.time()), model_name(body, ctx)
    if stream:
        return _sse(ctx, _chat_stream(ctx, es, first, rid, created, model, prompt.parser(),
                                      want_logprobs, include_usage), es, headers)
    events = await _rest(es, first, http)
    if events is None:
        return Response(status_code=499)
    end = ending(events)
    if isinstance(end, ErrorEvent):
        raise _error_answer(end, events)
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    text, reasoning, calls = split_reply(prompt.parser(), "".join(e.text for e in tokens))
    message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
    if reasoning:  # mlx_lm.server's name, and the one vLLM and DeepSeek's API use
        message["reasoning"] = message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [{k: v for k, v in _call_json(c, i).items() if k != "index"}
                                 for i, c in enumerate(calls)]
    logprobs = None
    if want_logprobs:
        logprobs = {"content": [x for e in tokens if (x := _chat_logprob(ctx, e)) is not None]}
    return JSONResponse({
        "id": rid, "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": 0, "message": message, "logprobs": logprobs,
                     "finish_reason": finish_reason(end, bool(calls))}],
        "usage": usage(events), "timings": timings(events)}, headers=headers)


def sse(obj: Any) -> str:
    return f"data: {dumps(obj)}\n\n"


async def _chat_stream(ctx: Context, es: EventStream, first: Event | Waiting, rid: str, created: int, model: str,
                       parser: Any, want_logprobs: bool, include_usage: bool) -> AsyncGenerator[str, None]:
    base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}

    def chunk(delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> str:
        obj = {**base, "choices": [{"index": 0, "delta": delta, "logprobs": logprobs,
                                    "finish_reason": finish}]}
        if include_usage:
            obj["usage"] = None
        return sse(obj)

    events: list[Event] = []
    n_calls = 0
    yield chunk({"role": "assistant", "content": ""})
    pending: list[Event | Waiting] = [first]
    async for event in _chain(pending, es):
        events.append(event)
        if isinstance(event, TokenEvent):
            lp = None
            if want_logprobs:
                entry = _chat_logprob(ctx, event)
                lp = {"content": [entry] if entry else []}
            for kind, piece in parser.feed(event.text):
                if kind == CALL:
                    yield chunk({"tool_calls": [_call_json(piece, n_calls)]})
                    n_calls += 1
                else:
                    yield chunk(_delta(kind, piece), logprobs=lp)
                    lp = None
            if lp is not None and lp["content"]:
                yield chunk({}, logprobs=lp)
        elif isinstance(event, ErrorEvent):
            yield sse(openai_body(_error_answer(event, events)))
            return
        elif isinstance(event, FinishedEvent):
            for kind, piece in parser.finish():
                if kind == CALL:
                    yield chunk({"tool_calls": [_call_json(piece, n_calls)]})
                    n_calls += 1
                else:
                    yield chunk(_delta(kind, piece))
            yield chunk({}, finish_reason(event, n_calls > 0))
    if include_usage:
        yield sse({**base, "choices": [], "usage": usage(events), "timings": timings(events)})
    yield "data: [DONE]\n\n"


def _delta(kind: str, piece: str) -> dict[str, Any]:
    """A chunk's delta of text or reasoning (under both names clients read)."""
    if kind == REASONING:
        return {"reasoning": piece, "reasoning_content": piece}
    assert kind == TEXT
    return {"content": piece}


async def _chain(first: list[Event | Waiting], es: EventStream) -> AsyncIterator[Event]:
    """The first event (already taken; none when the stream started while the request
    waited in the queue), then the rest of the stream; stats stay in order."""
    for event in first:
        if isinstance(event, Waiting):
            continue
        yield event
        if isinstance(event, (FinishedEvent, ErrorEvent)):
            return
    async for event in es.events():
        yield event


# ------------------------------------------------------------------------ completions
def completion_prompt(body: dict) -> dict[str, Any]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                   for t in prompt):
        return {"prompt_tokens": list(prompt)}
    if prompt is None:
        raise ApiError(400, "prompt is required", "prompt")
    raise ApiError(400, "prompt must be a string, one string in an array, or an array of token ids "
                        "(one prompt per request)", "prompt")


async def completions(http: HttpRequest, ctx: Context) -> Response:
    body = await read_json(http, ctx.config.max_body_bytes)
    ctx = await ctx.for_model(body)
    include_usage, stream = _common(body, ctx)
    if get_bool(body, "echo"):
        raise ApiError(400, "echo is not supported", "echo")
    if get_str(body, "suffix"):
        raise ApiError(400, "suffix is not supported", "suffix")
    logprobs = get_int(body, "logprobs", None, lo=0, hi=20)
    params = sampling(body, ctx.config.defaults, ctx.limits, ("max_tokens",))
    headers = max_tokens_header(body, ctx.limits, ("max_tokens",))
    req = _engine_request(**completion_prompt(body), params=params, session=session_of(http, body),
                          cache_scope=cache_scope(http, body),
                          logprobs=logprobs, retain_s=openai_retain_s(body), **extension_fields(body))
    started = await _Run(ctx, http, req, logprobs is not None, stream, "prompt").start()
    if isinstance(started, Response):
        return started
    es, first = started
    rid, created = new_id("cmpl-"), int(time.time())
    base = {"id": rid, "object": "text_completion", "created": created, "model": model_name(body, ctx)}
    if stream:
        return _sse(ctx, _completion_stream(ctx, es, first, base, logprobs is not None, include_usage),
                    es, headers)
    events = await _rest(es, first, http)
    if events is None:
        return Response(status_code=499)
    end = ending(events)
    if isinstance(end, ErrorEvent):
        raise _error_answer(end, events)
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    return JSONResponse({**base, "choices": [{
        "index": 0, "text": "".join(e.text for e in tokens),
        "logprobs": _completion_logprobs(ctx, tokens) if logprobs is not None else None,
        "finish_reason": finish_reason(end)}], "usage": usage(events), "timings": timings(events)},
        headers=headers)


async def _completion_stream(ctx: Context, es: EventStream, first: Event | Waiting, base: dict,
                             want_logprobs: bool, include_usage: bool) -> AsyncGenerator[str, None]:
    def chunk(text: str, finish: str | None = None, logprobs: Any = None) -> str:
        obj = {**base, "choices": [{"index": 0, "text": text, "logprobs": logprobs,
                                    "finish_reason": finish}]}
        if include_usage:
            obj["usage"] = None
        return sse(obj)

    events: list[Event] = []
    offset = 0
    async for event in _chain([first], es):
        events.append(event)
        if isinstance(event, TokenEvent):
            lp = _completion_logprobs(ctx, [event], offset) if want_logprobs else None
            offset += len(event.text)
            if event.text or lp:
                yield chunk(event.text, logprobs=lp)
        elif isinstance(event, ErrorEvent):
            yield sse(openai_body(_error_answer(event, events)))
            return
        elif isinstance(event, FinishedEvent):
            yield chunk("", finish_reason(event))
    if include_usage:
        yield sse({**base, "choices": [], "usage": usage(events), "timings": timings(events)})
    yield "data: [DONE]\n\n"

