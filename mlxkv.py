"""mlxkv command line: the entry point of the ``mlxkv`` console script and of
``build/mlxkv.spec``. The command line itself lives in ``cli/`` (``cli/main.py`` starts
there)."""

from __future__ import annotations

import sys

from cli.main import main
from cli.parser import VERSION as __version__

__all__ = ["main", "__version__"]

if __name__ == "__main__":
    sys.exit(main())
