"""mlxkv: a local LLM engine on MLX whose long prompts come back instantly.

One import name, five subpackages: ``mlxkv.engine`` (models, generation, speculation, the
tiered prefix cache), ``mlxkv.storage`` (the block store and its Cython kernel),
``mlxkv.server`` (OpenAI- and Anthropic-compatible HTTP), ``mlxkv.cli`` and ``mlxkv.tui``.

In the repository the subpackages are the top-level folders ``engine/``, ``storage/``,
``server/``, ``cli/`` and ``tui/``; this folder holds a symbolic link to each, so a source
checkout, ``python -m mlxkv``, the type checker and editors all resolve ``mlxkv.engine``
with nothing installed. A wheel installs the folders themselves inside this package
(setuptools' ``package-dir`` mapping in ``pyproject.toml``).
"""

from __future__ import annotations

__version__ = "0.1.0"


def main(argv: list[str] | None = None) -> int:
    """The ``mlxkv`` command (console script, ``python -m mlxkv``, the executable)."""
    from mlxkv.cli.main import main as cli_main

    return cli_main(argv)
