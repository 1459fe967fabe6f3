"""`mlxkv serve` left running under agents' traffic, then killed at bad moments.

    python -m bench.soak [--minutes 60] [--kills N] [--ooms N] [--stop-s S] [--json] [--check]

Soak: a real `mlxkv serve` process on the real model (the float32 folder of the GGUF
fixture, as the other benchmarks serve it) and a RAM tier
that holds about a thousand tokens, so states go to the SSD tier and are evicted from RAM
all the time. Two clients replay agent-shaped traffic: conversations that grow turn by turn
over a shared system prompt (Claude Code's shape on /v1/messages, Codex's on
/v1/chat/completions), a new conversation every few turns, an opencode-style title request
beside some turns, and streams the client drops after a few events. Halfway, `mlxkv cache
gc` runs on the live folder and the server flushes. Every ``period`` seconds it records the
server's RSS, open files and threads, MLX's memory, the tiers' bytes, and each request's
TTFT; the figures:

- ``soak_errors``: requests that failed (a dropped stream is not one);
- ``soak_rss_growth``, ``soak_mlx_memory_growth``: the last sample over the one at the
  end of the first sixth of the run (the first 10 of 60 minutes), minus one;
- ``soak_hit_ttft_drift``: p95 TTFT of cache hits in the last sixth over the first sixth.

The soak's samples also hold each compiled function's traces (``engine.stats()["compiled"]``:
MLX keeps one per input shape, and the engine bounds them), shown as
``soak_compiled_traces`` (at the end of the first sixth, at the end).

Then the disasters (:class:`Disasters`), each followed by a restart on the same folder timed
until it answers (``restart_to_serving_s``): ``--kills`` SIGKILLs at random moments of
traffic (in a prefill, a decode, a flush or a gc; default 20 for 60 minutes and
proportionally fewer), ``--ooms`` OOM kills while the server writes to the SSD tier (its
memory cgroup's limit set just above what it uses: the kernel's OOM killer, as on a machine
out of memory; ``oom_kills`` says who killed it and how many writes were in flight), and one
SIGSTOP of ``--stop-s`` seconds that outlasts its clients' timeouts (``sigstop_*``: the
clients that gave up, how soon it answered after SIGCONT, how soon nothing was in flight).
Before each a conversation is answered cold and flushed. After each, `mlxkv cache verify`
must find every entry whole (``kill_damaged``: entries it found damaged), and the next start
must answer every flushed conversation from the cache with the same greedy tokens as its
first, cold answer (``kill_restore_mismatch``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.server import Served, http_client, text_of_tokens
from mlxkv.engine.blas import preload

preload()  # the system OpenBLAS before mlx.core

httpx = http_client()
ROOT = Path(__file__).resolve().parent.parent


def _proc(pid: int) -> dict[str, int]:
    status = Path(f"/proc/{pid}/status").read_text()
    rss = next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:"))
    return {"rss_bytes": rss, "open_files": len(os.listdir(f"/proc/{pid}/fd")),
            "threads": len(os.listdir(f"/proc/{pid}/task"))}


def p95(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.95 * len(xs)))] if xs else float("nan")


class Traffic:
    """Agent-shaped requests against ``url`` until ``stop`` is set; every request's record."""

    def __init__(self, url: str, system: str, words: list[str], seed: int, max_tokens: int = 12):
        self.url, self.system, self.words, self.max_tokens = url, system, words, max_tokens
        self.rng = random.Random(seed)
        self.records: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()

    def _say(self, n: int) -> str:
        return " ".join(self.rng.choices(self.words, k=n))

    def _record(self, **rec: Any) -> None:
        with self.lock:
            self.records.append({"t": time.time(), **rec})

    def chat(self, messages: list[dict], kind: str, max_tokens: int | None = None) -> str | None:
        body = {"model": "m", "messages": [{"role": "system", "content": self.system}, *messages],
                "max_tokens": max_tokens or self.max_tokens, "temperature": 0}
        try:
            r = httpx.post(self.url + "/v1/chat/completions", json=body, timeout=600)
            ok = r.status_code == 200
            out = r.json() if ok else {}
            t = out.get("timings") or {}
            self._record(kind=kind, route="chat", status=r.status_code, ttft_s=t.get("ttft_s"),
                         prompt=(out.get("usage") or {}).get("prompt_tokens"),
                         cached=((out.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens"))
            return out["choices"][0]["message"]["content"] if ok else None
        except Exception as e:  # noqa: BLE001  (a failure is a record, the soak goes on)
            if not self.stop.is_set():
                self._record(kind=kind, route="chat", status=0, error=f"{type(e).__name__}: {e}")
            return None

    def streamed(self, messages: list[dict], kind: str, anthropic: bool) -> str | None:
        """A streamed turn, as agents send them (Claude Code's on /v1/messages, Codex's on
        /v1/chat/completions): TTFT is the time to the first text event."""
        if anthropic:
            route, body = "/v1/messages", {"system": self.system, "messages": messages}
        else:
            route = "/v1/chat/completions"
            body = {"messages": [{"role": "system", "content": self.system}, *messages],
                    "stream_options": {"include_usage": True}}
        body.update(model="m", max_tokens=self.max_tokens, temperature=0, stream=True)
        text, ttft, prompt, cached, status = [], None, None, None, 0
        out_tokens = None  # from the usage events
        try:
            t0 = time.perf_counter()
            with httpx.stream("POST", self.url + route, json=body, timeout=600) as r:
                status = r.status_code
                for line in r.iter_lines():
                    if not line.startswith("data:") or line == "data: [DONE]":
                        continue
                    ev = json.loads(line[5:])
                    piece = ""
                    if anthropic:
                        if ev.get("type") == "message_start":
                            usage = ev["message"]["usage"]
                            cached = usage.get("cache_read_input_tokens", 0)
                            prompt = usage.get("input_tokens", 0) + cached
                        elif ev.get("type") == "message_delta":
                            out_tokens = (ev.get("usage") or {}).get("output_tokens", out_tokens)
                        elif ev.get("type") == "content_block_delta":
                            piece = ev["delta"].get("text", "")
                    else:
                        if ev.get("usage"):
                            prompt = ev["usage"]["prompt_tokens"]
                            cached = (ev["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                            out_tokens = ev["usage"].get("completion_tokens")
                        for ch in ev.get("choices") or []:
                            piece += (ch.get("delta") or {}).get("content") or ""
                    if piece and ttft is None:
                        ttft = time.perf_counter() - t0
                    text.append(piece)
            # output tokens over the whole request: a reply of a few tokens can come in one
            # speculative round, so a rate after the first token would be no rate at all
            total = time.perf_counter() - t0
            tps = out_tokens / total if out_tokens and ttft is not None else None
            self._record(kind=kind, route=route, status=status, ttft_s=ttft, prompt=prompt, cached=cached,
                         tps=tps)
            return "".join(text) if status == 200 else None
        except Exception as e:  # noqa: BLE001
            if not self.stop.is_set():
                self._record(kind=kind, route=route, status=0, error=f"{type(e).__name__}: {e}")
            return None

    def dropped_stream(self, messages: list[dict]) -> None:
        body = {"model": "m", "messages": [{"role": "system", "content": self.system}, *messages],
                "max_tokens": 64, "temperature": 0, "stream": True}
        try:
            with httpx.stream("POST", self.url + "/v1/chat/completions", json=body, timeout=600) as r:
                for i, _ in enumerate(r.iter_lines()):
                    if i >= 3:
                        break
            self._record(kind="dropped", route="chat", status=r.status_code)
        except Exception as e:  # noqa: BLE001
            if not self.stop.is_set():
                self._record(kind="dropped", route="chat", status=0, error=f"{type(e).__name__}: {e}")

    def run(self, use_messages: bool) -> None:
        """Conversations of 3-8 turns, one after another, until stopped."""
        while not self.stop.is_set():
            history: list[dict] = []
            for _ in range(self.rng.randint(3, 8)):
                if self.stop.is_set():
                    return
                history.append({"role": "user", "content": self._say(self.rng.randint(20, 80))})
                roll = self.rng.random()
                if roll < 0.1:
                    self.dropped_stream(history)
                    history.pop()
                    continue
                title = None
                if roll < 0.35:  # a title request beside the turn, as opencode sends one
                    first = history[0]["content"][:200]
                    title = threading.Thread(target=self.chat, args=(
                        [{"role": "user", "content": f"Title for: {first}"}], "title", 6))
                    title.start()
                reply = self.streamed(history, "main", anthropic=use_messages)
                if title is not None:
                    title.join()
                if reply is None:
                    break
                history.append({"role": "assistant", "content": reply})


def soak(model: Path, work: Path, minutes: float, log: Any) -> dict[str, Any]:
    srv = Served("mlxkv", model, work, extra=("--ram-cache-bytes", "48MiB", "--spec", "auto",
                                             "--max-tokens", "12", "--quiet")).start(timeout=600)
    system = text_of_tokens(model, 1200, seed=1)
    words = text_of_tokens(model, 400, seed=2).split()
    traffic = [Traffic(srv.url, system, words, seed=10 + i) for i in range(2)]
    threads = [threading.Thread(target=t.run, args=(i == 0,), daemon=True) for i, t in enumerate(traffic)]
    total_s = minutes * 60
    period = max(5.0, total_s / 60)
    samples: list[dict[str, Any]] = []
    started, wall = time.monotonic(), time.time()
    middle_done = False
    try:
        for th in threads:
            th.start()
        while (now := time.monotonic() - started) < total_s:
            stats = httpx.get(srv.url + "/stats", timeout=60).json()
            since = [r for t in traffic for r in list(t.records) if r["t"] > wall]
            wall = time.time()
            cache, memory = stats.get("cache") or {}, stats["engine"].get("memory") or {}
            samples.append({"t": now, **_proc(srv.proc.pid),
                            "mlx_bytes": memory.get("mlx_active_bytes", 0) + memory.get("mlx_cache_bytes", 0),
                            "ram_tier_bytes": cache.get("ram_bytes"), "ssd_tier_bytes": cache.get("ssd_bytes"),
                            "compiled": stats["engine"].get("compiled") or {},
                            **_percentiles(since)})
            if not middle_done and now >= total_s / 2:
                middle_done = True
                gc = subprocess.run([sys.executable, "-m", "mlxkv", "cache", "gc", "--min-age", "30", "--cache-dir",
                                     str(work / "kv")], capture_output=True, text=True, cwd=ROOT, timeout=600)
                flushed = httpx.post(srv.url + "/admin/cache/flush", timeout=600).status_code
                log(f"soak: gc exit {gc.returncode}, flush {flushed} at {now / 60:.1f} min")
                samples[-1]["gc_exit"], samples[-1]["flush_status"] = gc.returncode, flushed
            time.sleep(period)
    finally:
        for t in traffic:
            t.stop.set()
        for th in threads:
            th.join(120)
        srv.stop(timeout=120)
    records = [r for t in traffic for r in t.records]
    errors = [r for r in records if r["status"] != 200]
    sixth = total_s / 6
    t0 = min((r["t"] for r in records), default=0.0)
    hits = [r for r in records if r["kind"] == "main" and r.get("cached") and r.get("ttft_s") is not None]
    first = [r["ttft_s"] for r in hits if r["t"] - t0 <= sixth]
    last = [r["ttft_s"] for r in hits if r["t"] - t0 >= total_s - sixth]
    base = next((s for s in samples if s["t"] >= sixth), samples[0])
    end = samples[-1]
    out = {"soak_minutes": minutes, "soak_requests": len(records), "soak_errors": len(errors),
           "soak_error_examples": [r.get("error") or r["status"] for r in errors[:5]],
           "soak_rss_growth": end["rss_bytes"] / base["rss_bytes"] - 1,
           "soak_mlx_memory_growth": (end["mlx_bytes"] / base["mlx_bytes"] - 1) if base["mlx_bytes"] else None,
           "soak_open_files": [base["open_files"], end["open_files"]],
           "soak_threads": [base["threads"], end["threads"]],
           "soak_hit_ttft_p95_first_s": p95(first), "soak_hit_ttft_p95_last_s": p95(last),
           "soak_hit_ttft_drift": p95(last) / p95(first) if first and last else None,
           # each compiled function's traces at the end of the first sixth and at the end
           "soak_compiled_traces": {name: [base["compiled"].get(name, {}).get("traces", 0), f["traces"]]
                                    for name, f in end["compiled"].items()},
           "soak_compiled_limit_resets": {name: f["resets"] for name, f in end["compiled"].items()},
           "soak_server_exit": srv.returncode, "soak_samples": samples}
    log(f"soak: {len(records)} requests, {len(errors)} errors; RSS {base['rss_bytes'] / 2**20:.0f} -> "
        f"{end['rss_bytes'] / 2**20:.0f} MiB ({out['soak_rss_growth']:+.1%}); MLX {base['mlx_bytes'] / 2**20:.0f} -> "
        f"{end['mlx_bytes'] / 2**20:.0f} MiB; files {base['open_files']} -> {end['open_files']}; threads "
        f"{base['threads']} -> {end['threads']}; hit TTFT p95 {p95(first):.2f} -> {p95(last):.2f} s")
    return out


def _percentiles(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The requests since the last sample: how many, failed, TTFT p50/p95 and the p50 of
    output tokens per second of whole streamed requests (TTFT included)."""
    ttft = sorted(r["ttft_s"] for r in records if r.get("ttft_s") is not None)
    tps = sorted(r["tps"] for r in records if r.get("tps"))
    return {"requests": len(records), "errors": sum(r["status"] != 200 for r in records),
            "ttft_p50_s": ttft[len(ttft) // 2] if ttft else None, "ttft_p95_s": p95(ttft) if ttft else None,
            "request_tps_p50": tps[len(tps) // 2] if tps else None}


def _answer(url: str, prompt: str, timeout: float = 600) -> tuple[str, int]:
    body = {"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": 8, "temperature": 0}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=timeout)
    r.raise_for_status()
    out = r.json()
    return out["choices"][0]["message"]["content"], out["usage"]["prompt_tokens_details"]["cached_tokens"]


class MemoryLimit:
    """A memory cgroup of this bench's own (cgroup v2, else v1), for an OOM kill the way the
    kernel makes one: the server is started in it, and its limit is later set just above
    what it uses, so the kernel's OOM killer ends it at an allocation. None from
    :meth:`make` where no memory cgroup can be made here."""

    def __init__(self, path: Path, v2: bool):
        self.path, self.v2 = path, v2

    @classmethod
    def make(cls) -> MemoryLimit | None:
        name = f"mlxkv-soak-{os.getpid()}"
        for root, v2 in ((Path("/sys/fs/cgroup"), True), (Path("/sys/fs/cgroup/unified"), True),
                         (Path("/sys/fs/cgroup/memory"), False)):
            if v2 and "memory" not in _read(root / "cgroup.controllers").split():
                continue
            if not v2 and not (root / "memory.limit_in_bytes").exists():
                continue
            try:
                (root / name).mkdir(exist_ok=True)
                return cls(root / name, v2)
            except OSError:
                continue
        return None

    def _file(self, v2: str, v1: str) -> Path:
        return self.path / (v2 if self.v2 else v1)

    def enter(self) -> None:  # in the child, before it runs the server
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def usage(self) -> int:
        return int(_read(self._file("memory.current", "memory.usage_in_bytes")))

    def limit(self, nbytes: int | None) -> None:
        value = ("max" if self.v2 else "-1") if nbytes is None else str(nbytes)
        self._file("memory.max", "memory.limit_in_bytes").write_text(value)

    def oom_kills(self) -> int:
        text = _read(self._file("memory.events", "memory.oom_control"))
        return next((int(line.split()[1]) for line in text.splitlines() if line.startswith("oom_kill ")), 0)

    def remove(self) -> None:
        try:
            self.limit(None)
            self.path.rmdir()
        except OSError:
            pass


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _temps(folder: Path) -> int:
    """Write temp files in the cache folder: writes a process was in when it died."""
    return sum(1 for _, _, files in os.walk(folder) for f in files if f.endswith(".tmp"))


class Disasters:
    """Restarts of `mlxkv serve` on one cache folder, each after a disaster: a SIGKILL at a
    random moment (in a prefill, a decode, a flush or a gc), an OOM kill while it writes to
    the SSD tier, or a SIGSTOP that outlasts its clients' timeouts. Before each, a
    conversation is answered cold and flushed; after each, `mlxkv cache verify` must find
    every entry whole, and the next start must be serving within seconds and answer every
    flushed conversation from the cache with its first, cold tokens."""

    EXTRA = ("--ram-cache-bytes", "48MiB", "--spec", "off", "--quiet")

    def __init__(self, model: Path, work: Path, log: Any, seed: int = 3):
        self.model, self.work, self.log = model, work, log
        self.rng = random.Random(seed)
        self.words = text_of_tokens(model, 400, seed=4).split()
        self.flushed: dict[str, str] = {}  # prompt -> its cold answer
        self.restarts: list[float] = []
        self.moments: list[str] = []
        self.damaged = self.mismatched = self.restored = self.checked = 0
        self.out: dict[str, Any] = {}

    def _say(self, lo: int, hi: int) -> str:
        return " ".join(self.rng.choices(self.words, k=self.rng.randint(lo, hi)))

    def start(self, cgroup: MemoryLimit | None = None) -> Served:
        """A server on the folder, timed until it answers; then every flushed conversation."""
        t0 = time.monotonic()
        srv = Served("mlxkv", self.model, self.work, extra=self.EXTRA,
                     preexec=cgroup.enter if cgroup is not None else None).start(timeout=600)
        _answer(srv.url, "Are you serving?")
        self.restarts.append(time.monotonic() - t0)
        for prompt, cold in list(self.flushed.items()):
            again, cached = _answer(srv.url, prompt)
            self.checked += 1
            self.restored += cached > 0
            if again != cold:
                self.mismatched += 1
                self.log(f"kills: restored answer differs: {cold!r} != {again!r}")
        return srv

    def remember(self, srv: Served) -> None:
        """One more conversation answered cold and flushed: it must come back after the disaster."""
        prompt = self._say(150, 400)
        cold, _ = _answer(srv.url, prompt)
        httpx.post(srv.url + "/admin/cache/flush", timeout=600).raise_for_status()
        self.flushed[prompt] = cold

    def verify(self, moment: str) -> None:
        verify = subprocess.run([sys.executable, "-m", "mlxkv", "cache", "verify", "--json", "--cache-dir",
                                 str(self.work / "kv")], capture_output=True, text=True, cwd=ROOT, timeout=600)
        report = json.loads(verify.stdout or "{}")
        bad = sum(v["corrupt"] + v["missing"] + v["manifests_damaged"] + len(v["learned_damaged"])
                  for v in report.values())
        self.damaged += bad
        self.moments.append(moment)
        self.log(f"kills: {len(self.moments)} during {moment}: verify exit {verify.returncode}, {bad} damaged")

    def kill(self, srv: Served) -> None:
        """SIGKILL at a random moment of traffic."""
        moment = self.rng.choice(["prefill", "decode", "flush", "gc"])
        go = _background(_answer, srv.url, self._say(600, 600))
        if moment == "prefill":
            time.sleep(self.rng.uniform(0.2, 1.5))
        elif moment == "decode":
            time.sleep(self.rng.uniform(2.0, 5.0))
        elif moment == "flush":
            _background(httpx.post, srv.url + "/admin/cache/flush", timeout=60)
            time.sleep(self.rng.uniform(0.0, 0.3))
        else:
            subprocess.Popen([sys.executable, "-m", "mlxkv", "cache", "gc", "--min-age", "0", "--cache-dir",
                              str(self.work / "kv")], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(self.rng.uniform(0.0, 0.5))
        srv.proc.send_signal(signal.SIGKILL)
        srv.proc.wait(60)
        go.join(60)
        srv.stop()
        self.verify(moment)

    def oom(self, srv: Served, cgroup: MemoryLimit | None) -> None:
        """Out of memory while writing: a long conversation is answered and flushed, and once
        a write's temp file shows up in the folder the server's memory cgroup is held to
        what it uses plus a few MiB, so the kernel kills it at its next allocations (with no
        cgroup, SIGKILL the moment its RSS passes that mark)."""
        kv = self.work / "kv"
        go = _background(self._long_and_flush, srv.url)
        deadline = time.monotonic() + 300
        while not _temps(kv) and go.is_alive() and time.monotonic() < deadline:
            time.sleep(0.002)
        writing = _temps(kv)
        headroom = self.rng.randint(1, 8) << 20
        before = cgroup.oom_kills() if cgroup is not None else 0
        if cgroup is not None:
            cgroup.limit(cgroup.usage() + headroom)
        else:
            mark = srv.rss_bytes() + headroom
        deadline = time.monotonic() + 120
        while srv.proc.poll() is None and time.monotonic() < deadline:
            if cgroup is None and srv.rss_bytes() >= mark:
                break
            if not go.is_alive():  # the write was over before it was seen: make it allocate again
                go = _background(self._long_and_flush, srv.url)
            time.sleep(0.001)
        by_kernel = cgroup is not None and cgroup.oom_kills() > before
        if srv.proc.poll() is None:  # it did not allocate past the mark: kill it there
            srv.proc.send_signal(signal.SIGKILL)
            srv.proc.wait(60)
        left = _temps(kv)
        if cgroup is not None:
            cgroup.limit(None)
        go.join(60)
        srv.stop()
        self.out.setdefault("oom_kills", []).append(
            {"by_kernel": by_kernel, "exit": srv.returncode, "writing_when_limited": writing,
             "temp_files_left": left, "headroom_mib": headroom >> 20})
        self.log(f"oom: {'the kernel' if by_kernel else 'SIGKILL'} ended the server (exit {srv.returncode}), "
                 f"{writing} writes in flight when limited, {left} temp files left")
        self.verify("oom")

    def _long_and_flush(self, url: str) -> None:
        _answer(url, self._say(2000, 2500))
        httpx.post(url + "/admin/cache/flush", timeout=600)

    def stopped(self, srv: Served, stop_s: float) -> None:
        """SIGSTOP for ``stop_s`` under traffic: clients time out; after SIGCONT the server
        must answer a new request promptly and settle every abandoned one."""
        long = _background(_answer, srv.url, self._say(1500, 1500), timeout=min(10.0, stop_s / 2))
        time.sleep(self.rng.uniform(0.3, 1.0))
        srv.proc.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        timeouts = 0
        for _ in range(3):  # new clients while it is stopped: each gives up
            try:
                _answer(srv.url, self._say(20, 40), timeout=min(5.0, stop_s / 3))
            except httpx.TimeoutException:
                timeouts += 1
        long.join()
        time.sleep(max(0.0, stop_s - (time.monotonic() - t0)))
        srv.proc.send_signal(signal.SIGCONT)
        t1 = time.monotonic()
        _answer(srv.url, "Are you back?", timeout=120)
        recover = time.monotonic() - t1
        while httpx.get(srv.url + "/stats", timeout=60).json()["engine"].get("active") and \
                time.monotonic() - t1 < 120:
            time.sleep(0.1)
        settled = time.monotonic() - t1
        self.out.update(sigstop_s=stop_s, sigstop_client_timeouts=timeouts, sigstop_recover_s=recover,
                        sigstop_settled_s=settled)
        self.log(f"sigstop: {stop_s:.0f} s stopped, {timeouts} of 3 new clients timed out; answering "
                 f"{recover:.2f} s after SIGCONT, nothing in flight after {settled:.2f} s")
        self.remember(srv)
        srv.stop(timeout=120)
        self.verify("sigstop")

    def figures(self) -> dict[str, Any]:
        n = len(self.moments)
        return {**self.out, "kill_restarts": n, "kill_moments": self.moments, "kill_damaged": self.damaged,
                "kill_restore_mismatch": self.mismatched, "kill_restored": self.restored,
                "kill_restores_checked": self.checked,
                "restart_to_serving_s": max(self.restarts),
                "restart_to_serving_s_median": statistics.median(self.restarts)}


def kills(model: Path, work: Path, n: int, log: Any, ooms: int = 1, stop_s: float = 60.0) -> dict[str, Any]:
    """``n`` SIGKILLs, ``ooms`` OOM kills and one SIGSTOP of ``stop_s``, in a shuffled order,
    each followed by a restart on the same folder (:class:`Disasters`)."""
    d = Disasters(model, work, log)
    plan = ["kill"] * n + ["oom"] * ooms + ["sigstop"]
    d.rng.shuffle(plan)
    cgroup = MemoryLimit.make() if ooms else None
    try:
        for what in plan:
            srv = d.start(cgroup if what == "oom" else None)
            d.remember(srv)
            if what == "kill":
                d.kill(srv)
            elif what == "oom":
                d.oom(srv, cgroup)
            else:
                d.stopped(srv, stop_s)
        d.start().stop(timeout=120)  # the last restart: every flushed conversation once more
    finally:
        if cgroup is not None:
            cgroup.remove()
    out = {**d.figures(), "oom_limit": "cgroup " + ("v2" if cgroup.v2 else "v1") if cgroup else "rss watch"}
    log(f"kills: {out['kill_restarts']} disasters, {out['kill_damaged']} damaged, {out['kill_restore_mismatch']} "
        f"restores differing of {out['kill_restores_checked']} ({out['kill_restored']} from the cache); serving "
        f"{out['restart_to_serving_s_median']:.1f} s after a start (at most {out['restart_to_serving_s']:.1f} s)")
    return out


def _quietly(fn: Any, *args: Any, **kw: Any) -> None:
    try:
        fn(*args, **kw)
    except Exception:  # noqa: BLE001  (the server is being killed under it)
        pass


def _background(fn: Any, *args: Any, **kw: Any) -> threading.Thread:
    """``fn(*args, **kw)`` on a daemon thread, started, its failure ignored (:func:`_quietly`)."""
    th = threading.Thread(target=_quietly, args=(fn, *args), kwargs=kw, daemon=True)
    th.start()
    return th


def main(argv: list[str] | None = None) -> int:
    from bench.models import real_model_folder

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument("--kills", type=int, default=None, help="SIGKILLs; default: 20 per 60 minutes, at least 1")
    ap.add_argument("--ooms", type=int, default=None, help="OOM kills; default: one per 5 SIGKILLs, at least 1")
    ap.add_argument("--stop-s", type=float, default=None,
                    help="how long the SIGSTOP lasts; default: a second per minute of soak, 10 to 60")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--keep", type=Path, default=None, help="work in this folder and keep it (servers' logs, caches)")
    ap.add_argument("--check", action="store_true",
                    help="exit 1 unless no request failed, nothing was damaged and every restore matched "
                         "(the short form CI runs)")
    args = ap.parse_args(argv)
    model = real_model_folder()  # the GGUF's float32 folder, as the other benchmarks serve it
    n = args.kills if args.kills is not None else max(1, round(20 * args.minutes / 60))
    ooms = args.ooms if args.ooms is not None else max(1, n // 5)
    stop_s = args.stop_s if args.stop_s is not None else min(60.0, max(10.0, args.minutes))

    def log(msg: str) -> None:
        print(f"bench.soak: {msg}", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="mlxkv-soak-") as tmp:
        work = args.keep or Path(tmp)
        (work / "soak").mkdir(parents=True)
        (work / "kills").mkdir()
        out: dict[str, Any] = {"model": str(model), "load_avg_start": os.getloadavg()[0]}
        out.update(soak(model, work / "soak", args.minutes, log))
        out.update(kills(model, work / "kills", n, log, ooms=ooms, stop_s=stop_s))
        out["load_avg_end"] = os.getloadavg()[0]
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for key in ("soak_errors", "soak_rss_growth", "soak_mlx_memory_growth", "soak_hit_ttft_drift",
                    "soak_compiled_traces", "kill_restarts", "kill_damaged", "kill_restore_mismatch",
                    "restart_to_serving_s", "oom_kills", "sigstop_recover_s"):
            print(f"{key:<28} {out[key]}")
    failed = [k for k in ("soak_errors", "kill_damaged", "kill_restore_mismatch") if out[k]]
    if args.check and (failed or out["soak_server_exit"] != 0):
        print(f"bench.soak: FAILED: {', '.join(f'{k} {out[k]}' for k in failed) or 'the server exit'}; "
              f"{out['soak_error_examples']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
