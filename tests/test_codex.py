"""Codex CLI itself against ``mlxkv serve``: the pinned ``@openai/codex`` (installed into the
git-ignored ``.cache/agents`` by ``make agents``) runs ``codex exec`` non-interactively on the
real model through ``POST /v1/responses``, then resumes the conversation for a second turn.
Every request it makes must be answered 2xx, the reply it prints must be the model's, and the
second turn, which sends the whole history again, must find the first in the prefix cache.

Codex is configured in a private ``CODEX_HOME`` as ``bench.agents`` runs it
(``bench.agent_clients.CodexCli``): a local provider (``wire_api = "responses"``, no key, no
login), a one-line base prompt instead of its own several thousand tokens
(``model_instructions_file``), and its optional prompt sections and tools off, so that the
real model prefills it in seconds on a CPU. Its traffic anywhere but the server goes to a
proxy that is not there: the run needs no network.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from common import T
from server_support import LoopbackServer

from bench.agent_clients import CodexCli
from mlxkv.engine.engine import Engine
from mlxkv.server.context import ServerConfig
from support.real_model import real_model_path

ROOT = Path(__file__).resolve().parent.parent
CODEX_VERSION = "0.171.0"  # what `make agents` installs
CODEX = ROOT / ".cache" / "agents" / "node_modules" / ".bin" / "codex"
REAL = real_model_path()
RUN_S = 1800  # one `codex exec`: a cold prompt of ~1,500 tokens (12 min seen on two busy cores)


def _codex_version() -> str | None:
    if not CODEX.exists() or shutil.which("node") is None:
        return None
    r = subprocess.run([str(CODEX), "--version"], capture_output=True, text=True, timeout=60)
    return r.stdout.strip().rsplit(" ", 1)[-1] if r.returncode == 0 else None


VERSION = _codex_version()
pytestmark = [
    pytest.mark.skipif(REAL is None, reason="the real model is not fetched: run `make fixtures`"),
    pytest.mark.skipif(VERSION is None, reason="Codex CLI is not installed in .cache/agents "
                                               "(`make agents` installs the pinned version; it needs npm)"),
    pytest.mark.skipif(VERSION not in (None, CODEX_VERSION),
                       reason=f".cache/agents holds Codex {VERSION}, not the pinned {CODEX_VERSION}"),
]


class Recorder:
    """ASGI middleware: every request's method, path, status and response body."""

    def __init__(self, app: Any):
        self.app = app
        self.calls: list[dict[str, Any]] = []

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        call: dict[str, Any] = {"method": scope["method"], "path": scope["path"], "status": None,
                                "body": bytearray()}
        self.calls.append(call)

        async def record(message: dict) -> None:
            if message["type"] == "http.response.start":
                call["status"] = message["status"]
            elif message["type"] == "http.response.body":
                call["body"] += message.get("body", b"")
            await send(message)
        await self.app(scope, receive, record)


def _final_response(body: bytes) -> dict[str, Any]:
    """The response object of a streamed /v1/responses answer's last event."""
    events = [json.loads(line[6:]) for line in body.decode().splitlines() if line.startswith("data: ")]
    assert events and events[-1]["type"] in ("response.completed", "response.incomplete"), events[-1:]
    return events[-1]["response"]


def _codex(codex: CodexCli, project: Path, prompt: str, thread: str | None = None) -> list[dict[str, Any]]:
    """``codex exec --json PROMPT`` (or ``exec resume THREAD PROMPT``) and its JSONL events."""
    r = codex.run(project, prompt, RUN_S, thread)
    assert r.returncode == 0, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    return CodexCli.events(r)


def _reply(events: list[dict[str, Any]]) -> str:
    texts = [e["item"]["text"] for e in events
             if e.get("type") == "item.completed" and e["item"].get("type") == "agent_message"]
    assert texts, events
    return texts[-1]


def test_codex_exec_and_resume_against_the_real_model(tmp_path):
    from mlxkv.engine.cache.prefix_cache import PrefixCache

    home, project = tmp_path / "codex-home", tmp_path / "project"
    home.mkdir()
    project.mkdir()
    recorder: Recorder | None = None

    def wrap(app: Any) -> Recorder:
        nonlocal recorder
        recorder = Recorder(app)
        return recorder

    cache = PrefixCache(ram_bytes=256 << 20, cache_dir=None, block_tokens=16)
    with Engine(str(REAL), prefix_cache=cache).start(timeout=T) as engine, \
            LoopbackServer(engine, ServerConfig(), wrap=wrap) as srv:
        codex = CodexCli(home, f"http://127.0.0.1:{srv.port}")
        first = _codex(codex, project, "What is the capital of France? Answer in one word.")
        turn1 = [c for c in recorder.calls if c["path"] == "/v1/responses"]
        thread = next(e["thread_id"] for e in first if e.get("type") == "thread.started")
        second = _codex(codex, project, "And of Italy? One word.", thread)
    calls = recorder.calls
    assert calls and all(c["status"] is not None and 200 <= c["status"] < 300 for c in calls), \
        [(c["method"], c["path"], c["status"], bytes(c["body"][:300])) for c in calls]
    turn2 = [c for c in calls if c["path"] == "/v1/responses"][len(turn1):]
    assert turn1 and turn2
    # each answer ended with response.completed: Codex retried nothing
    assert all(_final_response(bytes(c["body"]))["status"] == "completed" for c in turn1 + turn2)
    # what Codex shows is what the model wrote
    for events, turn in ((first, turn1), (second, turn2)):
        final = _final_response(bytes(turn[-1]["body"]))
        written = "".join(p["text"] for o in final["output"] if o["type"] == "message" for p in o["content"])
        assert _reply(events).strip() == written.strip() and written.strip()
    # the second turn resends the first: its prompt is found in the prefix cache
    u1 = _final_response(bytes(turn1[-1]["body"]))["usage"]
    u2 = _final_response(bytes(turn2[0]["body"]))["usage"]
    assert u2["input_tokens_details"]["cached_tokens"] >= u1["input_tokens"], (u1, u2)
    usage = next(e["usage"] for e in second if e.get("type") == "turn.completed")
    assert usage["cached_input_tokens"] >= u2["input_tokens_details"]["cached_tokens"]
