"""The Textual terminal UI of mlxkv: a streaming chat with persisted conversations
(:mod:`tui.chat`) and a cache inspector (:mod:`tui.inspector`), on one engine reached only
through :mod:`tui.bridge`. ``tui.app.run(settings)`` is what bare ``mlxkv`` opens.

Importing this package (or ``tui.app``) imports neither mlx nor the engine: the engine is
imported and started on a background thread, so the first screen takes keys at once."""
