"""Benchmarks (``python -m bench.NAME``; ``make bench`` runs them all). Development only:
not part of the installed package. Each benchmark calls :func:`mlxkv.engine.blas.preload`
before it imports ``mlx.core``, as the ``mlxkv`` command does (after it has set
``OPENBLAS_NUM_THREADS``, which OpenBLAS reads when it loads), so ours and mlx-lm's figures
are taken on the same BLAS."""
