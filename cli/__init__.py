"""The command line's sub-commands (``mlxkv.py`` parses arguments and dispatches here)."""
