"""Hostile clients against a real `mlxkv serve` (the demo model, its own process, a loopback
port): a fuzzer of every route's every field (each value replaced by values of every JSON
type, sizes and encodings, or removed), whole bodies that are not what they claim, streams
dropped at every event, a slow upload, and 1,000 idle connections. Every answer must be a
2xx or a 4xx in the route's own error shape, a 4xx for a field must name it, and the server
must go on serving. The counts are printed (``-s``) for the record."""

from __future__ import annotations

import copy
import json
import os
import random
import socket
import threading
import time
from collections import Counter
from typing import Any

import pytest
from common import T

from bench.server import Served, http_client
from mlxkv.engine.settings import DEMO_MODEL

httpx = http_client()
SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
BASES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {
        "model": "demo", "messages": [{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": "What is mlxkv?"}],
        "max_tokens": 2, "temperature": 0, "top_p": 1, "stop": ["\n\n"], "stream": False, "seed": 1,
        "tools": [{"type": "function", "function": {"name": "f", "description": "d", "parameters": SCHEMA}}],
        "tool_choice": "auto", "response_format": {"type": "text"}, "session_id": "s", "cache_salt": "c",
        "stream_options": {"include_usage": True}, "logprobs": False, "n": 1},
    "/v1/completions": {"model": "demo", "prompt": "mlxkv is", "max_tokens": 2, "temperature": 0,
                        "stop": ["."], "logprobs": None, "echo": False},
    "/v1/responses": {
        "model": "demo", "input": [{"role": "user", "content": [{"type": "input_text", "text": "What is mlxkv?"}]}],
        "instructions": "Be brief.", "max_output_tokens": 2, "temperature": 0,
        "tools": [{"type": "function", "name": "f", "parameters": SCHEMA}], "tool_choice": "auto",
        "text": {"format": {"type": "text"}}, "store": True},
    "/v1/messages": {
        "model": "demo", "max_tokens": 2, "system": [{"type": "text", "text": "Be brief."}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "What is mlxkv?"}]}],
        "tools": [{"name": "f", "description": "d", "input_schema": SCHEMA}], "tool_choice": {"type": "auto"},
        "stop_sequences": ["\n\n"], "temperature": 0, "metadata": {"user_id": "u"}},
    "/v1/messages/count_tokens": {"model": "demo", "messages": [{"role": "user", "content": "What is mlxkv?"}],
                                  "system": "Be brief."},
}
# values of every JSON type, the edges of numbers, sizes and text a parser trips on
VALUES: list[Any] = [None, True, False, 0, -1, 2**64, -(2**63) - 1, 0.5, 1e308, -1e308, "", "x" * 20000,
                     "\u0000\u001b[2J", "☃\u202e" * 50, [], [None], [[[[[[[[]]]]]]]], {}, {"": None},
                     {"type": 5}, [{"role": "user"}], "user"]
RAW = ["NaN", "-Infinity", "1e999", '"\\ud800"', '"\\udfff tail"', "00", "0x10", '"' + "\\u0000" * 1000 + '"']


def paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path into ``value``: dict keys and list positions, outermost first."""
    out = []
    if isinstance(value, dict):
        for k, v in value.items():
            out.append(prefix + (k,))
            out += paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out.append(prefix + (i,))
            out += paths(v, prefix + (i,))
    return out


def replaced(body: dict, path: tuple, value: Any) -> dict:
    out = copy.deepcopy(body)
    node = out
    for step in path[:-1]:
        node = node[step]
    if value is DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return out


DELETE = object()
# every value at every path (MLXKV_TEST_FUZZ=full, about 3,000 requests); by default a seeded
# sample of them: every path, four values and one broken spelling at the top level, one and one deeper
FULL = os.environ.get("MLXKV_TEST_FUZZ") == "full"
MARK = "__fuzz_raw__"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    work = tmp_path_factory.mktemp("fuzz")
    srv = Served("mlxkv", DEMO_MODEL, work, extra=("--max-tokens", "2", "--max-body-bytes", "1MiB",
                                                   "--spec", "off")).start(timeout=T)
    yield srv
    srv.stop(timeout=T)
    assert srv.returncode == 0
    log = (work / "mlxkv.log").read_text()
    assert "Traceback" not in log and " 500 " not in log


def post(srv, route: str, content: bytes, headers: dict | None = None):
    return httpx.post(srv.url + route, content=content,
                      headers={"content-type": "application/json", **(headers or {})}, timeout=T)


def error_shape_ok(route: str, r) -> bool:
    """A 4xx in the route's own error shape, with a message."""
    try:
        body = r.json()
    except ValueError:
        return False
    if route.startswith("/v1/messages"):
        return body.get("type") == "error" and bool(body["error"].get("message"))
    return bool(body.get("error", {}).get("message"))


def names(r, path: tuple) -> bool:
    """The error names the field: its param, or a key on its path, in the message."""
    err = r.json()["error"]
    text = f"{err.get('param') or ''} {err.get('message') or ''}"
    keys = [str(p) for p in path if isinstance(p, str)]
    return any(k in text for k in keys) or f"[{path[-1]}]" in text


def still_serves(srv) -> None:
    r = post(srv, "/v1/chat/completions", json.dumps(BASES["/v1/chat/completions"]).encode())
    assert r.status_code == 200, r.text


def test_every_field_of_every_route(served):
    rng = random.Random(7)
    counts: Counter = Counter()
    unnamed: list[str] = []
    for route, base in BASES.items():
        assert post(served, route, json.dumps(base).encode()).status_code == 200, route
        for path in paths(base):
            k, r = (len(VALUES), len(RAW)) if FULL else (4, 1) if len(path) == 1 else (1, 1)
            cases = [json.dumps(replaced(base, path, v)).encode() for v in [DELETE, *rng.sample(VALUES, k)]]
            raw = json.dumps(replaced(base, path, MARK))
            cases += [raw.replace(f'"{MARK}"', text).encode() for text in rng.sample(RAW, r)]
            for content in cases:
                r = post(served, route, content)
                counts["requests"] += 1
                counts[f"{r.status_code // 100}xx"] += 1
                assert r.status_code < 500, (route, path, content[:300], r.text)
                if r.status_code >= 400:
                    assert error_shape_ok(route, r), (route, path, r.text)
                    if names(r, path):
                        counts["4xx naming the field"] += 1
                    elif "the model's context is" in r.json()["error"]["message"]:
                        counts["4xx: the whole prompt over the context"] += 1  # of no one field
                    else:
                        unnamed.append(f"{route} {path}: {r.json()['error'].get('message')}")
        still_serves(served)
    print("fields:", dict(counts))
    for line in unnamed[:40]:
        print("  not named:", line)
    assert not unnamed, f"{len(unnamed)} 4xx answers do not name their field"


def test_bodies_that_are_not_what_they_claim(served):
    deep = b"[" * 100_000 + b"]" * 100_000
    bodies = [b"", b"{", b"[]", b"null", b"7", b'"text"', b"\xff\xfe\x00{", b"\xef\xbb\xbf{}", deep,
              b'{"a":' * 50_000, json.dumps({f"k{i}": i for i in range(50_000)}).encode(),
              json.dumps(BASES["/v1/chat/completions"]).encode("utf-16"),
              b'{"model": "demo", "model": 5, "messages": []}', b"{" + b" " * 500_000 + b"}",
              b"x" * (2 << 20)]
    counts: Counter = Counter()
    for route in BASES:
        for content in bodies:
            for headers in ({}, {"content-type": "text/plain"}, {"content-encoding": "gzip"}):
                r = post(served, route, content, headers)
                counts[f"{r.status_code // 100}xx"] += 1
                assert 400 <= r.status_code < 500, (route, content[:80], headers, r.status_code, r.text[:300])
                assert error_shape_ok(route, r), (route, content[:80], r.text[:300])
        still_serves(served)
    print("bodies:", dict(counts))


def _events(srv, route: str, body: dict, keep: int) -> int:
    """Stream ``body`` and drop the connection after ``keep`` events; the events read."""
    seen = 0
    with httpx.stream("POST", srv.url + route, json={**body, "stream": True}, timeout=T) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data:") or line.startswith("event:"):
                seen += 1
                if seen >= keep:
                    break
    return seen


def test_streams_dropped_at_every_event(served):
    chat = {**BASES["/v1/chat/completions"], "max_tokens": 12}
    messages = {**BASES["/v1/messages"], "max_tokens": 12}
    dropped = 0
    for route, body in (("/v1/chat/completions", chat), ("/v1/messages", messages)):
        total = _events(served, route, body, 10_000)  # the whole stream: how many events it has
        for keep in range(total):
            _events(served, route, body, keep)
            dropped += 1
    deadline = time.monotonic() + T
    while (active := httpx.get(served.url + "/stats", timeout=T).json()["engine"].get("active", 0)):
        assert time.monotonic() < deadline, f"{active} requests still in flight after their clients left"
        time.sleep(0.1)
    print(f"streams dropped: {dropped}")
    still_serves(served)


def test_a_slow_upload_and_a_thousand_idle_connections(served):
    host, port = "127.0.0.1", served.port
    body = json.dumps(BASES["/v1/chat/completions"]).encode()
    answer: list[bytes] = []

    def slow() -> None:  # the body a few bytes at a time over about 3 s
        with socket.create_connection((host, port), timeout=T) as s:
            s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode())
            step = max(1, len(body) // 60)
            for i in range(0, len(body), step):
                s.sendall(body[i:i + step])
                time.sleep(0.05)
            answer.append(s.recv(64))

    uploader = threading.Thread(target=slow)
    uploader.start()
    idle = []
    try:
        for i in range(1000):
            s = socket.create_connection((host, port), timeout=T)
            if i % 2:
                s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")  # headers never finished
            idle.append(s)
        t0 = time.monotonic()
        still_serves(served)  # beside 1,000 idle connections and the slow upload
        print(f"a request beside 1,000 idle connections: {time.monotonic() - t0:.2f} s")
    finally:
        for s in idle:
            s.close()
    uploader.join(T)
    assert answer and answer[0].startswith(b"HTTP/1.1 200"), answer
    still_serves(served)
