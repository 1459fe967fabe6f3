"""The "bench" model: a realistic-shape qwen3 with random weights, built offline on demand
into a git-ignored folder (``.cache/models``). Sized for the BLAS in use: about 100M
parameters with OpenBLAS, about 40M on mlx's reference BLAS.

    from bench.models import bench_model_path
    path = bench_model_path()      # builds it the first time (tens of seconds)
"""

from __future__ import annotations

from pathlib import Path

# qwen3, hidden 1024, 8 layers, 16 query heads and 4 KV heads of 64: ~97M parameters.
OPENBLAS_SHAPE = {"hidden_size": 1024, "num_hidden_layers": 8, "intermediate_size": 3072,
                  "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64}
# Without a fast BLAS a cold 4k prefill of the big one takes minutes: ~38M parameters.
REFERENCE_SHAPE = {"hidden_size": 768, "num_hidden_layers": 6, "intermediate_size": 2048,
                   "num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": 64}


def bench_shape(blas_active: bool | None = None) -> dict:
    if blas_active is None:
        import engine  # noqa: F401  (loads the BLAS before mlx)
        from engine.blas import blas_info

        blas_active = blas_info()["name"] != "reference (bundled with mlx)"
    return dict(OPENBLAS_SHAPE if blas_active else REFERENCE_SHAPE)


def bench_model_path(blas_active: bool | None = None) -> Path:
    """Folder of the bench model for the BLAS in use (built once, then reused)."""
    import engine  # noqa: F401
    from bench.modelgen import TEST_MODELS, build_random_model

    shape = bench_shape(blas_active)
    name = "bench-qwen3-h{hidden_size}-l{num_hidden_layers}-kv{num_key_value_heads}".format(
        **shape)
    return build_random_model(TEST_MODELS / name, arch="qwen3", vocab_size=2048, seed=1,
                              tie_word_embeddings=False, **shape)


def parameter_count(path: Path) -> int:
    """Parameters stored in a model folder (from the safetensors headers, no loading)."""
    import json
    import struct

    total = 0
    for f in sorted(Path(path).glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for key, meta in header.items():
            if key != "__metadata__":
                count = 1
                for d in meta["shape"]:
                    count *= d
                total += count
    return total


if __name__ == "__main__":
    p = bench_model_path()
    print(p, f"{parameter_count(p) / 1e6:.1f}M parameters")
