"""Continuous batching in the service (#47 item 1), through live HTTP servers on a tiny random LLaVA (fp32).

The oracle of every request is the same request sent alone to the same server: run concurrently,
with different options in one batch (speculative or plain, policies, depths, tree budgets, stop
strings, streamed or not, seeded sampling), each must get exactly its own answer. The negative
control hands each row of a batched forward its neighbour's logits and must see answers change.
"""

from __future__ import annotations

import base64
import concurrent.futures
import io
import json
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
pytest.importorskip("prometheus_client")

from conftest import metric, tiny_target, wait_for

from vlmspec.app import ServerSettings, create_app
from vlmspec.draft import NgramDrafter, TreeConfig
from vlmspec.engine import Batch, SpecEngine
from vlmspec.app.live_server import LiveServer
from testing.tiny import tiny_image

MODEL = "tiny-llava"
MAX_BATCH = 4


def _data_url(seed: int) -> str:
    buf = io.BytesIO()
    tiny_image(seed).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _user(text: str, images: tuple[int, ...] = ()) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": _data_url(s)}} for s in images]
    return [{"role": "user", "content": parts + [{"type": "text", "text": text}]}]


def _body(text: str, images: tuple[int, ...] = (), **kw) -> dict:
    return {"model": MODEL, "messages": _user(text, images), "max_tokens": 24, "temperature": 0, "ignore_eos": True, **kw}


# different prompts, images, lengths and options, all in one batch
MIXED = [
    _body("describe the image in detail", (0,)),
    _body("once upon a time", speculative=False, max_tokens=30),
    _body("the cat sat on the mat. the cat sat on the mat. the cat", speculation={"policy": "fixed", "max_depth": 2, "tree_tokens": 3}),
    _body("compare the two images", (1, 2), speculation={"max_depth": 0}, stream=True),
    _body("the quick brown fox jumps over the lazy dog", stream=True, speculative=False, max_tokens=16),
    _body("what is in this picture", (3,), speculation={"policy": "goodput"}, max_tokens=12),
    _body("tell me a story about a dog", temperature=0.8, seed=7, top_p=0.9),  # seeded sampling: its own generator
    _body("a b c d e f g a b c d e f g a b", max_tokens=20, ignore_eos=False),
]


def ask(client: httpx.Client, body: dict) -> tuple[int, dict]:
    """(status, {"text", "finish_reason", "usage" | "error"}) of one request, streamed or not."""
    if not body.get("stream"):
        r = client.post("/v1/chat/completions", json=body)
        data = r.json()
        if r.status_code != 200:
            return r.status_code, {"error": data["error"], "retry_after": r.headers.get("retry-after")}
        choice = data["choices"][0]
        return 200, {"text": choice["message"]["content"], "finish_reason": choice["finish_reason"],
                     "tokens": data["usage"]["completion_tokens"]}
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream_options": {"include_usage": True}}) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, {"error": r.json()["error"], "retry_after": r.headers.get("retry-after")}
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
    assert "error" not in events[-1], events[-1]
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    finish = [e["choices"][0]["finish_reason"] for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    return 200, {"text": text, "finish_reason": finish[-1], "tokens": events[-1]["usage"]["completion_tokens"]}


def alone(client: httpx.Client, bodies: list[dict]) -> list[dict]:
    """Each request sent on its own, one after the other (nothing else in the batch)."""
    out = []
    for body in bodies:
        status, got = ask(client, body)
        assert status == 200, got
        out.append(got)
    return out


def together(url: str, bodies: list[dict]) -> list[tuple[int, dict]]:
    """Every request at once, each from its own client thread, released together."""
    barrier = threading.Barrier(len(bodies))

    def one(body: dict) -> tuple[int, dict]:
        with httpx.Client(base_url=url, timeout=120) as c:
            barrier.wait()
            return ask(c, body)

    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(one, bodies, timeout=300))


def differing(expected: list[dict], got: list[tuple[int, dict]]) -> list[int]:
    return [i for i, (want, (status, have)) in enumerate(zip(expected, got)) if status != 200 or have != want]


@pytest.fixture(scope="module")
def engine():
    return SpecEngine(tiny_target("llava"), NgramDrafter(TreeConfig(depth=4, top_k=2, total_tokens=8)))


@pytest.fixture(scope="module")
def server(engine):
    settings = ServerSettings(model=MODEL, max_batch=MAX_BATCH, max_queue=MAX_BATCH, request_timeout_s=120, ui=False,
                              max_model_len=engine.target.max_positions)  # the model's whole context (above the default's)
    with LiveServer(create_app(engine, settings)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def expected(client):
    return alone(client, MIXED)


def test_every_answer_in_a_batch_equals_its_answer_alone(server, client, expected, paced):
    before = client.get("/metrics").text
    got = together(server.url, MIXED)  # 8 requests, 4 slots: half wait, then join as rows leave
    assert differing(expected, got) == [], [(i, expected[i], got[i]) for i in differing(expected, got)]
    after = client.get("/metrics").text
    steps = metric(after, "vlmspec_batch_size_count") - metric(before, "vlmspec_batch_size_count")
    single = metric(after, "vlmspec_batch_size_bucket", {"le": "1.0"}) - metric(before, "vlmspec_batch_size_bucket", {"le": "1.0"})
    assert steps > single, "no step decoded two requests together: the test did not batch"
    assert metric(after, "vlmspec_speculation_depth_count", {"batch_size": str(MAX_BATCH)}) > 0
    health = client.get("/healthz").json()
    assert health["active"] == 0 and health["waiting"] == 0 and health["free_slots"] == MAX_BATCH


def test_negative_control_a_batch_that_mixes_up_its_rows_changes_answers(server, client, expected, paced, monkeypatch):
    """The check above must catch a batch that hands one row another row's logits."""
    import vlmspec.engine.batch

    real = vlmspec.engine.batch.verify_rows

    def mixed_up(trees, logits, *args, **kwargs):
        return real(trees, logits.roll(1, dims=0) if logits.shape[0] > 1 else logits, *args, **kwargs)

    monkeypatch.setattr(vlmspec.engine.batch, "verify_rows", mixed_up)
    got = together(server.url, MIXED)
    assert differing(expected, got), "a batch whose rows swapped their logits answered like the rows alone"


def test_a_burst_of_three_times_max_batch_loses_and_changes_nothing(server, client):
    bodies = [_body(f"request number {i}: the cat sat on the", (i % 3,) if i % 2 else (), max_tokens=8 + i % 5,
                    stream=i % 3 == 0, speculative=i % 4 != 1) for i in range(3 * MAX_BATCH)]
    want = alone(client, bodies)
    service = server.app.state.service
    completed, rejected = service.stats["completed"], metric(client.get("/metrics").text, "vlmspec_rejected_requests_total")
    got = together(server.url, bodies)
    codes = [status for status, _ in got]
    assert len(got) == len(bodies) and set(codes) <= {200, 429}, codes
    for i, (status, have) in enumerate(got):
        if status == 200:
            assert have == want[i], (i, have, want[i])  # none changed
        else:  # a clear 429: what happened, and when to come back
            err = have["error"]
            assert err["code"] == "queue_full" and "retry after" in err["message"] and int(have["retry_after"]) >= 1, have
    assert codes.count(200) >= 2 * MAX_BATCH  # the batch and the queue took at least their places
    assert service.stats["completed"] - completed == codes.count(200)  # none lost: every 200 a completed generation
    assert metric(client.get("/metrics").text, "vlmspec_rejected_requests_total") - rejected == codes.count(429)
    assert wait_for(lambda: service.active == 0 and service.waiting == 0)


def test_a_client_disconnect_mid_batch_frees_its_slot_and_changes_no_other_answer(server, client, paced):
    service = server.app.state.service
    others = [_body(f"keep going {i}", (i,) if i else (), max_tokens=200) for i in range(MAX_BATCH)]  # one more than the free slots
    want = alone(client, others)
    cancelled = metric(client.get("/metrics").text, "vlmspec_cancelled_generations_total", {"reason": "disconnect"})
    leaving = _body("a long story", max_tokens=1000, stream=True)
    with httpx.Client(base_url=server.url, timeout=120) as c, c.stream("POST", "/v1/chat/completions", json=leaving) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # kept: an iterator dropped mid-stream closes the connection
        for line in lines:
            if '"content"' in line and '"content": ""' not in line:
                break  # streaming: now the others come
        pool = concurrent.futures.ThreadPoolExecutor(len(others))
        futures = [pool.submit(ask, c, b) for b in others]  # MAX_BATCH - 1 join, one waits
        assert wait_for(lambda: service.active == MAX_BATCH and service.waiting == 1), (service.active, service.waiting)
        r.close()  # hang up
        # its row leaves at the next step and the waiting request takes its slot, while the others still run
        assert wait_for(lambda: service.waiting == 0, timeout=10)
        still_running = sum(not f.done() for f in futures)
        got = [f.result(timeout=120) for f in futures]
        pool.shutdown()
    assert still_running == MAX_BATCH, "the waiting request joined only when another finished, not when the slot was freed"
    assert [g for _, g in got] == want and all(status == 200 for status, _ in got)
    assert metric(client.get("/metrics").text, "vlmspec_cancelled_generations_total", {"reason": "disconnect"}) == cancelled + 1
    assert wait_for(lambda: client.get("/healthz").json()["free_slots"] == MAX_BATCH)


def test_prompt_plus_max_tokens_over_the_context_is_a_400_never_truncated(server, client, engine):
    limit = engine.target.max_positions
    prompt = "hello " * 1300
    n_prompt = client.post("/v1/chat/completions", json=_body(prompt, max_tokens=1)).json()["usage"]["prompt_tokens"]
    room = limit - n_prompt
    assert 1 < room < server.app.state.settings.default_max_tokens  # less context left than the server's default max_tokens
    r = client.post("/v1/chat/completions", json=_body(prompt, max_tokens=room + 1))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "max_tokens"
    assert f"maximum context length is {limit} tokens" in err["message"]
    assert f"you requested {limit + 1} tokens ({n_prompt} in the messages, {room + 1} in the completion)" in err["message"]
    # negative control: exactly the room left is served in full (max_tokens tokens, not cut by the context)
    status, got = ask(client, _body(prompt, max_tokens=room))
    assert status == 200 and got["tokens"] == room and got["finish_reason"] == "length"
    # no max_tokens given: the server's default is lowered to the context left, as vLLM does
    body = _body(prompt)
    del body["max_tokens"]
    status, got = ask(client, body)
    assert status == 200 and got["tokens"] == room
    # a prompt alone over the context names the messages
    r = client.post("/v1/chat/completions", json=_body("hello " * 5000, max_tokens=4))
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_the_kv_pool_is_sized_at_start_up_never_grows_and_is_reported(engine):
    """--max-model-len: every slot holds that many tokens plus the draft tree, fixed at start-up; a
    longer request is a 400 naming that length (never a grown pool), and /healthz and /metrics
    report the pool's size and use."""
    length, tree = 64, engine.drafter.tree.total_tokens + 1
    settings = ServerSettings(model=MODEL, max_batch=MAX_BATCH, max_queue=MAX_BATCH, ui=False, max_model_len=length)
    with LiveServer(create_app(engine, settings)) as srv, httpx.Client(base_url=srv.url, timeout=120) as c:
        pool = c.get("/healthz").json()["kv_pool"]
        assert pool == {"slots": MAX_BATCH, "entries_per_slot": length + tree, "max_model_len": length, "used_slots": 0,
                        "used_entries": 0, "bytes": 0}  # nothing allocated before the first request
        n_prompt = c.post("/v1/chat/completions", json=_body("the cat", max_tokens=1)).json()["usage"]["prompt_tokens"]
        allocated = c.get("/healthz").json()["kv_pool"]["bytes"]
        assert allocated > 0
        r = c.post("/v1/chat/completions", json=_body("the cat", max_tokens=length - n_prompt + 1))
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        assert f"maximum context length is {length} tokens" in r.json()["error"]["message"]
        # negative control: exactly the room left is served in full; several at once leave the pool as it was
        got = together(srv.url, [_body("the cat", max_tokens=length - n_prompt)] * MAX_BATCH)
        assert all(status == 200 and g["tokens"] == length - n_prompt for status, g in got), got
        body = _body("the cat")
        del body["max_tokens"]  # the server's default, lowered to what a slot holds
        status, g = ask(c, body)
        assert status == 200 and g["tokens"] == length - n_prompt
        health, text = c.get("/healthz").json()["kv_pool"], c.get("/metrics").text
        assert health["bytes"] == allocated and health["used_slots"] == health["used_entries"] == 0
        assert metric(text, "vlmspec_kv_pool_bytes") == allocated
        assert metric(text, "vlmspec_kv_pool_entries") == MAX_BATCH * (length + tree)
        assert metric(text, "vlmspec_kv_pool_used_entries") == 0


def test_a_joining_requests_first_token_goes_out_before_the_next_step(server, monkeypatch):
    """The prefill's token is handed to the client as soon as its prefill is done, not after the
    batch's next draft -> verify round (held here for 1.5 s): a streamed request sees it first."""
    rounds: list[float] = []
    real = Batch._round

    def slow_round(self, reqs):
        rounds.append(time.monotonic())
        time.sleep(1.5)
        return real(self, reqs)

    monkeypatch.setattr(Batch, "_round", slow_round)
    body = {**_body("the cat the cat", max_tokens=3), "stream": True}
    with httpx.Client(base_url=server.url, timeout=120) as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        first, lines = None, r.iter_lines()
        for line in lines:
            if line.startswith("data: {") and '"content": "' in line and '"content": ""' not in line:
                first = time.monotonic()
                break
        for _ in lines:  # the rest of the answer
            pass
    assert first is not None and rounds, rounds
    assert first < rounds[0] + 1.0, (first - rounds[0])  # before the first round could have returned


def test_metrics_count_steps_latencies_and_speculation(server, client):
    before = client.get("/metrics").text
    together(server.url, [_body("the cat the cat the cat the cat", speculative=False, max_tokens=6)] * 2)
    mid = client.get("/metrics").text
    for name in ("vlmspec_spec_decode_num_drafts_total", "vlmspec_spec_decode_num_draft_tokens_total"):
        assert metric(mid, name) == metric(before, name), name  # plain requests draft nothing
    assert metric(mid, "vlmspec_inter_token_latency_seconds_count", {"mode": "plain"}) - \
        metric(before, "vlmspec_inter_token_latency_seconds_count", {"mode": "plain"}) == 2 * (6 - 1)
    together(server.url, [_body("the cat the cat the cat the cat", max_tokens=12, speculation={"policy": "fixed"})] * 3)
    text = client.get("/metrics").text
    drafts, drafted = metric(text, "vlmspec_spec_decode_num_drafts_total"), metric(text, "vlmspec_spec_decode_num_draft_tokens_total")
    accepted = metric(text, "vlmspec_spec_decode_num_accepted_tokens_total")
    assert drafts > metric(mid, "vlmspec_spec_decode_num_drafts_total") and 0 < accepted <= drafted
    assert metric(text, "vlmspec_spec_decode_num_accepted_tokens_per_pos_total") == accepted
    assert metric(text, "vlmspec_spec_decode_num_accepted_tokens_per_pos_total", {"position": "0"}) <= \
        metric(text, "vlmspec_spec_decode_num_drafts_reaching_pos_total", {"position": "0"}) <= drafts
    assert metric(text, "vlmspec_time_to_first_token_seconds_count") >= 5
    assert metric(text, "vlmspec_queue_wait_seconds_count") >= 5
    help_lines = [line for line in text.splitlines() if line.startswith("# HELP vlmspec_spec_decode_num_draft_tokens")]
    assert help_lines and "node of a draft tree" in help_lines[0]
    assert "vlmspec_acceptance_rate" not in text and "vlmspec_mean_accepted_length" not in text  # no ratio gauges


def test_plain_rows_of_the_speculative_batch_are_plain_decoding(server, client, engine):
    """A plain request is a row of the speculative engine's batch that never drafts: its tokens are the
    plain engine's (PlainDrafter, the oracle) and it reports what plain decoding reports (no drafts, no depths)."""
    from vlmspec.draft import PlainDrafter
    from vlmspec.engine import GenerationConfig
    from vlmspec.inputs import encode_prompt

    plain = SpecEngine(engine.target, PlainDrafter())
    cases = [("once upon a time", ()), ("compare the two images", (1, 2))]
    bodies = [_body(text, seeds, speculative=False, max_tokens=20) for text, seeds in cases]
    got = together(server.url, bodies + [_body("the cat sat on the mat. the cat sat on the", max_tokens=20)])
    for (text, seeds), (status, have) in zip(cases, got):
        inputs = encode_prompt(engine.target, text, [tiny_image(s) for s in seeds])
        want = plain.generate(inputs, GenerationConfig(max_new_tokens=20, ignore_eos=True))
        assert status == 200 and have["text"] == engine.target.tokenizer.decode(want.token_ids, skip_special_tokens=True)
    r = client.post("/v1/chat/completions", json=bodies[0]).json()["speculative"]
    assert r["enabled"] is False and r["drafted_tokens"] == 0 and r["depths"] == [] and r["target_forwards"] == 20


def test_the_service_reports_policy_none_for_a_plain_row(server):
    """What the demo reads (`GenerationResult.policy` / `depths`): plain rows say "plain" and no depths,
    as the plain engine does; a speculative row of the same batch says its policy (negative control)."""
    import asyncio

    from vlmspec.engine import GenerationConfig
    from vlmspec.inputs import user_turn
    from vlmspec.app.worker import Job

    service = server.app.state.service

    async def run(speculative: bool):
        job = Job.on_loop(user_turn("the cat the cat the cat"), [], GenerationConfig(max_new_tokens=8, ignore_eos=True),
                          speculative=speculative, timeout_s=60)
        service.submit(job)
        while True:
            kind, payload = await job.receive(60)
            if kind in ("done", "error"):
                return kind, payload

    async def both():
        return await asyncio.gather(run(False), run(True))

    (k_plain, plain), (k_spec, spec) = asyncio.run(both())
    assert k_plain == k_spec == "done"
    assert plain.result.policy == "plain" and plain.result.depths == [] and plain.result.num_drafted == 0
    assert spec.result.policy == "fixed" and len(spec.result.depths) == spec.result.num_target_forwards - 1
