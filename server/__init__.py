"""``mlxkv serve``: OpenAI- and Anthropic-compatible HTTP API in front of the engine thread.

Starlette routes on uvicorn; every request becomes one :class:`engine.requests.Request`
submitted to the one :class:`engine.engine.Engine`, whose events are carried back to the
event loop and written out as JSON or server-sent events.

    from server.app import ServerConfig, create_app
    app = create_app(engine, ServerConfig(...))      # any ASGI server can run it
    from server.run import serve
    serve(settings)                                   # what `mlxkv serve` does
"""
