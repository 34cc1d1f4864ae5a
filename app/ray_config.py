"""How the service scales out on Ray Serve (`vlmspec serve --replicas N`): the replica count or the
autoscaling range, where Ray runs, the Serve deployment options they give, and what a client joining
a cluster does about Ray's token authentication (`client_auth`). No Ray import here (the CLI builds
and checks a RayConfig before anything heavy loads); the deployment is `ray_serve.py`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
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


# ------------------------------------------------------------------------------------------ token authentication
AUTH_MODE = "RAY_AUTH_MODE"  # Ray's switch: "token" makes this client send the cluster's token
HEAD_TOKEN = "~/.ray/auth_token"  # where `ray start --head` keeps the token (Ray's default path)


@dataclass(frozen=True)
class RayAuth:
    """What a client joining a cluster (`vlmspec serve --ray-address`) does about Ray's token
    authentication, decided before Ray is imported (`client_auth`)."""

    env: dict[str, str]  # variables to set in this process first
    note: str  # one line for stderr ("" when there is nothing to say)
    hint: str  # what to do, appended to the line of a join that fails


def token_source(environ: Mapping[str, str], home: Path) -> tuple[str | None, str]:
    """(where this machine's Ray token is, as Ray looks for it: $RAY_AUTH_TOKEN, then the file
    $RAY_AUTH_TOKEN_PATH, then ~/.ray/auth_token; None when nowhere, and what is wrong if anything)."""
    if environ.get("RAY_AUTH_TOKEN", "").strip():
        return "$RAY_AUTH_TOKEN", ""
    path = environ.get("RAY_AUTH_TOKEN_PATH")
    if path:
        ok = _readable_token(Path(path).expanduser())
        return (path, "") if ok else (None, f"RAY_AUTH_TOKEN_PATH={path} is not a readable token file")
    return (HEAD_TOKEN, "") if _readable_token(home / ".ray" / "auth_token") else (None, "")


def _readable_token(path: Path) -> bool:
    try:
        return bool(path.read_text().strip())
    except (OSError, UnicodeDecodeError):
        return False


def client_auth(environ: Mapping[str, str], home: Path) -> RayAuth:
    """Token authentication on the client side when a token is here and RAY_AUTH_MODE is not set (as
    `ray start` does for a head: a token sent to a cluster without authentication is ignored, and a
    cluster with it needs it); an explicit RAY_AUTH_MODE is respected; with no token, the hint says
    what to export."""
    mode = environ.get(AUTH_MODE)
    where, problem = token_source(environ, home)
    need = f"export {AUTH_MODE}=token RAY_AUTH_TOKEN=<the token in the head's {HEAD_TOKEN}> (or copy that file here)"
    if mode is not None and mode.strip().lower() != "token":
        return RayAuth({}, "", f" ({AUTH_MODE}={mode} here: a cluster with Ray's token authentication needs {AUTH_MODE}=token and its token)")
    if where is None:
        return RayAuth({}, "", f" ({problem}; {need})" if problem else f" (a cluster with Ray's token authentication needs its token: {need})")
    hint = f" (the token in {where} may not be this cluster's: `ray get-auth-token` on its head prints it)"
    if mode is not None:
        return RayAuth({}, "", hint)
    return RayAuth({AUTH_MODE: "token"}, f"ray: token authentication on ({AUTH_MODE}=token, the token in {where})", hint)
