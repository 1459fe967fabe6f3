"""Storage benchmark: persist/restore of a synthetic large-model KV snapshot, side by side
with the machine's limits and mlx-lm's prompt-cache files, in one run (median of N).

    python -m bench.storage [--full] [--tokens N] [--repeats 3] [--dir DIR] [--json]

Shape: 32 layers x 8 KV heads x 128 dim, bf16 = 128 KiB per token (8,192 tokens = 1 GiB
with --full; the default uses fewer tokens so the run stays short, and says so).
Files go to a temporary folder under --dir (default: the cache folder, ~/.cache/mlxkv),
so the plain-file limits are measured on the same filesystem. Throughput ratios are ours
divided by the other; "warm" means the files are in the page cache, "cold" means their
pages were dropped with posix_fadvise(DONTNEED) (fsync first) where the OS honours it
(ours then reads them with O_DIRECT, see storage.direct).

ssd_restore_vs_mlx_lm is the engine's whole SSD hit, in a new process: a model of the same
KV shape (random weights, bf16) is built and bound to a PrefixCache on the stored state
(the KV arena is prepared then, as during a model load), and the time from ``lookup`` to
the restored KV cache ready is compared with mlx-lm's ``load_prompt_cache`` + eval of the
same state in its own new process, both with the files in the page cache; the two kinds of
process alternate. restore_vs_mlx_lm counts the allocation of the destination mx arrays (mlx-lm's load
allocates its own) the way the engine allocates them, without a zero fill
(engine.cache.buffers); restore_zeroed_vs_mlx_lm is the same with zero-filled destinations
(the engine's fallback); restore_prealloc_vs_mlx_lm is the restore into arrays the engine
already holds. Each allocating measurement, ours and mlx-lm's, starts after freed heap
pages were returned to the OS (malloc_trim), so both pay for fresh pages as after a
restart and neither reuses the other's. --no-mlx runs the storage parts alone (numpy sources and destinations).
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
from collections.abc import Callable
from typing import Any

import numpy as np
import xxhash

from mlxkv.engine.blas import preload

preload()  # the system OpenBLAS before mlx.core

LAYERS, HEADS, DIM = 32, 8, 128
ROW = DIM * 2  # bf16 bytes per token per head
GIB = 1 << 30


def median_time(fn: Callable[[], Any], repeats: int, setup: Callable[[], Any] | None = None) -> float:
    ts = []
    for _ in range(repeats):
        if setup is not None:
            setup()
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def release_free_memory() -> None:
    """Hand freed heap pages back to the OS (glibc ``malloc_trim``; elsewhere a no-op), so
    the next allocation takes fresh pages as a new process would."""
    try:
        import ctypes

        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def mlx_lm_cache() -> tuple[Any, str]:
    """mlx-lm's ``models.cache`` module. Where the ``mlx_lm`` package's ``__init__`` cannot
    import (it pulls in transformers), load the package without running it: the functions
    measured are still mlx-lm's own ``save_prompt_cache`` / ``load_prompt_cache``."""
    try:
        from mlx_lm.models import cache

        return cache, ""
    except ImportError:
        import importlib.util
        import types

        for name in [m for m in sys.modules if m == "mlx_lm" or m.startswith("mlx_lm.")]:
            del sys.modules[name]
        spec = importlib.util.find_spec("mlx_lm")
        if spec is None or not spec.submodule_search_locations:
            raise
        pkg = types.ModuleType("mlx_lm")
        pkg.__path__ = list(spec.submodule_search_locations)
        sys.modules["mlx_lm"] = pkg
        from mlx_lm.models import cache

        return cache, " (mlx_lm loaded without its package __init__)"


# ----------------------------------------------------------------------------- SSD hit
NS = "bench-storage-bf16"


def bench_kv_model() -> Any:
    """A model whose KV cache has the benchmark's shape (32 layers x 8 KV heads x 128 dim,
    bf16): small random weights, since only its cache layout matters here."""
    import mlx.core as mx

    from support.modelgen import init_model, model_config

    model = init_model(model_config("llama", 512, num_hidden_layers=LAYERS, hidden_size=256,
                                    intermediate_size=256, num_attention_heads=HEADS,
                                    num_key_value_heads=HEADS, head_dim=DIM), seed=0)
    model.set_dtype(mx.bfloat16)
    return model


def child_restore(args: argparse.Namespace) -> int:
    """One new process: the engine's SSD hit (``ours``) or mlx-lm's load (``mlx``)."""
    import mlx.core as mx

    out: dict[str, Any] = {}
    if args.child_restore == "mlx":
        C, _ = mlx_lm_cache()
        t = time.perf_counter()
        cache = C.load_prompt_cache(args.mlx_file)
        mx.eval([c.state for c in cache])
        out["s"] = time.perf_counter() - t
        out["n"] = int(cache[0].offset)
    else:
        from mlxkv.engine.cache import PrefixCache

        model = bench_kv_model()  # "loading the model"
        pc = PrefixCache(ram_bytes=1 << 34, cache_dir=args.store_dir, block_tokens=256)
        pc.bind_model(NS, model)  # as the engine does during a load: the arena is prepared
        prompt = list(range(args.tokens)) + [7]
        t = time.perf_counter()
        n, cache = pc.lookup(prompt, NS)
        if cache is not None:
            mx.eval([c.state for c in cache])
        out["s"] = time.perf_counter() - t
        out["n"] = n
        st = pc.stats()
        out["arena_hits"] = st["arena_hits"]
        out["tier"] = st["last"]["tier"]
        pc.close(10)
    print(json.dumps(out))
    return 0


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        mx = None
        if not args.no_mlx:
            import mlx.core as mx

        from mlxkv.storage import _blocks as K
        from mlxkv.storage import format as fmt
        from mlxkv.storage.io import ReadRequest, StorageIO, WriteRequest
        from mlxkv.storage.store import BlockStore

        self.mx, self.K, self.fmt = mx, K, fmt
        self.ReadRequest, self.WriteRequest = ReadRequest, WriteRequest
        self.args = args
        self.T = args.tokens
        self.R = args.repeats
        base = os.path.expanduser(args.dir)
        os.makedirs(base, exist_ok=True)
        self.dir = tempfile.mkdtemp(prefix="bench-storage-", dir=base)
        self.store = BlockStore(os.path.join(self.dir, "store"), block_tokens=256,
                                read_threads=args.read_threads)
        self.io = StorageIO(self.store, max_pending_writes=4)
        self.layout = fmt.make_layout(
            [fmt.SegmentSpec(f"{li}.{kv}", "bfloat16", (DIM,), HEADS, ROW)
             for li in range(LAYERS) for kv in "kv"])
        self.nbytes = self.T * LAYERS * 2 * HEADS * ROW
        self.rows: list[tuple[str, str, str]] = []
        self.res: dict[str, float] = {}
        self.ns_counter = 0
        self.mlx_lm_note = ""

    # ------------------------------------------------------------------ data
    def make_source(self) -> None:
        mx = self.mx
        rng = np.random.default_rng(0)
        self.src = []  # mx arrays [1, H, T, D] bf16, evaluated
        for _ in range(LAYERS * 2):
            a = rng.integers(0, 1 << 16, size=(1, HEADS, self.T, DIM), dtype=np.uint16)
            if mx is not None:
                a = mx.array(a).view(mx.bfloat16)
                mx.eval(a)
            self.src.append(a)
        self.src_segs = [(memoryview(a), HEADS, self.T, ROW) for a in self.src]
        self.tokens = np.arange(self.T, dtype=np.uint32)

    def alloc_dst(self, zeroed: bool = False) -> list:
        """Evaluated mx arrays to restore into, as the engine allocates them (without a
        zero fill, engine.cache.buffers), or zero-filled (its fallback) when ``zeroed``."""
        mx, shape = self.mx, (1, HEADS, self.T, DIM)
        if mx is None:
            return [np.zeros(shape, np.uint16) for _ in range(LAYERS * 2)]
        from mlxkv.engine.cache import buffers as mxbuffers

        shapes, dtypes = [shape] * (LAYERS * 2), [mx.bfloat16] * (LAYERS * 2)
        if zeroed:
            return mxbuffers.zeroed_arrays(shapes, dtypes)
        return mxbuffers.unfilled_arrays(shapes, dtypes)

    def check_dst(self, dst: list) -> None:
        addrs = set()
        for a in dst:
            mv = memoryview(a)
            if mv.readonly or not mv.c_contiguous or mv.nbytes != HEADS * self.T * ROW:
                raise RuntimeError("a destination is not a full writable buffer")
            addrs.add(np.frombuffer(mv, dtype=np.uint8).ctypes.data)
        if len(addrs) != len(dst):
            raise RuntimeError("destinations share buffers")

    def new_ns(self, tag: str) -> str:
        self.ns_counter += 1
        return f"{tag}-{self.ns_counter}"

    def drop_ns(self, ns: str) -> None:
        shutil.rmtree(os.path.join(self.store.root, ns), ignore_errors=True)
        self.store.scan()

    # ------------------------------------------------------------------ measurements
    def persist(self) -> None:
        R, n = self.R, self.nbytes
        plain = os.path.join(self.dir, "plain.bin")
        blob = np.empty(n, dtype=np.uint8)  # the same bytes, contiguous
        for i, a in enumerate(self.src):
            m = np.frombuffer(memoryview(a), dtype=np.uint8)
            blob[i * m.size : (i + 1) * m.size] = m

        def plain_write():
            fd = os.open(plain, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            mv = memoryview(blob)
            while mv:
                w = os.write(fd, mv[: 1 << 30])
                mv = mv[w:]
            os.fsync(fd)
            os.close(fd)

        def rm_plain():
            if os.path.exists(plain):
                os.unlink(plain)

        self.blob = blob
        ns_list: list[str] = []

        def ours():
            ns = self.new_ns("persist")
            ns_list.append(ns)
            self.io.submit_write(self.WriteRequest(ns, self.tokens, self.layout, self.src_segs)).result()

        def cleanup_ours():
            for ns in ns_list[:-1]:
                self.drop_ns(ns)
            del ns_list[:-1]

        mlx_file = os.path.join(self.dir, "mlx_lm.safetensors")
        if self.mx is not None:
            C, self.mlx_lm_note = mlx_lm_cache()
            self.kv = []
            for li in range(LAYERS):
                c = C.KVCache()
                c.update_and_fetch(self.src[2 * li], self.src[2 * li + 1])
                self.kv.append(c)
            self.mx.eval([c.state for c in self.kv])

        def mlx_save():
            C, _ = mlx_lm_cache()
            C.save_prompt_cache(mlx_file, self.kv)
            fd = os.open(mlx_file, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)

        t_plain, t_ours, t_mlx = [], [], []
        for _ in range(R):  # interleaved so background load hits all three alike
            rm_plain()
            t_plain.append(median_time(plain_write, 1))
            cleanup_ours()
            t_ours.append(median_time(ours, 1))
            if self.mx is not None:
                t_mlx.append(median_time(mlx_save, 1))
        tp, to = statistics.median(t_plain), statistics.median(t_ours)
        self.persist_ns = ns_list[-1]
        self.mlx_file, self.plain = mlx_file, plain
        self.add("persist: ours (pack+hash+write+fsync)", to, n)
        self.add("persist: plain os.write + fsync", tp, n)
        self.res["persist_vs_limit"] = tp / to
        if t_mlx:
            tm = statistics.median(t_mlx)
            self.add(f"persist: mlx-lm save_prompt_cache + fsync{self.mlx_lm_note}", tm, n)
            self.res["persist_vs_mlx_lm"] = tm / to

    def restore(self) -> None:
        mx, R, n = self.mx, self.R, self.nbytes

        ns = self.persist_ns
        dst = self.alloc_dst()
        self.check_dst(dst)
        dsegs = [(memoryview(a), HEADS, self.T, ROW) for a in dst]

        def ours(segs=dsegs):
            r = self.io.submit_read(self.ReadRequest(ns, self.tokens, self.layout, segs)).result()
            if r.n_tokens != self.T:
                raise RuntimeError(f"restore returned {r.n_tokens} of {self.T} tokens")

        # warm: every file in the page cache (block files are written and, when cold, read
        # with O_DIRECT, so a restore alone never puts them there)
        for dp, _, fs in os.walk(os.path.join(self.store.root, ns)):
            for f in fs:
                with open(os.path.join(dp, f), "rb") as fh:
                    while fh.read(16 << 20):
                        pass
        ours()  # check the bytes once
        for a, b in ((dst[0], self.src[0]), (dst[-1], self.src[-1])):
            if bytes(memoryview(a).cast("B")) != bytes(memoryview(b).cast("B")):
                raise RuntimeError("restored bytes differ from the source")

        def ours_alloc(zeroed=False):
            d = self.alloc_dst(zeroed)
            self.check_dst(d)
            ours([(memoryview(a), HEADS, self.T, ROW) for a in d])

        def mlx_load():
            C, _ = mlx_lm_cache()
            cache = C.load_prompt_cache(self.mlx_file)
            mx.eval([c.state for c in cache])

        if mx is not None:
            mlx_load()
        out = np.empty_like(self.blob)

        def memcpy():
            np.copyto(out, self.blob)

        memcpy()
        t = {k: [] for k in ("ours", "ours_alloc", "ours_zeroed", "mlx", "memcpy", "alloc",
                             "alloc_zeroed")}
        for _ in range(R):
            t["ours"].append(median_time(ours, 1))
            # every allocating measurement (ours and mlx-lm's) starts from the same heap:
            # pages freed by the one before are handed back to the OS first, else whichever
            # runs second reuses mapped pages and skips the page faults the other paid
            t["ours_alloc"].append(median_time(ours_alloc, 1, release_free_memory))
            if mx is not None:
                t["ours_zeroed"].append(median_time(lambda: ours_alloc(True), 1,
                                                    release_free_memory))
                t["alloc_zeroed"].append(median_time(lambda: self.alloc_dst(True), 1,
                                                     release_free_memory))
            if mx is not None:
                t["mlx"].append(median_time(mlx_load, 1, release_free_memory))
            t["memcpy"].append(median_time(memcpy, 1))
            t["alloc"].append(median_time(self.alloc_dst, 1, release_free_memory))
        to, ta, tc, tz = (statistics.median(t[k]) for k in ("ours", "ours_alloc", "memcpy", "alloc"))
        what = "evaluated mx arrays" if mx is not None else "numpy arrays (--no-mlx)"
        alloc = "unfilled, mx.load of an .npy stream + eval" if mx is not None else "np.zeros"
        self.add(f"restore warm: ours, verified, into {what}", to, n)
        self.add(f"restore warm: ours incl. allocating them ({alloc})", ta, n)
        if mx is not None:
            tzr = statistics.median(t["ours_zeroed"])
            self.add("restore warm: ours incl. allocating them zero-filled (fallback)", tzr, n)
            tm = statistics.median(t["mlx"])
            self.add("restore warm: mlx-lm load_prompt_cache + eval", tm, n)
            self.res["restore_vs_mlx_lm"] = tm / ta
            self.res["restore_zeroed_vs_mlx_lm"] = tm / tzr
            self.res["restore_prealloc_vs_mlx_lm"] = tm / to
        self.add("memory copy: numpy copyto", tc, n)
        self.add(f"  ({alloc} of the destination alone)", tz, n)
        if mx is not None:
            self.add("  (zero-filled allocation of the destination alone)",
                     statistics.median(t["alloc_zeroed"]), n)
        self.res["restore_vs_memcpy"] = tc / to

        # cold: drop the pages of every file, then read
        K = self.K
        files = [os.path.join(dp, f) for dp, _, fs in os.walk(os.path.join(self.store.root, ns))
                 for f in fs]

        def drop(paths):
            dropped = True
            for p in paths:
                fd = os.open(p, os.O_RDONLY)
                dropped &= K.drop_cache(fd)
                os.close(fd)
            return dropped

        buf = K.AlignedBuffer(16 << 20)

        def plain_read():
            fd = os.open(self.plain, os.O_RDONLY)
            off = 0
            while True:
                got = K.pread_full(fd, buf, off)
                off += got
                if got < len(buf):
                    break
            os.close(fd)
            if off != n:
                raise RuntimeError(f"plain read {off} of {n} bytes")

        honoured = drop(files) and drop([self.plain])
        tc_o, tc_p = [], []
        for _ in range(R):
            drop(files)
            tc_o.append(median_time(ours, 1))
            drop([self.plain])
            tc_p.append(median_time(plain_read, 1))
        to, tp = statistics.median(tc_o), statistics.median(tc_p)
        note = "" if honoured else " (DONTNEED not honoured: warm)"
        self.add(f"restore cold: ours{note}", to, n)
        self.add(f"read cold: plain sequential pread{note}", tp, n)
        self.res["restore_cold_vs_limit"] = tp / to
        self.res["cold_pages_dropped"] = bool(honoured)

    def ssd_restore(self) -> None:
        """The engine's SSD hit in a new process vs mlx-lm's load of the same state."""
        import subprocess

        from mlxkv.engine.cache import PrefixCache

        mx, T, R = self.mx, self.T, self.R
        C, note = mlx_lm_cache()
        model = bench_kv_model()
        cache = [C.KVCache() for _ in range(LAYERS)]
        for li, c in enumerate(cache):
            c.update_and_fetch(self.src[2 * li], self.src[2 * li + 1])
        mx.eval([c.state for c in cache])
        root = os.path.join(self.dir, "engine-store")
        pc = PrefixCache(ram_bytes=1 << 34, cache_dir=root, block_tokens=256)
        pc.bind_model(NS, model)  # checks the stored state against this model's caches
        pc.store(list(range(T)), cache, NS)
        rep = pc.close(120)
        if rep["durable"] != 1:
            raise RuntimeError(f"the state was not persisted: {rep}")
        mlx_file = os.path.join(self.dir, "mlx_lm_engine.safetensors")
        C.save_prompt_cache(mlx_file, cache)
        del cache, pc
        files = [os.path.join(dp, f) for dp, _, fs in os.walk(root) for f in fs] + [mlx_file]

        def warm() -> None:  # the same page-cache state for both: every file cached
            for p in files:
                with open(p, "rb") as f:
                    while f.read(16 << 20):
                        pass

        def child(kind: str) -> dict:
            cmd = [sys.executable, "-m", "bench.storage", "--child-restore", kind,
                   "--store-dir", root, "--mlx-file", mlx_file, "--tokens", str(T)]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False,
                                  cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            if proc.returncode != 0:
                raise RuntimeError(f"restore child failed:\n{proc.stderr[-3000:]}")
            return json.loads(proc.stdout.strip().splitlines()[-1])

        ours, theirs, hits = [], [], 0
        for r in range(R):
            for kind in (("ours", "mlx") if r % 2 == 0 else ("mlx", "ours")):
                warm()
                res = child(kind)
                if res["n"] != T:
                    raise RuntimeError(f"{kind}: restored {res['n']} of {T} tokens ({res})")
                (ours if kind == "ours" else theirs).append(res["s"])
                hits += res.get("arena_hits", 0)
        to, tm = statistics.median(ours), statistics.median(theirs)
        self.add(f"SSD hit, new process: lookup to KV ready (arena hits {hits}/{R})", to, self.nbytes)
        self.add(f"  mlx-lm load_prompt_cache + eval, new process{note}", tm, self.nbytes)
        self.res["ssd_restore_vs_mlx_lm"] = tm / to

    def kernels(self) -> None:
        K, R = self.K, max(self.R, 5)
        buf = self.blob[: 256 << 20]
        try:  # S1's kernel benchmark measures these interleaved; use it when present
            from bench import kernels as kb
        except ImportError:
            kb = None
        if kb is not None:
            h = kb.measure_hash(buf, repeats=R)
            flat = [(np.frombuffer(memoryview(a).cast("B"), np.uint8), o, t, rb)
                    for (a, o, t, rb) in self.src_segs]  # numpy cannot wrap bf16 views
            p = kb.measure_pack(flat, block_tokens=256, repeats=R)
            self.rows.append((f"hash: _blocks.xxh3_64 ({K.hash_isa()}) vs xxhash [bench.kernels]",
                              f"{h['xxh3_gbps']:.2f} GB/s", f"xxhash {h['xxhash_gbps']:.2f} GB/s"))
            self.rows.append(("pack+hash vs pack [bench.kernels]", f"{p['packhash_gbps']:.2f} GB/s",
                              f"pack {p['pack_gbps']:.2f} GB/s, memcpy {p['memcpy_gbps']:.2f} GB/s"))
            self.res["hash_vs_xxhash"] = h["hash_vs_xxhash"]
            self.res["packhash_vs_pack"] = p["packhash_vs_pack"]
            return
        t_ours = median_time(lambda: K.xxh3_64(buf), R)
        t_xx = median_time(lambda: xxhash.xxh3_64_intdigest(buf), R)
        self.add(f"hash: _blocks.xxh3_64 ({K.hash_isa()})", t_ours, buf.nbytes)
        self.add("hash: xxhash package xxh3_64", t_xx, buf.nbytes)
        self.res["hash_vs_xxhash"] = t_xx / t_ours
        nt = min(self.T, 256)
        dst = K.AlignedBuffer(K.packed_size(self.src_segs, nt))
        t_ph = median_time(lambda: K.pack(dst, 0, self.src_segs, 0, nt), R)
        t_p = median_time(lambda: K.pack(dst, 0, self.src_segs, 0, nt, hash=False), R)
        self.add(f"pack+hash of one {nt}-token block", t_ph, dst.nbytes)
        self.add("pack alone", t_p, dst.nbytes)
        self.res["packhash_vs_pack"] = t_p / t_ph

    def gil(self) -> None:
        """A pure-Python loop on another thread, alone and while the writer persists."""
        count = max(1, -(-GIB // self.nbytes))  # 1 GiB in all

        def spin(stop: threading.Event, out: dict) -> None:
            n, last, worst = 0, time.perf_counter(), 0.0
            t0 = last
            while not stop.is_set():
                n += 1
                now = time.perf_counter()
                worst = max(worst, now - last)
                last = now
            out.update(rate=n / (last - t0), stall=worst)

        def run_spin(work: Callable[[], None]) -> dict:
            stop, out = threading.Event(), {}
            th = threading.Thread(target=spin, args=(stop, out))
            th.start()
            work()
            stop.set()
            th.join()
            return out

        ns_list = [self.new_ns("gil") for _ in range(count)]

        def persist_all():
            futs = [self.io.submit_write(self.WriteRequest(ns, self.tokens, self.layout, self.src_segs))
                    for ns in ns_list]
            for f in futs:
                f.result()

        def gil_free_load(seconds: float) -> Callable[[], None]:
            """Control: a thread as CPU-hungry as the writer that never needs the GIL
            (numpy copies release it), to tell GIL contention from a busy machine."""
            a = np.empty(32 << 20, np.uint8)
            b = np.empty_like(a)

            def work():
                stop = threading.Event()

                def copy_loop():
                    while not stop.is_set():
                        np.copyto(b, a)

                th = threading.Thread(target=copy_loop)
                th.start()
                time.sleep(seconds)
                stop.set()
                th.join()

            return work

        ratios, stalls, controls, cstalls = [], [], [], []
        for _ in range(self.R):
            solo = run_spin(lambda: time.sleep(0.5))
            t = time.perf_counter()
            busy = run_spin(persist_all)
            dt = time.perf_counter() - t
            for ns in ns_list:
                self.drop_ns(ns)
            ctrl = run_spin(gil_free_load(dt))
            ratios.append(busy["rate"] / solo["rate"])
            stalls.append(busy["stall"] * 1e3)
            controls.append(ctrl["rate"] / solo["rate"])
            cstalls.append(ctrl["stall"] * 1e3)
        self.res["gil_ratio"] = statistics.median(ratios)
        self.res["gil_max_stall_ms"] = statistics.median(stalls)
        self.res["gil_control_ratio"] = statistics.median(controls)
        self.res["gil_control_max_stall_ms"] = statistics.median(cstalls)
        self.rows.append((f"GIL: Python loop rate while persisting {count * self.nbytes / GIB:.2f} GiB",
                          f"{self.res['gil_ratio']:.2f}x solo",
                          f"max stall {self.res['gil_max_stall_ms']:.1f} ms (persist {dt:.2f} s)"))
        self.rows.append(("  control: same loop beside a GIL-free numpy copy thread",
                          f"{self.res['gil_control_ratio']:.2f}x solo",
                          f"max stall {self.res['gil_control_max_stall_ms']:.1f} ms"))

    def dedup(self) -> None:
        """8 snapshots sharing a 6,144-token prefix plus 512 unique tokens each."""
        from mlxkv.storage.store import BlockStore

        mx = self.mx
        layers = LAYERS if self.args.full else 4
        T = 6144 + 512
        layout = self.fmt.make_layout([self.fmt.SegmentSpec(f"{li}.{kv}", "bfloat16", (DIM,), HEADS, ROW)
                                       for li in range(layers) for kv in "kv"])
        rng = np.random.default_rng(1)
        arrs = []
        for _ in range(layers * 2):
            a = rng.integers(0, 1 << 16, (1, HEADS, T, DIM), dtype=np.uint16)
            if mx is not None:
                a = mx.array(a).view(mx.bfloat16)
                mx.eval(a)
            arrs.append(a)
        segs = [(memoryview(a), HEADS, T, ROW) for a in arrs]
        root = os.path.join(self.dir, "dedup")
        store = BlockStore(root, block_tokens=256)
        prefix = np.arange(6144)
        for i in range(8):
            toks = np.concatenate([prefix, 100_000 + 1000 * i + np.arange(512)])
            store.put_blocks("dedup", toks, layout, segs)
        disk = 0
        for dp, _, fs in os.walk(root):
            for f in fs:
                st = os.stat(os.path.join(dp, f))
                disk += st.st_blocks * 512
        per_tok = self.fmt.bytes_per_token(layout)
        ideal = (6144 + 8 * 512) * per_tok
        self.res["dedup_ratio"] = disk / ideal
        mlx_ratio = 8 * T * per_tok / ideal
        self.rows.append((f"dedup: 8 x (6,144 shared + 512 unique), {layers} layers",
                          f"{self.res['dedup_ratio']:.3f}x ideal",
                          f"mlx-lm files: {mlx_ratio:.2f}x ideal (8 full copies)"))
        shutil.rmtree(root, ignore_errors=True)

    def scan(self) -> None:
        from mlxkv.storage.store import BlockStore

        root = os.path.join(self.dir, "scan")
        layout = self.fmt.make_layout([("k", "bfloat16", (32,), 1, 64)])
        # built without fsync or direct I/O: only the scan is measured
        store = BlockStore(root, block_tokens=16, durable=False, direct_io=False)
        toks = np.arange(10_000 * 16)
        src = np.zeros((1, toks.size, 64), dtype=np.uint8)
        t = time.perf_counter()
        store.put_blocks("scan", toks, layout, [(src, 1, toks.size, 64)], tail=False)
        build = time.perf_counter() - t

        def fresh_scan():
            s = BlockStore(root, block_tokens=16)
            rep = s.scan()
            if rep["blocks"] != 10_000:
                raise RuntimeError(f"scan found {rep['blocks']} blocks")

        ts = median_time(fresh_scan, self.R)
        self.res["scan_10k_s"] = ts
        self.rows.append(("scan(): 10,000 block headers (fresh index, warm cache)", f"{ts:.3f} s",
                          f"built in {build:.1f} s"))
        files = [os.path.join(dp, f) for dp, _, fs in os.walk(root) for f in fs]

        def drop():
            for p in files:
                fd = os.open(p, os.O_RDONLY)
                self.K.drop_cache(fd)
                os.close(fd)

        tc = median_time(fresh_scan, self.R, setup=drop)
        self.res["scan_10k_cold_s"] = tc
        self.rows.append(("scan(): 10,000 block headers, pages dropped", f"{tc:.3f} s", ""))
        shutil.rmtree(root, ignore_errors=True)

    # ------------------------------------------------------------------ output
    def add(self, what: str, seconds: float, nbytes: int) -> None:
        self.rows.append((what, f"{gbps(nbytes, seconds):.2f} GB/s", f"{seconds * 1e3:.1f} ms"))

    def run(self) -> dict:
        t0 = time.perf_counter()
        try:
            self.make_source()
            self.persist()
            self.restore()
            if self.mx is not None:
                self.ssd_restore()
            self.kernels()
            self.gil()
            self.dedup()
            self.scan()
        finally:
            self.io.close(timeout=60)
            shutil.rmtree(self.dir, ignore_errors=True)
        self.res["seconds"] = time.perf_counter() - t0
        return self.res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--full", action="store_true", help="8,192 tokens = 1 GiB snapshot")
    p.add_argument("--tokens", type=int, default=None, help="snapshot tokens (default 2048)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=os.environ.get("MLXKV_CACHE_DIR", "~/.cache/mlxkv"))
    p.add_argument("--json", action="store_true")
    p.add_argument("--read-threads", type=int, default=None,
                   help="threads verifying blocks of one restore (default: store's)")
    p.add_argument("--no-mlx", action="store_true",
                   help="skip the mlx / mlx-lm parts (numpy sources and destinations)")
    p.add_argument("--child-restore", choices=("ours", "mlx"), help=argparse.SUPPRESS)
    p.add_argument("--store-dir", help=argparse.SUPPRESS)
    p.add_argument("--mlx-file", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.tokens = args.tokens or (8192 if args.full else 2048)
    if args.child_restore:
        return child_restore(args)
    if args.tokens % 256:
        p.error("--tokens must be a multiple of 256 (the block size)")
    args.repeats = max(3, args.repeats)
    b = Bench(args)
    from mlxkv.storage import store

    print(f"bench.storage: {args.tokens} tokens x {LAYERS} layers x {HEADS} heads x {DIM} dim bf16 "
          f"= {b.nbytes / GIB:.3f} GiB snapshot{'' if args.full else ' (use --full for 1 GiB)'}; "
          f"median of {args.repeats}; kernel {store.KERNEL}; {os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.1f}; read threads {b.store.read_threads}; "
          f"folder {os.path.dirname(b.dir)}")
    res = b.run()
    w = max(len(r[0]) for r in b.rows)
    for what, a, c in b.rows:
        print(f"  {what:<{w}}  {a:>16}  {c}")
    print("ratios (ours / other, throughput):")
    for k in ("persist_vs_limit", "persist_vs_mlx_lm", "ssd_restore_vs_mlx_lm", "restore_vs_mlx_lm",
              "restore_zeroed_vs_mlx_lm", "restore_prealloc_vs_mlx_lm", "restore_vs_memcpy", "restore_cold_vs_limit",
              "hash_vs_xxhash", "packhash_vs_pack", "gil_ratio", "gil_max_stall_ms",
              "gil_control_ratio", "dedup_ratio", "scan_10k_s", "scan_10k_cold_s"):
        if k in res:
            print(f"  {k:<26} {res[k]:.3f}")
    if args.json:
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in res.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
