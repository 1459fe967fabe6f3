"""`mlxkv serve` as a user runs it: a process on a loopback port. Under load (200 requests
from 16 clients, twice, after a warm-up run) it answers everything and its RSS stays put;
on SIGTERM it finishes the reply in flight, flushes the prefix cache to disk and exits 0."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys

from common import T

from bench.server import Served, http_client, load_run
from mlxkv.server.run import is_loopback, warn_if_open

httpx = http_client()
KEY = "cli-key"


def test_serve_under_load_then_drains_and_flushes_on_sigterm(tiny_qwen3, tmp_path):
    srv = Served("mlxkv", tiny_qwen3, tmp_path, extra=("--api-key", KEY, "--max-tokens", "4")).start(timeout=T)
    auth = {"authorization": f"Bearer {KEY}"}
    try:
        # warm-up: mlx's allocator settles its cache of freed buffers over the first run
        load_run(srv.url, 200, 16, 4, headers=auth)
        rss = []
        for _ in range(2):
            run = load_run(srv.url, 200, 16, 4, headers=auth)
            assert (run["requests"], run["errors"]) == (200, 0), run["first_errors"]
            rss.append(srv.rss_bytes())
        assert rss[1] <= rss[0] * 1.10, [r / 2**20 for r in rss]

        # SIGTERM while a reply streams: the reply is finished, then the cache flushed
        body = {"model": "m", "messages": [{"role": "user", "content": "drain me"}], "max_tokens": 200,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, headers=auth, timeout=T) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            srv.proc.terminate()
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        usage = json.loads(rest[-2][6:])["usage"]
        assert usage["completion_tokens"] == 200
    finally:
        srv.stop(timeout=T)
    assert srv.returncode == 0
    log = (tmp_path / "mlxkv.log").read_text()
    assert "prefix cache flushed" in log and "Traceback" not in log
    assert "without the SSD tier" not in log
    # one access line per request: route, status, token counts, cache outcome; no text, no key
    access = [line for line in log.splitlines() if " /v1/chat/completions " in line]
    assert len(access) >= 601 and all(" 200 " in line and "prompt=" in line and "cache=" in line
                                      for line in access), access[:3]
    assert "drain me" not in log and KEY not in log
    assert sum(1 for p in (tmp_path / "kv").rglob("*") if p.is_file()) > 2  # states on disk


def test_a_port_in_use_fails_before_the_model_loads(tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "mlxkv", "serve", "--port", str(port),
                            "--model", str(tmp_path / "no-such-model")], capture_output=True, text=True,
                           timeout=T, env={**os.environ, "XDG_CONFIG_HOME": str(tmp_path)})
    assert r.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in r.stderr and "Traceback" not in r.stderr


def test_an_open_address_without_a_key_warns(caplog):
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.4")
    with caplog.at_level(logging.WARNING, logger="mlxkv.server"):
        warn_if_open("127.0.0.1", None)
        warn_if_open("0.0.0.0", "a key")
        assert not caplog.records
        warn_if_open("0.0.0.0", None)
    assert "without --api-key" in caplog.records[0].getMessage()
