"""The vlmspec service (installed as `vlmspec.app`): an OpenAI-compatible REST API over one
engine (plain requests are rows of its batch that never draft), and a Gradio demo.

    from vlmspec.app import ServerSettings, create_app, serve
    app = create_app(engine, ServerSettings(...))     # -> FastAPI; nothing is loaded at import time
    serve(engine, settings, host, port)               # prints the URLs, runs uvicorn (what `vlmspec serve` calls)

Layering: app -> vlmspec, never the reverse; app never imports vlmspec.cli; engines are built by
vlmspec.factory. The routes, the request's fields and every status code: docs/api.md; the files
and a request's walk from HTTP to tokens: docs/architecture.md, "The service"."""

from .routes import create_app
from .serve import serve
from .settings import ServerSettings

__all__ = ["ServerSettings", "create_app", "serve"]
