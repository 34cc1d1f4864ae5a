"""The service's suffix drafter across API keys: one store per model, one pool per key (a tenant),
never one key's answers drafted for another; its counters on /metrics; the store off."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")

from conftest import metric, tiny_target
from fastapi.testclient import TestClient

from vlmspec.app import ServerSettings, create_app
from vlmspec.app.metrics import DRAFTER_METRICS
from vlmspec.draft import SuffixDrafter, SuffixStore, TreeConfig
from vlmspec.engine import SpecEngine

MODEL = "tiny-qwen"
KEYS = ("key-a", "key-b")
DEEP = TreeConfig(depth=16, top_k=3, total_tokens=16)
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "once upon a time"}], "max_tokens": 32, "temperature": 0,
        "ignore_eos": True}


def _app(store: SuffixStore | None, keys: tuple[str, ...] = KEYS):
    engine = SpecEngine(tiny_target("qwen2_5_vl"), SuffixDrafter(DEEP, store=store))
    return create_app(engine, ServerSettings(model=MODEL, api_keys=keys, ui=False, request_timeout_s=60))


def _ask(client: TestClient, key: str) -> dict:
    r = client.post("/v1/chat/completions", json=BODY, headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    return r.json()


def _store_hits(client: TestClient) -> float:
    text = client.get("/metrics", headers={"Authorization": f"Bearer {KEYS[0]}"}).text
    return metric(text, "vlmspec_suffix_hits_total", {"source": "store"})


def test_one_key_s_answers_are_never_drafted_for_another_and_the_counters_say_so():
    store = SuffixStore(10_000)
    with TestClient(_app(store)) as client:
        first = _ask(client, "key-a")
        assert _store_hits(client) == 0 and len(store.tenants()) == 1  # key-a's answer is in key-a's pool
        other = _ask(client, "key-b")  # the same request under another key: nothing of key-a's is proposed
        assert _store_hits(client) == 0
        again = _ask(client, "key-a")  # negative control: the key's own repeat is drafted from its pool
        assert _store_hits(client) > 0
        texts = {r["choices"][0]["message"]["content"] for r in (first, other, again)}
        assert len(texts) == 1  # the answer is the target's whoever drafts it
        text = client.get("/metrics", headers={"Authorization": "Bearer key-b"}).text
        assert metric(text, "vlmspec_suffix_store_tenants") == 2
        assert 0 < metric(text, "vlmspec_suffix_store_tokens") <= store.max_tokens
        accepted, drafted = metric(text, "vlmspec_suffix_accepted_tokens_total"), metric(text, "vlmspec_suffix_drafted_tokens_total")
        assert 0 < accepted <= drafted
        assert metric(text, "vlmspec_suffix_proposals_total") >= metric(text, "vlmspec_suffix_hits_total")
        types = dict(line.split()[2:4] for line in text.splitlines() if line.startswith("# TYPE "))
        for name, kind in DRAFTER_METRICS.items():  # the hybrid's series are left out for the suffix drafter alone
            if not name.startswith("vlmspec_hybrid"):
                assert types.get(name, types.get(name.removesuffix("_total"))) == kind, (name, kind)
    assert not set(store.tenants()) & set(KEYS)  # a pool is named by the key's digest, never by the key


def test_an_open_service_shares_one_pool_and_no_store_keeps_nothing():
    store = SuffixStore(10_000)
    with TestClient(_app(store, keys=())) as client:
        _ask(client, "anything")
        _ask(client, "else")  # no keys: one tenant, the second request is drafted from the first's answer
        assert _store_hits(client) > 0 and store.tenants() == [None]
    with TestClient(_app(None)) as client:  # --suffix-memory 0: no store, the counters but no store hits
        _ask(client, "key-a")
        _ask(client, "key-a")
        assert _store_hits(client) == 0


def test_settings_tell_keys_apart_in_constant_time_and_refuse_blank_ones():
    s = ServerSettings(api_keys=KEYS)
    assert s.tenant("key-a") != s.tenant("key-b") and s.tenant("key-c") is None and s.tenant("") is None
    assert not s.open and ServerSettings().open
    for bad in (("",), (" key",), "key-a"):
        with pytest.raises(ValueError):
            ServerSettings(api_keys=bad)


def test_api_keys_on_the_command_line_and_in_the_environment(monkeypatch):
    from vlmspec.cli.options import UsageError
    from vlmspec.cli.serve import api_keys

    assert api_keys(["k1,k2", "k3", "k1"]) == ("k1", "k2", "k3")
    monkeypatch.setenv("VLMSPEC_API_KEY", "e1, e2")
    assert api_keys(None) == ("e1", "e2")
    monkeypatch.delenv("VLMSPEC_API_KEY")
    assert api_keys(None) == ()
    with pytest.raises(UsageError, match="empty key"):
        api_keys(["k1,,k2"])
