"""OpenAI Responses API: ``POST /v1/responses``, JSON or server-sent events, the wire format
Codex CLI speaks.

A stream goes ``response.created``, ``response.in_progress``, then per output item
``response.output_item.added`` .. ``response.output_item.done`` (a ``message`` item with one
``output_text`` part and its deltas, or a ``function_call`` item with its arguments), and
ends with ``response.completed`` (``response.incomplete`` when ``max_output_tokens`` cut the
reply; ``error`` and ``response.failed`` when the engine failed). Every event has its
``sequence_number`` and an ``event:`` line. While a long prompt waits or is prefilled,
``response.in_progress`` is sent again every keep-alive interval (``server.keepalive``, 10 s
by default): clients that give up on a
quiet stream (Codex after 300 s, then retrying the whole request) see it is alive. A reply
that is not streamed is the same response object, built from the same items.

``previous_response_id`` continues a response kept in the server's bounded memory
(:mod:`mlxkv.server.response_store`; ``store: false`` keeps none, as Codex asks), and is a
400 once forgotten. How input items and tools become the prompt:
:mod:`mlxkv.server.responses_items`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response

from mlxkv.engine.requests import ErrorEvent, Event, FinishedEvent, Request, TokenEvent
from mlxkv.server.bridge import EventStream, SseResponse, Waiting, all_events, ending, error_status, first_event
from mlxkv.server.chat_prompt import chat_prompt
from mlxkv.server.context import Context, dumps, new_id, read_json, session_of, timings, usage_counts
from mlxkv.server.errors import ApiError
from mlxkv.server.fields import extension_fields, get_bool, get_int, get_list, get_object, get_str, sampling
from mlxkv.server.formats import REASONING, TEXT, ToolCall
from mlxkv.server.formats.stream import ReplyParser
from mlxkv.server.grammars import reply_grammar
from mlxkv.server.keepalive import keep_alive
from mlxkv.server.reasoning import responses_kwargs
from mlxkv.server.responses_items import (
    Tools,
    check_tool_choice,
    parse_input,
    parse_tools,
    to_messages,
)
from mlxkv.server.retention import openai_retain_s
from mlxkv.server.tenants import cache_scope, scoped_name

_TEXT_FORMATS = ("text", "json_object", "json_schema")
_TRUNCATIONS = ("auto", "disabled")
SEED_MAX = 2**64 - 1  # mlx's random seed is an unsigned 64-bit integer


# ------------------------------------------------------------------------- the request
def lone_surrogate(value: Any) -> str | None:
    """The path of the first string in ``value`` (a JSON body) holding a lone UTF-16
    surrogate (``"\\ud800"``: valid JSON, not text: it cannot be encoded), or None."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return path or "the body"
        elif isinstance(v, dict):
            for k, x in v.items():
                key = f"{path}.{k}" if path else str(k)
                if isinstance(k, str) and lone_surrogate(k) is not None:
                    return key
                stack.append((key, x))
        elif isinstance(v, list):
            stack.extend((f"{path}[{i}]", x) for i, x in enumerate(v))
    return None


def _string_object(body: dict, name: str) -> dict | None:
    value = get_object(body, name)
    if value is not None and not all(isinstance(v, str) for v in value.values()):
        raise ApiError(400, f"{name} must be an object of string values", name)
    return value


def _choice(body: dict, name: str, choices: tuple[str, ...]) -> str | None:
    value = get_str(body, name)
    if value is not None and value not in choices:
        raise ApiError(400, f"{name} must be one of {', '.join(choices)}; got {value!r}", name)
    return value


def _reasoning(body: dict) -> dict[str, Any]:
    """``reasoning`` is echoed; its ``effort`` goes to the chat template (server.reasoning).
    No summaries are written: a thinking model's reasoning comes back whole, as a
    ``reasoning`` item."""
    value = get_object(body, "reasoning") or {}
    for key in ("effort", "summary", "generate_summary"):
        if value.get(key) is not None and not isinstance(value[key], str):
            raise ApiError(400, f"reasoning.{key} must be a string", f"reasoning.{key}")
    return {"effort": value.get("effort"), "summary": value.get("summary") or value.get("generate_summary")}


def _text_config(body: dict) -> dict[str, Any]:
    """``text``: its ``format`` (text, ``json_object``, ``json_schema``: the reply is held to
    it, ``server.grammars``) and ``verbosity``, echoed."""
    value = get_object(body, "text") or {}
    fmt = value.get("format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") not in _TEXT_FORMATS:
            raise ApiError(400, f"text.format must be an object with type {', '.join(_TEXT_FORMATS)}",
                           "text.format")
        if fmt["type"] == "json_schema" and not isinstance(fmt.get("schema"), dict):
            raise ApiError(400, "text.format.schema must be a JSON schema object", "text.format.schema")
    verbosity = value.get("verbosity")
    if verbosity is not None and not isinstance(verbosity, str):
        raise ApiError(400, "text.verbosity must be a string", "text.verbosity")
    return {"format": dict(fmt) if fmt else {"type": "text"}, "verbosity": verbosity or "medium"}


def _text_schema(text: dict[str, Any]) -> Any:
    fmt = text["format"]
    return {} if fmt["type"] == "json_object" else fmt["schema"] if fmt["type"] == "json_schema" else None


def _forced(choice: Any, tools: Tools) -> list[str] | bool:
    """What ``tool_choice`` demands: True (``required``), the named function, or False."""
    if choice == "required":
        return True
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = choice.get("name")
        if not isinstance(name, str) or name not in {t["function"]["name"] for t in tools.chat}:
            raise ApiError(400, f"tool_choice names {name!r}, which is not in tools", "tool_choice.name")
        return [name]
    return False


@dataclasses.dataclass
class Ask:
    """One request, read and checked."""

    model: str
    items: list[dict[str, Any]]  # the whole conversation: earlier response's, then input
    instructions: str | None
    tools: Tools
    use_tools: bool
    tool_choice: Any
    parallel_tool_calls: bool
    params: Any  # SamplingParams
    max_output_tokens: int | None  # as asked (None: the server's default)
    clamped: bool
    stream: bool
    store: bool
    echo_tools: list[Any]  # as given
    echo: dict[str, Any]  # other fields the response object repeats as given
    retain_s: float | None  # prompt_cache_key / prompt_cache_retention as a retention hint
    template_kwargs: dict[str, Any] | None = None  # reasoning switches (server.reasoning)
    extensions: dict[str, Any] = dataclasses.field(default_factory=dict)  # guided_choice, spec
    # the reply's parser, once the prompt is built (engine_request)
    parser: Callable[[], Any] = dataclasses.field(default=lambda: ReplyParser(None, None))
    scope: str | None = None  # the request's cache scope (a tenant's): its stored responses


def read_ask(body: dict, ctx: Context, scope: str | None = None) -> Ask:
    bad = lone_surrogate(body)
    if bad is not None:
        raise ApiError(400, f"{bad} holds a lone UTF-16 surrogate (not text)", bad)
    model = get_str(body, "model") or ctx.model_id
    previous_id = get_str(body, "previous_response_id")
    items: list[dict[str, Any]] = []
    if previous_id is not None:
        earlier = ctx.responses.get(scoped_name(previous_id, scope))
        if earlier is None:
            raise ApiError(400, f"previous_response_id {previous_id!r} is not known here: it was "
                                "not stored (store: false), was evicted (responses_store_bytes), or "
                                "the server restarted since; send the whole conversation as input",
                           "previous_response_id", code="previous_response_not_found")
        items = earlier
    raw = body.get("input")
    if raw is None and previous_id is None:
        raise ApiError(400, "input is required", "input")
    items += parse_input(raw) if raw is not None else []
    instructions = get_str(body, "instructions")
    tools = parse_tools(body.get("tools"))
    use_tools = check_tool_choice(body.get("tool_choice")) and bool(tools.chat)
    for name in ("conversation", "prompt"):
        if body.get(name) is not None:
            raise ApiError(400, f"{name} is not supported: this server keeps no conversations or "
                                "prompt templates (send input, or previous_response_id)", name)
    if get_bool(body, "background"):
        raise ApiError(400, "background responses are not supported (use stream)", "background")
    get_int(body, "seed", None, lo=0, hi=SEED_MAX)
    params = sampling(body, ctx.config.defaults, ctx.limits, ())
    # without max_output_tokens a reply may run to the end of the context, as OpenAI's do
    # (Codex sends none, and takes a reply cut short for an error it retries); above the
    # server's limit it is clamped, not refused
    asked = get_int(body, "max_output_tokens", None, lo=1)
    cap = ctx.limits.max_tokens_limit or ctx.limits.context_tokens
    clamped = asked is not None and cap is not None and asked > cap
    limit = asked if asked is not None and not clamped else cap
    if limit is not None:
        params = dataclasses.replace(params, max_tokens=limit)
    include = get_list(body, "include") or []
    if not all(isinstance(x, str) for x in include):
        raise ApiError(400, "include must be an array of strings", "include")
    # accepted and echoed, or accepted and not used: logprobs and tool-call bounds are not
    # reported or enforced on this route; user, safety_identifier, service_tier and
    # prompt_cache_key name the caller and the cache group for a hosted service
    get_int(body, "top_logprobs", None, lo=0, hi=20)
    get_int(body, "max_tool_calls", None, lo=1)
    for name in ("user", "safety_identifier", "prompt_cache_retention"):
        get_str(body, name)
    get_object(body, "client_metadata")
    get_object(body, "stream_options")
    echo = {
        "instructions": instructions, "previous_response_id": previous_id,
        "metadata": _string_object(body, "metadata") or {}, "reasoning": _reasoning(body),
        "text": _text_config(body), "truncation": _choice(body, "truncation", _TRUNCATIONS) or "disabled",
        "user": get_str(body, "user"), "service_tier": get_str(body, "service_tier") or "default",
        "prompt_cache_key": get_str(body, "prompt_cache_key"),
    }
    return Ask(model=model, items=items, instructions=instructions, tools=tools, use_tools=use_tools,
               tool_choice=body.get("tool_choice", "auto"),
               parallel_tool_calls=get_bool(body, "parallel_tool_calls", True), params=params,
               max_output_tokens=asked, clamped=clamped, stream=get_bool(body, "stream"),
               store=get_bool(body, "store", True), echo_tools=body.get("tools") or [], echo=echo,
               retain_s=openai_retain_s(body), template_kwargs=responses_kwargs(body),
               extensions=extension_fields(body), scope=scope)


async def engine_request(ask: Ask, ctx: Context, session: str | None) -> Request:
    """The engine request for ``ask``: its conversation built as every chat route builds
    one (``server.chat_prompt``: the churn rules, the tools in the template's own format or,
    when it has none, in the default one, later system messages where the template can
    render them)."""
    messages = to_messages(ask.items, ask.instructions)
    prompt = await chat_prompt(ctx.template, messages, ask.tools.chat if ask.use_tools else None,
                               ctx.config.churn_rules, ask.template_kwargs)
    ask.parser = prompt.parser
    grammar = reply_grammar(prompt, _forced(ask.tool_choice, ask.tools) if ask.use_tools else False,
                            _text_schema(ask.echo["text"]), schema_field="text.format.schema",
                            parallel=ask.parallel_tool_calls)
    try:
        return Request(messages=prompt.messages, params=ask.params, session=session,
                       tools=prompt.tools, template_kwargs=prompt.template_kwargs, grammar=grammar,
                       truncate=ask.echo["truncation"] == "auto", retain_s=ask.retain_s,
                       cache_scope=ask.scope, **ask.extensions)
    except ValueError as e:
        raise ApiError(400, f"input: {e}", "input") from None


# ------------------------------------------------------------------------- the answer
class OutputItems:
    """The reply as output items, step by step: text goes into ``message`` items, each tool
    call is a ``function_call`` item; every step returns the stream events it makes (a reply
    that is not streamed drops them). Whitespace is held back until text follows, so the
    line break a model writes before a call opens no empty message; a reply with nothing
    else is one message with it."""

    def __init__(self, tools: Tools):
        self.items: list[dict[str, Any]] = []
        self._tools = tools
        self._open: dict[str, Any] | None = None  # the message being written
        self._open_index = -1
        self._held = ""
        self._reasoning: dict[str, Any] | None = None  # the reasoning item being written
        self._reasoning_index = -1

    def _message_events(self, text: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = self._close_reasoning()
        if self._open is None:
            self._open = {"id": new_id("msg_"), "type": "message", "status": "in_progress",
                          "role": "assistant", "content": []}
            index = self._open_index = len(self.items)
            out += [{"type": "response.output_item.added", "output_index": index,
                     "item": {**self._open, "content": []}},
                    {"type": "response.content_part.added", "item_id": self._open["id"],
                     "output_index": index, "content_index": 0,
                     "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}}]
            self._open["content"] = [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]
            self.items.append(self._open)
        if text:
            self._open["content"][0]["text"] += text
            out.append({"type": "response.output_text.delta", "item_id": self._open["id"],
                        "output_index": self._open_index, "content_index": 0, "delta": text,
                        "logprobs": []})
        return out

    def text(self, piece: str) -> list[dict[str, Any]]:
        if not piece:
            return []
        if not piece.strip():
            self._held += piece
            return []
        text, self._held = self._held + piece, ""
        return self._message_events(text)

    def _close(self, status: str = "completed") -> list[dict[str, Any]]:
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = status
        index = self._open_index
        part = item["content"][0]
        base = {"item_id": item["id"], "output_index": index}
        return [{"type": "response.output_text.done", **base, "content_index": 0, "text": part["text"],
                 "logprobs": []},
                {"type": "response.content_part.done", **base, "content_index": 0, "part": dict(part)},
                {"type": "response.output_item.done", "output_index": index, "item": _copy(item)}]

    def reasoning(self, piece: str) -> list[dict[str, Any]]:
        """Reasoning goes into a ``reasoning`` item (``reasoning_text`` content) of its own."""
        out: list[dict[str, Any]] = []
        if self._reasoning is None:
            self._held = ""
            out += self._close()
            item: dict[str, Any] = {"id": new_id("rs_"), "type": "reasoning", "summary": [],
                    "content": [{"type": "reasoning_text", "text": ""}]}
            self._reasoning, self._reasoning_index = item, len(self.items)
            self.items.append(item)
            out += [{"type": "response.output_item.added", "output_index": self._reasoning_index,
                     "item": {**item, "content": []}},
                    {"type": "response.content_part.added", "item_id": item["id"],
                     "output_index": self._reasoning_index, "content_index": 0,
                     "part": {"type": "reasoning_text", "text": ""}}]
        self._reasoning["content"][0]["text"] += piece
        out.append({"type": "response.reasoning_text.delta", "item_id": self._reasoning["id"],
                    "output_index": self._reasoning_index, "content_index": 0, "delta": piece})
        return out

    def _close_reasoning(self) -> list[dict[str, Any]]:
        item, self._reasoning = self._reasoning, None
        if item is None:
            return []
        base = {"item_id": item["id"], "output_index": self._reasoning_index}
        part = dict(item["content"][0])
        return [{"type": "response.reasoning_text.done", **base, "content_index": 0, "text": part["text"]},
                {"type": "response.content_part.done", **base, "content_index": 0, "part": part},
                {"type": "response.output_item.done", "output_index": self._reasoning_index,
                 "item": _copy(item)}]

    def call(self, call: ToolCall) -> list[dict[str, Any]]:
        self._held = ""
        out = self._close_reasoning() + self._close()
        item: dict[str, Any] = {"id": new_id("fc_"), "type": "function_call", "status": "in_progress",
                                "call_id": call.id, "name": call.name, "arguments": ""}
        if call.name in self._tools.namespaced:
            item["namespace"], item["name"] = self._tools.namespaced[call.name]
        index = len(self.items)
        self.items.append(item)
        args = call.arguments_json
        base = {"item_id": item["id"], "output_index": index}
        out.append({"type": "response.output_item.added", "output_index": index, "item": dict(item)})
        item.update(arguments=args, status="completed")
        out += [{"type": "response.function_call_arguments.delta", **base, "delta": args},
                {"type": "response.function_call_arguments.done", **base, "name": item["name"],
                 "arguments": args},
                {"type": "response.output_item.done", "output_index": index, "item": dict(item)}]
        return out

    def finish(self, cut: bool) -> list[dict[str, Any]]:
        """The end of the reply (``cut``: at max_output_tokens)."""
        out: list[dict[str, Any]] = []
        if self._held and (self._open is not None or not self.items):
            out += self._message_events(self._held)
        self._held = ""
        if not any(i["type"] != "reasoning" for i in self.items):
            out += self._message_events("")
        out += self._close_reasoning()
        return out + self._close("incomplete" if cut else "completed")


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    return {**item, "content": [dict(p) for p in item["content"]]}


def _usage(events: list[Event]) -> dict[str, Any]:
    prompt, cached, generated = usage_counts(events)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": generated, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + generated}


class Answer:
    """The response object of one request as it goes from in progress to its end."""

    def __init__(self, ask: Ask, ctx: Context):
        self.ask = ask
        self.id = new_id("resp_")
        self.created = int(time.time())
        self.output = OutputItems(ask.tools)
        self.parser = ask.parser()
        self.events: list[Event] = []

    def obj(self, status: str, error: dict | None = None) -> dict[str, Any]:
        ask = self.ask
        done = status in ("completed", "incomplete", "failed")
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "background": False, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            **ask.echo, "model": ask.model,
            "max_output_tokens": ask.params.max_tokens if ask.max_output_tokens is not None else None,
            "output": [_copy(i) if i["type"] == "message" else dict(i) for i in self.output.items]
            if done else [],
            "parallel_tool_calls": ask.parallel_tool_calls, "store": ask.store,
            "temperature": ask.params.temperature, "top_p": ask.params.top_p,
            "tool_choice": ask.tool_choice, "tools": ask.echo_tools,
            "usage": _usage(self.events) if done and status != "failed" else None,
            "completed_at": int(time.time()) if status == "completed" else None,
            **({"timings": timings(self.events)} if done else {}),
        }

    def feed(self, event: Any) -> list[dict[str, Any]]:
        """The stream events one engine event makes."""
        self.events.append(event)
        out: list[dict[str, Any]] = []
        pieces: list[tuple[str, Any]] = []
        if isinstance(event, TokenEvent):
            pieces = self.parser.feed(event.text)
        elif isinstance(event, FinishedEvent):
            pieces = self.parser.finish()
        for kind, piece in pieces:
            out += self.output.text(piece) if kind == TEXT else self.output.reasoning(piece) \
                if kind == REASONING else self.output.call(piece)
        if isinstance(event, FinishedEvent):
            out += self.output.finish(event.reason == "length")
        return out

    @property
    def status(self) -> str:
        last = self.events[-1] if self.events else None
        if isinstance(last, FinishedEvent) and last.reason == "length":
            return "incomplete"
        return "completed"

    def keep(self, ctx: Context) -> None:
        """Remember the conversation this response ends, for previous_response_id."""
        if self.ask.store:
            ctx.responses.put(scoped_name(self.id, self.ask.scope),
                              [*self.ask.items, *self.obj(self.status)["output"]])


def _sse(event: dict[str, Any], seq: int) -> str:
    return f"event: {event['type']}\ndata: {dumps({**event, 'sequence_number': seq})}\n\n"


async def responses(http: HttpRequest, ctx: Context) -> Response:
    body = await read_json(http, ctx.config.max_body_bytes)
    ctx = await ctx.for_model(body)
    ask = read_ask(body, ctx, cache_scope(http, body))
    req = await engine_request(ask, ctx, session_of(http, body))
    es = EventStream(ctx.engine, req, ctx.gate, asyncio.get_running_loop(), ctx.lease)
    # a stream starts once the prompt is taken, or after a keep-alive interval in the queue
    first = await first_event(es, http.receive, accepted=ask.stream,
                              wait_s=ctx.config.ping_interval_s if ask.stream else None)
    if first is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    if isinstance(first, ErrorEvent):
        raise error_status(first)
    answer = Answer(ask, ctx)
    headers = {"x-mlxkv-max-tokens": f"requested {ask.max_output_tokens}, clamped to {ask.params.max_tokens}"} \
        if ask.clamped else {}
    if ask.stream:
        sse = SseResponse(_stream(answer, es, first, ctx), es)
        sse.headers.update(headers)
        return sse
    events = await all_events(es, first, http.receive)
    if events is None:
        return Response(status_code=499)
    end = ending(events)
    if isinstance(end, ErrorEvent):
        raise ApiError(500, f"the request failed: {end.message}")
    for event in events:
        answer.feed(event)
    answer.keep(ctx)
    return JSONResponse(answer.obj(answer.status), headers=headers)


async def _engine_events(es: EventStream, first: Event | Waiting) -> AsyncIterator[Event]:
    """The first event (unless the request still waited: :data:`WAITING`), then the rest of
    the request's, to its end."""
    if not isinstance(first, Waiting):
        yield first
        if isinstance(first, (FinishedEvent, ErrorEvent)):
            return
    while True:
        event = await es.next()
        yield event
        if isinstance(event, (FinishedEvent, ErrorEvent)):
            return


def _stream(answer: Answer, es: EventStream, first: Event | Waiting, ctx: Context,
            quiet_s: float | None = None) -> AsyncIterator[str]:
    """The response's events as SSE chunks, with ``response.in_progress`` again whenever
    ``quiet_s`` (default: the server's keep-alive interval) passes without one: an event,
    not an SSE comment, because Codex's idle timer (300 s) counts events only."""
    seq = 0

    def send(event: dict[str, Any]) -> str:
        nonlocal seq
        seq += 1
        return _sse(event, seq - 1)

    async def chunks() -> AsyncGenerator[str, None]:
        yield send({"type": "response.created", "response": answer.obj("in_progress")})
        yield send({"type": "response.in_progress", "response": answer.obj("in_progress")})
        async for event in _engine_events(es, first):
            if isinstance(event, ErrorEvent):
                answer.events.append(event)
                message = f"the request failed: {event.message}"
                yield send({"type": "error", "code": "server_error", "message": message, "param": None})
                yield send({"type": "response.failed", "response": answer.obj(
                    "failed", {"code": "server_error", "message": message})})
                return
            for e in answer.feed(event):
                yield send(e)
            if isinstance(event, FinishedEvent):
                answer.keep(ctx)
                status = answer.status
                yield send({"type": f"response.{status}", "response": answer.obj(status)})

    interval = ctx.config.ping_interval_s if quiet_s is None else quiet_s
    return keep_alive(chunks(), interval,
                      lambda n: send({"type": "response.in_progress", "response": answer.obj("in_progress")}))
