"""Several models behind one `mlxkv serve`, on the real model (SmolLM2-135M-Instruct, its
float32 mlx-lm folder: what `mlx_lm.server` can read too), over HTTP on loopback, ratios
inside one run.

1. ``two_models_agg_vs_one``: one server with the real model under two names (two engines,
   two threads); the aggregate decode tok/s of one greedy stream on each at once over one
   stream on one of them alone (the median of 3, alternated). ``cores_allow`` is the most
   the machine could give: the server's CPU time over one stream alone says how many cores
   a stream keeps busy (its products are split over the cores already), and two at once
   cannot use more cores than there are nor go faster each than alone:
   min(2, cores / busy). ``two_models_agg_vs_cores_allow`` is the share of it reached
   (>= 0.9 wanted).
2. ``model_switch_restore_ttft_vs_cold``: a server of the demo model and the real model
   under a budget that holds one model at a time; a long conversation on the real model
   (its cold TTFT), a request to the demo model (the real one is unloaded, its cache
   flushed to the SSD tier), then the conversation's next turn on the real model: its TTFT
   less the reload's time (``/stats``'s load event), over the cold TTFT (<= 0.1 wanted).
3. ``model_load_s``: the time a request naming another model adds, on both servers: ours
   loads it beside the first (``mlx_lm.server`` loads it in place of the first); each side's
   switching request's time to its first token less a warm request's of the same size.

    python -m bench.pool [--json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.models import REAL_FOLDER_NOTE, real_model_file, real_model_folder
from bench.server import Served, http_client, text_of_tokens
from mlxkv.engine.pool import entry_name

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # as bench.server: one BLAS thread per engine


def _chat(url: str, model: str, messages: list[dict], max_tokens: int) -> dict[str, Any]:
    """One streamed greedy chat request naming ``model`` (bench.server's client)."""
    httpx = http_client()
    from bench.server import _stream_chat

    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    with httpx.Client(timeout=900) as client:
        return _stream_chat(client, url, body, t0)


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used so far, all its threads."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _decode_tps(run: dict[str, Any]) -> float:
    return max(run["tokens"] - 1, 0) / max(run["last"] - run["first"], 1e-9)


def _at_once(url: str, names: list[str], prompt: list[dict], tokens: int) -> list[dict[str, Any]]:
    """One stream on each model, sent together."""
    runs: list[dict[str, Any]] = [{} for _ in names]
    ready = threading.Barrier(len(names))

    def one(i: int) -> None:
        ready.wait()
        runs[i] = _chat(url, names[i], prompt, tokens)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(names))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return runs


def two_models(folder: Path, work: Path, tokens: int, reps: int, log: Any) -> dict[str, Any]:
    srv = Served("mlxkv", folder, work / "two", extra=("--model", f"b={folder}", "--spec", "off",
                                                       "--max-batch", "1")).start()
    try:
        prompt = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]
        names = [entry_name(str(folder)), "b"]
        for name in names:  # load both and warm them over the whole run's shapes
            _chat(srv.url, name, prompt, tokens)
        _at_once(srv.url, names, prompt, tokens)
        alone, together, busy = [], [], []
        for k in range(reps):
            cpu, t = _cpu_s(srv.proc.pid), time.perf_counter()
            run = _chat(srv.url, names[k % 2], prompt, tokens)
            busy.append((_cpu_s(srv.proc.pid) - cpu) / (time.perf_counter() - t))
            alone.append(_decode_tps(run))
            runs = _at_once(srv.url, names, prompt, tokens)
            start = min(r["first"] for r in runs)
            end = max(r["last"] for r in runs)
            together.append(sum(max(r["tokens"] - 1, 0) for r in runs) / max(end - start, 1e-9))
        a, t = statistics.median(alone), statistics.median(together)
        # each repetition's together over its alone, then the median: a machine whose speed
        # drifts over the run moves both sides of a pair alike
        ratio = statistics.median(x / y for x, y in zip(together, alone))
        # one stream alone keeps `used` cores busy (its step's products are split over the
        # cores already): two at once can have at most the cores there are, each token costing
        # what it cost alone, and no stream runs faster than alone
        used = statistics.median(busy)
        cores = os.cpu_count() or 1
        allow = min(2.0, cores / used)
        log(f"two models: one stream alone {a:.1f} tok/s keeping {used:.2f} of {cores} cores busy; one on each "
            f"at once {t:.1f} tok/s together ({ratio:.2f}x, the median of {reps} pairs; the cores allow "
            f"{allow:.2f}x)")
        return {"one_model_tps": a, "two_models_tps": t, "two_models_agg_vs_one": ratio, "cores_allow": allow,
                "one_stream_cores_busy": used, "two_models_agg_vs_cores_allow": ratio / allow,
                "two_models_runs": {"alone": alone, "together": together}}
    finally:
        srv.stop()


def _load_s(url: str, name: str) -> float:
    events = http_client().get(url + "/stats", timeout=60).json()["model_events"]
    return [e for e in events if e["event"] == "load" and e["model"] == name][-1]["load_s"]


def switch_restore(folder: Path, work: Path, long_tokens: int, log: Any) -> dict[str, Any]:
    # the real model first (the default, loaded at start); a budget of one byte holds one model
    srv = Served("mlxkv", folder, work / "switch", extra=("--model", "demo", "--models-memory-bytes", "1",
                                                          "--spec", "off")).start()
    try:
        text = text_of_tokens(folder, long_tokens, seed=5)
        conv = [{"role": "user", "content": text + "\nSummarise the words above."}]
        real = entry_name(str(folder))
        _chat(srv.url, real, [{"role": "user", "content": "warm up"}], 2)
        cold = _chat(srv.url, real, conv, 8)
        cold_ttft = cold["first"] - cold["t0"]
        _chat(srv.url, "demo", [{"role": "user", "content": "hello"}], 4)  # the real model is unloaded
        states = {m["name"]: m["state"] for m in http_client().get(srv.url + "/stats", timeout=60).json()["models"]}
        conv += [{"role": "assistant", "content": cold["text"]}, {"role": "user", "content": "And in one word?"}]
        back = _chat(srv.url, real, conv, 8)
        reload_s = _load_s(srv.url, real)
        ttft = back["first"] - back["t0"]
        ratio = (ttft - reload_s) / cold_ttft
        log(f"switch: cold TTFT {cold_ttft:.2f} s ({cold['prompt']} tokens); after an unload and reload "
            f"{ttft:.2f} s, {reload_s:.2f} s of it the load, {back['cached']} tokens from the cache: {ratio:.3f}")
        return {"cold_ttft_s": cold_ttft, "cold_prompt_tokens": cold["prompt"], "restored_ttft_s": ttft,
                "reload_s": reload_s, "restored_cached_tokens": back["cached"], "states_after_switch": states,
                "model_switch_restore_ttft_vs_cold": ratio}
    finally:
        srv.stop()


def load_times(folder: Path, work: Path, log: Any) -> dict[str, Any]:
    from mlxkv.engine.settings import DEMO_MODEL

    out: dict[str, float] = {}
    for kind in ("mlxkv", "mlx_lm"):
        # both start on the demo model, then a request names the real model's folder
        extra = ("--model", str(folder), "--spec", "off") if kind == "mlxkv" else ()
        srv = Served(kind, DEMO_MODEL, work / f"load-{kind}", extra=extra).start()
        try:
            name = entry_name(str(folder)) if kind == "mlxkv" else str(folder)
            _chat(srv.url, "demo" if kind == "mlxkv" else "default_model", [{"role": "user", "content": "warm up"}], 2)
            switch = _chat(srv.url, name, [{"role": "user", "content": "Name a colour."}], 2)
            warm = _chat(srv.url, name, [{"role": "user", "content": "Name a fruit."}], 2)
            out[kind] = (switch["first"] - switch["t0"]) - (warm["first"] - warm["t0"])
        finally:
            srv.stop()
    log(f"a request naming another model: ours +{out['mlxkv']:.2f} s, mlx_lm.server +{out['mlx_lm']:.2f} s")
    return {"model_load_s": out["mlxkv"], "mlx_lm_server_switch_s": out["mlx_lm"],
            "model_load_vs_mlx_lm_server": out["mlxkv"] / out["mlx_lm"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.pool", description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="one JSON object on the last line")
    ap.add_argument("--quick", action="store_true", help="a short smoke run")
    ap.add_argument("--parts", default="two,switch,load", help="which figures: two, switch, load (default: all)")
    args = ap.parse_args(argv)

    def log(msg: str) -> None:
        print(f"bench.pool: {msg}", file=sys.stderr, flush=True)

    real_model_file()  # a clear error when it is not fetched
    folder = real_model_folder()
    work = Path(tempfile.mkdtemp(prefix="mlxkv-bench-pool-"))
    for sub in ("two", "switch", "load-mlxkv", "load-mlx_lm"):
        (work / sub).mkdir()
    out: dict[str, Any] = {"real_model_folder": str(folder), "note": REAL_FOLDER_NOTE, "quick": args.quick,
                           "load_avg_start": os.getloadavg()[0],
                           "openblas_threads": os.environ.get("OPENBLAS_NUM_THREADS")}
    try:
        parts = set(args.parts.split(","))
        if "two" in parts:
            out.update(two_models(folder, work, 24 if args.quick else 64, 1 if args.quick else 5, log))
        if "switch" in parts:
            out.update(switch_restore(folder, work, 1000 if args.quick else 3000, log))
        if "load" in parts:
            out.update(load_times(folder, work, log))
    finally:
        out["load_avg_end"] = os.getloadavg()[0]
        shutil.rmtree(work, ignore_errors=True)
    targets = {"two_models_agg_vs_cores_allow": (">=", 0.9), "model_switch_restore_ttft_vs_cold": ("<=", 0.1)}
    if not args.json:
        for key, (op, want) in targets.items():
            if key not in out:
                continue
            ok = out[key] >= want if op == ">=" else out[key] <= want
            print(f"{key:<36} {out[key]:8.3f}   target {op} {want}   {'ok' if ok else 'MISSED'}")
        if "model_load_s" in out:
            theirs = out["mlx_lm_server_switch_s"]
            print(f"{'model_load_s':<36} {out['model_load_s']:8.3f}   mlx_lm.server {theirs:.3f}")
    print(json.dumps(out, default=str) if args.json else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
