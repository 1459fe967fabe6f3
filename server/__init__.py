"""``mlxkv serve``: OpenAI- and Anthropic-compatible HTTP API in front of the engine thread.

Starlette routes on uvicorn; every request becomes one :class:`mlxkv.engine.requests.Request`
submitted to the one :class:`mlxkv.engine.engine.Engine`, whose events are carried back to the
event loop and written out as JSON or server-sent events.

    from mlxkv.server.app import ServerConfig, create_app
    app = create_app(engine, ServerConfig(...))      # any ASGI server can run it
    from mlxkv.server.run import serve
    serve(settings)                                   # what `mlxkv serve` does
"""

if __name__ != "mlxkv.server":  # this checkout's folder, imported by its folder name
    raise ImportError(f"import mlxkv.server, not {__name__}: the folder server/ is the subpackage "
                      "mlxkv.server, and a second copy under another name would not share its state")
