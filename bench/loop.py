"""The engine loop on the real model: long prompts against the machine's matmul limit,
plain decode against mlx-lm and the bandwidth limit, and a stream decoding beside a cold
prefill. Like with like: speculation off on our side (bench.spec measures its gain on real
tasks), the same float32 folder on both sides, natural text (this repository's own docs
and code) as the prompts.

1. ``prefill``: cold prefill at 512, 2k, 8k, 12k and 16k tokens (past the model's trained
   context through ``context_tokens``: the arithmetic is the same), over the FLOPs a token
   costs (2 x the decoder's parameters for the weights, plus 4 x layers x context x hidden
   for attention's two products) at the float32 matmul rate measured in the same process
   at the model's shapes (``sgemm_rate``): ``prefill_vs_matmul_limit_{512,2k,8k}``,
   ``cold_prefill_{12k,16k}_s``; and ``mlx_lm.stream_generate`` at 8k
   (``prefill_vs_mlx_lm_8k``). Run on all cores (OPENBLAS_NUM_THREADS unset, what a user
   gets) and, in a child process, on one thread (``_1t`` keys).
2. ``decode``: plain decode tok/s of ours and mlx-lm at 256 tokens of context
   (``decode_plain_vs_mlx_lm``) and against the limit that the bytes a step reads
   (weights + KV) set at the memory bandwidth measured now (the faster of a one-thread copy
   and an all-cores read: ``decode_plain_vs_bandwidth_limit``,
   and at 8k: ``decode_plain_8k_vs_bandwidth_limit``, its prompt served from the prefix cache).
3. ``stall``: a stream decoding while another request prefills 8,000 cold tokens: its
   inter-token p99 over its p99 alone (``decode_itl_p99_during_prefill_vs_alone``) and the
   prefill's TTFT beside it over alone (``prefill_ttft_shared_vs_alone``).

    python -m bench.loop [--json] [--parts prefill,decode,stall] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from mlxkv.engine.blas import describe, preload

preload()  # the system OpenBLAS before mlx.core

ROOT = Path(__file__).resolve().parent.parent
LENGTHS = (512, 2048, 8192, 12288, 16384)
LABELS = {512: "512", 2048: "2k", 8192: "8k", 12288: "12k", 16384: "16k"}


def natural_tokens(encode, n: int) -> list[int]:
    """``n`` tokens of natural text: this repository's docs and sources, in a fixed order,
    repeated if they run short."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
             *sorted((ROOT / "engine").rglob("*.py")), *sorted((ROOT / "server").rglob("*.py"))]
    tokens: list[int] = []
    for f in files:
        tokens += encode(f.read_text(errors="replace"))
        if len(tokens) >= n:
            return tokens[:n]
    while len(tokens) < n:
        tokens += tokens
    return tokens[:n]


SGEMM_ROWS = (256, 512, 1024, 2048)  # the rows a prefill chunk's products may have


def sgemm_rate(shapes: list[tuple[int, int]], rows: tuple[int, ...] = SGEMM_ROWS, reps: int = 5) -> float:
    """FLOP/s of float32 products [r, in] x [in, out] over ``shapes`` (the model's weight
    shapes, weighted by their FLOPs), on this thread's BLAS threads: the best of ``reps``
    rounds at the best of the row counts ``rows``. One row count is not the machine's
    rate: on a 2-core AVX-512 EPYC, 256 rows ran at 97 GFLOP/s and 1,024 at 198, and a
    limit from the first put a prefill of 8,192 tokens at 1.61 of it."""
    import mlx.core as mx

    best_rate = 0.0
    for r in rows:
        mats = [(mx.random.normal((r, i)), mx.random.normal((i, o))) for i, o in shapes]
        mx.eval(mats)
        flops = sum(2 * r * i * o for i, o in shapes)
        best = float("inf")
        for _ in range(reps + 1):
            t = time.perf_counter()
            mx.eval([a @ b for a, b in mats])
            best = min(best, time.perf_counter() - t)
        best_rate = max(best_rate, flops / best)
    return best_rate


def model_shapes(model) -> dict:
    """The decoder's weight shapes (in, out) and sizes, for the FLOP count and sgemm_rate."""
    from mlx.utils import tree_flatten

    shapes, params = [], 0
    layers = model.model.layers
    for _name, p in tree_flatten(layers[0].parameters()):
        if p.ndim == 2:
            shapes.append((p.shape[1], p.shape[0]))
        elif p.ndim == 3:  # column chunks [n, in, c] (engine.weight_layout)
            shapes.append((p.shape[1], p.shape[0] * p.shape[2]))
        params += p.size
    args = model.args
    return {"shapes": shapes, "decoder_params": params * len(layers), "layers": len(layers),
            "hidden": args.hidden_size}


def prefill_flops(shape: dict, tokens: int) -> float:
    """2 x decoder parameters per token, plus attention's 4 x layers x context x hidden."""
    weights = 2.0 * shape["decoder_params"] * tokens
    attention = 4.0 * shape["layers"] * shape["hidden"] * tokens * (tokens + 1) / 2
    return weights + attention


def _engine(folder: Path, **values):
    import tempfile

    from mlxkv.engine.engine import Engine
    from mlxkv.engine.settings import Settings

    cache_dir = tempfile.mkdtemp(prefix="mlxkv-bench-loop-")  # never the user's cache
    settings = Settings.load({"model": str(folder), "spec": "off", "context_tokens": 16500,
                              "cache_dir": cache_dir, **values})
    return Engine.from_settings(settings).start(timeout=600)


def _ttft(eng, tokens: list[int], max_tokens: int = 1) -> tuple[float, list[float]]:
    from mlxkv.engine.engine import Request, TokenEvent
    from mlxkv.engine.generate import SamplingParams

    t = time.perf_counter()
    h = eng.submit(Request(prompt_tokens=tokens, spec="off",
                           params=SamplingParams(max_tokens=max_tokens, temperature=0.0)))
    stamps = [time.perf_counter() for ev in h.events(timeout=3600)
              if isinstance(ev, TokenEvent) and ev.token is not None]
    return stamps[0] - t, stamps


def _mlx_lm_ttft(eng, peer, tokens: list[int]) -> float:
    def run():
        import mlx.core as mx
        from mlx_lm.generate import stream_generate

        from bench.engine import as_mlx_lm

        with as_mlx_lm():
            t = time.perf_counter()
            for _ in stream_generate(peer[0], peer[1], mx.array(tokens), max_tokens=1):
                return time.perf_counter() - t
    return eng.call(run).result(3600)


def _peer(eng, folder: Path):
    from bench.engine import _peer as load_peer

    return load_peer(eng, folder, True)


def prefill_part(folder: Path, lengths: tuple[int, ...], mlx_lm_at: int | None) -> dict:
    eng = _engine(folder, prefix_cache=False)
    try:
        encode = lambda text: eng.encode(text)  # noqa: E731
        shape = eng.call(lambda: model_shapes(eng.loaded.model)).result(600)
        rate = eng.call(lambda: sgemm_rate(shape["shapes"])).result(600)
        tokens = natural_tokens(encode, max(lengths))
        _ttft(eng, tokens[:256])  # warm up
        out: dict = {"sgemm_gflops": rate / 1e9, "decoder_params": shape["decoder_params"]}
        for n in lengths:
            # a fresh start of the same text per length: nothing cached (the cache is off)
            s, _ = _ttft(eng, tokens[:n])
            limit_s = prefill_flops(shape, n) / rate
            label = LABELS.get(n, str(n))
            out[f"cold_prefill_{label}_s"] = s
            out[f"prefill_{label}_tps"] = n / s
            out[f"prefill_vs_matmul_limit_{label}"] = limit_s / s
            print(f"  prefill {n:>6} tokens {s:8.1f} s {n / s:7.1f} tok/s, matmul limit {limit_s:6.1f} s: "
                  f"{limit_s / s:.3f}", flush=True)
        if mlx_lm_at:
            peer = _peer(eng, folder)
            theirs = _mlx_lm_ttft(eng, peer, tokens[:mlx_lm_at])
            ours = out[f"cold_prefill_{LABELS[mlx_lm_at]}_s"]
            out[f"mlx_lm_prefill_{LABELS[mlx_lm_at]}_s"] = theirs
            out[f"prefill_vs_mlx_lm_{LABELS[mlx_lm_at]}"] = theirs / ours
            print(f"  mlx_lm.stream_generate at {mlx_lm_at}: {theirs:.1f} s, ours {ours:.1f} s: "
                  f"{theirs / ours:.2f}x", flush=True)
    finally:
        eng.shutdown()
    return out


def decode_part(folder: Path, reps: int, n: int) -> dict:
    from bench.engine import _mlx_lm, _ours, bytes_per_token, decode_bandwidth

    out: dict = {}
    eng = _engine(folder, prefix_cache=True)
    try:
        tokens = natural_tokens(lambda t: eng.encode(t), 8192)
        peer = _peer(eng, folder)
        short = tokens[:256 - n // 2]  # the decode's mean context: 256
        _ours(eng, short[:64], 4, spec="off")
        _mlx_lm(eng, peer, short[:64], 4)
        ours, theirs = [], []
        for rep in range(reps):
            pair = [(lambda: _ours(eng, short, n, spec="off"), ours),
                    (lambda: _mlx_lm(eng, peer, short, n), theirs)]
            for fn, acc in (pair if rep % 2 == 0 else pair[::-1]):
                acc.append(fn()[1])
        rates_now = decode_bandwidth()
        bandwidth = rates_now["limit"]
        read = eng.call(lambda: bytes_per_token(eng.loaded.model, 256)).result(600)
        limit = bandwidth / read["total"]
        out.update(decode_plain_tps=statistics.median(ours), mlx_lm_decode_plain_tps=statistics.median(theirs),
                   decode_plain_vs_mlx_lm=statistics.median(a / b for a, b in zip(ours, theirs)),
                   bandwidth_gbs=bandwidth / 1e9, copy_gbs=rates_now["copy_gbs"], read_gbs=rates_now["read_gbs"],
                   decode_limit_tps=limit,
                   decode_plain_vs_bandwidth_limit=statistics.median(ours) / limit)
        print(f"  plain decode at 256 tokens: ours {out['decode_plain_tps']:.1f} tok/s, mlx-lm "
              f"{out['mlx_lm_decode_plain_tps']:.1f} ({out['decode_plain_vs_mlx_lm']:.2f}x paired); "
              f"limit {limit:.1f} tok/s ({read['total'] / 1e6:.0f} MB a token at {bandwidth / 1e9:.1f} GB/s, the "
              f"faster of a one-thread copy {rates_now['copy_gbs']:.1f} and an all-cores read "
              f"{rates_now['read_gbs']:.1f}): "
              f"{out['decode_plain_vs_bandwidth_limit']:.3f}", flush=True)
        long = tokens[:8192 - n]
        _ttft(eng, long, 2)  # prefilled once, then served from the prefix cache
        rates = []
        for _ in range(max(1, reps // 2)):
            _, stamps = _ttft(eng, long, n)
            rates.append((len(stamps) - 1) / (stamps[-1] - stamps[0]))
        read8 = eng.call(lambda: bytes_per_token(eng.loaded.model, 8192 - n // 2)).result(600)
        limit8 = bandwidth / read8["total"]
        out.update(decode_plain_8k_tps=statistics.median(rates), decode_limit_8k_tps=limit8,
                   decode_plain_8k_vs_bandwidth_limit=statistics.median(rates) / limit8)
        print(f"  plain decode at 8k tokens: {out['decode_plain_8k_tps']:.1f} tok/s, limit {limit8:.1f} "
              f"({read8['total'] / 1e6:.0f} MB a token): {out['decode_plain_8k_vs_bandwidth_limit']:.3f}",
              flush=True)
    finally:
        eng.shutdown()
    return out


def _p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))]


def stall_part(folder: Path, prompt: int) -> dict:
    eng = _engine(folder, prefix_cache=False)
    try:
        tokens = natural_tokens(lambda t: eng.encode(t), prompt + 400)
        long, short = tokens[400:400 + prompt], tokens[:64]
        _ttft(eng, tokens[:256])
        alone_ttft, _ = _ttft(eng, long)
        _, stamps = _ttft(eng, short, 96)
        itl_alone = [b - a for a, b in zip(stamps[5:], stamps[6:])]
        from mlxkv.engine.engine import Request, TokenEvent
        from mlxkv.engine.generate import SamplingParams

        # The stream: long enough to outlast the shared prefill, cancelled once it is done.
        handle = eng.submit(Request(prompt_tokens=short, spec="off",
                                    params=SamplingParams(max_tokens=4000, temperature=0.0)))
        stream_stamps: list[float] = []

        def consume() -> None:
            for ev in handle.events(timeout=3600):
                if isinstance(ev, TokenEvent) and ev.token is not None:
                    stream_stamps.append(time.perf_counter())
        t = threading.Thread(target=consume)
        t.start()
        while len(stream_stamps) < 10:
            time.sleep(0.05)
        t0 = time.perf_counter()
        shared_ttft, _ = _ttft(eng, long)
        t1 = t0 + shared_ttft
        handle.cancel()
        t.join(600)
        during = [b - a for a, b in zip(stream_stamps, stream_stamps[1:]) if a >= t0 and b <= t1]
        figures = eng.stats().get("step_budget")
    finally:
        eng.shutdown()
    out = {"stall_prompt_tokens": prompt, "itl_alone_p99_s": _p99(itl_alone),
           "itl_alone_p50_s": statistics.median(itl_alone), "itl_during_prefill_p99_s": _p99(during),
           "itl_during_prefill_p50_s": statistics.median(during), "itl_during_prefill_n": len(during),
           "prefill_alone_ttft_s": alone_ttft, "prefill_shared_ttft_s": shared_ttft,
           "decode_itl_p99_during_prefill_vs_alone": _p99(during) / _p99(itl_alone),
           "prefill_ttft_shared_vs_alone": shared_ttft / alone_ttft, "step_budget": figures}
    print(f"  a stream beside a cold {prompt}-token prefill: inter-token p50/p99 {out['itl_during_prefill_p50_s']:.3f}"
          f"/{out['itl_during_prefill_p99_s']:.3f} s against {out['itl_alone_p50_s']:.3f}/"
          f"{out['itl_alone_p99_s']:.3f} s alone ({out['decode_itl_p99_during_prefill_vs_alone']:.2f}x p99); "
          f"the prefill's TTFT {shared_ttft:.1f} s against {alone_ttft:.1f} s alone "
          f"({out['prefill_ttft_shared_vs_alone']:.2f}x)", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.loop", description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="end with one JSON line")
    ap.add_argument("--parts", default="prefill,decode,stall")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--stall-prompt", type=int, default=8000)
    ap.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    ap.add_argument("--one-thread-lengths", default="512,2048,8192",
                    help="the lengths the one-thread child measures ('' skips it)")
    ap.add_argument("--quick", action="store_true", help="512 and 2k only, 3 reps, a 2,000-token stall prompt")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    from bench.models import real_keys, real_model_folder

    folder = real_model_folder()
    lengths = tuple(int(x) for x in args.lengths.split(",") if x)
    if args.quick:
        lengths, args.reps, args.stall_prompt, args.one_thread_lengths = (512, 2048), 3, 2000, "512"
    parts = set(args.parts.split(","))
    threads = os.environ.get("OPENBLAS_NUM_THREADS")
    print(f"BLAS: {describe()}, OPENBLAS_NUM_THREADS={threads}; cores: {os.cpu_count()}; "
          f"load average: {os.getloadavg()[0]:.1f}; real model folder {folder.name}", flush=True)
    figures: dict = {}
    if "prefill" in parts:
        print("prefill, all cores:" if not threads else f"prefill, {threads} BLAS thread(s):", flush=True)
        figures.update(prefill_part(folder, lengths, None if args.child or 8192 not in lengths else 8192))
        one = [x for x in args.one_thread_lengths.split(",") if x]
        if one and not args.child:
            # one thread for the BLAS and for the engine's own primitives (attention, row products)
            env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "MLXKV_ROW_THREADS": "1"}
            child = subprocess.run([sys.executable, "-m", "bench.loop", "--child", "--json", "--parts", "prefill",
                                    "--lengths", ",".join(one)], env=env, cwd=ROOT, capture_output=True, text=True)
            if child.returncode != 0:
                raise RuntimeError(f"the one-thread child failed:\n{child.stderr[-2000:]}")
            print("prefill, one BLAS thread:\n" + "\n".join(child.stdout.splitlines()[2:-1]), flush=True)
            mine = json.loads(child.stdout.splitlines()[-1])
            figures.update({k.removesuffix("_real") + "_1t": v for k, v in mine.items()
                            if k.startswith(("prefill_vs_matmul", "cold_prefill", "sgemm"))})
    if "decode" in parts and not args.child:
        print("plain decode (speculation off on both sides):", flush=True)
        figures.update(decode_part(folder, args.reps, args.decode_tokens))
    if "stall" in parts and not args.child:
        print("stall-free batching:", flush=True)
        figures.update(stall_part(folder, args.stall_prompt))
    result = real_keys(figures)
    result["load_average_end"] = os.getloadavg()[0]
    print(f"load average at the end: {result['load_average_end']:.1f}")
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
