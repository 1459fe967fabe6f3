"""Micro benchmark of the storage kernels against their limits, in one run.

    python -m bench.kernels [--tokens N | --full] [--repeats R] [--json]

- hash: ``storage._blocks.xxh3_64`` vs the ``xxhash`` package on one large buffer;
- pack: gather a synthetic KV snapshot (32 layers x 8 KV heads x 128 dim, bf16 = 128 KiB
  per token) block by block, without and with the fused hash, vs a numpy copy of the same
  bytes (memory-copy bandwidth); unpack likewise for the restore direction.
Each figure is the median over interleaved repeats, and ratios are taken per repeat, so a
noisy shared machine moves numerator and denominator together. Import ``measure_hash``,
``measure_pack`` and ``make_snapshot`` to reuse them (bench/storage.py does).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import numpy as np
import xxhash

from mlxkv.storage import _blocks

LAYERS, HEADS, DIM, ITEMSIZE = 32, 8, 128, 2  # bf16
TOKEN_BYTES = LAYERS * 2 * HEADS * DIM * ITEMSIZE  # K and V: 128 KiB per token


def make_snapshot(tokens: int, layers: int = LAYERS, heads: int = HEADS, dim: int = DIM,
                  seed: int = 0) -> list[tuple[np.ndarray, int, int, int]]:
    """Segments of a KVCache-like snapshot: per layer K and V [1, heads, tokens, dim] bf16
    bits (uint16), random so the hash cannot shortcut anything."""
    rng = np.random.default_rng(seed)
    segs = []
    for _ in range(layers * 2):
        a = rng.integers(0, 2**16, (1, heads, tokens, dim), dtype=np.uint16)
        segs.append((a, heads, tokens, dim * ITEMSIZE))
    return segs


def _timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _interleave(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Run every fn once per round (after one warm-up round), alternating the order each
    round so neither side always runs first; seconds per fn per round."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for r in range(repeats):
        for k in names if r % 2 == 0 else reversed(names):
            times[k].append(_timed(fns[k]))
    return times


def _summarize(times: dict[str, list[float]], nbytes: int, pairs: dict[str, tuple[str, str]]
               ) -> dict[str, float]:
    out: dict[str, float] = {}
    for k, ts in times.items():
        out[f"{k}_gbps"] = round(nbytes / statistics.median(ts) / 1e9, 3)
    for name, (num, den) in pairs.items():
        # ratio of throughputs = inverse ratio of times, per round, then the median
        out[name] = round(statistics.median(d / n for n, d in zip(times[num], times[den])), 3)
    return out


def measure_hash(buf, repeats: int = 5, seed: int = 0) -> dict[str, float]:
    """xxh3_64 (ours) vs xxhash.xxh3_64_intdigest on ``buf``: GB/s and ``hash_vs_xxhash``."""
    mv = memoryview(buf).cast("B")
    if _blocks.xxh3_64(mv, seed) != xxhash.xxh3_64_intdigest(mv, seed):
        raise AssertionError("xxh3_64 disagrees with the xxhash package")
    times = _interleave({
        "xxh3": lambda: _blocks.xxh3_64(mv, seed),
        "xxhash": lambda: xxhash.xxh3_64_intdigest(mv, seed),
    }, repeats)
    res = _summarize(times, mv.nbytes, {"hash_vs_xxhash": ("xxh3", "xxhash")})
    res["bytes"] = mv.nbytes
    return res


def measure_pack(segments, block_tokens: int = 256, repeats: int = 5) -> dict[str, float]:
    """Pack (and unpack) ``segments`` block by block into one reused aligned block buffer.

    Keys: pack/packhash/unpack/unpackhash/memcpy GB/s, ``packhash_vs_pack``,
    ``pack_vs_memcpy``, ``unpackhash_vs_unpack``, ``unpack_vs_memcpy``.
    """
    t_cap = segments[0][2]
    starts = list(range(0, t_cap, block_tokens))
    block = _blocks.AlignedBuffer(_blocks.packed_size(segments, block_tokens))
    total = _blocks.packed_size(segments, t_cap)
    # memcpy limit: the same bytes, contiguous source, block-sized copies into one buffer.
    flat = np.empty(total, np.uint8)
    pos = 0
    for a, *_ in segments:
        b = memoryview(a).cast("B")
        flat[pos : pos + b.nbytes] = np.frombuffer(b, np.uint8)
        pos += b.nbytes
    dst = np.frombuffer(block, np.uint8)
    restore = [(np.empty_like(a),) + tuple(rest) for a, *rest in segments]

    def pack(hash_: bool):
        for t0 in starts:
            _blocks.pack(block, 0, segments, t0, min(t0 + block_tokens, t_cap), hash=hash_)

    def unpack(hash_: bool):
        for t0 in starts:
            n = min(block_tokens, t_cap - t0)
            if hash_:
                _blocks.unpack_hash(block, 0, restore, t0, n)
            else:
                _blocks.unpack(block, 0, restore, t0, n)

    def memcpy():
        step = dst.nbytes
        for off in range(0, total, step):
            n = min(step, total - off)
            np.copyto(dst[:n], flat[off : off + n])

    times = _interleave({
        "pack": lambda: pack(False),
        "packhash": lambda: pack(True),
        "unpack": lambda: unpack(False),
        "unpackhash": lambda: unpack(True),
        "memcpy": memcpy,
    }, repeats)
    res = _summarize(times, total, {
        "packhash_vs_pack": ("packhash", "pack"),
        "pack_vs_memcpy": ("pack", "memcpy"),
        "unpackhash_vs_unpack": ("unpackhash", "unpack"),
        "unpack_vs_memcpy": ("unpack", "memcpy"),
    })
    res["bytes"] = total
    return res


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048, help="snapshot tokens (128 KiB each)")
    ap.add_argument("--full", action="store_true", help="8,192 tokens = 1 GiB")
    ap.add_argument("--block-tokens", type=int, default=256)
    ap.add_argument("--hash-mib", type=int, default=64, help="hash buffer size")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true", help="print one JSON object last")
    args = ap.parse_args(argv)
    tokens = 8192 if args.full else args.tokens

    hbuf = np.random.default_rng(1).integers(0, 256, args.hash_mib << 20, dtype=np.uint8)
    h = measure_hash(hbuf, args.repeats)
    del hbuf
    segs = make_snapshot(tokens)
    p = measure_pack(segs, args.block_tokens, args.repeats)
    result = {"hash_isa": _blocks.hash_isa(), "tokens": tokens, **h,
              **{k: v for k, v in p.items() if k != "bytes"}, "snapshot_bytes": p["bytes"]}

    gib = p["bytes"] / 2**30
    rows = [
        (f"xxh3_64 (ours), {args.hash_mib} MiB", h["xxh3_gbps"], f"{h['hash_vs_xxhash']:.2f}x xxhash"),
        ("xxhash package", h["xxhash_gbps"], ""),
        (f"pack, {gib:.2f} GiB snapshot", p["pack_gbps"], f"{p['pack_vs_memcpy']:.2f}x memcpy"),
        ("pack + hash (fused)", p["packhash_gbps"], f"{p['packhash_vs_pack']:.2f}x pack"),
        ("unpack", p["unpack_gbps"], f"{p['unpack_vs_memcpy']:.2f}x memcpy"),
        ("unpack + hash (fused)", p["unpackhash_gbps"], f"{p['unpackhash_vs_unpack']:.2f}x unpack"),
        ("memcpy (numpy copy)", p["memcpy_gbps"], ""),
    ]
    print(f"storage kernels: hash loop {result['hash_isa']}, median of {args.repeats} "
          f"interleaved repeats, {args.block_tokens}-token blocks")
    print(f"{'measure':<34}{'GB/s':>8}   ratio")
    for name, gbps, ratio in rows:
        print(f"{name:<34}{gbps:>8.2f}   {ratio}")
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
