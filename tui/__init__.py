"""The Textual terminal UI of mlxkv: a streaming chat with persisted conversations
(:mod:`mlxkv.tui.chat`) and a cache inspector (:mod:`mlxkv.tui.inspector`), on one engine reached only
through :mod:`mlxkv.tui.bridge`. ``mlxkv.tui.app.run(settings)`` is what bare ``mlxkv`` opens.

Importing this package (or ``mlxkv.tui.app``) imports neither mlx nor the engine: the engine is
imported and started on a background thread, so the first screen takes keys at once."""

if __name__ != "mlxkv.tui":  # this checkout's folder, imported by its folder name
    raise ImportError(f"import mlxkv.tui, not {__name__}: the folder tui/ is the subpackage "
                      "mlxkv.tui, and a second copy under another name would not share its state")
