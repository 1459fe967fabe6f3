"""Engine speed against mlx-lm, in one run, interleaved, medians.

1. Prefill and decode tok/s of the mlxkv Engine (submit -> events, through its thread)
   vs ``mlx_lm.stream_generate`` on mlx-lm's own load of the same bench model folder,
   float32, greedy, both plain (our speculation off: like with like; ``bench.spec``
   measures its gain apart); and the decode as a fraction of the machine's limit: the bytes a step
   must read (weights + KV at the run's context) over the memory bandwidth measured
   in the same run (the faster of a one-thread copy and an all-cores read) (``decode_vs_bandwidth_limit``).
2. Process start -> first token of ``mlxkv generate`` vs the ``mlx_lm.generate`` CLI on
   the demo model (the tiny test model when the demo model is not built), same BLAS.

Then both again on the real model (SmolLM2-135M-Instruct, ``support.real_model``), the
figures under the same keys with ``_real`` appended (``prefill_vs_mlx_lm_real``,
``decode_vs_mlx_lm_real``, ``first_token_vs_mlx_lm_real``, ...; ``real_model`` names the
file): mlx-lm cannot read GGUF, so both sides run the float32 mlx-lm folder converted from
it (``bench.models.real_model_folder``). ``--no-real`` skips that pass. Last, the real
model as an mlx-lm 4-bit folder (mlx-lm's own quantization of those weights, built once
beside it): mlx-lm's quantized matmuls vs mlxkv under ``--dequantize auto`` (float32 on the
CPU), ``q4_prefill_vs_mlx_lm``, ``q4_decode_vs_mlx_lm`` and ``q4_greedy_agreement`` (the
fraction of greedy tokens, position by position, both paths share); ``--skip-q4`` skips it.

    python -m bench.engine [--json] [--reps N] [--prompt-tokens N] [--decode-tokens N] [--no-real]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# One BLAS thread unless told otherwise: on 2 shared cores a descheduled BLAS worker
# thread makes every matmul wait, which swamps the differences measured here.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
from bench.models import add_real_flag, real_model_file  # noqa: E402
from mlxkv.engine.blas import blas_info, describe, preload  # noqa: E402

preload()  # the system OpenBLAS before mlx.core

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "What is mlxkv and how does its prefix cache work?"


# --------------------------------------------------------------------- throughput
def _now() -> tuple[float, float]:
    # Wall clock and process CPU time (all threads: engine, mlx workers, our consumer).
    return time.perf_counter(), time.process_time()


def _ours(eng, tokens: list[int], n: int, spec: str | None = None) -> tuple[float, ...]:
    from mlxkv.engine.engine import Request, TokenEvent
    from mlxkv.engine.generate import SamplingParams

    t0 = _now()
    greedy = SamplingParams(max_tokens=n, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0,
                            repetition_penalty=1.0)  # as stream_generate's defaults
    handle = eng.submit(Request(prompt_tokens=tokens, params=greedy, spec=spec))
    stamps = [_now() for ev in handle.events(timeout=600)
              if isinstance(ev, TokenEvent) and ev.token is not None]
    return _rates(t0, stamps, len(tokens), n)


@contextlib.contextmanager
def as_mlx_lm():
    """On the engine thread, which opted in to our CPU kernels (the architecture module the
    peer shares reaches them too): run the block with MLX's own, as mlx-lm runs elsewhere."""
    from mlxkv.engine import cpu_attention

    on = cpu_attention.enabled()
    cpu_attention.use_on_this_thread(False)
    try:
        yield
    finally:
        cpu_attention.use_on_this_thread(on)


def _mlx_lm(eng, peer, tokens: list[int], n: int) -> tuple[float, ...]:
    """``stream_generate`` on mlx-lm's own load of the folder (``peer``: (model, tokenizer)),
    on the engine thread (MLX streams are per thread)."""
    def run():
        import mlx.core as mx
        from mlx_lm.generate import stream_generate

        with as_mlx_lm():
            t0 = _now()
            stamps = [_now() for _ in stream_generate(peer[0], peer[1], mx.array(tokens), max_tokens=n)]
        return t0, stamps

    t0, stamps = eng.call(run).result(600)
    return _rates(t0, stamps, len(tokens), n)


def _peer(eng, path: Path, float32: bool) -> tuple:
    """mlx-lm's own load of ``path`` (as ``mlx_lm.load`` gives it, cast to float32 when the
    comparison is in float32), made on the engine thread, its EOS off like ours."""
    def load():
        import mlx.core as mx
        from mlx_lm import load as mlx_lm_load

        model, tokenizer = mlx_lm_load(str(path))
        if float32:
            model.set_dtype(mx.float32)
            mx.eval(model.parameters())
        tokenizer.eos_token_ids = set()
        return model, tokenizer

    return eng.call(load).result(600)


def _rates(t0, stamps, n_prompt: int, n: int) -> tuple[float, ...]:
    """(prefill tok/s, decode tok/s, prefill tok/CPU-s, decode tok/CPU-s)."""
    if len(stamps) != n:
        raise RuntimeError(f"expected {n} tokens, got {len(stamps)}")
    (w0, c0), (w1, c1), (w2, c2) = t0, stamps[0], stamps[-1]
    return (n_prompt / (w1 - w0), (n - 1) / (w2 - w1),
            n_prompt / max(c1 - c0, 1e-9), (n - 1) / max(c2 - c1, 1e-9))


def memory_bandwidth(mib: int = 512, reps: int = 5) -> float:
    """Bytes per second a numpy copy of a ``mib`` MiB buffer moves (read + written), one
    thread, the best of ``reps``: the machine's memory bandwidth, measured in this run."""
    import numpy as np

    src = np.ones(mib << 18, dtype=np.float32)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.nbytes / best


def read_bandwidth(mib: int = 1024, reps: int = 5) -> float:
    """Bytes per second read from memory by every core at once (numpy sums of a ``mib``
    MiB buffer's parts on one thread per core; numpy releases the GIL in them), the best of
    ``reps`` and of 1..cores threads: the rate a decode step that streams its weights on
    every core can reach, measured in this run."""
    import threading

    import numpy as np

    src = np.ones(mib << 18, dtype=np.float32)
    best = 0.0
    for threads in range(1, (os.cpu_count() or 1) + 1):
        parts = np.array_split(src, threads)
        for _ in range(reps):
            workers = [threading.Thread(target=part.sum) for part in parts]
            t = time.perf_counter()
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            best = max(best, src.nbytes / (time.perf_counter() - t))
    return best


def decode_bandwidth() -> dict:
    """The bandwidth a decode step's limit is set at: the faster of a one-thread copy (read
    + written) and an all-cores read, both measured now (a step that reads on every core
    is held to the all-cores rate)."""
    copy, read = memory_bandwidth(), read_bandwidth()
    return {"copy_gbs": copy / 1e9, "read_gbs": read / 1e9, "limit": max(copy, read)}


def bytes_per_token(model, context: int) -> dict:
    """What one decode step must read at ``context`` tokens: every weight once (an untied
    embedding table only its one row; a tied one whole, as the LM head) and the KV of every
    attention layer (keys and values of ``context`` positions)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    params = dict(tree_flatten(model.parameters()))
    tied = not any("lm_head." in name for name in params)
    weights = 0
    for name, p in params.items():
        if "embed_tokens" in name and not tied:
            rows = p.shape[0] * p.shape[2] if p.ndim == 3 else p.shape[0]  # chunked on the CPU
            weights += p.nbytes // rows  # one row is looked up
        else:
            weights += p.nbytes
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[1]]), cache=cache))
    kv = sum(2 * c.keys.shape[1] * c.keys.shape[3] * c.keys.dtype.size * context
             for c in cache if type(c) is KVCache)
    return {"weights": weights, "kv": kv, "total": weights + kv}


def throughput(reps: int, prompt_tokens: int, decode_tokens: int, model: Path | None = None,
               peer: Path | None = None, dtype: str = "float32") -> dict:
    """Prefill/decode of ours (``model`` under ``dtype``, default: the bench model) vs
    stream_generate on mlx-lm's own load of ``peer`` (default: the same folder, float32
    when ``dtype`` is), and the decode's bytes per token over the measured bandwidth."""
    import random

    from bench.models import bench_model_path, parameter_count
    from mlxkv.engine.engine import Engine
    from mlxkv.engine.models import weights_dtype

    path = model or bench_model_path()
    with Engine(str(path), dtype=dtype).start() as eng:
        vocab = eng.call(lambda: eng.loaded.tokenizer.vocab_size).result(60)
        special = eng.call(lambda: set(eng.loaded.tokenizer.all_special_ids)).result(60)
        # Random weights may pick EOS under greedy: no EOS for either side, so every run
        # decodes exactly decode_tokens tokens.
        eng.call(lambda: setattr(eng.loaded.tokenizer, "eos_token_ids", set())).result(60)
        theirs_model = _peer(eng, peer or path, dtype == "float32")
        peer_dtype = eng.call(lambda: weights_dtype(theirs_model[0])).result(60)
        rng = random.Random(0)
        ids = [i for i in range(vocab) if i not in special]
        tokens = [rng.choice(ids) for _ in range(prompt_tokens)]
        _ours(eng, tokens[:64], 4, spec="off")  # warm both paths up (our compiled step is checked here)
        _mlx_lm(eng, theirs_model, tokens[:64], 4)
        ours, theirs = [], []
        for rep in range(reps):  # interleaved, alternating who goes first
            pair = [(lambda: _ours(eng, tokens, decode_tokens, spec="off"), ours),
                    (lambda: _mlx_lm(eng, theirs_model, tokens, decode_tokens), theirs)]
            for fn, out in (pair if rep % 2 == 0 else pair[::-1]):
                out.append(fn())
        context = prompt_tokens + decode_tokens // 2  # the decode's mean context
        read = eng.call(lambda: bytes_per_token(eng.loaded.model, context)).result(600)
        info = dict(eng.info)
    bandwidth = decode_bandwidth()["limit"]
    med = lambda xs, i: statistics.median(x[i] for x in xs)  # noqa: E731
    paired = lambda i: statistics.median(a[i] / b[i] for a, b in zip(ours, theirs))  # noqa
    limit_tps = bandwidth / read["total"]
    return {"paired_prefill_ratio": paired(0), "paired_decode_ratio": paired(1),
            "cpu_prefill_ratio": med(ours, 2) / med(theirs, 2),
            "cpu_decode_ratio": med(ours, 3) / med(theirs, 3),
            "model": str(path), "params_m": round(parameter_count(path) / 1e6, 1),
            "compute_dtype": info["compute_dtype"], "peer_dtype": peer_dtype, "prompt_tokens": prompt_tokens,
            "decode_tokens": decode_tokens, "reps": reps,
            "ours_prefill_tps": med(ours, 0), "mlx_lm_prefill_tps": med(theirs, 0),
            "ours_decode_tps": med(ours, 1), "mlx_lm_decode_tps": med(theirs, 1),
            "bandwidth_gbs": bandwidth / 1e9, "bytes_per_token": read,
            "bandwidth_limit_tps": limit_tps, "decode_vs_bandwidth_limit": med(ours, 1) / limit_tps}


def greedy_agreement(model: Path, peer: Path, prompts: list[str], n: int, float32: bool = False) -> float:
    """The fraction of greedy tokens (position by position, ``n`` per prompt) that ours on
    ``model`` and mlx-lm's ``generate_step`` on its own load of ``peer`` (cast to float32
    with ``float32``) share."""
    from mlxkv.engine.engine import Engine, Request
    from mlxkv.engine.generate import SamplingParams

    same = total = 0
    with Engine(str(model)).start() as eng:
        eng.call(lambda: setattr(eng.loaded.tokenizer, "eos_token_ids", set())).result(60)
        theirs = _peer(eng, peer, float32)

        def reference(tokens: list[int]) -> list[int]:
            import mlx.core as mx
            from mlx_lm.generate import generate_step

            return [t for t, _ in generate_step(mx.array(tokens), theirs[0], max_tokens=n)]

        for text in prompts:
            tokens = eng.encode_chat([{"role": "user", "content": text}])
            greedy = SamplingParams(max_tokens=n, temperature=0.0)
            ours = eng.submit(Request(prompt_tokens=tokens, params=greedy)).result(600).tokens
            want = eng.call(lambda tokens=tokens: reference(tokens)).result(600)
            same += sum(a == b for a, b in zip(ours, want))
            total += n
    return same / total


# -------------------------------------------------------------------- first token
def _first_output(cmd: list[str], env: dict, skip_prefix: bytes = b"") -> float:
    """Seconds from process start until its first byte of generated text on stdout."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            env=env, cwd=ROOT)
    buf = b""
    try:
        while True:
            chunk = os.read(proc.stdout.fileno(), 4096)
            if not chunk:
                raise RuntimeError(f"{cmd[:3]} ended without output")
            buf += chunk
            if len(buf) > len(skip_prefix) and buf.startswith(skip_prefix):
                return time.perf_counter() - t0
            if not skip_prefix.startswith(buf[: len(skip_prefix)]):
                raise RuntimeError(f"unexpected output from {cmd[:3]}: {buf[:200]!r}")
    finally:
        proc.stdout.close()
        proc.wait()


def _byte_compile() -> None:
    """Write .pyc files for our sources, as ``pip install`` does for mlx-lm's: otherwise
    (PYTHONDONTWRITEBYTECODE=1 here) every run of ours recompiles them and the peer's
    don't."""
    import compileall

    for pkg in ("mlxkv", "cli", "engine", "storage"):
        compileall.compile_dir(str(ROOT / pkg), quiet=2)


def first_token(reps: int, model_override: str | None = None) -> dict:
    _byte_compile()
    demo = ROOT / "engine" / "demo" / "model"
    if model_override:
        model, which = Path(model_override), f"model at {model_override}"
    elif (demo / "config.json").exists():
        model, which = demo, "demo model"
    else:
        from support.modelgen import tiny_model

        model, which = tiny_model("qwen3"), "tiny qwen3 test model (demo model not built)"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env_peer = dict(env)
    info = blas_info()
    if info["active"]:  # the same BLAS for mlx-lm's CLI: preloaded the same way
        env_peer["LD_PRELOAD"] = info["path"]
    else:
        env["MLXKV_BLAS"] = "off"
    peer_cli = Path(sys.executable).with_name("mlx_lm.generate")
    peer = ([str(peer_cli)] if peer_cli.exists()
            else [sys.executable, "-c", "from mlx_lm.generate import main; main()"])
    common = ["--model", str(model), "--prompt", PROMPT, "--max-tokens", "8", "--temp", "0"]
    ours_t, peer_t = [], []
    for rep in range(reps + 1):  # the first pair warms the page cache and is dropped
        cache_dir = tempfile.mkdtemp(prefix="mlxkv-bench-")  # cold prefix cache each run
        ours_cmd = [sys.executable, "-m", "mlxkv", "generate", *common,
                    "--cache-dir", cache_dir]
        runs = [(lambda cmd=ours_cmd: _first_output(cmd, env), ours_t),
                (lambda: _first_output(peer + common, env_peer, b"==========\n"), peer_t)]
        for fn, out in (runs if rep % 2 == 0 else runs[::-1]):
            t = fn()
            if rep:
                out.append(t)
        shutil.rmtree(cache_dir, ignore_errors=True)
    return {"model": str(model), "which": which, "reps": reps,
            "paired_ratio": statistics.median(a / b for a, b in zip(ours_t, peer_t)),
            "ours_s": statistics.median(ours_t), "mlx_lm_s": statistics.median(peer_t),
            "ours_all": ours_t, "mlx_lm_all": peer_t}


def _throughput_report(args: argparse.Namespace, model: Path | None = None,
                       label: str = "bench model") -> dict:
    tp = throughput(args.reps, args.prompt_tokens, args.decode_tokens, model)
    print(f"{label} {tp['params_m']}M params, {tp['compute_dtype']}, prompt "
          f"{tp['prompt_tokens']} tokens, {tp['decode_tokens']} generated, median of "
          f"{tp['reps']} interleaved runs")
    rows = [("prefill tok/s", tp["ours_prefill_tps"], tp["mlx_lm_prefill_tps"]),
            ("decode tok/s", tp["ours_decode_tps"], tp["mlx_lm_decode_tps"])]
    # Headline ratios: median over the interleaved pairs of (ours / mlx-lm) in that pair.
    # Pairs run back to back, so drifting background load cancels out; the ratio of the
    # two medians is printed and kept in the JSON as well.
    result = {"throughput": tp,
              "prefill_cpu_ratio": tp["cpu_prefill_ratio"],
              "decode_cpu_ratio": tp["cpu_decode_ratio"],
              "prefill_vs_mlx_lm": tp["paired_prefill_ratio"],
              "decode_vs_mlx_lm": tp["paired_decode_ratio"],
              "prefill_ratio_of_medians": tp["ours_prefill_tps"] / tp["mlx_lm_prefill_tps"],
              "decode_ratio_of_medians": tp["ours_decode_tps"] / tp["mlx_lm_decode_tps"]}
    print(f"{'':<28}{'mlxkv':>10}{'mlx-lm':>10}{'ratio':>8}   (ratio of the medians)")
    paired = (tp["paired_prefill_ratio"], tp["paired_decode_ratio"])
    cpu = (tp["cpu_prefill_ratio"], tp["cpu_decode_ratio"])
    for (name, ours, theirs), pr, cr in zip(rows, paired, cpu):
        print(f"{name:<28}{ours:>10.1f}{theirs:>10.1f}{ours / theirs:>8.3f}"
              f"   (paired {pr:.3f}; per CPU-second {cr:.3f})")
    read = tp["bytes_per_token"]
    print(f"{'decode limit tok/s':<28}{tp['bandwidth_limit_tps']:>10.1f}{'':>10}"
          f"{tp['decode_vs_bandwidth_limit']:>8.3f}   (mlxkv's decode over it: "
          f"{read['weights'] / 1e6:.0f} MB of weights + {read['kv'] / 1e6:.1f} MB of KV per token "
          f"at a {tp['bandwidth_gbs']:.1f} GB/s copy bandwidth measured now)")
    result["decode_vs_bandwidth_limit"] = tp["decode_vs_bandwidth_limit"]
    return result


Q4_PROMPTS = ("What is the capital of France?", "Write a Python function that returns the square "
              "of a number.", "Explain what a CPU does in one sentence.")


def _q4_report(args: argparse.Namespace, folder: Path) -> dict:
    """The real model as mlx-lm's own 4-bit folder: mlx-lm loads it as it would (quantized
    matmuls), mlxkv with --dequantize auto (on the CPU: float32 weights)."""
    from support.modelgen import quantized_copy

    q4 = quantized_copy(folder)
    tp = throughput(args.q4_reps, args.q4_prompt_tokens, args.q4_decode_tokens, q4, q4, dtype="auto")
    agreement = greedy_agreement(q4, q4, list(Q4_PROMPTS), args.q4_decode_tokens)
    # the same quantized matmuls with float32 activations: what dequantizing alone changes
    agreement_f32 = greedy_agreement(q4, q4, list(Q4_PROMPTS), args.q4_decode_tokens, float32=True)
    print(f"real model, mlx-lm 4-bit folder ({q4.name}): mlx-lm quantized vs mlxkv --dequantize auto "
          f"({tp['compute_dtype']}), prompt {tp['prompt_tokens']}, {tp['decode_tokens']} generated, "
          f"median of {tp['reps']} interleaved runs")
    for name, key in (("prefill tok/s", "prefill"), ("decode tok/s", "decode")):
        ours, theirs = tp[f"ours_{key}_tps"], tp[f"mlx_lm_{key}_tps"]
        print(f"{'q4 ' + name:<28}{ours:>10.1f}{theirs:>10.1f}{ours / theirs:>8.3f}"
              f"   (paired {tp[f'paired_{key}_ratio']:.3f})")
    print(f"greedy agreement with the quantized path: {agreement:.3f} of {len(Q4_PROMPTS)} x "
          f"{args.q4_decode_tokens} tokens as mlx-lm runs it ({tp['peer_dtype']} activations), "
          f"{agreement_f32:.3f} with its quantized matmuls in float32")
    return {"q4_throughput": tp, "q4_prefill_vs_mlx_lm": tp["paired_prefill_ratio"],
            "q4_decode_vs_mlx_lm": tp["paired_decode_ratio"], "q4_greedy_agreement": agreement,
            "q4_greedy_agreement_float32": agreement_f32,
            "q4_model_folder": str(q4)}


def _first_token_report(args: argparse.Namespace, model: str | None, header: bool,
                        which: str | None = None) -> dict:
    ft = first_token(args.first_token_reps, model)
    if which:
        ft["which"] = which
    if header:
        print(f"{'':<28}{'mlxkv':>10}{'mlx-lm':>10}{'ratio':>8}   (ratio of the medians)")
    print(f"{'start -> first token (s)':<28}{ft['ours_s']:>10.2f}{ft['mlx_lm_s']:>10.2f}"
          f"{ft['ours_s'] / ft['mlx_lm_s']:>8.3f}   (median of paired ratios "
          f"{ft['paired_ratio']:.3f}; lower is better)")
    print(f"first token measured on the {ft['which']}: mlxkv generate vs the "
          "mlx_lm.generate CLI, same BLAS, same prompt, greedy")
    return {"first_token": ft, "first_token_vs_mlx_lm": ft["paired_ratio"],
            "first_token_ratio_of_medians": ft["ours_s"] / ft["mlx_lm_s"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.engine", description=__doc__.split(
        "\n")[0])
    ap.add_argument("--json", action="store_true", help="end with one JSON line")
    ap.add_argument("--reps", type=int, default=7, help="interleaved pairs (>= 5)")
    ap.add_argument("--first-token-reps", type=int, default=5)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--skip-first-token", action="store_true")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--first-token-model", help="model folder (default: the demo model)")
    ap.add_argument("--q4-reps", type=int, default=3, help="interleaved pairs on the real model's 4-bit folder")
    ap.add_argument("--q4-prompt-tokens", type=int, default=64)
    ap.add_argument("--q4-decode-tokens", type=int, default=12)
    ap.add_argument("--skip-q4", action="store_true", help="skip the real model's 4-bit folder")
    ap.add_argument("--full", action="store_true",
                    help="longer: 9 pairs, 1024-token prompt, 32 generated tokens")
    add_real_flag(ap)
    args = ap.parse_args(argv)
    real = None if args.no_real else real_model_file()  # fails before the synthetic pass
    if args.full:
        args.reps, args.first_token_reps = max(args.reps, 9), max(args.first_token_reps, 9)
        args.prompt_tokens, args.decode_tokens = 1024, 32
    print(f"BLAS: {describe()}, OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS')}"
          f"; cores: {os.cpu_count()}; "
          f"load average: {os.getloadavg()[0]:.1f}", flush=True)
    result: dict = {"blas": blas_info()["name"]}
    if not args.skip_throughput:
        result.update(_throughput_report(args))
    if not args.skip_first_token:
        result.update(_first_token_report(args, args.first_token_model, args.skip_throughput))
    if real is not None:
        from bench.models import REAL_FOLDER_NOTE, real_keys, real_model_folder

        folder = real_model_folder()
        print(f"real model {real.name}: {REAL_FOLDER_NOTE}", flush=True)
        figures: dict = {}
        if not args.skip_throughput:
            figures.update(_throughput_report(args, folder, "real model"))
        if not args.skip_first_token:
            figures.update(_first_token_report(args, str(folder), args.skip_throughput,
                                               "real model (f32 folder)"))
        result.update(real_keys(figures))
        if not args.skip_throughput and not args.skip_q4:
            result.update(_q4_report(args, folder))
        result["real_model"] = str(real)
        result["real_model_folder"] = str(folder)
        result["real_model_note"] = REAL_FOLDER_NOTE
    result["load_average_end"] = os.getloadavg()[0]
    cores = os.cpu_count() or 1
    print(f"load average at the end: {result['load_average_end']:.1f} ({cores} cores: above "
          f"~{cores} the machine was shared and the ratios are noisy)")
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
