"""Run the service: print its URLs, then uvicorn until SIGTERM or SIGINT, which drain it first
(`drain.DrainingServer`). The CLI's `vlmspec serve` parses the options, builds the engine through
vlmspec.factory and calls `serve`."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Iterator, TextIO

import uvicorn

from vlmspec.engine import SpecEngine

from .drain import DrainingServer
from .settings import ServerSettings

LOOPBACK = ("127.0.0.1", "localhost", "::1")
STARTUP_FAILURE = 3  # the exit code when the server did not start (uvicorn's)


def serve(engine: SpecEngine, settings: ServerSettings, host: str = "127.0.0.1", port: int = 8000,
          log_level: str = "info") -> int:
    """Serve `engine` (and plain decoding over its target) until SIGTERM or SIGINT, which drain it
    (`settings.shutdown_grace_s`). Returns the exit code: 0 once stopped, 3 when it did not start."""
    from . import create_app

    app = create_app(engine, settings)
    print_urls(settings, engine.drafter.name, host, port, app.state.ui_path, sys.stderr, app.state.docs_path)
    # after the drain every request has its answer; what is still being sent gets a few seconds
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    server = DrainingServer(config, app.state.service)
    server.run()
    return 0 if server.started else STARTUP_FAILURE


@contextmanager
def serving(engine: SpecEngine, settings: ServerSettings) -> Iterator[str]:
    """The service over `engine` on 127.0.0.1 and a free port, in a background thread, for the
    length of the block; yields its base URL (what `vlmspec bench server` sends its requests to)."""
    from . import create_app
    from .live_server import LiveServer

    with LiveServer(create_app(engine, settings)) as srv:
        yield srv.url


def print_urls(settings: ServerSettings, drafter: str, host: str, port: int, ui_path: str | None, out: TextIO,
               docs_path: str | None = "/docs") -> None:
    """What `vlmspec serve` prints before it starts listening."""
    shown = f"[{host}]" if ":" in host else host
    base = f"http://{shown}:{port}"
    print(f"vlmspec serve: model {settings.model!r}, drafter {drafter!r}", file=out)
    print(f"  API base: {base}/v1", file=out)
    if docs_path is not None:
        print(f"  docs:     {base}{docs_path}", file=out)
    print(f"  metrics:  {base}/metrics", file=out)
    print(f"  health:   {base}/healthz", file=out)
    if ui_path is not None:
        login = "  (login: a user name, an API key as password)" if not settings.open else ""
        print(f"  demo UI:  {base}{ui_path}{login}", file=out)
    elif settings.ui:
        print("  demo UI:  not mounted (pip install gradio)", file=out)
    if host not in LOOPBACK and settings.open:
        print("  warning: listening beyond loopback without --api-key", file=out)
