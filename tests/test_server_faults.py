"""Fault isolation (#72 item 4): what serving one request raises ends that request alone.

Each test injects an exception at one stage (the prefill, the drafter's propose, its commit, the
detokenizer, the batched step, the worker thread itself) for the one request whose prompt says
POISON (or, for the detokenizer, whose stop strings name it), among concurrent requests that share
its batch. The failed request must get a 500 (or, streamed, an error event) that carries its
request id, logged with the traceback under that id and counted by stage; every other request
must get its answer from a run without the fault, word for word (fp32, tiny random LLaVA). The
negative controls: the poisoned request itself gets a 200 when nothing is injected, and the answers
compared against are those of the same requests alone, without any fault.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import threading

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
pytest.importorskip("prometheus_client")

from conftest import metric, tiny_target, wait_for

from vlmspec.app import ServerSettings, create_app
from vlmspec.draft import NgramDrafter, TreeConfig
from vlmspec.draft.ngram import _NgramSession
from vlmspec.engine import GenerationConfig, SpecEngine
from vlmspec.inputs import encode_prompt
from vlmspec.app.live_server import LiveServer
from vlmspec.text import TextStream

MODEL = "tiny-llava"
MAX_BATCH = 6
MARK = "POISON"  # the poisoned request's prompt says so
STOP_MARK = "@@poisoned-stop@@"  # ... and its stop strings name it (never matched: the detokenizer is what fails)


class InjectedFault(RuntimeError):
    """The exception the tests inject."""


def _body(text: str, **kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 24, "temperature": 0, "ignore_eos": True, **kw}


OTHERS = [
    _body("describe the image in detail", max_tokens=30),
    _body("once upon a time", speculative=False, stream=True),
    _body("the cat sat on the mat. the cat sat on the mat. the cat", stream=True, speculation={"policy": "fixed"}),
    _body("tell me a story about a dog", temperature=0.8, seed=7, top_p=0.9),
]


def poisoned(stream: bool) -> dict:
    return _body(f"{MARK} the cat sat on the mat. the cat sat on the mat. the cat", max_tokens=40, stream=stream, stop=[STOP_MARK])


def ask(client: httpx.Client, body: dict) -> tuple[int, dict]:
    """(status, {"text", "finish_reason"} | {"error", "id"}) of one request; a stream that ends in an
    error event gives (500, its error) with the id its chunks carried."""
    if not body.get("stream"):
        r = client.post("/v1/chat/completions", json=body)
        if r.status_code != 200:
            return r.status_code, {"error": r.json()["error"], "header_id": r.headers.get("x-request-id")}
        return 200, {"text": r.json()["choices"][0]["message"]["content"], "finish_reason": r.json()["choices"][0]["finish_reason"]}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, {"error": r.json()["error"], "header_id": r.headers.get("x-request-id")}
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]", lines[-3:]
    events = [json.loads(line[6:]) for line in lines[:-1]]
    if "error" in events[-1]:
        return 500, {"error": events[-1]["error"], "id": events[0]["id"], "streamed": len(events) - 1}
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    return 200, {"text": text, "finish_reason": [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1]}


def together(url: str, bodies: list[dict]) -> list[tuple[int, dict]]:
    barrier = threading.Barrier(len(bodies))

    def one(body: dict) -> tuple[int, dict]:
        with httpx.Client(base_url=url, timeout=120) as c:
            barrier.wait()
            return ask(c, body)

    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(one, bodies, timeout=300))


def beside(server, bad: dict, others: list[dict]) -> list[tuple[int, dict]]:
    """`others` at once, then `bad` once at least two of them decode: its answer first, then theirs."""
    service = server.app.state.service

    def one(body: dict) -> tuple[int, dict]:
        with httpx.Client(base_url=server.url, timeout=120) as c:
            return ask(c, body)

    with concurrent.futures.ThreadPoolExecutor(len(others) + 1) as pool:
        futures = [pool.submit(one, body) for body in others]
        assert wait_for(lambda: len(service.worker.rows) >= 2), "the other requests did not start"
        futures.insert(0, pool.submit(one, bad))
        return [f.result(timeout=300) for f in futures]


@pytest.fixture(scope="module")
def engine():
    return SpecEngine(tiny_target("llava"), NgramDrafter(TreeConfig(depth=4, top_k=2, total_tokens=8)))


def says_poison(engine: SpecEngine, token_ids) -> bool:
    return MARK in engine.target.tokenizer.decode(token_ids)


@pytest.fixture(scope="module")
def server(engine):
    settings = ServerSettings(model=MODEL, max_batch=MAX_BATCH, max_queue=2 * MAX_BATCH, request_timeout_s=120, ui=False)
    with LiveServer(create_app(engine, settings)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def expected(client):
    """The negative control's answers: each request alone, nothing injected."""
    out = []
    for body in OTHERS + [poisoned(False)]:
        status, got = ask(client, body)
        assert status == 200, got  # the poisoned request itself is served when nothing is injected
        out.append(got)
    return out[:-1]


# ------------------------------------------------------------------------------------------ the injections


class Injection:
    """Where the fault went off: how many requests were in the service then (isolation within a shared batch)."""

    def __init__(self, service=None) -> None:
        self.service, self.fired, self.active_then = service, 0, 0

    def fire(self) -> None:
        self.fired += 1
        self.active_then = max(self.active_then, self.service.active if self.service is not None else 0)
        raise InjectedFault("an injected fault")


def inject_prefill(engine, service, monkeypatch) -> Injection:
    """The target's prefill raises for the poisoned request (inside the batch's admission, its slot taken)."""
    inj, real = Injection(service), engine.target.prefill

    def prefill(inputs, *args, **kwargs):
        if says_poison(engine, inputs["input_ids"][0]):
            inj.fire()
        return real(inputs, *args, **kwargs)

    monkeypatch.setattr(engine.target, "prefill", prefill)
    return inj


def _poison_sessions(engine, monkeypatch) -> None:
    real = NgramDrafter.start

    def start(self, prompt, tree=None):
        session = real(self, prompt, tree)
        session.poisoned = says_poison(engine, prompt.token_ids)
        session.calls = 0
        return session

    monkeypatch.setattr(NgramDrafter, "start", start)


def inject_propose(engine, service, monkeypatch) -> Injection:
    """The drafter's propose raises for the poisoned request at its 4th step (tokens already streamed)."""
    inj, real = Injection(service), _NgramSession.propose
    _poison_sessions(engine, monkeypatch)

    def propose(self, root, max_depth):
        self.calls += 1
        if self.poisoned and self.calls == 4:
            inj.fire()
        return real(self, root, max_depth)

    monkeypatch.setattr(_NgramSession, "propose", propose)
    return inj


def inject_commit(engine, service, monkeypatch) -> Injection:
    """The drafter session's commit raises for the poisoned request at its 3rd step (after the target committed)."""
    inj, real = Injection(service), _NgramSession.commit
    _poison_sessions(engine, monkeypatch)

    def commit(self, token_ids, features):
        self.calls += 1
        if self.poisoned and self.calls == 3:
            inj.fire()
        return real(self, token_ids, features)

    monkeypatch.setattr(_NgramSession, "commit", commit)
    return inj


def inject_detokenizer(engine, service, monkeypatch) -> Injection:
    """The detokenizer (TextStream.push: detokenization and stop strings) raises for the request whose
    stop strings name it, at its 3rd step."""
    inj, init, push = Injection(service), TextStream.__init__, TextStream.push

    def patched_init(self, tokenizer, stop=()):
        init(self, tokenizer, stop)
        self.poisoned, self.pushes = STOP_MARK in stop, 0

    def patched_push(self, step):
        self.pushes += 1
        if self.poisoned and self.pushes == 3:
            inj.fire()
        return push(self, step)

    monkeypatch.setattr(TextStream, "__init__", patched_init)
    monkeypatch.setattr(TextStream, "push", patched_push)
    return inj


STAGES = {  # stage -> (injection, the poisoned request streamed?)
    "prefill": (inject_prefill, False),
    "draft": (inject_propose, True),
    "commit": (inject_commit, False),
    "output": (inject_detokenizer, True),
}


# ------------------------------------------------------------------------------------------ one request's failure


def assert_names_itself(got: dict, stage_words: str) -> str:
    """The error of a failed request: a 500 naming its request id; returns that id."""
    err = got["error"]
    rid = err["request_id"]
    assert rid.startswith("chatcmpl-") and err["code"] == "internal_error" and err["type"] == "server_error", err
    assert rid in err["message"] and stage_words in err["message"], err
    assert got.get("header_id", rid) == rid and got.get("id", rid) == rid, got  # the x-request-id header, a stream's chunk id
    return rid


@pytest.mark.parametrize("stage", list(STAGES))
def test_a_fault_serving_one_request_ends_it_alone_and_changes_no_other_answer(stage, server, client, expected, engine, paced,
                                                                                monkeypatch, caplog):
    inject, stream = STAGES[stage]
    service = server.app.state.service
    before = client.get("/metrics").text
    inj = inject(engine, service, monkeypatch)
    with caplog.at_level(logging.ERROR, logger="vlmspec.server"):
        got = beside(server, poisoned(stream), OTHERS)
    (status, bad), others = got[0], got[1:]
    assert inj.fired == 1 and inj.active_then >= 2, (inj.fired, inj.active_then)  # it failed beside other requests
    assert status == 500, bad
    rid = assert_names_itself(bad, {"prefill": "preparing", "draft": "drafter", "commit": "committing", "output": "text"}[stage])
    if stream:
        assert bad["streamed"] >= 1  # the stream had started (its role chunk, an HTTP 200) when it failed
    assert [g for _, g in others] == expected and [s for s, _ in others] == [200] * len(OTHERS)
    logged = [r for r in caplog.records if rid in r.getMessage()]
    assert len(logged) == 1 and isinstance(logged[0].exc_info[1], InjectedFault), [r.getMessage() for r in caplog.records]
    after = client.get("/metrics").text
    assert metric(after, "vlmspec_failed_requests_total", {"stage": stage}) - metric(before, "vlmspec_failed_requests_total", {"stage": stage}) == 1
    assert metric(after, "vlmspec_failed_requests_total") - metric(before, "vlmspec_failed_requests_total") == 1
    assert metric(after, "vlmspec_batch_resets_total") == metric(before, "vlmspec_batch_resets_total")
    assert wait_for(lambda: client.get("/healthz").json()["free_slots"] == MAX_BATCH)  # its slot came back
    health = client.get("/healthz")
    assert health.status_code == 200 and health.json()["status"] == "ok" and "reason" not in health.json()
    monkeypatch.undo()  # negative control: the same request, nothing injected, is served in full
    status, again = ask(client, poisoned(stream))
    assert status == 200 and again["finish_reason"] == "length", again


def test_a_failed_batched_step_resets_the_batch_answers_each_row_and_the_worker_serves_on(server, client, expected, engine, paced,
                                                                                          monkeypatch, caplog):
    """The target's batched forward raises once: no one row owns it. Every row of that step gets a
    500 with its own request id, the batch starts afresh, the queued requests and the next ones are
    served with their answers from the run without the fault."""
    service = server.app.state.service
    before = client.get("/metrics").text
    inj, real = Injection(service), engine.target.forward_batch

    def forward_batch(states, trees, *args, **kwargs):
        if len(states) >= 2 and not inj.fired:
            inj.rows = len(states)
            inj.fire()
        return real(states, trees, *args, **kwargs)

    monkeypatch.setattr(engine.target, "forward_batch", forward_batch)
    bodies = OTHERS + [dict(b, messages=[{"role": "user", "content": f"and again: {b['messages'][0]['content']}"}]) for b in OTHERS]
    with caplog.at_level(logging.ERROR, logger="vlmspec.server"):
        got = together(server.url, bodies)  # 8 requests, 6 slots: 2 wait in the queue
    failed = [g for s, g in got if s == 500]
    assert inj.fired == 1 and len(failed) == inj.rows >= 2, (inj.rows, got)
    ids = [assert_names_itself(g, "batched engine step") for g in failed]
    assert len(set(ids)) == len(ids)  # each its own id
    assert all(s in (200, 500) for s, _ in got)
    for (s, g), body in zip(got[: len(OTHERS)], OTHERS):
        assert s == 500 or g == expected[OTHERS.index(body)]  # the ones served: unchanged answers
    logged = [r for r in caplog.records if "batched step failed" in r.getMessage()]
    assert len(logged) == 1 and all(i in logged[0].getMessage() for i in ids) and isinstance(logged[0].exc_info[1], InjectedFault)
    after = client.get("/metrics").text
    assert metric(after, "vlmspec_batch_resets_total") - metric(before, "vlmspec_batch_resets_total") == 1
    assert metric(after, "vlmspec_failed_requests_total", {"stage": "step"}) - metric(before, "vlmspec_failed_requests_total", {"stage": "step"}) == len(ids)
    # the worker serves on: the same requests again, every answer the one without the fault
    again = together(server.url, OTHERS)
    assert [g for _, g in again] == expected and [s for s, _ in again] == [200] * len(OTHERS)
    assert client.get("/healthz").json()["status"] == "ok"


def test_a_dead_worker_answers_its_requests_and_healthz_says_why(engine, monkeypatch, caplog):
    """The batch cannot even be rebuilt after a failed step: the worker thread dies. Its requests are
    answered (500, never a wait for the timeout), /healthz answers 503 with the reason (what Ray's
    health check reads), and new requests get a 503 that says why."""
    settings = ServerSettings(model=MODEL, max_batch=1, max_queue=4, request_timeout_s=120, ui=False)
    with LiveServer(create_app(engine, settings)) as srv, httpx.Client(base_url=srv.url, timeout=120) as c:
        service = srv.app.state.service
        assert c.get("/healthz").json()["status"] == "ok" and service.broken() is None  # negative control: before the fault
        assert ask(c, OTHERS[0])[0] == 200
        real_forward = engine.target.forward_batch
        gate = threading.Event()

        def forward_batch(*args, **kwargs):
            gate.wait(30)  # until the second request is queued
            raise InjectedFault("the step")

        def no_batch(*args, **kwargs):
            raise InjectedFault("no new batch")

        monkeypatch.setattr(engine.target, "forward_batch", forward_batch)
        monkeypatch.setattr(engine, "batch", no_batch)
        with caplog.at_level(logging.ERROR, logger="vlmspec.server"), concurrent.futures.ThreadPoolExecutor(2) as pool:
            first = pool.submit(ask, c, OTHERS[0])
            assert wait_for(lambda: service.active == 1)
            second = pool.submit(ask, c, OTHERS[2])
            assert wait_for(lambda: service.waiting == 1)
            gate.set()
            (s1, g1), (s2, g2) = first.result(60), second.result(60)
        assert s1 == 500 and "batched engine step" in g1["error"]["message"]  # the row of the step
        assert s2 == 500 and "worker thread stopped" in g2["error"]["message"]  # the queued one
        assert_names_itself(g1, "step")
        assert_names_itself(g2, "worker")
        health = c.get("/healthz")
        assert health.status_code == 503 and health.json()["status"] == "unavailable", health.json()
        assert health.json()["reason"] == "the worker thread died: InjectedFault: no new batch" == service.broken()
        r = c.post("/v1/chat/completions", json=OTHERS[0])
        assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable" and "worker thread died" in r.json()["error"]["message"]
        text = c.get("/metrics").text
        assert metric(text, "vlmspec_failed_requests_total", {"stage": "worker"}) == 1
        assert metric(text, "vlmspec_failed_requests_total", {"stage": "step"}) == 1
        assert any(r.levelno == logging.CRITICAL and isinstance(r.exc_info[1], InjectedFault) for r in caplog.records)
        monkeypatch.setattr(engine.target, "forward_batch", real_forward)


# ------------------------------------------------------------------------------------------ the engine's part


def _requests(engine: SpecEngine) -> list[tuple[dict, GenerationConfig]]:
    prompts = ["the cat sat on the mat. the cat sat on the mat. the cat", f"{MARK} the cat sat on the mat. the cat", "once upon a time"]
    return [(encode_prompt(engine.target, p), GenerationConfig(max_new_tokens=20, ignore_eos=True)) for p in prompts]


@pytest.mark.parametrize("stage", ["draft", "commit"])
def test_a_batch_takes_out_the_row_whose_drafter_failed_and_steps_the_others_unchanged(engine, monkeypatch, stage):
    requests = _requests(engine)
    alone = [engine.generate(inputs, config).token_ids for inputs, config in requests]  # the negative control: no fault
    (inject_propose if stage == "draft" else inject_commit)(engine, None, monkeypatch)
    batch = engine.batch(3)
    tickets = [batch.submit(inputs, config) for inputs, config in requests]
    while not batch.idle:
        batch.step()
    reqs = [t.request for t in tickets]
    bad = reqs[1]
    assert bad.failure is not None and bad.failure.stage == stage and isinstance(bad.failure.error, InjectedFault)
    assert bad.result is not None and len(bad.result.token_ids) < 20 and batch.free == [0, 1, 2]
    assert [reqs[0].result.token_ids, reqs[2].result.token_ids] == [alone[0], alone[2]]
    assert reqs[0].failure is None and reqs[2].failure is None
    with pytest.raises(InjectedFault):  # a request of its own raises what failed it, as before
        engine.generate(*requests[1])
    with pytest.raises(InjectedFault):  # so do several, once the others have finished
        engine.generate_many(requests, slots=3)
