"""`vlmspec serve`: the OpenAI-compatible REST API (and the demo UI at /ui) on one engine.

The engine is built here (`vlmspec.factory`); the service is `vlmspec.app`, imported only when
this command runs (the one place the CLI reaches into the app layer):

    engine = factory.build_engine(spec)
    from vlmspec.app import ServerSettings, serve
    serve(engine, ServerSettings(...), host, port, log_level)
"""

from __future__ import annotations

import argparse
import errno
import importlib.util
import os
import socket
import sys
from pathlib import Path

from vlmspec.cli.options import UsageError, add_engine_args, describe_speculation, engine_spec, env_default, float_in, int_in, non_negative_int, positive_int

SERVE_EXTRA = ("fastapi", "uvicorn")
INSTALL_HINT = "the server needs fastapi, uvicorn and prometheus_client: pip install 'vlmspec[serve]'"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="the OpenAI-compatible REST API (and demo UI) on the default model or --model",
                       description="OpenAI-compatible REST API with speculative decoding")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int_in("--port", 0, 65535), default=8000, help='port to listen on (0 = any free port)')
    p.add_argument("--api-key", default=env_default("VLMSPEC_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every route but /healthz (default: $VLMSPEC_API_KEY, else open)")
    p.add_argument("--allow-remote-images", action="store_true", help="let clients pass http(s) image URLs (the server fetches them)")
    p.add_argument("--served-model-name", default=None, help="the `model` name clients send (default: the model folder's name)")
    p.add_argument("--max-batch", type=positive_int("--max-batch"), default=16,
                   help="requests decoded together (continuous batching; 1: one at a time)")
    p.add_argument("--max-queue", type=non_negative_int("--max-queue"), default=16, help="requests waiting for a free slot")
    p.add_argument("--request-timeout", type=float_in("--request-timeout", 0.0, 1e6, low_open=True), default=120.0,
                   help="seconds from a request's arrival to its last token")
    p.add_argument("--max-tokens-cap", type=positive_int("--max-tokens-cap"), default=1024, help="the most max_tokens a request may ask for")
    p.add_argument("--max-images", type=non_negative_int("--max-images"), default=4, help="images per request")
    p.add_argument("--max-image-pixels", type=positive_int("--max-image-pixels"), default=4096 * 4096,
                   help="pixels per image (width x height, read from the header before decoding: larger ones, "
                        "decompression bombs included, get a 400)")
    p.add_argument("--max-image-aspect-ratio", type=float_in("--max-image-aspect-ratio", 1.0, 1e6), default=100.0,
                   help="longest side / shortest side of an image")
    p.add_argument("--max-body-bytes", type=positive_int("--max-body-bytes"), default=20 * 1024 * 1024,
                   help="bytes per request body (413 above), and per remote image with --allow-remote-images; "
                        "the demo's uploads too")
    p.add_argument("--no-ui", action="store_true", help="do not mount the Gradio demo at /ui")
    p.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="uvicorn's log level")
    p.set_defaults(func=run)


def served_name(model: str, served_model_name: str | None) -> str:
    """The `model` name clients send: --served-model-name, else the model folder's name, else the hub id."""
    return served_model_name or (Path(model).name if Path(model).is_dir() else model)


def check_port(host: str, port: int) -> None:
    """UsageError when host:port cannot be bound (in use, or not an address of this machine), so that
    `serve` says so in one line before it loads a model, instead of dying after printing its URLs."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise UsageError(f"--host {host}: cannot resolve it ({exc.strerror})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        if os.name != "nt":
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no conflict
        try:
            probe.bind(address)
        except OSError as exc:
            why = "is already in use" if exc.errno == errno.EADDRINUSE else f"cannot be bound ({exc.strerror})"
            raise UsageError(f"{host}:{port} {why}: pick another port with --port (make serve PORT=...)") from None


def run(args: argparse.Namespace) -> int:
    if any(importlib.util.find_spec(m) is None for m in SERVE_EXTRA):  # before the model loads
        raise UsageError(INSTALL_HINT)
    check_port(args.host, args.port)
    from vlmspec import factory

    spec = engine_spec(args, max_batch=args.max_batch)  # the goodput cost is measured up to the batch it serves
    model = factory.resolve_model(spec.model)
    drafter = factory.resolve_drafter(spec.drafter, model)  # a bad choice fails before the model loads
    print(f"loading {model} (drafter: {drafter}) ...", file=sys.stderr)
    engine = factory.build_engine(spec)
    print(f"speculation: {describe_speculation(engine)}", file=sys.stderr)
    try:
        from vlmspec.app import ServerSettings, serve
    except ModuleNotFoundError as exc:  # an optional dependency of the service
        if exc.name and not exc.name.startswith("vlmspec"):
            raise UsageError(f"{INSTALL_HINT} ({exc.name} is missing)") from None
        raise
    settings = ServerSettings(
        model=served_name(model, args.served_model_name), model_aliases=(model,), api_key=args.api_key,
        allow_remote_images=args.allow_remote_images, max_batch=args.max_batch, max_queue=args.max_queue,
        request_timeout_s=args.request_timeout, max_tokens_cap=args.max_tokens_cap, max_images=args.max_images,
        max_image_pixels=args.max_image_pixels, max_image_aspect_ratio=args.max_image_aspect_ratio, max_body_bytes=args.max_body_bytes,
        ui=not args.no_ui,
    )
    code = serve(engine, settings, args.host, args.port, args.log_level)
    return code if isinstance(code, int) else 0
