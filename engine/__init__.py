"""mlxkv engine: models, the generation loop, the engine thread and the prefix cache.

Importing this package does nothing else: the system-OpenBLAS preload that makes float32
CPU matmuls fast is a call, :func:`mlxkv.engine.blas.preload`, which the command line makes
before anything imports ``mlx.core`` (a program that embeds the engine makes it itself)."""

if __name__ != "mlxkv.engine":  # this checkout's folder, imported by its folder name
    raise ImportError(f"import mlxkv.engine, not {__name__}: the folder engine/ is the subpackage "
                      "mlxkv.engine, and a second copy under another name would not share its state")
