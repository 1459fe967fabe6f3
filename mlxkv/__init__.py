"""mlxkv: a local LLM engine on MLX whose long prompts come back instantly.

One import name, five subpackages: ``mlxkv.engine`` (models, generation, speculation, the
tiered prefix cache), ``mlxkv.storage`` (the block store and its Cython kernel),
``mlxkv.server`` (OpenAI- and Anthropic-compatible HTTP), ``mlxkv.cli`` and ``mlxkv.tui``.

In the repository the subpackages are the top-level folders ``engine/``, ``storage/``,
``server/``, ``cli/`` and ``tui/``; a wheel installs them inside this package (setuptools'
``package-dir`` mapping in ``pyproject.toml``). In a source checkout this package therefore
also searches the checkout's root for its subpackages, so ``python -m mlxkv`` and the tests
run from a clone with nothing installed. An installed ``mlxkv`` holds its subpackages and
never looks elsewhere.
"""

from __future__ import annotations

import os as _os

__version__ = "0.1.0"

_here = _os.path.dirname(_os.path.abspath(__file__))
_root = _os.path.dirname(_here)
if not _os.path.isdir(_os.path.join(_here, "engine")) and all(
        _os.path.isfile(_os.path.join(_root, *part)) for part in
        (("pyproject.toml",), ("engine", "__init__.py"), ("storage", "_blocks.pyx"))):
    __path__.append(_root)  # noqa: F821 (a package's __path__ is set by the import system)


def main(argv: list[str] | None = None) -> int:
    """The ``mlxkv`` command (console script, ``python -m mlxkv``, the executable)."""
    from mlxkv.cli.main import main as cli_main

    return cli_main(argv)
