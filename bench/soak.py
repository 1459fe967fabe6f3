"""`mlxkv serve` left running under agents' traffic, then killed at bad moments.

    python -m bench.soak [--minutes 60] [--kills N] [--json]

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

Kills (``--kills``, default 20 for 60 minutes and proportionally fewer): the server is
restarted on the same folder and timed until it answers (``restart_to_serving_s``); a
conversation is sent, the cache flushed, then traffic runs and the server is SIGKILLed at a
random moment (in a prefill, a decode, a flush or a gc). Then `mlxkv cache verify` must find
every entry whole (``kill_damaged``: entries it found damaged), and after the next restart
every flushed conversation must come back from the cache with the same greedy tokens as its
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
                        elif ev.get("type") == "content_block_delta":
                            piece = ev["delta"].get("text", "")
                    else:
                        if ev.get("usage"):
                            prompt = ev["usage"]["prompt_tokens"]
                            cached = (ev["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                        for ch in ev.get("choices") or []:
                            piece += (ch.get("delta") or {}).get("content") or ""
                    if piece and ttft is None:
                        ttft = time.perf_counter() - t0
                    text.append(piece)
            self._record(kind=kind, route=route, status=status, ttft_s=ttft, prompt=prompt, cached=cached)
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
    started = time.monotonic()
    middle_done = False
    try:
        for th in threads:
            th.start()
        while (now := time.monotonic() - started) < total_s:
            stats = httpx.get(srv.url + "/stats", timeout=60).json()
            cache, memory = stats.get("cache") or {}, stats["engine"].get("memory") or {}
            samples.append({"t": now, **_proc(srv.proc.pid),
                            "mlx_bytes": memory.get("mlx_active_bytes", 0) + memory.get("mlx_cache_bytes", 0),
                            "ram_tier_bytes": cache.get("ram_bytes"), "ssd_tier_bytes": cache.get("ssd_bytes")})
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
           "soak_server_exit": srv.returncode, "soak_samples": samples}
    log(f"soak: {len(records)} requests, {len(errors)} errors; RSS {base['rss_bytes'] / 2**20:.0f} -> "
        f"{end['rss_bytes'] / 2**20:.0f} MiB ({out['soak_rss_growth']:+.1%}); MLX {base['mlx_bytes'] / 2**20:.0f} -> "
        f"{end['mlx_bytes'] / 2**20:.0f} MiB; files {base['open_files']} -> {end['open_files']}; threads "
        f"{base['threads']} -> {end['threads']}; hit TTFT p95 {p95(first):.2f} -> {p95(last):.2f} s")
    return out


def _answer(url: str, prompt: str) -> tuple[str, int]:
    body = {"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": 8, "temperature": 0}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
    r.raise_for_status()
    out = r.json()
    return out["choices"][0]["message"]["content"], out["usage"]["prompt_tokens_details"]["cached_tokens"]


def kills(model: Path, work: Path, n: int, log: Any, seed: int = 3) -> dict[str, Any]:
    rng = random.Random(seed)
    words = text_of_tokens(model, 400, seed=4).split()
    flushed: dict[str, str] = {}  # prompt -> its cold answer
    restarts, damaged, mismatched, restored, moments = [], 0, 0, 0, []
    extra = ("--ram-cache-bytes", "48MiB", "--spec", "off", "--quiet")
    for k in range(n + 1):
        t0 = time.monotonic()
        srv = Served("mlxkv", model, work, extra=extra).start(timeout=600)
        probe = "Are you serving?"
        _answer(srv.url, probe)
        restarts.append(time.monotonic() - t0)
        for prompt, cold in list(flushed.items()):  # every flushed conversation, from the cache
            again, cached = _answer(srv.url, prompt)
            restored += cached > 0
            if again != cold:
                mismatched += 1
                log(f"kills: restored answer differs: {cold!r} != {again!r}")
        if k == n:
            srv.stop(timeout=120)
            break
        prompt = " ".join(rng.choices(words, k=rng.randint(150, 400)))
        cold, _ = _answer(srv.url, prompt)
        httpx.post(srv.url + "/admin/cache/flush", timeout=600)
        flushed[prompt] = cold
        moment = rng.choice(["prefill", "decode", "flush", "gc"])
        other = " ".join(rng.choices(words, k=600))
        go = threading.Thread(target=_quietly, args=(_answer, srv.url, other), daemon=True)
        go.start()
        if moment == "prefill":
            time.sleep(rng.uniform(0.2, 1.5))
        elif moment == "decode":
            time.sleep(rng.uniform(2.0, 5.0))
        elif moment == "flush":
            threading.Thread(target=_quietly, args=(httpx.post, srv.url + "/admin/cache/flush"),
                             kwargs={"timeout": 60}, daemon=True).start()
            time.sleep(rng.uniform(0.0, 0.3))
        else:
            subprocess.Popen([sys.executable, "-m", "mlxkv", "cache", "gc", "--min-age", "0", "--cache-dir",
                              str(work / "kv")], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(rng.uniform(0.0, 0.5))
        srv.proc.send_signal(signal.SIGKILL)
        srv.proc.wait(60)
        moments.append(moment)
        go.join(60)
        verify = subprocess.run([sys.executable, "-m", "mlxkv", "cache", "verify", "--json", "--cache-dir",
                                 str(work / "kv")], capture_output=True, text=True, cwd=ROOT, timeout=600)
        report = json.loads(verify.stdout or "{}")
        bad = sum(v["corrupt"] + v["missing"] + v["manifests_damaged"] + len(v["learned_damaged"])
                  for v in report.values())
        damaged += bad
        log(f"kills: {k + 1}/{n} during {moment}: verify exit {verify.returncode}, {bad} damaged")
    out = {"kill_restarts": n, "kill_moments": moments, "kill_damaged": damaged,
           "kill_restore_mismatch": mismatched, "kill_restored": restored,
           "kill_restores_checked": sum(range(n + 1)),
           "restart_to_serving_s": max(restarts), "restart_to_serving_s_median": statistics.median(restarts)}
    log(f"kills: {n} kills, {damaged} damaged, {mismatched} restores differing of {out['kill_restores_checked']} "
        f"({restored} from the cache); serving {out['restart_to_serving_s_median']:.1f} s after a start "
        f"(at most {out['restart_to_serving_s']:.1f} s)")
    return out


def _quietly(fn: Any, *args: Any, **kw: Any) -> None:
    try:
        fn(*args, **kw)
    except Exception:  # noqa: BLE001  (the server is being killed under it)
        pass


def main(argv: list[str] | None = None) -> int:
    from bench.models import real_model_folder

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument("--kills", type=int, default=None, help="default: 20 per 60 minutes, at least 1")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--check", action="store_true",
                    help="exit 1 unless no request failed, nothing was damaged and every restore matched "
                         "(the short form CI runs)")
    args = ap.parse_args(argv)
    model = real_model_folder()  # the GGUF's float32 folder, as the other benchmarks serve it
    n = args.kills if args.kills is not None else max(1, round(20 * args.minutes / 60))

    def log(msg: str) -> None:
        print(f"bench.soak: {msg}", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="mlxkv-soak-") as tmp:
        work = Path(tmp)
        (work / "soak").mkdir()
        (work / "kills").mkdir()
        out: dict[str, Any] = {"model": str(model), "load_avg_start": os.getloadavg()[0]}
        out.update(soak(model, work / "soak", args.minutes, log))
        out.update(kills(model, work / "kills", n, log))
        out["load_avg_end"] = os.getloadavg()[0]
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for key in ("soak_errors", "soak_rss_growth", "soak_mlx_memory_growth", "soak_hit_ttft_drift",
                    "kill_restarts", "kill_damaged", "kill_restore_mismatch", "restart_to_serving_s"):
            print(f"{key:<28} {out[key]}")
    failed = [k for k in ("soak_errors", "kill_damaged", "kill_restore_mismatch") if out[k]]
    if args.check and (failed or out["soak_server_exit"] != 0):
        print(f"bench.soak: FAILED: {', '.join(f'{k} {out[k]}' for k in failed) or 'the server exit'}; "
              f"{out['soak_error_examples']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
