"""Distributed benchmark: ``mlxkv serve`` on 2 ranks of this machine (mlx.launch, ring
backend on loopback, tensor sharding of the bench model), each rank caching its shard.

    python -m bench.distributed [--context 4096] [--decode 64] [--quick] [--json] [--no-real]

* ``dist_ssd_hit_vs_cold``: TTFT of a repeated ``--context``-token prompt after both ranks
  were restarted (each rank restores its shard's KV from its SSD tier), over the TTFT of
  the same prompt computed cold on 2 ranks. Target <= 0.1.
* ``dist_vs_single_decode``: decode tokens/s on 2 ranks over one process of the same model
  (reported, no target: two ranks sharing one machine's cores cannot be faster; the figure
  is there to compare on real multi-machine setups).

Then both again on the real model (SmolLM2-135M-Instruct, ``support.real_model``), under
the same keys with ``_real`` appended (``dist_ssd_hit_vs_cold_real``,
``dist_vs_single_decode_real``, ...), ``real_model`` naming the file; ``--no-real`` skips
it. Sharding cannot split a GGUF file, so every server of that pass runs the float32
mlx-lm folder converted from it (``bench.models.real_model_folder``). Its 9 attention
heads and 3 KV heads do not divide by 2, and mlx-lm has no pipeline sharding for llama,
so the real pass runs on 3 ranks (``ranks_real``), tensor-sharded, at the same
``--context``.

The engine's own figures are used (``timings`` of each reply: TTFT counts lookup, restore
and prefill). Run with ``OPENBLAS_NUM_THREADS=1``; the last line with --json is one JSON
object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.models import add_real_flag, real_keys, real_model_file, real_model_folder
from mlxkv.engine.blas import preload

preload()  # the system OpenBLAS before mlx.core

ROOT = Path(__file__).resolve().parent.parent
# The real model's 9 attention heads and 3 KV heads divide by 3 ranks, not by 2, and mlx-lm
# has no pipeline sharding for llama.
REAL_RANKS = 3


def free_ports(n: int = 1) -> int:
    """The first of ``n`` consecutive free TCP ports on 127.0.0.1."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first = s.getsockname()[1]
        if first + n > 65535:
            continue
        socks = []
        try:
            for port in range(first, first + n):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError("no run of free ports found")


def http_json(port: int, path: str, body: dict | None = None, timeout: float = 600.0) -> dict:
    """GET (or POST ``body`` as JSON) ``path`` on 127.0.0.1:``port``; the reply's JSON."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


class Server:
    """``mlxkv serve`` on ``ranks`` ranks (1: a plain process), stopped like a user would."""

    def __init__(self, model: Path, cache: Path, ranks: int):
        self.port, self.ranks = free_ports(), ranks
        env = {**os.environ, "OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS", "1"),
               "HF_HUB_OFFLINE": "1"}
        args = ["-m", "mlxkv", "serve", "--model", str(model), "--cache-dir", str(cache),
                "--port", str(self.port), "--dist-timeout-s", "600"]
        if ranks > 1:
            args = [str(Path(sys.executable).with_name("mlx.launch")), "--backend", "ring", "-n",
                    str(ranks), "--starting-port", str(free_ports(ranks)), "--python",
                    sys.executable, "--", *args, "--shard", "tensor"]
        else:
            args = [sys.executable, *args]
        self.proc = subprocess.Popen(args, cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited: {self.proc.communicate()[1][-2000:]}")
            try:
                http_json(self.port, "/health", timeout=2)
                return
            except OSError:
                time.sleep(0.3)
        self.kill()
        raise TimeoutError("the server did not start")

    def complete(self, tokens: list[int], max_tokens: int) -> dict[str, Any]:
        reply = http_json(self.port, "/v1/completions", {"prompt": tokens, "max_tokens": max_tokens,
                                                     "temperature": 0})
        return {**reply["timings"], "cached": reply["usage"]["prompt_tokens_details"]["cached_tokens"]}

    def stop(self) -> None:
        """SIGTERM to rank 0 (the process itself without a launcher): drain, flush, stop."""
        pid = self.proc.pid
        if Path(sys.executable).with_name("mlx.launch").name in " ".join(self.proc.args):
            pid = rank_pids(self.proc.pid, self.ranks)[0]
        os.kill(pid, signal.SIGTERM)
        try:
            self.proc.communicate(timeout=300)
        finally:
            self.kill()

    def kill(self) -> None:
        for sig in (signal.SIGKILL, signal.SIGCONT):
            try:
                os.killpg(self.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


def rank_pids(launcher: int, n: int = 2, timeout: float = 60.0) -> dict[int, int]:
    """rank -> pid of the rank processes the mlx.launch process ``launcher`` started."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) != launcher:
                    continue
                environ = (entry / "environ").read_bytes().split(b"\0")
            except (OSError, IndexError, ValueError):
                continue
            for item in environ:
                if item.startswith(b"MLX_RANK="):
                    found[int(item[9:])] = int(entry.name)
        if len(found) == n:
            return found
        time.sleep(0.1)
    raise TimeoutError(f"the ranks of mlx.launch {launcher} did not start in {timeout} s")


def measure(args: argparse.Namespace, log: Any, model: Path | None = None, ranks: int = 2) -> dict[str, Any]:
    """Cold and SSD-hit TTFT on ``ranks`` ranks and decode against one process, on ``model``
    (default: the bench model)."""
    from bench.models import bench_model_path

    model = model or bench_model_path()
    rng = random.Random(0)
    prompt = [rng.randrange(10, 2000) for _ in range(args.context)]
    decode_prompt = [rng.randrange(10, 2000) for _ in range(64)]
    work = Path(tempfile.mkdtemp(prefix="mlxkv-bench-dist-"))
    out: dict[str, Any] = {"context": args.context, "decode_tokens": args.decode, "ranks": ranks,
                           "shard": "tensor", "model": model.name}
    try:
        log(f"{model.name}: {ranks} ranks, cold: {args.context}-token prompt")
        server = Server(model, work / "dist", ranks)
        try:
            cold = server.complete(prompt, 1)
            dist_decode = server.complete(decode_prompt, args.decode)
        finally:
            server.stop()
        log(f"{ranks} ranks, restarted: the same prompt from each rank's SSD tier")
        server = Server(model, work / "dist", ranks)
        try:
            hit = server.complete(prompt, 1)
        finally:
            server.stop()
        log("1 process: decode")
        server = Server(model, work / "single", 1)
        try:
            single = server.complete(decode_prompt, args.decode)
        finally:
            server.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out.update({
        "cold_ttft_s": cold["ttft_s"], "ssd_hit_ttft_s": hit["ttft_s"],
        "ssd_hit_cached_tokens": hit["cached"], "ssd_hit_ssd_tokens": hit["cached_ssd_tokens"],
        "dist_decode_tps": dist_decode["decode_tps"], "single_decode_tps": single["decode_tps"],
        "dist_ssd_hit_vs_cold": hit["ttft_s"] / cold["ttft_s"] if cold["ttft_s"] else None,
        "dist_vs_single_decode": (dist_decode["decode_tps"] / single["decode_tps"]
                                  if single["decode_tps"] else None)})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.distributed", description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=4096, help="prompt tokens (default 4096)")
    ap.add_argument("--decode", type=int, default=64, help="tokens decoded (default 64)")
    ap.add_argument("--quick", action="store_true", help="a short smoke run (1024 and 16 tokens)")
    ap.add_argument("--json", action="store_true", help="one JSON object on the last line")
    add_real_flag(ap)
    args = ap.parse_args(argv)
    real = None if args.no_real else real_model_file()  # fails before the synthetic pass
    if args.quick:
        args.context, args.decode = 1024, 16

    def log(msg: str) -> None:
        print(f"bench.distributed: {msg}", file=sys.stderr, flush=True)

    out = measure(args, log)
    if real is not None:
        folder = real_model_folder()
        log(f"real model {real.name}: every server on the float32 folder converted from it "
            f"(sharding cannot split a GGUF file), {REAL_RANKS} ranks (9 heads, 3 KV heads)")
        out.update(real_keys(measure(args, log, folder, REAL_RANKS)))
        out.update({"real_model": str(real), "real_model_folder": str(folder),
                    "real_model_note": "every server on the float32 mlx-lm folder converted from the GGUF"})
    if not args.json:
        for tag in ("", "_real") if real is not None else ("",):
            ratio = out[f"dist_ssd_hit_vs_cold{tag}"]
            print(f"{'dist_ssd_hit_vs_cold' + tag:<29} {ratio:8.3f}   target <= 0.1   "
                  f"{'ok' if ratio is not None and ratio <= 0.1 else 'MISSED'}")
            print(f"{'dist_vs_single_decode' + tag:<29} {out['dist_vs_single_decode' + tag]:8.3f}   (reported)")
    print(json.dumps(out) if args.json else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
