"""How the service scales out on Ray Serve (`vlmspec serve --replicas N`): the replica count or the
autoscaling range, where Ray runs, and the Serve deployment options they give. No Ray import here
(the CLI builds and checks a RayConfig before anything heavy loads); the deployment is `ray_serve.py`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .settings import ServerSettings

DEPLOYMENT = "VlmspecReplica"  # the Serve application's one deployment


@dataclass(frozen=True)
class RayConfig:
    """Where the replicas run and how many. Validated at the CLI (one-line messages); asserted here."""

    replicas: int = 1  # a fixed count; with autoscaling, the initial count
    min_replicas: int | None = None  # min or max given: autoscaling between them on the replicas' ongoing requests
    max_replicas: int | None = None
    address: str | None = None  # an existing cluster (host:port of its head, or "auto"); None: start a local Ray
    replica_cpus: float = 1.0  # Ray CPUs each replica reserves; its torch threads are this, rounded (at least 1)
    target_ongoing_requests: float | None = None  # autoscaling's target per replica (None: the replica's max_batch)
    local_cpus: int | None = None  # a local Ray's CPUs (None: Ray counts the machine's)

    def __post_init__(self) -> None:
        assert self.replicas >= 1 and self.replica_cpus > 0, self
        if self.autoscaling:
            assert 1 <= self.lo <= self.hi and self.lo <= self.replicas <= self.hi, self

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None or self.max_replicas is not None

    @property
    def lo(self) -> int:
        return self.min_replicas if self.min_replicas is not None else 1

    @property
    def hi(self) -> int:
        return self.max_replicas if self.max_replicas is not None else max(self.lo, self.replicas)

    @property
    def threads(self) -> int:
        return max(1, round(self.replica_cpus))


def deployment_options(cfg: RayConfig, settings: ServerSettings) -> dict[str, Any]:
    """The Serve deployment's options: replica count or autoscaling, CPUs, and how many requests
    Ray lets into one replica (its batch and its queue: beyond that Ray's proxy holds them)."""
    opts: dict[str, Any] = {
        "name": DEPLOYMENT,
        "ray_actor_options": {"num_cpus": cfg.replica_cpus},
        "max_ongoing_requests": settings.max_batch + settings.max_queue,
        "health_check_period_s": 5.0,
        "health_check_timeout_s": 30.0,
        "graceful_shutdown_timeout_s": settings.shutdown_grace_s,
    }
    if cfg.autoscaling:
        opts["autoscaling_config"] = {"min_replicas": cfg.lo, "max_replicas": cfg.hi, "initial_replicas": cfg.replicas,
                                      "target_ongoing_requests": cfg.target_ongoing_requests or settings.max_batch}
    else:
        opts["num_replicas"] = cfg.replicas
    return opts
