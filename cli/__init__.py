"""The command line's sub-commands (:func:`mlxkv.main` hands over to :mod:`mlxkv.cli.main`)."""

if __name__ != "mlxkv.cli":  # this checkout's folder, imported by its folder name
    raise ImportError(f"import mlxkv.cli, not {__name__}: the folder cli/ is the subpackage "
                      "mlxkv.cli, and a second copy under another name would not share its state")
