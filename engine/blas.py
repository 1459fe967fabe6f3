"""Load a system OpenBLAS before mlx so its CPU backend runs float32 matmuls on it.

The Linux CPU wheel of mlx links a bundled reference BLAS (a few GFLOP/s). ``libmlx.so``
leaves ``cblas_sgemm`` and friends undefined and the dynamic linker resolves them through
the global scope first, so a BLAS loaded with ``RTLD_GLOBAL`` *before* ``mlx.core`` is
imported wins. After ``mlx.core`` has been imported the symbols are already bound (or will
bind to the bundled copy), so :func:`preload` must run first: ``engine/__init__.py`` calls
it. ``MLXKV_BLAS=off`` disables it; ``MLXKV_BLAS=/path/libopenblas.so.0`` picks a library.

OpenBLAS picks its kernels by the CPU's model number, and a CPU it has no entry for (a
virtual machine's generic "Intel Xeon Processor", a newer model than the library) gets
its slowest x86-64 kernels ("Prescott"), several times slower than the AVX-512 kernels
on such a machine. Unless ``OPENBLAS_CORETYPE`` is set, :func:`preload` names the
kernel family the CPU's instruction set supports (the flags Linux reports), which is what
OpenBLAS itself picks on a CPU it knows.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
from typing import Any

# Debian/Ubuntu libopenblas0-pthread first (multi-threaded), then the generic names.
CANDIDATES = (
    "/usr/lib/*/openblas-pthread/libopenblas.so.0",
    "/usr/lib/*/openblas-openmp/libopenblas.so.0",
    "/usr/lib/*/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
    "/usr/local/lib/libopenblas.so.0",
    "/opt/homebrew/opt/openblas/lib/libopenblas.dylib",
)

_state: dict[str, Any] = {"requested": None, "path": None, "loaded": False, "active": False,
                          "reason": "preload() not called", "config": None, "core": None,
                          "core_source": "OpenBLAS's own detection"}
_handle: ctypes.CDLL | None = None


def _requested_setting() -> str:
    """MLXKV_BLAS, else the ``blas`` key of the config file, else "auto"."""
    value = os.environ.get("MLXKV_BLAS")
    if value:
        return value.strip()
    try:  # cheap: the config file is tiny and tomllib is stdlib
        from mlxkv.engine.settings import config_file_value

        value = config_file_value("blas")
    except Exception:  # a broken config file is reported by `mlxkv config`, not here
        value = None
    return str(value).strip() if value else "auto"


# The OpenBLAS kernel family for an x86-64 CPU's instruction set (its sgemm kernels are the
# ones it picks for the CPU models it knows with these flags), best first.
_CORE_BY_FLAGS = (
    ("SkylakeX", {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}),
    ("Haswell", {"avx2", "fma"}),
)


def core_for_flags(flags: set[str]) -> str | None:
    """The ``OPENBLAS_CORETYPE`` for a CPU with these ``/proc/cpuinfo`` flags, or None."""
    for core, needed in _CORE_BY_FLAGS:
        if needed <= flags:
            return core
    return None


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


def _choose_core() -> None:
    """Set ``OPENBLAS_CORETYPE`` from the CPU's flags unless the user set it (read by
    OpenBLAS when it is loaded, so before the load)."""
    if os.environ.get("OPENBLAS_CORETYPE"):
        _state["core_source"] = "OPENBLAS_CORETYPE"
        return
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        return
    core = core_for_flags(_cpu_flags())
    if core is not None:
        os.environ["OPENBLAS_CORETYPE"] = core
        _state["core_source"] = "the CPU's flags"


def find_openblas() -> str | None:
    """The first system OpenBLAS found on this machine, or None."""
    for pattern in CANDIDATES:
        for path in sorted(glob.glob(pattern)):
            if os.path.exists(path):
                return path
    return None


def preload(setting: str | None = None) -> dict[str, Any]:
    """Load a system OpenBLAS with global symbol visibility (idempotent).

    ``setting``: "auto" (default: load it if present), "off", or a library path."""
    global _handle
    if _state["loaded"] or _state["requested"] is not None:
        return blas_info()
    setting = (setting or _requested_setting()).strip()
    _state["requested"] = setting
    if setting.lower() in ("off", "0", "false", "no", "reference", "none"):
        _state["reason"] = "disabled by MLXKV_BLAS=off"
        return blas_info()
    if not sys.platform.startswith("linux"):
        _state["reason"] = "not needed on this platform (mlx brings its own BLAS)"
        return blas_info()
    path = find_openblas() if setting.lower() in ("auto", "on", "openblas", "") else setting
    if path is None:
        _state["reason"] = "no system OpenBLAS found (apt install libopenblas0-pthread)"
        return blas_info()
    mlx_already = "mlx.core" in sys.modules
    _choose_core()
    try:
        _handle = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        _state["reason"] = f"could not load {path}: {e}"
        return blas_info()
    _state.update(path=path, loaded=True)
    try:
        _handle.openblas_get_config.restype = ctypes.c_char_p
        _state["config"] = _handle.openblas_get_config().decode()
        _handle.openblas_get_corename.restype = ctypes.c_char_p
        _state["core"] = _handle.openblas_get_corename().decode()
    except AttributeError:
        pass
    if mlx_already:
        # Symbols of libmlx.so may already be bound to its bundled BLAS: say so.
        _state["reason"] = "loaded after mlx.core was imported: may not be in effect"
    else:
        _state["active"] = True
        _state["reason"] = "loaded with RTLD_GLOBAL before mlx.core"
    return blas_info()


def set_threads(n: int) -> bool:
    """Set the loaded OpenBLAS's thread count now (``openblas_set_num_threads``); False
    when no OpenBLAS is loaded or it lacks the call. The count is in ``blas_info()``."""
    if _handle is None or n < 1:
        return False
    try:
        _handle.openblas_set_num_threads(ctypes.c_int(int(n)))
        _handle.openblas_get_num_threads.restype = ctypes.c_int
        _state["threads"] = int(_handle.openblas_get_num_threads())
    except AttributeError:
        return False
    return True


def leave_a_core() -> bool:
    """An interactive front end shares the CPU with the engine thread: unless the user set
    ``OPENBLAS_NUM_THREADS``, BLAS gets one core fewer than the machine has, so the UI
    thread is not starved while a reply decodes (and on two cores decoding is faster too:
    fewer threads contend with the engine thread)."""
    if os.environ.get("OPENBLAS_NUM_THREADS"):
        return False
    return set_threads(max(1, (os.cpu_count() or 2) - 1))


def blas_info() -> dict[str, Any]:
    """Which BLAS mlx's CPU backend uses: {"name", "path", "active", "reason", ...}."""
    info = dict(_state)
    info["name"] = "openblas" if info["active"] else (
        "accelerate" if sys.platform == "darwin" else "reference (bundled with mlx)")
    return info


def describe() -> str:
    info = blas_info()
    if info["active"]:
        core = f", {info['core']} kernels from {info['core_source']}" if info["core"] else ""
        return f"OpenBLAS ({info['path']}{core})"
    return f"{info['name']}: {info['reason']}"

