"""mlxkv engine: models, the generation loop, the engine thread and the prefix cache.

Importing this package is light (no mlx, no Textual): it only makes sure a system OpenBLAS
is loaded before anything imports ``mlx.core`` (see :mod:`engine.blas`)."""

from engine import blas as _blas

_blas.preload()
