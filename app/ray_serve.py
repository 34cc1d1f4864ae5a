"""The service on Ray Serve (`vlmspec serve --replicas N`, #49): the same FastAPI app, `create_app`, as
a Ray Serve deployment of N replicas behind Ray's HTTP proxy. Ray does placement, routing, health
checks, replacement and autoscaling; each replica builds its own engine (`vlmspec.factory.build_engine`)
and runs its own worker and queue: nothing is shared between replicas (docs/scale-out.md).

    cfg = RayConfig(replicas=2)                                    # or min_replicas / max_replicas: autoscaling
    with ray_serving(spec, settings, cfg, port=0) as url: ...      # tests and benches: Ray's proxy URL
    serve_on_ray(spec, settings, cfg, host, port)                  # `vlmspec serve --replicas N` (until SIGTERM / SIGINT)

Added to the one-process app: the header ``x-vlmspec-replica`` on every answer; ``GET /metrics/replicas``, every
live replica's metrics labelled ``replica="<id>"`` (a Serve broadcast); ``check_health``, which fails when the
replica's worker thread is gone, so Ray replaces it. Ray is optional (``pip install 'vlmspec[ray]'``): this
module imports it at the top and is imported only when the Ray path runs (`vlmspec.app` does not import it).
"""

from __future__ import annotations

import functools
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import ray
from fastapi import Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString
from ray import serve

from vlmspec import factory
from vlmspec.factory import EngineSpec

from .ray_config import DEPLOYMENT, RayConfig, deployment_options
from .routes import create_app
from .serve import print_urls
from .settings import ServerSettings

APP_NAME = "vlmspec"  # the Serve application
REPLICA_HEADER = "x-vlmspec-replica"  # names the replica that served a response
REPLICAS_METRICS_PATH = "/metrics/replicas"
BROADCAST_TIMEOUT_S = 10.0  # /metrics/replicas waits this long for the replicas' answers


class ReplicaHeader:
    """Pure ASGI: adds ``x-vlmspec-replica: <id>`` to every HTTP response of the replica."""

    def __init__(self, app: Any, replica: str) -> None:
        self.app, self.value = app, replica.encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (REPLICA_HEADER.encode(), self.value)]}
            await send(message)

        await self.app(scope, receive, send_with_header)


class Replica:
    """One replica: the app of `create_app` over an engine this replica builds (in the app's lifespan,
    on its worker thread), plus the header, the aggregated metrics route and the health check."""

    def __init__(self, spec: EngineSpec, settings: ServerSettings, threads: int) -> None:
        import torch

        torch.set_num_threads(threads)
        self.spec, self.settings = spec, settings
        self.replica_id = serve.get_replica_context().replica_id.unique_id

    def __serve_build_asgi_app__(self) -> Any:
        app = create_app(functools.partial(factory.build_engine, self.spec), self.settings)
        app.add_api_route(REPLICAS_METRICS_PATH, replicas_metrics, methods=["GET"], response_model=None)
        app.add_middleware(ReplicaHeader, replica=self.replica_id)
        return app

    async def check_health(self) -> None:
        """Ray's health check: raises when the worker thread is gone though nobody stopped it (Ray
        then replaces the replica); a replica that is draining is healthy."""
        why = self.app.state.service.broken()
        if why is not None:
            raise RuntimeError(f"replica {self.replica_id}: {why}")

    def drain(self) -> int:
        """The first half of a stop (`stop`): refuse new requests (503) while the accepted ones finish;
        returns how many are still being served."""
        service = self.app.state.service
        service.close()
        return service.active + service.waiting

    def metrics_text(self) -> tuple[str, str]:
        """(this replica's id, its Prometheus text): what /metrics/replicas collects from every replica."""
        state = self.app.state
        state.metrics.queue_depth.set(state.service.waiting)
        return self.replica_id, state.metrics.render().decode()


# the ASGI app comes from __serve_build_asgi_app__, on the replica
VlmspecReplica = serve.deployment(name=DEPLOYMENT)(serve.ingress()(Replica))


async def replicas_metrics(request: Request) -> Response:
    """Every replica's metrics, each sample labelled with its replica (a replica that does not answer
    in BROADCAST_TIMEOUT_S is left out and named in a comment)."""
    handle = serve.get_deployment_handle(DEPLOYMENT, APP_NAME)
    answers = await handle.broadcast("metrics_text").results_async(timeout_s=BROADCAST_TIMEOUT_S, return_exceptions=True)
    texts = dict(a for a in answers if isinstance(a, tuple))
    missing = [f"# a replica did not answer: {type(a).__name__}" for a in answers if not isinstance(a, tuple)]
    return Response("\n".join([*missing, merge_metrics(texts)]), media_type=CONTENT_TYPE_LATEST)


def merge_metrics(texts: dict[str, str]) -> str:
    """Prometheus texts by replica -> one text, every sample with a `replica` label (families merged)."""
    families: dict[str, tuple[str, str, list[str]]] = {}
    for replica, text in sorted(texts.items()):
        for fam in text_string_to_metric_families(text):
            _, _, lines = families.setdefault(fam.name, (fam.documentation, fam.type, []))
            for s in fam.samples:
                labels = ",".join(f'{k}="{_escape(v)}"' for k, v in {**s.labels, "replica": replica}.items())
                lines.append(f"{s.name}{{{labels}}} {floatToGoString(s.value)}")
    out = []
    for name, (doc, kind, lines) in families.items():
        name = f"{name}_total" if kind == "counter" else name  # as prometheus_client writes a counter's family
        out += [f"# HELP {name} {_escape(doc, quote=False)}", f"# TYPE {name} {kind}", *lines]
    return "\n".join(out) + "\n"


def _escape(value: str, quote: bool = True) -> str:
    """A label value (or, quote=False, a HELP text) as the text format writes it."""
    out = value.replace("\\", "\\\\").replace("\n", "\\n")
    return out.replace('"', '\\"') if quote else out


# ------------------------------------------------------------------------------------------ running it


def start_ray(cfg: RayConfig) -> bool:
    """Connect to `cfg.address`, or start a local Ray. Returns whether this process started it.
    ConnectionError when the address has no cluster."""
    if ray.is_initialized():
        return False
    if cfg.address:
        ray.init(address=cfg.address, logging_level="warning", log_to_driver=False)
        return False
    # "local": a new Ray of this process, never a `ray start` cluster that ray.init() would find on its own
    ray.init(address="local", num_cpus=cfg.local_cpus, include_dashboard=False, logging_level="warning", log_to_driver=False)
    return True


def deploy(spec: EngineSpec, settings: ServerSettings, cfg: RayConfig, host: str, port: int) -> int:
    """Start Serve's HTTP proxy on host:port (port 0: a free one) and run the deployment; returns the
    proxy's port once every replica is up (their models loaded)."""
    if port == 0:
        import socket

        with socket.socket() as probe:
            probe.bind((host, 0))
            port = probe.getsockname()[1]
    serve.start(http_options={"host": host, "port": port, "request_timeout_s": settings.request_timeout_s + 30})
    app = VlmspecReplica.options(**deployment_options(cfg, settings)).bind(spec, settings, cfg.threads)
    serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
    return port


def base_url(host: str, port: int) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


DRAIN_POLL_S = 0.2


def drain(grace_s: float) -> int:
    """Every replica refuses new requests (503, through Ray's proxy as from one process) and
    finishes its accepted ones, for up to `grace_s`; returns how many were left unfinished."""
    handle = serve.get_deployment_handle(DEPLOYMENT, APP_NAME)
    deadline = time.monotonic() + grace_s
    while True:
        answers = handle.broadcast("drain").results(timeout_s=BROADCAST_TIMEOUT_S, return_exceptions=True)
        busy = sum(n for n in answers if isinstance(n, int))
        if busy == 0 or time.monotonic() >= deadline:
            return busy
        time.sleep(DRAIN_POLL_S)


def stop(started_ray: bool, grace_s: float = 0.0) -> None:
    """Drain the replicas for up to `grace_s` (`drain`), then delete the application (what a
    replica still serves then is cut by its own graceful shutdown). When this process started Ray,
    Serve and Ray are shut down too, whatever the steps before raised: no process of that Ray is
    left. A cluster this process joined keeps running."""
    try:
        try:
            if grace_s > 0:
                drain(grace_s)
        finally:
            serve.delete(APP_NAME)
    finally:
        if started_ray:
            try:
                serve.shutdown()
            finally:
                ray.shutdown()


@contextmanager
def ray_serving(spec: EngineSpec, settings: ServerSettings, cfg: RayConfig, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """The deployment on Ray for the length of the block; yields the proxy's base URL."""
    started = start_ray(cfg)
    try:
        yield base_url(host, deploy(spec, settings, cfg, host, port))
    finally:
        stop(started)


def serve_on_ray(spec: EngineSpec, settings: ServerSettings, cfg: RayConfig, drafter: str, host: str = "127.0.0.1",
                 port: int = 8000) -> int:
    """What `vlmspec serve --replicas N` runs: deploy, print the URLs, wait for SIGTERM or SIGINT,
    then `stop`. Returns the exit code: 0 once stopped."""
    signalled: list[int] = []

    def interrupt(signum: int, frame: Any) -> None:
        if not signalled:  # the first signal ends the wait; a later one must not break off the clean-up half-way
            signalled.append(signum)
            raise KeyboardInterrupt

    started, grace = start_ray(cfg), 0.0
    for sig in (signal.SIGTERM, signal.SIGINT):  # after ray.init, which sets its own SIGTERM handler (sys.exit: an abort)
        signal.signal(sig, interrupt)
    try:
        count = (f"{cfg.lo}..{cfg.hi} replicas (autoscaling, {cfg.replicas} at start)" if cfg.autoscaling
                 else f"{cfg.replicas} replica{'' if cfg.replicas == 1 else 's'}")
        where = f"the Ray cluster at {cfg.address}" if cfg.address else "a local Ray"
        print(f"starting {count} on {where}: each loads its own model and drafter ...", file=sys.stderr)
        port = deploy(spec, settings, cfg, host, port)
        print_urls(settings, drafter, host, port, None, sys.stderr, "/docs")
        print(f"  replicas: {base_url(host, port)}{REPLICAS_METRICS_PATH} (every replica's metrics, labelled by replica); "
              f"each response names its replica in the {REPLICA_HEADER} header", file=sys.stderr)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        grace = settings.shutdown_grace_s
        then = ", then the local Ray shuts down" if started else "; the Ray cluster keeps running"
        print(f"stopping: new requests get 503, the replicas finish their accepted ones (up to {grace:g} s){then} ...", file=sys.stderr)
    finally:
        stop(started, grace)
    return 0
