"""Build the Cython kernels (storage, attention). Everything else lives in pyproject.toml."""
import os
import sys

from Cython.Build import cythonize
from setuptools import Extension, setup

extra_compile_args = ["-O3"]
if sys.platform != "win32":
    extra_compile_args += ["-fno-strict-aliasing"]
if os.environ.get("MLXKV_NATIVE") == "1":
    extra_compile_args.append("-march=native")

# Cython names the module after the folder it sits in (``storage._blocks``), which is how
# it finds ``_blocks.pxd`` beside the .pyx; the compiled extension is installed as
# ``mlxkv.storage._blocks`` (the ``package-dir`` mapping maps ``storage/`` to ``mlxkv.storage``).
[cython_ext, kernels_ext] = cythonize(
    [Extension("storage._blocks", ["storage/_blocks.pyx"],
               # Rebuild when the C headers change, not only the .pyx.
               depends=["storage/_blocks.pxd", "storage/xxh3.h", "storage/fileio.h"]),
     Extension("engine._kernels", ["engine/_kernels.pyx"], depends=["engine/kernels.h"])],
    language_level=3,
    compiler_directives={"boundscheck": False, "wraparound": False, "cdivision": True},
)

setup(
    ext_modules=[Extension(
        "mlxkv.storage._blocks", cython_ext.sources, include_dirs=["storage"],
        depends=cython_ext.depends, extra_compile_args=extra_compile_args),
        # The prefill's softmax and swiglu (engine/kernels.h picks its SIMD width at run time).
        Extension("mlxkv.engine._kernels", kernels_ext.sources, include_dirs=["engine"],
                  depends=kernels_ext.depends, extra_compile_args=extra_compile_args,
                  extra_link_args=[] if sys.platform == "win32" else ["-pthread"])],
)
