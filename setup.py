"""Build the Cython storage kernel. Everything else lives in pyproject.toml."""
import os
import sys

from Cython.Build import cythonize
from setuptools import Extension, setup

extra_compile_args = ["-O3"]
if sys.platform != "win32":
    extra_compile_args += ["-fno-strict-aliasing"]
if os.environ.get("MLXKV_NATIVE") == "1":
    extra_compile_args.append("-march=native")

extensions = [
    Extension(
        "storage._blocks",
        ["storage/_blocks.pyx"],
        include_dirs=["storage"],
        # Rebuild when the C headers change, not only the .pyx.
        depends=["storage/_blocks.pxd", "storage/xxh3.h", "storage/fileio.h"],
        extra_compile_args=extra_compile_args,
    )
]

setup(
    ext_modules=cythonize(
        extensions,
        language_level=3,
        compiler_directives={"boundscheck": False, "wraparound": False, "cdivision": True},
    ),
)
