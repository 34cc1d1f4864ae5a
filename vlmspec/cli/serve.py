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

from vlmspec.cli.options import SERVICE_PROMPT_CACHE_MIB, UsageError, add_engine_args, describe_speculation, engine_spec, env_default, float_in, int_in, non_negative_int, positive_int

SERVE_EXTRA = ("fastapi", "uvicorn")
INSTALL_HINT = "the server needs fastapi, uvicorn and prometheus_client: pip install 'vlmspec[serve]'"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="the OpenAI-compatible REST API (and demo UI) on the default model or --model",
                       description="OpenAI-compatible REST API with speculative decoding")
    add_engine_args(p)
    p.set_defaults(prompt_cache_mb=SERVICE_PROMPT_CACHE_MIB)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int_in("--port", 0, 65535), default=8000, help='port to listen on (0 = any free port)')
    p.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every route but /healthz; repeat it (or separate keys with commas) "
                        "for several clients: each key is a tenant, whose earlier answers the suffix drafter never proposes to "
                        "another (default: $VLMSPEC_API_KEY, comma-separated keys, else open)")
    p.add_argument("--allow-remote-images", action="store_true", help="let clients pass http(s) image URLs (the server fetches them)")
    p.add_argument("--served-model-name", default=None, help="the `model` name clients send (default: the model folder's name)")
    p.add_argument("--max-batch", type=positive_int("--max-batch"), default=16,
                   help="requests decoded together (continuous batching; 1: one at a time)")
    p.add_argument("--max-queue", type=non_negative_int("--max-queue"), default=16, help="requests waiting for a free slot")
    p.add_argument("--request-timeout", type=float_in("--request-timeout", 0.0, 1e6, low_open=True), default=120.0,
                   help="seconds from a request's arrival to its last token")
    p.add_argument("--max-model-len", type=int_in("--max-model-len", 2, 10**7), default=None,
                   help="the longest prompt + answer a request may have, in tokens; the KV pool (every slot this plus the "
                        "draft tree) is sized from it at start-up and never grows; longer requests get a 400 (default: the "
                        "model's context, at most 2048)")
    p.add_argument("--prefill-chunk", type=non_negative_int("--prefill-chunk"), default=512,
                   help="prompts longer than this many tokens enter the batch in pieces of at most this many, one per "
                        "step, so the requests already decoding wait for at most one piece (chunked prefill; a piece "
                        "never splits an image); 0: whole prompts")
    p.add_argument("--prefill-first", action=argparse.BooleanOptionalAction, default=True,
                   help="prompts that join are prefilled before the running requests' next decode round, so a burst gets its "
                        "first tokens sooner while the running requests pause (default); --no-prefill-first: one step's "
                        "prefill budget (--prefill-chunk) beside every decode round")
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
    p.add_argument("--drain-seconds", type=float_in("--drain-seconds", 0.0, 1e6), default=30.0,
                   help="on SIGTERM or SIGINT, how long the requests already accepted may run to their end (new ones get 503 "
                        "meanwhile; what is left then gets 503), before the server stops and exits 0; with --replicas, "
                        "every replica's drain (and Ray's graceful shutdown of it)")
    p.add_argument("--no-ui", action="store_true", help="do not mount the Gradio demo at /ui")
    p.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="uvicorn's log level")
    scale = p.add_argument_group("scale out on Ray Serve (any of these: the app as a Ray Serve deployment behind Ray's HTTP proxy; "
                                 "needs pip install 'vlmspec[ray]'; docs/scale-out.md)")
    scale.add_argument("--replicas", type=positive_int("--replicas"), default=None,
                       help="replicas, each with its own engine, batch and queue (with --min/--max-replicas: the count at start)")
    scale.add_argument("--min-replicas", type=positive_int("--min-replicas"), default=None,
                       help="autoscaling on the replicas' ongoing requests: the fewest replicas (default 1)")
    scale.add_argument("--max-replicas", type=positive_int("--max-replicas"), default=None,
                       help="autoscaling: the most replicas (default: --replicas, else --min-replicas)")
    scale.add_argument("--ray-address", default=None,
                       help="join a running Ray cluster: its head's HOST:PORT (what `ray start --head` prints) or 'auto'; "
                            "default: start a local Ray on this machine")
    scale.add_argument("--replica-cpus", type=float_in("--replica-cpus", 0.0, 1024.0, low_open=True), default=1.0,
                       help="CPUs Ray reserves for each replica (its torch threads: this, rounded, at least 1)")
    p.set_defaults(func=run)


RAY_HINT = "--replicas, --min/--max-replicas and --ray-address need Ray Serve: pip install 'vlmspec[ray]'"
RAY_OPTIONS = ("replicas", "min_replicas", "max_replicas", "ray_address")


def ray_config(args: argparse.Namespace):
    """The `RayConfig` of the scale-out options (None when none is given: one process, no Ray).
    UsageError, in one line, for a bad combination, a missing Ray or an address nobody answers at."""
    if all(getattr(args, name, None) is None for name in RAY_OPTIONS):
        if getattr(args, "replica_cpus", 1.0) != 1.0:
            raise UsageError("--replica-cpus is for replicas on Ray: pass --replicas N (or --min/--max-replicas) too")
        return None
    lo, hi, n = args.min_replicas, args.max_replicas, args.replicas
    autoscaling = lo is not None or hi is not None
    if autoscaling:
        lo = 1 if lo is None else lo
        hi = hi if hi is not None else max(lo, n or lo)
        if lo > hi:
            raise UsageError(f"--min-replicas {lo} is above --max-replicas {hi}: pass min <= max")
        if n is not None and not lo <= n <= hi:
            raise UsageError(f"--replicas {n} is outside --min-replicas {lo} .. --max-replicas {hi}: the count at start must be in the range")
    if importlib.util.find_spec("ray") is None:
        raise UsageError(RAY_HINT)
    if args.ray_address is not None:
        join_auth()  # before anything imports Ray, which reads RAY_AUTH_MODE once (finding ray.serve imports it)
    if importlib.util.find_spec("ray.serve") is None:
        raise UsageError(RAY_HINT)
    if args.ray_address is not None:
        check_ray_address(args.ray_address)
    from vlmspec.app.ray_config import RayConfig

    return RayConfig(replicas=n or (lo if autoscaling else 1), min_replicas=lo, max_replicas=hi if autoscaling else None,
                     address=args.ray_address, replica_cpus=args.replica_cpus)


def check_ray_address(address: str, timeout_s: float = 5.0) -> None:
    """UsageError unless something answers at the HOST:PORT of `address` ('auto' is left to Ray)."""
    if address == "auto":
        return
    host, _, port = address.split("://", 1)[-1].rpartition(":")
    if not host or not port.isdigit():
        raise UsageError(f"--ray-address must be HOST:PORT (the head node's, as `ray start --head` prints it) or 'auto', got {address!r}")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
        raise UsageError(f"--ray-address {address}: no Ray cluster answers there ({why}); start its head with 'ray start --head' "
                         "and pass the address it prints, or leave --ray-address out for a local Ray") from None


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


def api_keys(given: list[str] | None) -> tuple[str, ...]:
    """--api-key values (each may hold several, comma-separated), else $VLMSPEC_API_KEY's: the keys, in order, once each."""
    raw = given if given is not None else [env_default("VLMSPEC_API_KEY") or ""]
    keys = [k.strip() for value in raw for k in value.split(",")]
    if given is not None and not all(keys):
        raise UsageError("--api-key: an empty key (a stray comma or an empty value): give each key once, e.g. --api-key KEY1,KEY2")
    return tuple(dict.fromkeys(k for k in keys if k))


def server_settings(args: argparse.Namespace, model: str, ui: bool):
    from vlmspec.app import ServerSettings

    return ServerSettings(
        model=served_name(model, args.served_model_name), model_aliases=(model,), api_keys=api_keys(args.api_key),
        allow_remote_images=args.allow_remote_images, max_batch=args.max_batch, max_queue=args.max_queue,
        request_timeout_s=args.request_timeout, max_tokens_cap=args.max_tokens_cap, max_images=args.max_images,
        max_image_pixels=args.max_image_pixels, max_image_aspect_ratio=args.max_image_aspect_ratio, max_body_bytes=args.max_body_bytes,
        shutdown_grace_s=args.drain_seconds, ui=ui, max_model_len=args.max_model_len, prefill_chunk=args.prefill_chunk or None,
        prefill_first=args.prefill_first,
    )


def run(args: argparse.Namespace) -> int:
    if any(importlib.util.find_spec(m) is None for m in SERVE_EXTRA):  # before the model loads
        raise UsageError(INSTALL_HINT)
    scale_out = ray_config(args)
    check_port(args.host, args.port)
    from vlmspec import factory

    spec = engine_spec(args, max_batch=args.max_batch)  # the goodput cost is measured up to the batch it serves
    model = factory.resolve_model(spec.model, spec.drafter)  # no --model: the one a drafter folder records
    drafter = factory.resolve_drafter(spec.drafter, model)  # a bad choice fails before the model loads
    if scale_out is not None:
        return run_on_ray(args, spec, model, drafter, scale_out)
    print(f"loading {model} (drafter: {drafter}) ...", file=sys.stderr)
    engine = factory.build_engine(spec)
    print(f"speculation: {describe_speculation(engine)}", file=sys.stderr)
    try:
        from vlmspec.app import serve
    except ModuleNotFoundError as exc:  # an optional dependency of the service
        if exc.name and not exc.name.startswith("vlmspec"):
            raise UsageError(f"{INSTALL_HINT} ({exc.name} is missing)") from None
        raise
    settings = server_settings(args, model, ui=not args.no_ui)
    code = serve(engine, settings, args.host, args.port, args.log_level)
    return code if isinstance(code, int) else 0


def join_auth() -> None:
    """Joining a cluster (--ray-address): Ray's token authentication on this side where a token is here
    and RAY_AUTH_MODE is not set (`vlmspec.app.ray_config.client_auth`), said in one line on stderr."""
    from vlmspec.app.ray_config import client_auth

    auth = client_auth(os.environ, Path.home())
    os.environ.update(auth.env)
    if auth.note:
        print(auth.note, file=sys.stderr)


def run_on_ray(args: argparse.Namespace, spec, model: str, drafter: str, scale_out) -> int:
    """The same app as a Ray Serve deployment: the replicas load the model (this process does not).
    Local folders are passed as absolute paths (a replica's working directory is Ray's); on a
    cluster every node needs them at that path (or pass a hub id)."""
    import dataclasses

    def absolute(name: str) -> str:
        return str(Path(name).resolve()) if Path(name).is_dir() else name

    spec = dataclasses.replace(spec, model=absolute(model), drafter=absolute(drafter))
    from vlmspec.app.ray_serve import serve_on_ray

    # the demo UI is not mounted on replicas: a Gradio session's requests must reach one process
    settings = server_settings(args, model, ui=False)
    import ray.exceptions

    refused = (ConnectionError, getattr(ray.exceptions, "AuthenticationError", ConnectionError))
    try:
        return serve_on_ray(spec, settings, scale_out, drafter, args.host, args.port)
    except refused as exc:  # ray.init: no cluster at --ray-address (e.g. 'auto' with none running), or its token refused
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        from vlmspec.app.ray_config import client_auth

        hint = client_auth(os.environ, Path.home()).hint if args.ray_address is not None else ""  # what to export, or check
        raise UsageError(f"--ray-address {args.ray_address}: {first}{hint}") from None
