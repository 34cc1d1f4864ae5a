"""`vlmspec bench soak` (#47's soak): the judging of each kind of request, the checks over a run, and a
short soak through the real HTTP server on the toy model."""

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

from vlmspec import assets
from vlmspec.bench.soak import KINDS, SoakOptions, judge, markdown, summarise


def _got(text, status=200, error=None, closed=False):
    return {"status": status, "text": text, "error": error, "closed": closed, "seconds": 0.1}


def test_each_kind_is_judged_against_the_answer_alone():
    ref = "The cat sits on the mat."
    assert judge("complete", _got(ref), ref, exact=True) is None
    assert "changed" in judge("complete", _got("The cat sat."), ref, exact=True)  # negative control
    assert judge("complete", _got("A sampled answer."), ref, exact=False) is None  # sampled rows that draft: it finished
    assert "status 429" in judge("complete", _got("", status=429, error="rate_limited"), ref, exact=True)
    assert judge("cancel", _got("The cat", closed=True), ref, exact=True) is None
    assert "prefix" in judge("cancel", _got("The dog", closed=True), ref, exact=True)
    assert judge("cancel", _got("The dog", closed=True), ref, exact=False) is None  # a sampled row that drafts: another sample
    assert judge("client-timeout", _got("", status=0, closed=True), ref, exact=True) is None  # timed out before the headers
    assert "status 0" in judge("cancel", _got("", status=0), ref, exact=True)
    # the long answer is cut by the server's timeout: its text and the short answer alone share a prefix
    assert judge("server-timeout", _got(ref + " It purrs", error="timeout"), ref, exact=True) is None
    assert judge("server-timeout", _got("The", error="timeout"), ref, exact=True) is None
    # it finished before the deadline (a repeated answer drafted whole): right while it extends its reference
    assert judge("server-timeout", _got(ref + " It purrs."), ref, exact=True) is None
    assert "off its reference" in judge("server-timeout", _got("A dog sat."), ref, exact=True)  # negative control
    assert "timeout event" in judge("server-timeout", _got("", status=500, error="internal"), ref, exact=True)
    assert "prefix" in judge("server-timeout", _got("A dog", error="timeout"), ref, exact=True)
    # a complete request the server cut at its deadline (a machine loaded beyond it): not wrong while a prefix, counted apart
    assert judge("complete", _got("The cat", error="timeout"), ref, exact=True) is None
    assert judge("complete", _got("", status=504, error="timeout"), ref, exact=True) is None  # cut before its first token
    assert "prefix" in judge("complete", _got("The dog", error="timeout"), ref, exact=True)


def _run(wrong=None, rss=(100, 100, 101, 100, 101, 100), active=0, cut=True):
    results = [{"kind": k, "variant": "plain", "start_s": 1.0, "wrong": None,
                **_got("x", error="timeout" if k == "server-timeout" and cut else None)} for k in KINDS]
    if wrong:
        results[0]["wrong"] = wrong
    samples = [(60.0 * i, m * 2**20) for i, m in enumerate(rss)]
    state = {"active": active, "waiting": 0, "free_slots": 4 - active, "max_batch": 4}
    return summarise(results, samples, state, [], 300.0, SoakOptions(minutes=5, warmup_fraction=0.2), 30.0)


def test_the_heap_is_read_apart_from_resident_memory():
    """glibc's heap in use and free, sampled beside resident memory: compared after warm-up like it."""
    from vlmspec.bench.soak import heap_bytes

    got = heap_bytes()
    assert got is not None and got[0] > 0 and got[1] >= 0  # glibc (Linux): in use, free in its arenas
    results = [{"kind": k, "variant": "plain", "start_s": 1.0, "wrong": None, **_got("x")} for k in KINDS]
    rss = [(60.0 * i, 100 * 2**20) for i in range(6)]
    heap = [(60.0 * i, (50 + 10 * i) * 2**20, (20 - 2 * i) * 2**20) for i in range(6)]  # in use grows, free shrinks
    report = summarise(results, rss, {"active": 0, "waiting": 0, "free_slots": 4, "max_batch": 4}, [], 300.0,
                       SoakOptions(minutes=5, warmup_fraction=0.2), 30.0, heap)
    h = report["heap"]
    assert h["in_use_after_warmup_mib"] == pytest.approx(60) and h["in_use_end_mib"] == pytest.approx(100)
    assert h["free_after_warmup_mib"] == pytest.approx(18) and h["free_end_mib"] == pytest.approx(10)
    assert "heap in use after warm-up 60 MiB, at the end 100 MiB" in markdown(report)
    assert "CACHE_CAPACITY" not in markdown(report)  # no env: no capacities said
    report["env"] = {"onednn_caches": {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "256", "LRU_CACHE_CAPACITY": "1024"}}
    assert "; ONEDNN_PRIMITIVE_CACHE_CAPACITY=256; LRU_CACHE_CAPACITY=1024" in markdown(report).splitlines()[0]


def test_the_checks_over_a_run_and_their_negative_controls():
    ok = _run()
    assert ok["passed"] and ok["rss"]["growth"] == pytest.approx(0.0) and ok["counts"]["cancel"] == {"sent": 1, "cut": 0, "wrong": 0}
    cut = [{"kind": "complete", "variant": "plain", "start_s": 1.0, "wrong": None, **_got("x", error="timeout")}]
    assert summarise(cut, [(0.0, 1)], {"active": 0, "waiting": 0, "free_slots": 4, "max_batch": 4}, [], 1.0, SoakOptions(minutes=5), 30.0
                     )["counts"]["complete"] == {"sent": 1, "cut": 1, "wrong": 0}
    assert not _run(wrong="changed")["passed"]
    grown = _run(rss=(100, 100, 100, 100, 108, 110))  # after warm-up (minute 1) memory grows 10%
    assert not grown["passed"] and grown["rss"]["growth"] == pytest.approx(0.10)
    assert ok["heap"] is None and "heap" not in markdown(ok)  # no heap samples given: no heap line
    assert not grown["checks"]["memory after warm-up grew under 5%"]
    uncut = _run(cut=False)  # every long request finished in time: the server's timeout went unchecked
    assert not uncut["passed"] and not uncut["checks"]["the server's timeout cut a long request"]
    leaked = _run(active=1)
    assert not leaked["passed"] and not leaked["checks"]["all slots free at the end"]
    assert "FAIL: all slots free at the end" in markdown(leaked) and "pass: nothing hung" in markdown(leaked)


@pytest.mark.skipif(assets.bundled_target() is None, reason="needs the committed toy model (assets/toyworld-vlm)")
def test_a_short_soak_on_the_toy_passes_every_check(tmp_path, monkeypatch):
    import vlmspec.app.worker as worker
    from vlmspec import factory
    from vlmspec.runtime import memory
    from vlmspec.app import ServerSettings
    from vlmspec.app.serve import serving
    from vlmspec.bench.soak import soak

    assert memory._MALLOC_TRIM is not None  # glibc (Linux): the worker hands freed heap memory back
    trims = []
    monkeypatch.setattr(worker, "release_free_memory", lambda: trims.append(memory._MALLOC_TRIM(0)))
    # the hybrid drafter (the toy's EAGLE head + suffix) with a small store: answers evicted over the soak
    engine = factory.build_engine(factory.EngineSpec(model="toy", drafter="hybrid", suffix_memory=300, policy="fixed", max_batch=4))
    opts = SoakOptions(minutes=0.25, clients=3, prompts=2, max_tokens=8, shares=(0.2, 0.2, 0.2), long_tokens=700, sample_s=0.5)
    settings = ServerSettings(model="bench", max_batch=4, max_queue=8, request_timeout_s=1.5, max_tokens_cap=1024, ui=False)
    with serving(engine, settings) as url:
        report = soak(url, "bench", opts, settings.request_timeout_s, progress=False, store=engine.drafter.store)
    store = report["suffix_store"]
    assert report["checks"]["the suffix store stayed within 300 tokens"] and 0 < store["peak_tokens"] <= 300
    assert store["evicted_tokens"] > 0 and len(store["samples"]) >= 10  # the budget was reached and held
    # every check but memory, which a 15-second run cannot judge (the slot cache still grows to the longest request)
    assert all(ok for name, ok in report["checks"].items() if not name.startswith("memory")), (report["checks"], report["wrong"])
    assert report["rss"]["after_warmup_mib"] > 0 and report["rss"]["end_mib"] > 0
    assert all(report["counts"][k]["sent"] > 0 for k in KINDS)
    timeouts = [r for r in report["timeline"] if r["kind"] == "server-timeout"]
    assert all(r["seconds"] < 1.5 + 5 for r in timeouts) and any(r["error"] == "timeout" for r in timeouts)  # the server cut them, none hung
    assert report["health_at_end"]["free_slots"] == 4 and len(report["rss"]["samples"]) >= 10
    json.dumps(report)  # the report is written as JSON
    # the worker handed freed memory back every TRIM_EVERY requests that left (the references count too)
    assert report["requests"] >= worker.TRIM_EVERY and len(trims) >= report["requests"] // worker.TRIM_EVERY
