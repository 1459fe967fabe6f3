"""``bench.agents``'s own parts, without the agents: its removal of Claude Code's billing line
and the longest common token prefix it takes as the ideal (on Claude Code-shaped bodies,
rendered by the real model's template), and the recording proxy (real HTTP over loopback: a
stream passes through as it comes, and what it recorded reads back as the server wrote it).

With ``MLXKV_TEST_AGENTS=1`` and the pinned agents installed (``make agents``), the quick run of
the benchmark itself: real Claude Code and Codex CLI against ``mlxkv serve`` on the real model.
"""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from bench.agent_prompts import PromptRenderer, best_prefix, common_prefix, without_volatile
from bench.agent_proxy import RecordingProxy
from bench.agents import cache_header, reply_of, stop_of, ttft_of, usage_of
from bench.server import http_client
from support.real_model import real_model_path

ROOT = Path(__file__).resolve().parent.parent
REAL = real_model_path()
httpx = http_client()  # the HTTP client the openai and anthropic packages install


def claude_body(version: str, prompt: str) -> dict[str, Any]:
    """A request body shaped as Claude Code 2.1.332 sends it (the billing line a text block
    of its own, the environment a system entry after the prompt, tools, its other fields)."""
    return {
        "model": "smollm2", "max_tokens": 48, "stream": True,
        "system": [
            {"type": "text", "text": f"x-anthropic-billing-header: cc_version={version}; cc_entrypoint=sdk-cli;"},
            {"type": "text", "text": "You are a Claude agent, built on Anthropic's Claude Agent SDK.",
             "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "\nYou are an agent working with the user toward their goals.\n" * 20,
             "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "<system-reminder>\nBe brief.\n</system-reminder>\n"},
                                         {"type": "text", "text": prompt}]},
            {"role": "system", "content": [{"type": "text", "text": "# Environment\n - Platform: linux\n"}]}],
        "tools": [{"name": "Read", "description": "Read a file.", "input_schema": {
            "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}],
        "thinking": {"type": "adaptive"}, "metadata": {"user_id": "{\"session_id\": \"s\"}"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
    }


def test_billing_line_removed_from_system_text_only():
    body = claude_body("2.1.332.34c", "x-anthropic-billing-header: cc_version=1; is what I typed")
    body["messages"][1]["content"][0]["text"] = "x-anthropic-billing-header: cc_version=9;\n# Environment\n"
    out = without_volatile(body)
    assert out["system"][0]["text"] == ""
    assert out["system"][1:] == body["system"][1:]
    assert out["messages"][1]["content"][0]["text"] == "# Environment\n"
    assert out["messages"][0] == body["messages"][0]  # what the user wrote stays
    assert body["system"][0]["text"].startswith("x-anthropic-billing-header")  # a copy was changed
    assert without_volatile({**body, "system": "a\nx-anthropic-billing-header: v=1;\nb"})["system"] == "a\nb"


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0
    assert best_prefix([1, 2, 3], [[9], [1, 2, 3, 4], [1]]) == 3
    assert best_prefix([1], []) == 0


@pytest.mark.skipif(REAL is None, reason="the real model is not fetched: run `make fixtures`")
def test_ideal_prefix_of_two_conversations_ends_at_the_first_real_difference():
    a = claude_body("2.1.332.34c", "What is the capital of France?")
    b = claude_body("2.1.332.f07", "Name one primary colour.")
    a_with_b_prompt = claude_body("2.1.332.34c", "Name one primary colour.")
    with PromptRenderer(REAL) as renderer:
        ta, tb, tab = (renderer.anthropic(x) for x in (a, b, a_with_b_prompt))
        raw_a, raw_b = (renderer.anthropic(x, remove_volatile=False) for x in (a, b))
        # the renderer removes the line itself: a body without it renders the same tokens
        assert renderer.anthropic(without_volatile(a)) == ta
        assert renderer.responses({"model": "m", "input": "Hello"})
    ideal = common_prefix(ta, tb)
    # the bodies differ only in the billing line and the prompt: with the line removed the
    # prefix runs to the prompt, as far as the same body with the other prompt shares
    assert ideal == common_prefix(ta, tab) > 300
    assert tb[:ideal] == tab[:ideal]
    # the line is what made them part near the top
    assert len(raw_a) > len(ta) and common_prefix(raw_a, raw_b) < 40


# ------------------------------------------------------------------------- the proxy
def _delta(text: str) -> dict[str, Any]:
    return {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}}


USAGE = {"input_tokens": 5, "cache_read_input_tokens": 90, "cache_creation_input_tokens": 5}
SSE_EVENTS = [
    ("message_start", {"type": "message_start", "message": {"usage": {**USAGE, "output_tokens": 0}}}),
    ("ping", {"type": "ping"}),
    ("content_block_start", {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
    ("content_block_delta", _delta("")),  # a keep-alive: no text yet
    ("content_block_delta", _delta("Par")),
    ("content_block_delta", _delta("is.")),
    ("content_block_stop", {"type": "content_block_stop", "index": 0}),
    ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                       "usage": {**USAGE, "output_tokens": 2}}),
    ("message_stop", {"type": "message_stop"}),
]


class Upstream(http.server.ThreadingHTTPServer):
    """A loopback HTTP server standing for ``mlxkv serve``: a chunked SSE answer whose rest
    waits until ``release`` is set, a JSON answer with a length, a 400; it keeps the bodies
    it was sent."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.streamed: bool | None = None  # whether the client released the stream's rest
        self.received: list[tuple[str, bytes]] = []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                server.received.append((self.path, body))
                if self.path.startswith("/v1/messages?"):
                    self.send_response(200)
                    self.send_header("content-type", "text/event-stream")
                    self.send_header("x-mlxkv-cache", "matched=90/100; tier=ram; outcome=diverged; diverged_at=90")
                    self.send_header("transfer-encoding", "chunked")
                    self.end_headers()
                    for i, (name, data) in enumerate(SSE_EVENTS):
                        if i == 4:  # the client must have had the first events to release the rest
                            server.streamed = server.release.wait(30)
                        piece = f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()
                        for part in (piece[:7], piece[7:]):  # events split across chunks
                            self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
                            self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")
                    return
                status, data = (200, {"input_tokens": 100}) if "count_tokens" in self.path else \
                    (400, {"type": "error", "error": {"message": "bad"}})
                raw = json.dumps(data).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

        super().__init__(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"


@pytest.fixture
def upstream():
    server = Upstream()
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield server
    server.release.set()
    server.shutdown()
    server.server_close()


def test_proxy_streams_and_records(upstream):
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "é"}], "stream": True}
    with RecordingProxy(upstream.url) as proxy, httpx.Client(timeout=30) as client:
        proxy.label = "step 1"
        with client.stream("POST", proxy.url + "/v1/messages?beta=true", json=body,
                           headers={"x-api-key": "x"}) as r:
            assert r.status_code == 200 and r.headers["x-mlxkv-cache"].startswith("matched=90/100")
            lines = r.iter_lines()
            seen = []
            while len(seen) < 4:  # the first events arrive while the server holds back the rest
                line = next(lines)
                if line.startswith("data: "):
                    seen.append(json.loads(line[6:])["type"])
            upstream.release.set()
            rest = [json.loads(ln[6:])["type"] for ln in lines if ln.startswith("data: ")]
        assert upstream.streamed and seen + rest == [name for name, _ in SSE_EVENTS]
        proxy.label = "step 2"
        assert client.post(proxy.url + "/v1/messages/count_tokens?beta=true", json=body).json() == {"input_tokens": 100}
        bad = client.post(proxy.url + "/v1/messages", content=b"{not json")
        assert bad.status_code == 400 and bad.json()["error"]["message"] == "bad"
        stream, count, refused = proxy.exchanges
    # what reached the server is what the client sent
    assert [p for p, _ in upstream.received] == ["/v1/messages?beta=true", "/v1/messages/count_tokens?beta=true",
                                                 "/v1/messages"]
    assert json.loads(upstream.received[0][1]) == body and upstream.received[2][1] == b"{not json"
    # the record
    assert (stream.label, stream.method, stream.route, stream.status) == ("step 1", "POST", "/v1/messages", 200)
    assert stream.json_body() == body and stream.request_headers["x-api-key"] == "x"
    assert stream.is_sse() and [e.name for e in stream.sse_events()] == [name for name, _ in SSE_EVENTS]
    assert len(stream.chunks) > 1 and stream.ended >= stream.chunks[-1][0]
    assert cache_header(stream) == {"matched": "90/100", "tier": "ram", "outcome": "diverged", "diverged_at": "90"}
    assert usage_of(stream) == (100, 90) and reply_of(stream) == "Paris." and stop_of(stream) == "end_turn"
    saved = json.loads(json.dumps(stream.as_dict()))
    assert saved["response"] == stream.response_bytes().decode() and json.loads(saved["body"]) == body
    # the first token is the first non-empty text, which came after the held-back events
    first_text = stream.sse_events()[4].at
    assert ttft_of(stream) == pytest.approx(first_text - stream.started)
    assert stream.sse_events()[3].at <= first_text
    assert (count.label, count.status, count.response_json()) == ("step 2", 200, {"input_tokens": 100})
    assert refused.status == 400 and refused.json_body() is None and refused.error is None


def test_proxy_answers_502_when_the_server_is_gone():
    with RecordingProxy("http://127.0.0.1:9") as proxy:  # the discard port: nothing listens
        r = httpx.post(proxy.url + "/v1/messages", json={}, timeout=30)
    assert r.status_code == 502 and "upstream" in r.json()["error"]["message"]
    assert proxy.exchanges[0].status is None and proxy.exchanges[0].error.startswith("upstream")


# ------------------------------------------------------------------------- opt-in: the agents
@pytest.mark.skipif(os.environ.get("MLXKV_TEST_AGENTS") != "1",
                    reason="runs real Claude Code and Codex CLI for minutes: set MLXKV_TEST_AGENTS=1")
@pytest.mark.skipif(REAL is None, reason="the real model is not fetched: run `make fixtures`")
def test_bench_agents_quick_run():
    from bench.agent_clients import AgentsMissing, ensure_agents

    try:
        ensure_agents(install=False)
    except AgentsMissing as e:
        pytest.skip(str(e))
    proc = subprocess.run([sys.executable, "-m", "bench.agents", "--quick", "--json", "--no-install"], cwd=ROOT,
                          capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["all_2xx"] and result["replies_shown"], result["failed_steps"]
    assert result["all_2xx_codex"] and result["replies_shown_codex"], result["failed_steps"]
    for key in ("new_conversation_hit_vs_ideal", "in_conversation_hit_fraction", "after_restart_hit_fraction",
                "in_conversation_hit_fraction_codex"):
        assert result[key] >= 0.95, (key, result[key], result["requests"])
    assert result["hit_ttft_vs_cold"] and result["claude_code_version"] == "2.1.332"
