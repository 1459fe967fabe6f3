"""``python -m mlxkv``: the command line (the console script and the executable run the
same :func:`mlxkv.main`)."""

import sys

from mlxkv import main

if __name__ == "__main__":
    sys.exit(main())
