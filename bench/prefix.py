"""Prefix-cache benchmark: RAM hits, SSD hits after a restart, decoding while the writer
persists, a multi-round chat trace and shared-prefix RAM, side by side with mlx-lm's
``LRUPromptCache`` and with the model's own prefill, in one run (median of --repeats).

    python -m bench.prefix [--context 4096] [--new 64] [--repeats 3] [--quick] [--json]

Model: the bench model (``bench.models.bench_model_path()`` when present, else a qwen3 of
hidden 1024 x 8 layers, 4 KV heads of 64, random weights, built once into .cache/models),
float32. The chat trace runs on a tiny model: hit fractions do not depend on model size.
Time ratios are ours divided by the other; ``decode_under_persist`` is a throughput ratio.

Then the TTFT and hit figures again on the real model (SmolLM2-135M-Instruct,
``support.real_model``), its GGUF file loaded by mlxkv as a user loads it (float32 on the
CPU; mlx-lm's ``LRUPromptCache`` holds the KV state of the same loaded model): cold
prefill, RAM hit, SSD hit after a restart, tail reuse and the prefetched first turn, under
the synthetic keys' names with ``_real`` appended (``ram_hit_vs_prefill_real``,
``ssd_hit_vs_cold_real``, ...), ``real_model`` naming the file. The real pass runs at
``--context`` capped by the real model's context (8192 tokens), and leaves out decode under
persistence, shared-prefix RAM and the chat trace (figures of the cache, not of the model);
``--no-real`` skips it. Prompts are random token ids in both passes (a prefill's cost does
not depend on what the tokens say).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

# isort: off
from bench.models import REAL_GGUF_NOTE, REAL_SUFFIX, add_real_flag, real_model_file
from mlxkv.engine.blas import preload

preload()  # the system OpenBLAS before mlx.core
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
# isort: on

ROOT = Path(__file__).resolve().parent.parent
PREFILL_STEP = 2048  # mlx-lm's default prefill chunk
NS = "bench-prefix-float32"


# ----------------------------------------------------------------------------- models
def bench_model() -> Path:
    try:
        from bench.models import bench_model_path

        return Path(bench_model_path())
    except ImportError:
        from support.modelgen import build_random_model

        return build_random_model(
            ROOT / ".cache" / "models" / "bench-qwen3-prefix", arch="qwen3", vocab_size=512,
            hidden_size=1024, num_hidden_layers=8, intermediate_size=3072,
            num_attention_heads=16, num_key_value_heads=4, head_dim=64)


def load(path: Path) -> Any:
    """The model at ``path``: a folder through mlx-lm, a GGUF file through mlxkv's loader."""
    if Path(path).suffix.lower() == ".gguf":
        from mlxkv.engine.models import load_model

        return load_model(str(path)).model
    from mlx_lm import load as mlx_load

    model, _ = mlx_load(str(path))
    return model


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def prefill(model: Any, toks: list[int], cache: list) -> int:
    """Prefill in mlx-lm's chunks; return the first generated token (greedy)."""
    logits = None
    for i in range(0, len(toks), PREFILL_STEP):
        logits = model(mx.array(toks[i : i + PREFILL_STEP])[None], cache=cache)
        if i + PREFILL_STEP < len(toks):
            mx.eval([c.state for c in cache])
    tok = mx.argmax(logits[0, -1])
    mx.eval(tok)
    return int(tok.item())


def decode(model: Any, cache: list, first: int, n: int) -> float:
    """Greedy-decode n tokens; return tokens per second."""
    stamps = decode_stamps(model, cache, first, n)
    return n / (stamps[-1] - stamps[0])


def decode_stamps(model: Any, cache: list, first: int, n: int) -> list[float]:
    """Greedy-decode n tokens; return the start time and each token's finish time."""
    stamps = [time.perf_counter()]
    y = first
    for _ in range(n):
        logits = model(mx.array([[y]]), cache=cache)
        nxt = mx.argmax(logits[0, -1])
        mx.eval(nxt)
        y = int(nxt.item())
        stamps.append(time.perf_counter())
    return stamps


def real_copy(cache: list) -> list:
    """An independent copy of a KV cache (own buffers), as a warm engine would hold."""
    from mlx_lm.models.cache import KVCache

    out = []
    for c in cache:
        k = KVCache()
        k.keys, k.values, k.offset = mx.contiguous(c.keys + 0), mx.contiguous(c.values + 0), c.offset
        mx.eval(k.keys, k.values)
        out.append(k)
    return out


def blas_threads(n: int | None) -> int | None:
    """Set OpenBLAS's thread count (returns the previous one; None if not OpenBLAS)."""
    import ctypes

    from mlxkv.engine.blas import blas_info

    path = blas_info().get("path")
    if n is None or not path or not blas_info().get("active"):
        return None
    lib = ctypes.CDLL(path)
    if not hasattr(lib, "openblas_set_num_threads"):
        return None
    prev = lib.openblas_get_num_threads()
    lib.openblas_set_num_threads(int(n))
    return prev


def med(xs: list[float]) -> float:
    return statistics.median(xs)


# ----------------------------------------------------------------------------- child
def child_ssd(args: argparse.Namespace) -> int:
    """A new process with empty RAM: SSD hit TTFT + restore throughput."""
    from mlxkv.engine.cache import PrefixCache
    from mlxkv.engine.cache.tokens import store_namespace
    from mlxkv.storage.io import ReadRequest

    model = load(Path(args.model))
    prompt = tokens(args.context + args.new, 1)
    out: dict[str, Any] = {"ttft": [], "restore_gbps": [], "restore_ms": [], "first": [],
                           "cached": [], "storage_gbps": [], "storage_alloc_gbps": []}
    store_ns = store_namespace(NS)
    for _ in range(args.repeats):
        pc = PrefixCache(ram_bytes=1 << 34, cache_dir=args.child_ssd, block_tokens=256)
        pc.bind_model(NS, model)  # as the engine does while it loads (the KV arena too)
        t = time.perf_counter()
        n, cache = pc.lookup(prompt, NS)
        if cache is None:
            from mlx_lm.models.cache import make_prompt_cache

            cache = make_prompt_cache(model)
        first = prefill(model, prompt[n:], cache)
        out["ttft"].append(time.perf_counter() - t)
        st = pc.stats()
        out["restore_ms"].append(st["last"]["restore_ms"])
        out["restore_gbps"].append(st["restore_bytes"] / (st["last"]["restore_ms"] / 1e3) / 1e9)
        out["first"].append(first)
        out["cached"].append(n)
        del cache
        # the storage layer alone on the same blocks, as bench.storage measures a warm restore:
        # with and without allocating the evaluated destination arrays
        m = pc.disk.lookup(store_ns, prompt, max_tokens=len(prompt) - 1)
        layout = m.layout
        for with_alloc in (True, False):
            t = time.perf_counter()
            dst = [mx.zeros((1, s.outer, m.n_tokens, *s.shape), getattr(mx, s.dtype))
                   for s in layout]
            mx.eval(dst)
            if not with_alloc:
                t = time.perf_counter()
            segs = [(memoryview(a), s.outer, m.n_tokens, s.row_bytes) for a, s in zip(dst, layout)]
            r = pc.io.submit_read(ReadRequest(store_ns, prompt, layout, segs, n_tokens=m)).result()
            gbps = r.bytes_read / (time.perf_counter() - t) / 1e9
            out["storage_alloc_gbps" if with_alloc else "storage_gbps"].append(gbps)
            del dst, segs
        pc.close(10)
    out.update(child_tail_reuse(args, model, prompt))
    out.update(child_prefetched(args, model, prompt))
    print(json.dumps(out))
    return 0


def child_tail_reuse(args: argparse.Namespace, model: Any, prompt: list[int]) -> dict[str, Any]:
    """A new process repeats prompts the stored state runs past: one whose length is a
    multiple of the block size (the conversation itself) and one that is not."""
    from mlxkv.engine.cache import PrefixCache

    out: dict[str, Any] = {"tail_reuse": {}}
    for length in (args.context, args.context - 96):
        pc = PrefixCache(ram_bytes=1 << 34, cache_dir=args.child_ssd, block_tokens=256)
        pc.bind_model(NS, model)
        n, _ = pc.lookup(prompt[:length], NS)
        out["tail_reuse"][str(length)] = n
        pc.close(10)
    return out


def child_prefetched(args: argparse.Namespace, model: Any, prompt: list[int]) -> dict[str, Any]:
    """The first turn after a restart with the conversation prefetched (read in the
    background while the engine is busy, as the TUI does when a chat opens) against a RAM
    hit of the same turn, paired per round."""
    from mlx_lm.models.cache import trim_prompt_cache

    from mlxkv.engine.cache import PrefixCache

    out: dict[str, Any] = {"prefetched_ttft": [], "ram_ttft": [], "prefetched_first": []}
    for _ in range(args.repeats):
        pc = PrefixCache(ram_bytes=1 << 34, cache_dir=args.child_ssd, block_tokens=256)
        pc.bind_model(NS, model)
        pc.busy(True)  # another request decodes: the prefetch must not wait
        pc.prefetch(prompt[: args.context + 1], NS)
        pc.prefetch_wait(120)
        pc.busy(False)
        for key in ("prefetched_ttft", "ram_ttft"):
            t = time.perf_counter()
            n, cache = pc.lookup(prompt, NS)
            first = prefill(model, prompt[n:], cache)
            out[key].append(time.perf_counter() - t)
            if key == "prefetched_ttft":
                out["prefetched_first"].append([first, n, pc.stats()["last"]["tier"]])
            trim_prompt_cache(cache, len(prompt) - n)
            pc.store(prompt[:n], cache, NS)  # as the engine does after the turn
            del cache
        pc.close(10)
    return out


# ----------------------------------------------------------------------------- parent
REAL_CONTEXT = 8192  # the real model's context length


class Bench:
    """One pass on one model: the synthetic (bench) model by default; with ``model`` (the
    real model's GGUF), the TTFT and hit figures only, their keys ending in ``suffix``."""

    def __init__(self, args: argparse.Namespace, model: Path | None = None, suffix: str = "") -> None:
        self.args = args
        self.model_override, self.suffix = model, suffix
        self.rows: list[tuple[str, str, str]] = []
        self.res: dict[str, float] = {}
        base = Path(os.path.expanduser(args.dir))
        base.mkdir(parents=True, exist_ok=True)
        self.dir = Path(tempfile.mkdtemp(prefix="bench-prefix-", dir=base))

    def row(self, what: str, value: str, note: str = "") -> None:
        self.rows.append((what, value, note))
        print(f"  {what:<58} {value:>14}  {note}", flush=True)

    def run(self) -> dict[str, Any]:
        from mlxkv.engine.blas import describe

        real = self.model_override is not None
        try:
            self.model_path = self.model_override or bench_model()
            t = time.perf_counter()
            self.model = load(self.model_path)
            self.row("real model load (GGUF, mlxkv's loader)" if real else "bench model load",
                     f"{time.perf_counter() - t:.1f} s", str(self.model_path))
            self.row("BLAS", describe(), "")
            self.cold()
            self.ram_hit()
            self.ssd_hit()
            if not real:
                self.decode_under_persist()
                self.shared_ram()
                self.trace()
        finally:
            pc = getattr(self, "pc", None)
            if pc is not None:
                pc.close(30)
            shutil.rmtree(self.dir, ignore_errors=True)
        return {f"{k}{self.suffix}": v for k, v in self.res.items()}

    # ------------------------------------------------------------------ cold
    def cold(self) -> None:
        from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

        a = self.args
        self.prompt = tokens(a.context + a.new, 1)
        cache = make_prompt_cache(self.model)
        t = time.perf_counter()
        self.first = prefill(self.model, self.prompt, cache)
        self.t_cold = time.perf_counter() - t
        trim_prompt_cache(cache, a.new)
        self.conv = cache  # the cached conversation: prompt[:context]
        self.row(f"cold prefill of {len(self.prompt)} tokens (TTFT)", f"{self.t_cold:.2f} s")

    # ------------------------------------------------------------------ RAM
    def ram_hit(self) -> None:
        from mlx_lm.models.cache import LRUPromptCache, trim_prompt_cache

        from mlxkv.engine.cache import PrefixCache

        a, model, prompt = self.args, self.model, self.prompt
        self.pc = pc = PrefixCache(ram_bytes=1 << 34, cache_dir=self.dir / "cache",
                                   block_tokens=256)
        # Each holder gets its own buffers, as in a real server where only the cache holds
        # the conversation between turns.
        pc.store(prompt[: a.context], real_copy(self.conv), NS)
        lru = LRUPromptCache()
        lru.insert_cache("bench", prompt[: a.context], real_copy(self.conv))
        warm = real_copy(self.conv)  # the warm model's own (unshared) cache
        t_ours, t_base, t_mlx, t_look, bad = [], [], [], [], 0

        c_ours, c_base, c_mlx = [], [], []  # process CPU seconds: less sensitive to load

        def ours() -> None:
            nonlocal bad
            t, c = time.perf_counter(), time.process_time()
            n, cache = pc.lookup(prompt, NS)
            t_look.append(time.perf_counter() - t)
            first = prefill(model, prompt[n:], cache)
            t_ours.append(time.perf_counter() - t)
            c_ours.append(time.process_time() - c)
            bad += (first != self.first) + (n != a.context)
            # as the engine does after the turn (untimed): hand the state back; trimmed to
            # the conversation so every repetition is the same turn
            trim_prompt_cache(cache, len(prompt) - n)
            pc.store(prompt[:n], cache, NS)

        def base() -> None:
            nonlocal bad
            t, c = time.perf_counter(), time.process_time()
            first = prefill(model, prompt[a.context :], warm)
            t_base.append(time.perf_counter() - t)
            c_base.append(time.process_time() - c)
            trim_prompt_cache(warm, a.new)
            bad += first != self.first

        def mlx_lm() -> None:
            nonlocal bad
            t, c = time.perf_counter(), time.process_time()
            cache, rest = lru.fetch_nearest_cache("bench", prompt)
            first = prefill(model, rest, cache)
            t_mlx.append(time.perf_counter() - t)
            c_mlx.append(time.process_time() - c)
            bad += (first != self.first) + (len(rest) != a.new)

        base()  # the first write into the copy allocates its headroom; not a warm step
        t_base.clear()
        c_base.clear()
        pc.flush(120)  # the previous turn was persisted long ago by the time the user answers
        order = [ours, base, mlx_lm]
        rounds = max(a.repeats, 7)  # cheap, and the machine is noisy
        for r in range(rounds):
            for fn in order[r % 3 :] + order[: r % 3]:  # rotate: no variant always goes first
                fn()
        to, tb, tm = med(t_ours), med(t_base), med(t_mlx)
        # ratios paired within each round (the three ran back to back under the same load)
        r_base = med([o / b for o, b in zip(t_ours, t_base)])
        r_mlx = med([o / m for o, m in zip(t_ours, t_mlx)])
        cpu_base = med([o / b for o, b in zip(c_ours, c_base)])
        cpu_mlx = med([o / m for o, m in zip(c_ours, c_mlx)])
        self.row(f"RAM hit: ours, {a.context} cached + {a.new} new (TTFT)", f"{to * 1e3:.0f} ms")
        self.row("  of which lookup + lending", f"{med(t_look) * 1e3:.1f} ms")
        self.row(f"warm model: prefill just the {a.new} new tokens", f"{tb * 1e3:.0f} ms")
        self.row("mlx-lm LRUPromptCache fetch + prefill", f"{tm * 1e3:.0f} ms")
        self.row("  ratio ours / warm prefill (target <= 1.15)", f"{r_base:.3f}",
                 f"median of {rounds} paired rounds; {pc.ram.moves} turns written in place")
        self.row("  ratio ours / mlx-lm (target <= 1.0)", f"{r_mlx:.3f}",
                 f"(ratio of medians: {to / tb:.3f}, {to / tm:.3f})")
        self.row("  same, process CPU time: ours / warm prefill", f"{cpu_base:.3f}")
        self.row("  same, process CPU time: ours / mlx-lm", f"{cpu_mlx:.3f}")
        if bad:
            self.row("  WRONG: a cached run differed from the cold run", str(bad))
        self.res["ram_hit_vs_prefill_cpu"] = cpu_base
        self.res["ram_hit_vs_mlx_lm_cpu"] = cpu_mlx
        self.res["ram_hit_vs_prefill"] = r_base
        self.res["ram_hit_vs_mlx_lm"] = r_mlx
        self.res["ram_hit_mismatches"] = bad

    # ------------------------------------------------------------------ SSD
    def ssd_hit(self) -> None:
        a = self.args
        rep = self.pc.flush(120)
        if rep["pending"] or rep["failed"]:
            raise RuntimeError(f"flush did not complete: {rep}")
        cmd = [sys.executable, "-m", "bench.prefix", "--child-ssd", str(self.dir / "cache"),
               "--model", str(self.model_path), "--context", str(a.context), "--new", str(a.new),
               "--repeats", str(a.repeats)]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800,
                              check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"SSD child failed:\n{proc.stderr[-4000:]}")
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        bad = sum(f != self.first for f in out["first"]) + sum(
            n != a.context for n in out["cached"])
        tt = med(out["ttft"])
        ours, st_alloc, st_plain = (med(out[k]) for k in (
            "restore_gbps", "storage_alloc_gbps", "storage_gbps"))
        self.row("SSD hit after restart (new process): TTFT", f"{tt * 1e3:.0f} ms")
        self.row("  ratio SSD-hit TTFT / cold prefill (target <= 0.05)", f"{tt / self.t_cold:.4f}")
        self.row("  restore inside lookup (alloc + read + verify)", f"{ours:.2f} GB/s",
                 f"{med(out['restore_ms']):.0f} ms")
        self.row("  storage layer, warm, same blocks, incl. allocation", f"{st_alloc:.2f} GB/s")
        self.row("  storage layer, warm, same blocks, preallocated", f"{st_plain:.2f} GB/s")
        self.row("  ratio restore / storage incl. alloc (target >= 0.5)", f"{ours / st_alloc:.3f}")
        self.row("  ratio restore / storage preallocated", f"{ours / st_plain:.3f}")
        self.res["restore_vs_storage_bench"] = ours / st_alloc
        self.res["restore_vs_storage_preallocated"] = ours / st_plain
        reuse = {int(k): v for k, v in out["tail_reuse"].items()}
        fracs = [n / (length - 1) for length, n in reuse.items()]
        self.row("repeated prompt in a new process: cached / (prompt - 1)",
                 f"{min(fracs):.4f}", ", ".join(f"{n} of {length}" for length, n in reuse.items()))
        self.res["ssd_tail_reuse"] = min(fracs)
        pf, rm = out["prefetched_ttft"], out["ram_ttft"]
        ratio = med([p / r for p, r in zip(pf, rm)])
        bad += sum(f != self.first or n != a.context or tier != "ram"
                   for f, n, tier in out["prefetched_first"])
        self.row("first turn after restart, prefetched (TTFT)", f"{med(pf) * 1e3:.0f} ms")
        self.row("  same turn, RAM hit (TTFT)", f"{med(rm) * 1e3:.0f} ms")
        self.row("  ratio prefetched / RAM hit (target <= 1.05)", f"{ratio:.3f}",
                 f"median of {len(pf)} paired rounds")
        self.res["prefetched_hit_vs_ram_hit"] = ratio
        if bad:
            self.row("  WRONG: an SSD-restored run differed from the cold run", str(bad))
        self.res["ssd_hit_vs_cold"] = tt / self.t_cold
        self.res["ssd_hit_mismatches"] = bad

    # ------------------------------------------------------------------ decode
    def decode_under_persist(self) -> None:
        import dataclasses

        from mlx_lm.models.cache import trim_prompt_cache

        from mlxkv.engine.cache.tokens import store_namespace

        a, pc, model = self.args, self.pc, self.model
        cache = real_copy(self.conv)
        # the snapshot store() hands the writer, made once here on the engine thread
        snap = pc.snapshot(self.prompt[: a.context], self.conv, NS)
        counter = [0]

        def persist() -> Any:  # the previous turn's state, under a new namespace each time
            counter[0] += 1
            ns = f"{snap.ns}-persist-{counter[0]}"  # never deduplicated against earlier runs
            fut = pc.io.submit_write(dataclasses.replace(snap, ns=ns, manifest=None))
            fut.add_done_callback(lambda f, ns=ns: shutil.rmtree(
                os.path.join(pc.disk.root, ns), ignore_errors=True))
            return fut

        n = a.decode_tokens
        idle, under, one, cont, durable, after_idle = [], [], [], [], [], []
        # One BLAS thread for every run (benchmarks.md): on a 2-core machine the writer
        # otherwise competes with BLAS's second thread, whatever the writer does.
        prev_threads = blas_threads(1)
        decode(model, cache, self.first, 2)
        trim_prompt_cache(cache, 2)
        store_ns = store_namespace(NS)
        def idle_turn() -> None:
            idle.append(decode(model, cache, self.first, n))
            trim_prompt_cache(cache, n)

        def stored_turn(r: int) -> None:
            # (a) as the engine runs it: the previous turn is stored (write-behind) while
            # the engine is busy, and the next turn decodes at once; the writer yields
            toks = [100_000 + 1000 * r + i for i in range(8)] + self.prompt[8 : a.context]
            pc.busy(True)
            t_mark = time.perf_counter()
            pc.store(toks, self.conv, NS)
            under.append(decode(model, cache, self.first, n))
            pc.busy(False)
            t_idle = time.perf_counter()
            state = pc.durability.wait(store_ns, np.array(toks), 120)
            t_durable = time.perf_counter()
            if state != "durable":
                raise RuntimeError(f"the stored turn did not become durable: {state}")
            durable.append(t_durable - t_mark)
            after_idle.append(t_durable - t_idle)
            trim_prompt_cache(cache, n)

        for r in range(a.repeats):
            if r % 2:  # alternate which goes first: no order bias under a changing load
                stored_turn(r)
                idle_turn()
            else:
                idle_turn()
                stored_turn(r)
            # (b) a raw write of such a state overlapping the whole turn (no yielding)
            fut = persist()
            one.append(decode(model, cache, self.first, n))
            fut.result()
            trim_prompt_cache(cache, n)
            # (c) worst case: the writer persists such states back to back all along
            stop = threading.Event()

            def writer_busy(stop: threading.Event = stop) -> None:
                while not stop.is_set():
                    persist().result()

            th = threading.Thread(target=writer_busy, daemon=True)
            th.start()
            cont.append(decode(model, cache, self.first, n))
            stop.set()
            th.join()
            trim_prompt_cache(cache, n)
        blas_threads(prev_threads)
        ti = med(idle)
        r_under = med([u / i for i, u in zip(idle, under)])
        r_turn = med([o / i for i, o in zip(idle, one)])
        r_cont = med([c / i for i, c in zip(idle, cont)])
        self.row("decode, writer idle (1 BLAS thread)", f"{ti:.2f} tok/s")
        self.row(f"decode right after the previous turn ({a.context} tokens) was stored",
                 f"{med(under):.2f} tok/s", f"{pc.durability.yielded} writes yielded")
        self.row("  ratio (target >= 0.97)", f"{r_under:.3f}", f"median of {a.repeats} rounds")
        self.row("  turn end to durable (median)", f"{med(durable):.3f} s",
                 f"{med(after_idle) * 1e3:.0f} ms after the decode ended")
        self.row("  raw write overlapping the whole turn / idle", f"{r_turn:.3f}", "no yielding")
        self.row(f"decode while persisting back to back ({counter[0]} writes in all) / idle",
                 f"{r_cont:.3f}", "worst case")
        self.res["decode_under_persist"] = r_under
        self.res["durable_after_turn_s"] = med(durable)
        self.res["decode_turn_with_persist"] = r_turn
        self.res["decode_under_continuous_persist"] = r_cont

    # ------------------------------------------------------------------ shared RAM
    def shared_ram(self) -> None:
        from mlx_lm.models.cache import LRUPromptCache

        from mlxkv.engine.cache import PrefixCache

        a, model = self.args, self.model
        system = self.prompt[: a.context]
        pc = PrefixCache(ram_bytes=1 << 34, cache_dir=None, block_tokens=256)
        lru = LRUPromptCache(max_size=100)
        pc.store(system, self.conv, NS)
        lru.insert_cache("bench", system, self.conv)
        one = pc.ram.nbytes
        per_token = sum(x.nbytes // x.shape[2] for c in self.conv for x in (c.keys, c.values))
        unique = 0
        for i in range(8):
            t = system + tokens(a.new, 100 + i)
            n, cache = pc.lookup(t, NS)
            prefill(model, t[n:], cache)
            pc.store(t, cache, NS)
            c2, rest = lru.fetch_nearest_cache("bench", t)
            prefill(model, rest, c2)
            lru.insert_cache("bench", t, c2)
            unique += per_token * (len(t) - len(system))
            del cache, c2
        ideal = one + unique
        ratio = pc.ram.nbytes / ideal
        self.row("RAM, 8 requests sharing the system prompt: ours", f"{pc.ram.nbytes / 2**20:.1f} MiB")
        self.row("  one copy + the unique parts", f"{ideal / 2**20:.1f} MiB")
        self.row("  mlx-lm LRUPromptCache (its own count)", f"{lru.nbytes / 2**20:.1f} MiB")
        self.row("  ratio ours / ideal (target <= 1.2)", f"{ratio:.3f}")
        self.res["shared_ram_ratio"] = ratio
        self.res["shared_ram_vs_mlx_lm"] = pc.ram.nbytes / lru.nbytes
        pc.close()

    # ------------------------------------------------------------------ trace
    def trace(self) -> None:
        from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache

        from mlxkv.engine.cache import PrefixCache
        from support.modelgen import init_model, model_config

        model = init_model(model_config("qwen3", 512), seed=0)
        sys_p = tokens(1000, 7)
        users, rounds, msg, reply = 4, 4, 220, 30
        hist = {u: [] for u in range(users)}
        pc = PrefixCache(ram_bytes=1 << 34, cache_dir=None, block_tokens=256)
        lru = LRUPromptCache()
        seen: list[np.ndarray] = []
        tot = {"prompt": 0, "ours": 0, "mlx": 0, "ideal": 0}
        for r in range(rounds):
            for u in range(users):
                p = sys_p + hist[u] + tokens(msg, 1000 * u + r)
                arr = np.array(p)
                ideal = 0
                for s in seen:
                    m = min(len(s), len(arr))
                    d = np.flatnonzero(s[:m] != arr[:m])
                    ideal = max(ideal, int(d[0]) if d.size else m)
                tot["ideal"] += min(ideal, len(p) - 1)
                tot["prompt"] += len(p)
                n, cache = pc.lookup(p, "trace")
                cache = cache if cache is not None else make_prompt_cache(model)
                out = self._gen(model, p[n:], cache, reply)
                pc.store(p + out[:-1], cache, "trace")
                tot["ours"] += n
                c2, rest = lru.fetch_nearest_cache("trace", p)
                c2 = c2 if c2 is not None else make_prompt_cache(model)
                out2 = self._gen(model, rest, c2, reply)
                lru.insert_cache("trace", p + out2[:-1], c2)
                tot["mlx"] += len(p) - len(rest)
                hist[u] = p[len(sys_p) :] + out
                seen.append(np.array(p + out[:-1]))
        f_ours, f_mlx, f_ideal = (tot[k] / tot["prompt"] for k in ("ours", "mlx", "ideal"))
        self.row("trace: 1,000-token system, 4 users x 4 rounds, cached/prompt tokens", "")
        self.row("  best possible", f"{f_ideal:.3f}")
        self.row("  ours", f"{f_ours:.3f}")
        self.row("  mlx-lm LRUPromptCache", f"{f_mlx:.3f}")
        self.row("  ratio ours / best (target >= 0.9)", f"{f_ours / f_ideal:.3f}")
        self.row("  ratio ours / mlx-lm", f"{f_ours / f_mlx:.3f}")
        self.res["trace_hit_fraction"] = f_ours / f_ideal
        self.res["trace_hit_vs_mlx_lm"] = f_ours / f_mlx
        pc.close()

    @staticmethod
    def _gen(model: Any, rest: list[int], cache: list, n: int) -> list[int]:
        """Prefill ``rest`` and generate n tokens (returned); the cache then holds every
        token but the last generated one, as the engine's does."""
        y = prefill(model, rest, cache)
        out = [y]
        for _ in range(n - 1):
            logits = model(mx.array([[y]]), cache=cache)
            y = int(mx.argmax(logits[0, -1]).item())
            out.append(y)
        return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.prefix", description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=4096, help="cached conversation tokens")
    ap.add_argument("--new", type=int, default=64, help="new tokens of the next turn")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--quick", action="store_true", help="--context 1024 for a short run")
    ap.add_argument("--dir", default=os.path.join("~", ".cache", "mlxkv"),
                    help="folder for the temporary cache (same filesystem as the real one)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child-ssd", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    add_real_flag(ap)
    args = ap.parse_args(argv)
    if args.quick:
        args.context = 1024
    if args.child_ssd:
        return child_ssd(args)
    real = None if args.no_real else real_model_file()  # fails before the synthetic pass
    print(f"bench.prefix: {args.context}-token conversation + {args.new} new tokens, "
              f"median of {args.repeats}", flush=True)
    res = Bench(args).run()
    if real is not None:
        real_args = argparse.Namespace(**{**vars(args), "context": min(args.context, REAL_CONTEXT - args.new - 1)})
        print(f"bench.prefix, real model ({real.name}, {REAL_GGUF_NOTE}): {real_args.context}-token "
              f"conversation + {args.new} new tokens, median of {args.repeats}", flush=True)
        res.update(Bench(real_args, real, REAL_SUFFIX).run())
        res["real_model"] = str(real)
        res["real_context"] = real_args.context
    if args.json:
        print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
