"""A recording reverse proxy for ``bench.agents``: the agents talk to it, it forwards every
request to ``mlxkv serve`` and streams the answer back as it comes, and it keeps what went
through: the request (method, path, headers, body), the response's status and headers (the
server's ``x-mlxkv-cache`` among them) and every piece of its body with the time it arrived.

From that record alone the benchmark takes its figures: which requests an agent made and how
each was answered, the prompts it sent (to compute the ideal cache reuse independently of
the server), the usage the server reported (from the JSON answer or the SSE stream) and the
time to the first generated text. The upstream can be changed between requests (a restarted
server on another port) while the agents keep the proxy's address.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

# headers that belong to one connection, not to the request or response they travel with
HOP_BY_HOP = frozenset(("connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
                        "trailer", "transfer-encoding", "upgrade", "host", "content-length",
                        "accept-encoding"))
UPSTREAM_TIMEOUT_S = 3600.0  # a cold prefill of an agent's prompt answers no bytes for minutes


@dataclasses.dataclass
class SseEvent:
    at: float  # perf_counter time the piece that completed it arrived
    name: str  # the ``event:`` field ("message" when none)
    data: Any  # the ``data:`` field parsed as JSON (the raw text when it is not JSON)


@dataclasses.dataclass
class Exchange:
    """One request that went through the proxy and its answer."""

    index: int
    label: str  # what the benchmark was doing (set on the proxy before each agent run)
    method: str
    path: str  # with the query string
    request_headers: dict[str, str]
    body: bytes
    started: float  # perf_counter time the request was read in full
    status: int | None = None  # None: no answer came from upstream
    response_headers: dict[str, str] = dataclasses.field(default_factory=dict)
    chunks: list[tuple[float, bytes]] = dataclasses.field(default_factory=list)
    ended: float | None = None
    error: str | None = None  # why the exchange did not complete

    @property
    def route(self) -> str:
        """The path without its query string."""
        return urllib.parse.urlsplit(self.path).path

    def json_body(self) -> Any:
        try:
            return json.loads(self.body) if self.body else None
        except ValueError:
            return None

    def response_bytes(self) -> bytes:
        return b"".join(c for _, c in self.chunks)

    def is_sse(self) -> bool:
        return self.response_headers.get("content-type", "").startswith("text/event-stream")

    def response_json(self) -> Any:
        if self.is_sse():
            return None
        try:
            return json.loads(self.response_bytes())
        except ValueError:
            return None

    def as_dict(self) -> dict[str, Any]:
        """The record as JSON-ready values (bodies as text, times as offsets from the start)."""
        return {"index": self.index, "label": self.label, "method": self.method, "path": self.path,
                "request_headers": self.request_headers, "body": self.body.decode("utf-8", "replace"),
                "status": self.status, "response_headers": self.response_headers,
                "response": self.response_bytes().decode("utf-8", "replace"),
                "pieces_s": [round(at - self.started, 4) for at, _ in self.chunks],
                "wall_s": None if self.ended is None else round(self.ended - self.started, 4), "error": self.error}

    def sse_events(self) -> list[SseEvent]:
        """The server-sent events of a streamed answer, each with the time it arrived whole."""
        return parse_sse(self.chunks)


def parse_sse(chunks: list[tuple[float, bytes]]) -> list[SseEvent]:
    """Server-sent events from timed pieces of a stream (an event may span pieces, a piece
    may hold several events); comments (``: ...``) are left out."""
    events: list[SseEvent] = []
    buffer = b""
    for at, piece in chunks:
        buffer += piece.replace(b"\r\n", b"\n")
        while b"\n\n" in buffer:
            raw, buffer = buffer.split(b"\n\n", 1)
            name, data = "message", []
            for line in raw.decode("utf-8", "replace").split("\n"):
                if line.startswith("event:"):
                    name = line[6:].strip()
                elif line.startswith("data:"):
                    data.append(line[5:].removeprefix(" "))
            if not data:
                continue
            text = "\n".join(data)
            try:
                value: Any = json.loads(text)
            except ValueError:
                value = text
            events.append(SseEvent(at, name, value))
    return events


class RecordingProxy:
    """The proxy on ``127.0.0.1:port`` (a free port unless given), forwarding to ``upstream``
    (``http://host:port``); use it as a context manager, or :meth:`start` / :meth:`close`."""

    def __init__(self, upstream: str = "", port: int = 0):
        self.upstream = upstream
        self.label = ""
        self.exchanges: list[Exchange] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(_Forward):
            owner = proxy

        self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="agents-proxy", daemon=True)

    def start(self) -> RecordingProxy:
        self._thread.start()
        return self

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> RecordingProxy:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _new(self, method: str, path: str, headers: dict[str, str], body: bytes) -> Exchange:
        with self._lock:
            ex = Exchange(len(self.exchanges), self.label, method, path, headers, body, time.perf_counter())
            self.exchanges.append(ex)
            return ex

    def since(self, index: int) -> list[Exchange]:
        """The exchanges from ``index`` on (``len(proxy.exchanges)`` taken before a run)."""
        with self._lock:
            return self.exchanges[index:]


class _Forward(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the agents' HTTP clients expect
    owner: RecordingProxy

    def log_message(self, format: str, *args: Any) -> None:  # the benchmark prints its own table
        pass

    def _read_body(self) -> bytes:
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            parts = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return b"".join(parts)
                parts.append(self.rfile.read(size))
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("content-length") or 0))

    def _forward(self) -> None:
        body = self._read_body()
        headers = {k.lower(): v for k, v in self.headers.items()}
        ex = self.owner._new(self.command, self.path, headers, body)
        target = urllib.parse.urlsplit(self.owner.upstream)
        upstream = http.client.HTTPConnection(target.hostname, target.port, timeout=UPSTREAM_TIMEOUT_S)
        try:
            sent = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
            sent["Accept-Encoding"] = "identity"  # the record keeps the body as the server wrote it
            upstream.request(self.command, self.path, body=body or None, headers=sent)
            resp = upstream.getresponse()
        except OSError as e:
            ex.error, ex.ended = f"upstream: {type(e).__name__}: {e}", time.perf_counter()
            upstream.close()
            self._answer_502(ex.error)
            return
        ex.status = resp.status
        ex.response_headers = {k.lower(): v for k, v in resp.getheaders()}
        try:
            self._relay(resp, ex)
        except OSError as e:  # the agent went away: closing upstream tells the server to stop
            ex.error = f"client: {type(e).__name__}: {e}"
            self.close_connection = True
        finally:
            ex.ended = time.perf_counter()
            upstream.close()

    def _relay(self, resp: http.client.HTTPResponse, ex: Exchange) -> None:
        self.send_response(resp.status, resp.reason)
        for k, v in resp.getheaders():
            if k.lower() not in HOP_BY_HOP:
                self.send_header(k, v)
        length = resp.getheader("content-length")
        if length is not None:
            data = resp.read()
            ex.chunks.append((time.perf_counter(), data))
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            self.wfile.flush()
            return
        self.send_header("Transfer-Encoding", "chunked")  # a stream: each piece on as it comes
        self.end_headers()
        self.wfile.flush()
        while True:
            piece = resp.read1(65536)
            if not piece:
                break
            ex.chunks.append((time.perf_counter(), piece))
            self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def _answer_502(self, why: str) -> None:
        data = json.dumps({"error": {"type": "proxy_error", "message": why}}).encode()
        self.send_response(502)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = do_PATCH = do_OPTIONS = _forward
