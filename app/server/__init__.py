"""`kvchat serve`: an OpenAI-compatible HTTP server over the engine.

- `command`: the ``serve`` flags, start-up checks, the final all-blocks-free check
- `runner`: uvicorn with kvchat's signal handling (why Starlette + uvicorn: there)
- `app`: routes (/v1/models, /v1/chat/completions, /v1/completions, /health, /metrics)
- `openai_schema`: request bodies checked into a `ParsedRequest`; `responses`: reply shapes
- `serving`: one request's life (encode, admit, submit, stream or collect)
- `streaming`: engine events to the event loop; a disconnect cancels the request
- `keys`: API keys -> tenants; `errors`: OpenAI's error format; `metrics_export`: Prometheus
- `log`: the server's own stderr lines (start-up, drain, reloads, the final check)

Importing this package loads neither starlette nor uvicorn (the CLI registers ``serve``
on every start).
"""

from app.server.command import add_parser

__all__ = ["add_parser"]
