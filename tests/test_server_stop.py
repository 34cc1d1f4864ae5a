"""A clean stop (#72 item 5): SIGTERM / SIGINT drain the service, then the process exits 0.

In-process (a live server on a tiny random LLaVA, fp32): the drain (`DrainingServer.drain`, what
the signal handler calls) refuses new requests with 503 and /healthz says "draining", while the
accepted requests, running and queued, finish with the answers they get without a drain; the
negative controls: a grace period shorter than the requests cuts them (503), as does a second
signal. Out of process: `vlmspec serve` on the committed toy model, SIGTERM with requests in flight,
exit code 0 within the grace period, every in-flight request answered in full.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
pytest.importorskip("prometheus_client")

from conftest import tiny_target, wait_for

from vlmspec import assets
from vlmspec.app import ServerSettings, create_app
from vlmspec.draft import NgramDrafter, TreeConfig
from vlmspec.engine import SpecEngine
from vlmspec.app.live_server import LiveServer

MODEL = "tiny-llava"


def _body(text: str, **kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 48, "temperature": 0, "ignore_eos": True, **kw}


def ask(client: httpx.Client, body: dict) -> tuple[int, dict]:
    """(status, {"text", "finish_reason"} | {"error"}) of one request; a stream ending in an error event gives its error."""
    if not body.get("stream"):
        r = client.post("/v1/chat/completions", json=body)
        if r.status_code != 200:
            return r.status_code, {"error": r.json()["error"]}
        choice = r.json()["choices"][0]
        return 200, {"text": choice["message"]["content"], "finish_reason": choice["finish_reason"]}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, {"error": r.json()["error"]}
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
    if "error" in events[-1]:
        return 503 if events[-1]["error"]["code"] == "shutting_down" else 500, {"error": events[-1]["error"]}
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    return 200, {"text": text, "finish_reason": [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1]}


@pytest.fixture(scope="module")
def engine():
    return SpecEngine(tiny_target("llava"), NgramDrafter(TreeConfig(depth=4, top_k=2, total_tokens=8)))


def _settings(grace_s: float) -> ServerSettings:
    return ServerSettings(model=MODEL, max_batch=2, max_queue=2, request_timeout_s=120, shutdown_grace_s=grace_s, ui=False)


BODIES = [_body("once upon a time"), _body("the cat sat on the mat. the cat sat on the mat. the cat", stream=True),
          _body("tell me a story about a dog", speculative=False)]  # 2 slots: the third waits in the queue


def test_the_drain_refuses_new_requests_and_the_accepted_ones_finish_unchanged(engine, paced):
    with LiveServer(create_app(engine, _settings(60.0))) as srv, httpx.Client(base_url=srv.url, timeout=120) as c:
        expected = [ask(c, body) for body in BODIES]  # the same requests without a drain
        assert all(status == 200 for status, _ in expected)
        service = srv.app.state.service
        with concurrent.futures.ThreadPoolExecutor(len(BODIES)) as pool:
            futures = [pool.submit(ask, httpx.Client(base_url=srv.url, timeout=120), body) for body in BODIES]
            assert wait_for(lambda: service.active == 2 and service.waiting == 1), (service.active, service.waiting)
            t0 = time.monotonic()
            srv.server.drain()  # what SIGTERM does
            assert wait_for(lambda: service.closing)
            refused = c.post("/v1/chat/completions", json=_body("a new request"))
            health = c.get("/healthz")
            got = [f.result(timeout=120) for f in futures]
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down", refused.text
        assert health.status_code == 503 and health.json()["status"] == "draining" and "shutting down" in health.json()["reason"]
        assert got == expected  # running and queued alike: answered in full, as without the drain
        srv.thread.join(30)
        assert not srv.thread.is_alive() and srv.server.drained.is_set()  # the server stopped once drained
        assert time.monotonic() - t0 < 60.0
        assert service.stats["cancelled"] == 0


@pytest.mark.parametrize("how", ["grace period over", "second signal"])
def test_the_drain_cuts_what_outlasts_it(engine, paced, how):
    """Negative control: requests longer than the drain are cut (503, or an error event in a stream)
    when the grace period is over, or at once on a second signal; the server still stops."""
    grace = 0.3 if how == "grace period over" else 60.0
    long = [_body("go on and on", max_tokens=1000), _body("and on", max_tokens=1000, stream=True)]  # 20 ms a step: 10 s and more
    with LiveServer(create_app(engine, _settings(grace))) as srv:
        service = srv.app.state.service
        with concurrent.futures.ThreadPoolExecutor(len(long)) as pool:
            futures = [pool.submit(ask, httpx.Client(base_url=srv.url, timeout=120), body) for body in long]
            assert wait_for(lambda: service.active == 2 and all(r.req is not None and len(r.req.emitted) > 1 for r in service.worker.rows))
            t0 = time.monotonic()
            srv.server.drain()
            if how == "second signal":
                time.sleep(0.3)
                srv.server.drain()
            got = [f.result(timeout=60) for f in futures]
            cut_after = time.monotonic() - t0
        srv.thread.join(30)
        assert not srv.thread.is_alive()
    assert [status for status, _ in got] == [503, 503] and all(g["error"]["code"] == "shutting_down" for _, g in got), got
    assert cut_after < 5.0, cut_after  # not the 10 s and more the requests would have run
    assert service.stats["cancelled"] == 2


# ------------------------------------------------------------------------------------------ `vlmspec serve`, SIGTERM


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(assets.bundled_target() is None, reason="needs the committed toy model (assets/toyworld-vlm)")
def test_sigterm_drains_vlmspec_serve_and_it_exits_0(tmp_path):
    port, grace = _free_port(), 120  # generous: a shared, loaded machine decodes the toy many times slower
    argv = [sys.executable, "-m", "vlmspec.cli", "serve", "--model", "toy", "--drafter", "ngram", "--policy", "fixed", "--device", "cpu",
            "--dtype", "float32", "--no-ui", "--port", str(port), "--max-batch", "1", "--drain-seconds", str(grace),
            "--request-timeout", "600", "--log-level", "warning"]
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=url, timeout=120) as c:
            def up() -> bool:
                assert proc.poll() is None, log.read_text()
                try:
                    return c.get("/healthz").status_code == 200
                except httpx.TransportError:
                    return False

            assert wait_for(up, timeout=180), log.read_text()
            body = {"messages": [{"role": "user", "content": "Describe the picture."}], "max_tokens": 300, "temperature": 0, "ignore_eos": True}
            with concurrent.futures.ThreadPoolExecutor(2) as pool:  # one decodes, one waits in the queue (--max-batch 1)
                futures = [pool.submit(ask, httpx.Client(base_url=url, timeout=grace + 30), {**body, "stream": s}) for s in (True, False)]
                assert wait_for(lambda: c.get("/healthz").json()["waiting"] == 1, timeout=60), log.read_text()
                t0 = time.monotonic()
                proc.send_signal(signal.SIGTERM)
                assert wait_for(lambda: c.get("/healthz").status_code == 503, timeout=10)
                refused = c.post("/v1/chat/completions", json=body)
                got = [f.result(timeout=grace + 30) for f in futures]
            code = proc.wait(timeout=grace + 30)
            elapsed = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down", refused.text
    assert [status for status, _ in got] == [200, 200] and all(g["finish_reason"] == "length" for _, g in got), got
    assert code == 0 and elapsed < grace, (code, elapsed, log.read_text())
    assert "draining" in log.read_text() and "Traceback" not in log.read_text(), log.read_text()
