"""Build the engine's MLX primitives for the CPU (engine/native: few-row products and a
decode step's attention) in place, with CMake against the installed mlx wheel's headers
and nanobind in mlx's domain.

Optional: where CMake, nanobind or a C++20 compiler is missing, or mlx has no CPU backend
to speak of (macOS runs on Metal), it says why and exits 0, and the engine keeps its MLX paths
(the column-chunk layout of engine/weight_layout.py, MLX's attention). `make ext` runs it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "engine" / "native"
BUILD = ROOT / "build" / "native"


def _note(why: str) -> int:
    print(f"note: the CPU primitives (engine/native) are not built: {why}; "
          "the engine keeps its MLX paths", file=sys.stderr)
    return 0


def _cmake() -> str | None:
    here = Path(sys.executable).parent / "cmake"
    return str(here) if here.exists() else shutil.which("cmake")


def main() -> int:
    if sys.platform == "darwin":
        return _note("macOS runs on Metal")
    if os.environ.get("MLXKV_ROW_PRODUCT", "1") == "0":
        return _note("MLXKV_ROW_PRODUCT=0")
    cmake = _cmake()
    if cmake is None:
        return _note("no cmake")
    try:
        import mlx
        import nanobind
    except ImportError as e:
        return _note(f"{e.name} is not installed")
    configure = [cmake, "-S", str(SOURCE), "-B", str(BUILD), "-DCMAKE_BUILD_TYPE=Release",
                 f"-DPython_EXECUTABLE={sys.executable}", f"-Dnanobind_ROOT={nanobind.cmake_dir()}",
                 f"-DMLX_ROOT={mlx.__path__[0]}", f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={ROOT / 'engine'}"]
    steps = [] if (BUILD / "CMakeCache.txt").exists() else [configure]
    steps.append([cmake, "--build", str(BUILD), "-j", str(os.cpu_count() or 1)])
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True)
        if done.returncode:
            tail = (done.stdout + done.stderr).strip().splitlines()[-15:]
            print("\n".join(tail), file=sys.stderr)
            return _note(f"`{' '.join(step[:2])}` failed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
