"""Scaling out on Ray Serve (#49): `vlmspec serve --replicas N` is `create_app` as a Ray Serve deployment.

The Ray tests (marked `ray`) start one local Ray of 2 CPUs for the module, with 2 replicas of the toy
model (fp32, one torch thread each), behind Ray's HTTP proxy. Their oracle is the single-process
service over the same model: at temperature 0 every answer through the proxy must equal its answer
there, and the `x-vlmspec-replica` header must name both replicas (the negative control: the header
is not one constant). The fault test kills one replica's process mid-load and checks that no request
hangs, each gets an answer or a 5xx, Ray starts a new replica (a new id; the killed one never answers
again) and every request after recovery succeeds.

Without Ray the `ray` tests are skipped, except under CI=true (CI installs the ray extra), where a
missing Ray fails them. The configuration checks at the CLI need no cluster.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import os
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
pytest.importorskip("prometheus_client")

from vlmspec import assets
from vlmspec.cli import main

HAVE_RAY = importlib.util.find_spec("ray") is not None and importlib.util.find_spec("ray.serve") is not None
IN_CI = bool(os.environ.get("CI"))  # as tests/test_real_target.py reads it
MODEL = "toy"
MAX_BATCH = 4
TIMEOUT_S = 120.0  # every HTTP call's limit (a slow, shared 2-core machine)


def need_ray() -> None:
    """Skip without Ray; under CI a missing Ray is an error (CI installs the ray extra)."""
    if HAVE_RAY:
        return
    if IN_CI:
        pytest.fail("CI=true but Ray Serve is not installed: CI must pip install -e '.[ray]' (see .ci/run)")
    pytest.skip("needs Ray Serve: pip install -e '.[ray]'")


needs_toy = pytest.mark.skipif(assets.bundled_target() is None, reason="needs the committed toy model (assets/toyworld-vlm)")


# ------------------------------------------------------------------------------------------ configuration


def _serve_error(capsys, argv: list[str]) -> tuple[int, str]:
    """(exit code, stderr) of `vlmspec serve ARGV` that fails before any model loads."""
    try:
        code = main(["serve", "--model", MODEL, "--port", "0", *argv])
    except SystemExit as exc:  # argparse's usage errors
        code = exc.code
    return code, capsys.readouterr().err.strip()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("argv, says", [
    (["--replicas", "0"], "--replicas must be >= 1, got 0"),
    (["--min-replicas", "0", "--max-replicas", "2"], "--min-replicas must be >= 1, got 0"),
    (["--min-replicas", "3", "--max-replicas", "2"], "--min-replicas 3 is above --max-replicas 2"),
    (["--replicas", "5", "--min-replicas", "1", "--max-replicas", "2"], "--replicas 5 is outside --min-replicas 1 .. --max-replicas 2"),
    (["--replicas", "2", "--replica-cpus", "0"], "--replica-cpus must be in (0.0, 1024.0], got 0"),
    (["--replica-cpus", "2"], "--replica-cpus is for replicas on Ray: pass --replicas N"),
])
def test_bad_scale_out_options_fail_in_one_line_before_anything_loads(capsys, argv, says):
    code, err = _serve_error(capsys, argv)
    assert code == 2 and says in err.splitlines()[-1], err
    assert "loading" not in err and "Traceback" not in err


def test_an_unreachable_ray_address_fails_in_one_line(capsys, monkeypatch, tmp_path):
    need_ray()  # the address is checked once Ray is there (without it the line says what to install)
    monkeypatch.setenv("RAY_AUTH_MODE", "")  # recorded, so what a join sets is taken away after this test (a
    monkeypatch.delenv("RAY_AUTH_MODE")  # leaked RAY_AUTH_MODE=token made the later local clusters fail to start)
    for name in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):  # no token on this "machine" (a local Ray run leaves
        monkeypatch.delenv(name, raising=False)  # one in ~/.ray): no note line before the error
    monkeypatch.setenv("HOME", str(tmp_path))
    port = _free_port()  # nothing listens there
    t0 = time.monotonic()
    code, err = _serve_error(capsys, ["--replicas", "2", "--ray-address", f"127.0.0.1:{port}"])
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"vlmspec serve: error: --ray-address 127.0.0.1:{port}: no Ray cluster answers there") and "ray start --head" in err
    assert time.monotonic() - t0 < 30
    code, err = _serve_error(capsys, ["--ray-address", "no-port-here"])
    assert code == 2 and "--ray-address must be HOST:PORT" in err, err


def test_without_ray_the_scale_out_options_say_what_to_install(capsys, monkeypatch):
    import vlmspec.cli.serve as serve_cli

    real = serve_cli.importlib.util.find_spec
    monkeypatch.setattr(serve_cli.importlib.util, "find_spec", lambda name, *a: None if name.split(".")[0] == "ray" else real(name, *a))
    for argv in (["--replicas", "2"], ["--min-replicas", "1", "--max-replicas", "3"], ["--ray-address", "auto"]):
        code, err = _serve_error(capsys, argv)
        assert code == 2 and err == "vlmspec serve: error: --replicas, --min/--max-replicas and --ray-address need Ray Serve: " \
                                    "pip install 'vlmspec[ray]'", err


def _auth(tmp_path, env: dict[str, str], token: str | None = None):
    from vlmspec.app.ray_config import client_auth

    if token is not None:
        (tmp_path / ".ray").mkdir(parents=True, exist_ok=True)
        (tmp_path / ".ray" / "auth_token").write_text(token)
    return client_auth(env, tmp_path)


def test_joining_a_cluster_sends_a_token_where_one_is_here(tmp_path):
    """The client-side decision (#75), no cluster needed: token mode where this machine has a token
    and RAY_AUTH_MODE is unset (as `ray start` decides for a head), Ray's explicit mode respected,
    and with no token one line of what to export."""
    auth = _auth(tmp_path, {}, token="abc\n")
    assert auth.env == {"RAY_AUTH_MODE": "token"} and "the token in ~/.ray/auth_token" in auth.note
    auth = _auth(tmp_path / "none", {"RAY_AUTH_TOKEN": "abc"})
    assert auth.env == {"RAY_AUTH_MODE": "token"} and "$RAY_AUTH_TOKEN" in auth.note
    good, bad = tmp_path / "tok", tmp_path / "missing"
    good.write_text("abc")
    assert _auth(tmp_path / "none", {"RAY_AUTH_TOKEN_PATH": str(good)}).env == {"RAY_AUTH_MODE": "token"}
    auth = _auth(tmp_path / "none", {"RAY_AUTH_TOKEN_PATH": str(bad)})
    assert auth.env == {} and f"RAY_AUTH_TOKEN_PATH={bad} is not a readable token file" in auth.hint
    # no token anywhere (an empty file is none): nothing set, and the line says what to export
    auth = _auth(tmp_path / "empty", {}, token="")
    assert auth.env == {} and not auth.note
    assert "export RAY_AUTH_MODE=token RAY_AUTH_TOKEN=<the token in the head's ~/.ray/auth_token>" in auth.hint
    # an explicit mode is Ray's: never overridden
    auth = _auth(tmp_path, {"RAY_AUTH_MODE": "disabled"})
    assert auth.env == {} and "RAY_AUTH_MODE=disabled here" in auth.hint
    auth = _auth(tmp_path, {"RAY_AUTH_MODE": "token"})
    assert auth.env == {} and not auth.note and "`ray get-auth-token` on its head" in auth.hint


_JOIN_AUTH_CHILD = """
import importlib.util, json, os, sys
from vlmspec.cli import main
real = importlib.util.find_spec  # Ray counted as installed, Ray Serve as missing: serve stops there, after the decision
importlib.util.find_spec = lambda name, *a: None if name == "ray.serve" else real(name, *a) or (object() if name == "ray" else None)
out = []
for argv in sys.argv[1:]:
    try:
        code = main(["serve", "--model", "m", "--port", "0", *json.loads(argv)])
    except SystemExit as exc:
        code = exc.code
    out.append([code, os.environ.pop("RAY_AUTH_MODE", None)])
print(json.dumps(out))
"""


def test_serve_with_a_ray_address_sets_token_auth_up_before_ray_loads(tmp_path):
    """In a child process: a token mode set in this one outlives the test in what Ray reads once (it
    made this module's local clusters refuse their own driver)."""
    import json
    import subprocess
    import sys

    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("abc")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
    argvs = [["--replicas", "2", "--ray-address", "auto"], ["--replicas", "2"]]  # joining a cluster; a local Ray
    run = subprocess.run([sys.executable, "-c", _JOIN_AUTH_CHILD, *map(json.dumps, argvs)], env={**env, "HOME": str(tmp_path)},
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    (join_code, join_mode), (local_code, local_mode) = json.loads(run.stdout.splitlines()[-1])
    lines = run.stderr.splitlines()
    assert join_code == 2 and join_mode == "token", run.stderr
    assert lines[0] == "ray: token authentication on (RAY_AUTH_MODE=token, the token in ~/.ray/auth_token)", run.stderr
    # a local Ray sets its own up: nothing is changed here, and no note line
    assert local_code == 2 and local_mode is None and sum(line.startswith("ray:") for line in lines) == 1, run.stderr


def test_one_process_serving_never_imports_ray():
    import subprocess
    import sys

    def imports_ray(modules: str) -> bool:
        code = f"import sys, {modules}; sys.exit(7 if any(m == 'ray' or m.startswith('ray.') for m in sys.modules) else 0)"
        return subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 7

    assert not imports_ray("vlmspec.app, vlmspec.app.ray_config, vlmspec.cli, vlmspec.cli.serve, vlmspec.cli.load")
    if HAVE_RAY:
        assert imports_ray("vlmspec.app.ray_serve")  # negative control: the check sees Ray where it is imported


def test_serve_replicas_hands_the_replicas_what_to_load_and_loads_nothing_itself(monkeypatch, tmp_path):
    need_ray()
    import vlmspec.app.ray_serve as ray_serve
    from vlmspec import factory

    seen = {}

    def fake_serve_on_ray(spec, settings, cfg, drafter, host, port):
        seen.update(spec=spec, settings=settings, cfg=cfg, drafter=drafter, where=(host, port))
        return 0

    monkeypatch.setattr(ray_serve, "serve_on_ray", fake_serve_on_ray)
    monkeypatch.setattr(factory, "build_engine", lambda spec: pytest.fail("the CLI process must not load the model"))
    monkeypatch.chdir(assets.BUNDLED_TARGET.parent)  # a relative model folder becomes absolute for the replicas
    argv = ["serve", "--model", assets.BUNDLED_TARGET.name, "--drafter", "ngram", "--min-replicas", "2", "--max-replicas", "5",
            "--replica-cpus", "2", "--max-batch", "4", "--port", "0", "--policy", "fixed"]
    assert main(argv) == 0
    spec, settings, cfg = seen["spec"], seen["settings"], seen["cfg"]
    assert spec.model == str(assets.BUNDLED_TARGET.resolve()) and spec.drafter == "ngram" and spec.max_batch == 4 and spec.policy == "fixed"
    assert settings.max_batch == 4 and settings.ui is False and settings.model == assets.BUNDLED_TARGET.name
    assert (cfg.autoscaling, cfg.lo, cfg.hi, cfg.replicas, cfg.threads, cfg.address) == (True, 2, 5, 2, 2, None)


def test_the_scale_out_options_map_to_serve_deployment_options():
    from vlmspec.app import ServerSettings
    from vlmspec.app.ray_config import RayConfig, deployment_options

    settings = ServerSettings(max_batch=8, max_queue=4)
    fixed = deployment_options(RayConfig(replicas=3, replica_cpus=2), settings)
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed and fixed["ray_actor_options"] == {"num_cpus": 2}
    assert fixed["max_ongoing_requests"] == 12  # a replica takes its batch and its queue; Ray's proxy holds the rest
    auto = deployment_options(RayConfig(replicas=2, min_replicas=1, max_replicas=4), settings)
    assert "num_replicas" not in auto
    assert auto["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4, "initial_replicas": 2, "target_ongoing_requests": 8}
    assert RayConfig(replica_cpus=0.5).threads == 1 and RayConfig(replica_cpus=2).threads == 2


def test_replica_metrics_are_merged_with_a_replica_label():
    need_ray()
    from vlmspec.app.ray_serve import merge_metrics

    one = '# HELP vlmspec_x_total things\n# TYPE vlmspec_x_total counter\nvlmspec_x_total{mode="plain"} 2.0\n'
    two = '# HELP vlmspec_x_total things\n# TYPE vlmspec_x_total counter\nvlmspec_x_total{mode="plain"} 5.0\n'
    merged = merge_metrics({"a": one, "b": two})
    assert 'vlmspec_x_total{mode="plain",replica="a"} 2.0' in merged and 'vlmspec_x_total{mode="plain",replica="b"} 5.0' in merged
    assert merged.count("# TYPE vlmspec_x_total counter") == 1  # one family, two replicas


# ------------------------------------------------------------------------------------------ on a local Ray


def _bodies(n: int) -> list[dict]:
    """n held-out requests (ToyWorld scenes, photographs, text), every other one streamed, at T=0."""
    from vlmspec.bench.batch import mixed_conversations
    from vlmspec.bench.server import chat_body

    return [{**chat_body(conv, MODEL, 16, stream=i % 2 == 1), "ignore_eos": True} for i, conv in enumerate(mixed_conversations(n))]


def ask(client: httpx.Client, url: str, body: dict) -> tuple[int, str, str | None]:
    """(status, the answer's text or the error body, the replica header) of one request, streamed or not."""
    if not body.get("stream"):
        r = client.post(f"{url}/v1/chat/completions", json=body)
        text = r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else r.text
        return r.status_code, text, r.headers.get("x-vlmspec-replica")
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, r.text, r.headers.get("x-vlmspec-replica")
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
        replica = r.headers.get("x-vlmspec-replica")
    if any("error" in e for e in events):
        return 500, json.dumps(events[-1]), replica
    return 200, "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]), replica


def concurrently(url: str, bodies: list[dict]) -> list[tuple[int, str, str | None]]:
    def one(body: dict) -> tuple[int, str, str | None]:
        with httpx.Client(timeout=TIMEOUT_S) as c:
            return ask(c, url, body)

    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(one, bodies, timeout=3 * TIMEOUT_S))


def _settings():
    from vlmspec.app import ServerSettings

    return ServerSettings(model=MODEL, max_batch=MAX_BATCH, max_queue=16, request_timeout_s=TIMEOUT_S, ui=False)


def _spec():
    from vlmspec.factory import EngineSpec

    # policy fixed: no cost model to measure at start (the answers at T=0 do not depend on the policy)
    return EngineSpec(model=MODEL, device="cpu", dtype="float32", policy="fixed", max_batch=MAX_BATCH)


@pytest.fixture(scope="module")
def single_process_answers():
    """The oracle: each request alone through the single-process service (no Ray) over the toy."""
    from vlmspec import factory
    from vlmspec.app import create_app
    from vlmspec.app.live_server import LiveServer

    bodies = _bodies(6)
    with LiveServer(create_app(factory.build_engine(_spec()), _settings())) as srv, httpx.Client(timeout=TIMEOUT_S) as c:
        got = [ask(c, srv.url, b) for b in bodies]
    assert all(status == 200 and text for status, text, _ in got), got
    assert all(replica is None for _, _, replica in got)  # one process: no replica header
    return bodies, [text for _, text, _ in got]


@pytest.fixture(scope="module")
def two_replicas():
    """2 replicas of the toy on a local Ray of 2 CPUs; yields the proxy's URL. Ray is shut down after."""
    need_ray()
    if assets.bundled_target() is None:
        pytest.skip("needs the committed toy model (assets/toyworld-vlm)")
    import ray

    from vlmspec.app.ray_config import RayConfig
    from vlmspec.app.ray_serve import ray_serving

    with ray_serving(_spec(), _settings(), RayConfig(replicas=2, replica_cpus=1, local_cpus=2)) as url:
        yield url
    assert not ray.is_initialized()


def _replica_ids(url: str) -> dict[str, float]:
    """Replica id -> generations it completed, from the aggregated view (/metrics/replicas)."""
    with httpx.Client(timeout=TIMEOUT_S) as c:
        r = c.get(f"{url}/metrics/replicas")
    assert r.status_code == 200, r.text
    out: dict[str, float] = {}
    for line in r.text.splitlines():
        if not line.startswith("#") and 'replica="' in line:  # every replica has samples (its gauges at least)
            replica = line.split('replica="', 1)[1].split('"', 1)[0]
            value = float(line.rsplit(" ", 1)[1]) if line.startswith("vlmspec_generations_total{") else 0.0
            out[replica] = out.get(replica, 0.0) + value
    return out


@pytest.mark.ray
@needs_toy
def test_two_replicas_answer_as_the_single_process_service_and_both_serve(two_replicas, single_process_answers):
    url = two_replicas
    bodies, expected = single_process_answers
    before = _replica_ids(url)
    assert len(before) == 2, before  # both replicas answer the broadcast
    seen: dict[str, int] = {}
    for _ in range(5):  # Ray routes by load: concurrent rounds until both replicas have served (nearly always the first)
        got = concurrently(url, bodies + bodies)
        assert [status for status, _, _ in got] == [200] * len(got), got
        assert [text for _, text, _ in got] == expected + expected  # T=0: the single-process service's answers
        for _, _, replica in got:
            seen[replica] = seen.get(replica, 0) + 1
        if len(seen) == 2:
            break
    assert None not in seen and set(seen) == set(before), (seen, before)  # negative control: two different header values
    after = _replica_ids(url)
    # each replica's own metrics count the requests its header claimed
    assert {r: after[r] - before[r] for r in after} == {r: float(n) for r, n in seen.items()}, (before, after, seen)
    with httpx.Client(timeout=TIMEOUT_S) as c:  # the other routes, unchanged, through the proxy
        models = c.get(f"{url}/v1/models")
        health = c.get(f"{url}/healthz")
        metrics = c.get(f"{url}/metrics")
    assert models.status_code == 200 and models.json()["data"][0]["id"] == MODEL
    assert health.status_code == 200 and health.json()["max_batch"] == MAX_BATCH
    assert metrics.status_code == 200 and "vlmspec_generations_total" in metrics.text and "replica=" not in metrics.text
    assert metrics.headers["x-vlmspec-replica"] in seen  # /metrics: the one replica that answered


def _short_load(url: str, out) -> dict:
    code = main(["bench", "load", "--url", url, "--ways", "plain,fixed", "--concurrency", "1,4", "--requests", "4",
                 "--max-new-tokens", "6", "--prompts", "3", "--warmup", "1", "--out", str(out)])
    assert code == 0
    return json.loads((out / "load.json").read_text())


@needs_toy
def test_bench_load_sends_its_sweep_to_a_running_single_process_service(tmp_path, capsys):
    from vlmspec import factory
    from vlmspec.app import create_app
    from vlmspec.bench.load import REPLICA_HEADER
    from vlmspec.app.live_server import LiveServer

    if HAVE_RAY:
        from vlmspec.app.ray_serve import REPLICA_HEADER as served

        assert REPLICA_HEADER == served  # spelled twice (the bench does not import the app)
    with LiveServer(create_app(factory.build_engine(_spec()), _settings())) as srv:
        report = _short_load(srv.url, tmp_path / "load")
    assert {(lv["way"], lv["clients"]) for lv in report["levels"]} == {(w, c) for w in ("plain", "fixed") for c in (1, 4)}
    assert all(lv["changed"] == 0 and lv["tokens"] == 6 * lv["requests"] and lv["replicas"] == 0 for lv in report["levels"])
    assert report["env"]["url"] == srv.url and report["env"]["metrics"] == "/metrics" and report["env"]["max_batch"] == [MAX_BATCH]
    assert max(lv["mean_batch"] for lv in report["levels"]) > 1.0  # 4 clients share the batch
    assert "replicas serving" not in (tmp_path / "load" / "load.md").read_text()
    capsys.readouterr()
    code = main(["bench", "load", "--url", srv.url, "--ways", "baseline"])
    assert code == 2 and "--ways baseline needs a server of its own" in capsys.readouterr().err
    code = main(["bench", "load", "--url", f"http://127.0.0.1:{_free_port()}", "--concurrency", "1"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "no vlmspec service answers there" in err, err


@pytest.mark.ray
@needs_toy
def test_bench_load_through_the_ray_proxy_reads_every_replica(two_replicas, tmp_path):
    report = _short_load(two_replicas, tmp_path / "load")
    assert report["env"]["metrics"] == "/metrics/replicas"
    assert all(lv["changed"] == 0 and lv["tokens"] == 6 * lv["requests"] and lv["mean_batch"] >= 1.0 for lv in report["levels"])
    assert max(lv["replicas"] for lv in report["levels"] if lv["clients"] == 4) == 2  # both replicas served the 4-client levels
    assert "replicas serving |" in (tmp_path / "load" / "load.md").read_text()


@pytest.mark.ray
@needs_toy
def test_a_replica_killed_mid_load_fails_no_request_silently_and_is_replaced(two_replicas):
    import ray
    from ray import serve

    from vlmspec.app.ray_config import DEPLOYMENT
    from vlmspec.app.ray_serve import APP_NAME

    url = two_replicas
    body = {**_bodies(1)[0], "max_tokens": 48, "stream": False}
    outcomes: list[tuple[str, object, float]] = []
    first_answers: dict[str, int] = {}
    stop, lock = threading.Event(), threading.Lock()

    def client() -> None:
        with httpx.Client(timeout=TIMEOUT_S) as c:
            while not stop.is_set():
                t0 = time.monotonic()
                try:
                    status, _, replica = ask(c, url, body)
                    outcome: tuple[str, object, float] = ("http", status, time.monotonic() - t0)
                    if status == 200:
                        with lock:
                            first_answers[replica] = first_answers.get(replica, 0) + 1
                except httpx.TimeoutException as exc:  # a hang: the test fails on it
                    outcome = ("timeout", repr(exc), time.monotonic() - t0)
                except httpx.TransportError as exc:  # the connection cut: counted, reported
                    outcome = ("transport", repr(exc), time.monotonic() - t0)
                with lock:
                    outcomes.append(outcome)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(8)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 2 * TIMEOUT_S
    while len(first_answers) < 2 and time.monotonic() < deadline:  # both replicas busy serving
        time.sleep(0.2)
    assert len(first_answers) == 2, first_answers
    victim = sorted(first_answers)[0]
    actor = ray.get_actor(f"SERVE_REPLICA::{APP_NAME}#{DEPLOYMENT}#{victim}", namespace="serve")
    n_before_kill = len(outcomes)
    ray.kill(actor, no_restart=True)  # the replica's process dies with requests in flight
    time.sleep(3.0)  # load goes on while Ray notices
    stop.set()
    for t in threads:
        t.join(TIMEOUT_S + 30)
    assert not any(t.is_alive() for t in threads), "a client hangs"
    assert all(kind == "http" for kind, _, _ in outcomes), [o for o in outcomes if o[0] != "http"]
    statuses = [status for _, status, _ in outcomes]
    assert all(s == 200 or 500 <= s < 600 for s in statuses), statuses  # an answer, or a clear 5xx
    assert all(seconds < TIMEOUT_S for _, _, seconds in outcomes)
    assert len(outcomes) > n_before_kill  # requests ran across the kill
    print(f"replica {victim} killed after {n_before_kill} answers; across and after the kill: "
          f"{ {s: statuses[n_before_kill:].count(s) for s in sorted(set(statuses[n_before_kill:]))} } (status: count)")

    # Ray replaces the replica: a new id, two running, and the killed one never answers again
    deadline = time.monotonic() + 3 * TIMEOUT_S
    while True:
        ids = set(_replica_ids(url)) if time.monotonic() < deadline else set()
        status = serve.status().applications[APP_NAME].deployments[DEPLOYMENT]
        if len(ids) == 2 and victim not in ids and status.replica_states.get("RUNNING") == 2:
            break
        assert time.monotonic() < deadline, (ids, status)
        time.sleep(1.0)
    with pytest.raises(ValueError):  # negative control: the victim really is gone
        ray.get_actor(f"SERVE_REPLICA::{APP_NAME}#{DEPLOYMENT}#{victim}", namespace="serve")
    after = concurrently(url, _bodies(6) * 2)
    assert [s for s, _, _ in after] == [200] * len(after), after
    assert victim not in {r for _, _, r in after} and {r for _, _, r in after} <= ids


# ------------------------------------------------------------------------------------------ stopping


def test_stop_shuts_down_only_a_ray_it_started_whatever_the_drain_raised(monkeypatch):
    """`--ray-address`: the application is deleted and the cluster left running; a local Ray this
    process started: Serve and Ray shut down too, even when draining the replicas failed."""
    need_ray()
    import vlmspec.app.ray_serve as ray_serve

    calls: list[str] = []

    def failing_drain(grace_s: float) -> int:
        calls.append(f"drain {grace_s:g}")
        raise RuntimeError("no replica answered")

    monkeypatch.setattr(ray_serve, "drain", failing_drain)
    monkeypatch.setattr(ray_serve.serve, "delete", lambda name: calls.append(f"delete {name}"))
    monkeypatch.setattr(ray_serve.serve, "shutdown", lambda: calls.append("serve.shutdown"))
    monkeypatch.setattr(ray_serve.ray, "shutdown", lambda: calls.append("ray.shutdown"))
    ray_serve.stop(started_ray=False)
    assert calls == ["delete vlmspec"]  # a joined cluster: our application goes, the cluster stays
    calls.clear()
    with pytest.raises(RuntimeError, match="no replica answered"):
        ray_serve.stop(started_ray=True, grace_s=5)
    assert calls == ["drain 5", "delete vlmspec", "serve.shutdown", "ray.shutdown"]


def test_the_health_check_fails_for_a_dead_worker_not_for_a_draining_one():
    need_ray()
    import asyncio
    from types import SimpleNamespace

    from vlmspec.app.ray_serve import Replica

    def replica(broken: str | None) -> SimpleNamespace:
        service = SimpleNamespace(broken=lambda: broken)
        return SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(service=service)), replica_id="r1")

    asyncio.run(Replica.check_health(replica(None)))  # serving, or draining: healthy
    with pytest.raises(RuntimeError, match="replica r1: the worker thread died: ValueError: x"):
        asyncio.run(Replica.check_health(replica("the worker thread died: ValueError: x")))


def _descendants(pid: int) -> set[int]:
    """Every process below `pid` (Linux /proc)."""
    found: set[int] = set()
    try:
        children = [int(c) for task in os.listdir(f"/proc/{pid}/task") for c in open(f"/proc/{pid}/task/{task}/children").read().split()]
    except OSError:
        return found
    for child in children:
        found |= {child} | _descendants(child)
    return found


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except OSError:
        return False


@pytest.mark.ray
@needs_toy
def test_sigterm_drains_the_replicas_and_leaves_no_process_of_the_local_ray(tmp_path):
    """`vlmspec serve --replicas 1` on a local Ray, SIGTERM with a request in flight: new requests get
    503, the accepted one is answered in full, the process exits 0, and every process it started
    (GCS, raylet, the Serve controller, the proxy, the replica) is gone."""
    import signal
    import subprocess
    import sys

    need_ray()
    port, grace = _free_port(), 60
    argv = [sys.executable, "-m", "vlmspec.cli", "serve", "--model", MODEL, "--drafter", "ngram", "--policy", "fixed", "--device", "cpu",
            "--dtype", "float32", "--port", str(port), "--replicas", "1", "--max-batch", "1", "--drain-seconds", str(grace),
            "--request-timeout", "600"]
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=url, timeout=TIMEOUT_S) as c:
            deadline = time.monotonic() + 3 * TIMEOUT_S
            while True:
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                try:
                    if c.get("/healthz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.5)
            ray_processes = _descendants(proc.pid)
            body = {"messages": [{"role": "user", "content": "Describe the picture."}], "max_tokens": 300, "temperature": 0, "ignore_eos": True}
            with concurrent.futures.ThreadPoolExecutor(2) as pool:  # one decodes, one waits in the replica's queue
                futures = [pool.submit(lambda: httpx.post(f"{url}/v1/chat/completions", json=body, timeout=grace + 30)) for _ in range(2)]
                deadline = time.monotonic() + TIMEOUT_S
                while c.get("/healthz").json()["active"] + c.get("/healthz").json()["waiting"] < 2:
                    assert time.monotonic() < deadline
                    time.sleep(0.05)
                t0 = time.monotonic()
                proc.send_signal(signal.SIGTERM)
                while True:  # the replica refuses new requests once it drains
                    refused = c.post("/v1/chat/completions", json=body)
                    if refused.status_code != 200 or time.monotonic() - t0 > 30:
                        break
                answers = [f.result(timeout=grace + 30) for f in futures]
            code = proc.wait(timeout=grace + 60)
            elapsed = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down", refused.text
    assert [a.status_code for a in answers] == [200, 200] and all(a.json()["usage"]["completion_tokens"] == 300 for a in answers)
    assert code == 0 and elapsed < grace + 30, (code, elapsed, log.read_text()[-2000:])
    assert len(ray_processes) >= 3  # the check sees Ray's processes (GCS, raylet, workers) while it runs
    time.sleep(1.0)
    left = sorted(p for p in ray_processes if _running(p))
    assert not left, [open(f"/proc/{p}/cmdline").read().replace("\0", " ")[:120] for p in left]
