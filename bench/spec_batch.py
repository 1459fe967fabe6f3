"""Speculation in a batch: aggregate decode throughput of ``--rows`` x ``--waves`` requests
submitted at once to an engine that decodes ``--rows`` together (a row that ends is replaced
by the next request, as under a server's load), with speculation and without, side by side
in one engine (runs interleaved, median of ``--repeats``).

    python -m bench.spec_batch [--rows 4] [--waves 3] [--tokens 96] [--repeats 3] [--no-real]

Tasks (all greedy unless said; every row's output is checked equal across modes):
- ``demo_quote``: the demo model (trained) answering with quotes from a document in its
  system prompt, one question per row, ``spec=ngram`` vs ``off`` (input-grounded work);
- ``tiny_repeat``: the tiny random llama (``support.modelgen.tiny_model``) continuing prompts
  that repeat themselves (it falls into cycles prompt lookup predicts), ``ngram`` vs ``off``;
- ``demo_draft``: the demo pair, one of the demo model's questions per row, ``draft`` vs ``off``;
- ``demo_guided``: ``guided_choice`` among long answers (three of the demo model's own
  answers), ``auto`` (the choice's rest drafted) vs ``off`` (masked, one token a step);
- ``demo_freeform_auto``: sampled free-form text (temperature 1) on the demo model, ``auto``
  vs ``off``: what the batch pays for speculation that rarely pays;
- ``bench_freeform_auto``: the same on the bench model (``bench.models.bench_model_path``,
  random weights, the server benchmark's model): ``auto`` (prompt lookup, which finds
  little there) against ``off``, so the plain batched path is not made slower (at most 32
  tokens a request: the bench model is slow on a CPU).

Then the real model (SmolLM2-135M-Instruct, ``support.real_model``, its GGUF file loaded by
mlxkv, as a user loads it; only mlxkv runs here): ``real_quote`` (``ngram`` vs ``off``),
``real_guided`` (``auto`` vs ``off``, the same long choices) and ``real_freeform_auto``
(sampled, ``auto`` vs ``off``), the demo tasks' prompts, at most ``--real-tokens`` (64)
tokens a request (the real model is ~30x the demo model's cost per token); the headline
figures under the synthetic ones' names with ``_real`` appended (``ngram_batch_speedup_real``,
``constraint_batch_speedup_real``, ``auto_freeform_batch_ratio_real``; no draft model pairs
with it, so no ``draft_batch_speedup_real``), ``real_model`` naming the file. ``--no-real``
skips that pass.

Per task, three throughputs with and without speculation and their ratio: ``rows`` (the
headline ``ratio``): ``--rows`` x a request's mean decode throughput, what a full batch
decodes a second; ``agg``: all tokens over the time from the first token to the last
(prefill of later requests and a lone last row included); ``cpu``: tokens per CPU-second
of the process. One JSON line with every figure.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time
from typing import Any

from bench.models import add_real_flag, real_model_file
from mlxkv.engine.blas import preload

preload()  # the system OpenBLAS before mlx.core
T = 600


def _batch(eng: Any, reqs: list) -> tuple[dict, list]:
    """Serve ``reqs`` together; ({"agg": tokens over the span from the first token to the
    last, "rows": rows x the mean decode throughput of a request (what a full batch
    decodes a second, prefill of later rows and a lone last row left out), "cpu": tokens
    per CPU-second of this process (less sensitive to other load)}, results)."""
    from mlxkv.engine.engine import TokenEvent

    times: list[float] = []
    lock = threading.Lock()

    def on_event(ev: Any) -> None:
        if isinstance(ev, TokenEvent) and ev.token is not None:
            with lock:
                times.append(time.perf_counter())
    gate = threading.Event()
    c0 = time.process_time()
    busy = eng.call(gate.wait, T)  # everything submitted now is served as one batch
    handles = [eng.submit(r, callback=on_event) for r in reqs]
    gate.set()
    busy.result(timeout=T)
    results = [h.result(timeout=T) for h in handles]
    cpu = time.process_time() - c0
    tokens = sum(len(r.tokens) for r in results)
    span = max(times) - min(times) if len(times) > 1 else 0.0
    rows = min(len(reqs), eng.max_batch) * statistics.mean(r.stats.decode_tps for r in results)
    return {"agg": (tokens - 1) / span if span > 0 else 0.0, "rows": rows,
            "cpu": tokens / cpu if cpu > 0 else 0.0}, results


def _side_by_side(eng: Any, make: Any, modes: tuple[str, str], repeats: int, same: bool) -> dict:
    tps: dict[str, list[dict]] = {m: [] for m in modes}
    outputs: dict[str, list] = {}
    spec: dict = {}
    for m in modes:  # warm-up
        _batch(eng, make(m))
    for _ in range(repeats):
        for m in modes:
            rate, results = _batch(eng, make(m))
            tps[m].append(rate)
            outputs.setdefault(m, [r.tokens for r in results])
            if m != "off":
                drafted = sum((r.stats.spec or {}).get("drafted", 0) for r in results)
                accepted = sum((r.stats.spec or {}).get("accepted", 0) for r in results)
                spec = {"drafted": drafted, "accepted": accepted,
                        "acceptance": round(accepted / drafted, 4) if drafted else 0.0,
                        "batched": all(r.stats.batched for r in results)}
    out: dict[str, Any] = {}
    for key in ("rows", "agg", "cpu"):
        base, fast = (statistics.median(r[key] for r in tps[m]) for m in modes)
        out[f"{key}_off_tps"], out[f"{key}_{modes[1]}_tps"] = round(base, 2), round(fast, 2)
        out[f"{key}_ratio"] = round(fast / base, 3) if base else 0.0
    out["ratio"] = out["rows_ratio"]
    out.update(spec)
    if same:
        out["same_output"] = outputs[modes[0]] == outputs[modes[1]]
    return out


def _demo_tasks(count: int, n: int) -> tuple[Any, Any, Any, Any]:
    """The request builders (mode -> ``count`` requests) of the quote, question, free-form
    and guided tasks, ``n`` tokens a request at most."""
    from mlxkv.engine.engine import Request
    from mlxkv.engine.generate import SamplingParams
    from support.demo.facts import FACTS

    greedy = SamplingParams(max_tokens=n, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0)
    doc = "\n".join(f["a"][0] for f in FACTS)
    story = SamplingParams(max_tokens=n, temperature=1.0)

    def quote(mode: str) -> list:
        return [Request(messages=[{"role": "system", "content": "Answer with quotes from this document:\n" + doc},
                                  {"role": "user", "content": FACTS[3 + i]["q"][0]}], params=greedy, spec=mode)
                for i in range(count)]

    def ask(mode: str) -> list:
        return [Request(messages=[{"role": "user", "content": FACTS[i]["q"][0]}], params=greedy, spec=mode)
                for i in range(count)]

    def freeform(mode: str) -> list:
        return [Request(messages=[{"role": "user", "content": f"Tell me a long story about mlxkv, part {i}."}],
                        params=story, spec=mode) for i in range(count)]

    def guided(mode: str) -> list:
        return [Request(messages=[{"role": "user", "content": FACTS[i]["q"][1]}], params=greedy, spec=mode,
                        guided_choice=tuple(FACTS[i]["a"])) for i in range(count)]

    return quote, ask, freeform, guided


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--waves", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--real-tokens", type=int, default=64, help="tokens a request at most on the real model")
    add_real_flag(ap)
    args = ap.parse_args(argv)
    real = None if args.no_real else real_model_file()  # fails before the synthetic pass

    from mlxkv.engine.engine import Engine, Request
    from mlxkv.engine.generate import SamplingParams
    from mlxkv.engine.settings import DEMO_MODEL
    from support.modelgen import tiny_model

    n, rows, reps = args.tokens, args.rows, args.repeats
    count = rows * args.waves
    greedy = SamplingParams(max_tokens=n, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0)
    results: dict[str, Any] = {"rows": rows, "requests": count, "tokens": n, "repeats": reps}
    quote, ask, freeform, guided = _demo_tasks(count, n)
    with Engine(str(DEMO_MODEL), max_batch=rows, prefix_cache=None).start(timeout=T) as eng:
        results["demo_quote"] = _side_by_side(eng, quote, ("off", "ngram"), reps, True)
        results["demo_guided"] = _side_by_side(eng, guided, ("off", "auto"), reps, True)
        results["demo_draft"] = _side_by_side(eng, ask, ("off", "draft"), reps, True)
        results["demo_freeform_auto"] = _side_by_side(eng, freeform, ("off", "auto"), reps, False)
    with Engine(str(tiny_model("llama")), max_batch=rows, prefix_cache=None).start(timeout=T) as eng:
        rng = random.Random(5)
        prompts = []
        for _ in range(count):
            base = [rng.randrange(3, 500) for _ in range(rng.randint(8, 20))]
            prompts.append(base * 3)

        def repeat(mode: str) -> list:
            return [Request(prompt_tokens=p, params=greedy, spec=mode) for p in prompts]

        results["tiny_repeat"] = _side_by_side(eng, repeat, ("off", "ngram"), reps, True)
    from bench.models import bench_model_path

    with Engine(str(bench_model_path()), max_batch=rows, prefix_cache=None).start(timeout=T) as eng:
        sampled = SamplingParams(max_tokens=min(n, 32), temperature=1.0)  # ~0.2 s a step on 2 cores

        def bench_freeform(mode: str) -> list:
            return [Request(messages=[{"role": "user", "content": f"Write about the sea, part {i}."}],
                            params=sampled, spec=mode) for i in range(count)]

        results["bench_freeform_auto"] = _side_by_side(eng, bench_freeform, ("off", "auto"), reps, False)
    results["ngram_batch_speedup"] = results["demo_quote"]["ratio"]
    results["draft_batch_speedup"] = results["demo_draft"]["ratio"]
    results["constraint_batch_speedup"] = results["demo_guided"]["ratio"]
    results["auto_freeform_batch_ratio"] = results["demo_freeform_auto"]["ratio"]
    results["bench_auto_freeform_batch_ratio"] = results["bench_freeform_auto"]["ratio"]
    if real is not None:
        quote, _, freeform, guided = _demo_tasks(count, min(n, args.real_tokens))
        with Engine(str(real), max_batch=rows, prefix_cache=None).start(timeout=T) as eng:
            results["real_quote"] = _side_by_side(eng, quote, ("off", "ngram"), reps, True)
            results["real_guided"] = _side_by_side(eng, guided, ("off", "auto"), reps, True)
            results["real_freeform_auto"] = _side_by_side(eng, freeform, ("off", "auto"), reps, False)
        results["real_model"] = str(real)
        results["real_tokens"] = min(n, args.real_tokens)
        results["ngram_batch_speedup_real"] = results["real_quote"]["ratio"]
        results["constraint_batch_speedup_real"] = results["real_guided"]["ratio"]
        results["auto_freeform_batch_ratio_real"] = results["real_freeform_auto"]["ratio"]
        results["lossless_real"] = results["real_quote"]["same_output"] and results["real_guided"]["same_output"]
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
