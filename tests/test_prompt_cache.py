"""The prompt cache: a repeated prompt's prefill is served from what its first prefill left in its slot.

The oracle is the same requests through an engine without the cache (fp32 greedy, tiny models): every
answer equal, alone and in a batch, while the target's forward ran once per distinct prompt head.
"""
import pytest
import torch

from conftest import tiny_target
from test_batch import _drafter, _requests
from vlmspec.engine import SpecEngine
from vlmspec.engine.prompt_cache import PromptCache, prompt_key

# a prompt with an image asked twice, another image once, a text prompt twice: 3 distinct of 5
REPEATS = [("what is in this picture", [3], 12, 0), ("what is in this picture", [3], 12, 0),
           ("what is in this picture", [4], 12, 0), ("once upon a time", [], 10, 0), ("once upon a time", [], 10, 0)]


class CountForwards:
    """Counts the target model's forwards whose input is longer than one step's tree (prefills)."""

    def __init__(self, model, longer_than: int):
        self.n, self.longer_than = 0, longer_than
        self.handle = model.register_forward_pre_hook(self.hook, with_kwargs=True)

    def hook(self, module, args, kwargs):
        ids = kwargs.get("input_ids")
        if ids is not None and ids.shape[-1] > self.longer_than:
            self.n += 1


@pytest.mark.parametrize("arch", ["llava", "qwen2_5_vl", "idefics3"])
@pytest.mark.parametrize("drafter", ["none", "eagle"])
def test_a_repeated_prompt_is_served_from_the_cache_with_the_same_answer(arch, drafter):
    """fp32 greedy: alone and in a batch of 3 slots, each answer equals the engine's without the cache;
    the target prefilled 3 distinct prompts once each, the other 2 were hits. Control: without the
    cache every prompt is prefilled."""
    target = tiny_target(arch)
    plain = SpecEngine(target, _drafter(target, drafter))
    requests = _requests(target, REPEATS)
    want = [plain.generate(inputs, cfg).token_ids for inputs, cfg, _ in requests]
    shortest = min(int(inputs["input_ids"].shape[1]) for inputs, _, _ in requests)
    for batched in (False, True):
        cache = PromptCache(64 << 20)
        engine = SpecEngine(target, plain.drafter, prompt_cache=cache)
        counter = CountForwards(target.model, shortest - 1)
        try:
            if batched:
                got = [r.token_ids for r in engine.generate_many([(i, c) for i, c, _ in requests], slots=3, capacity=256)]  # a fixed pool
            else:
                got = [engine.generate(inputs, cfg).token_ids for inputs, cfg, _ in requests]
        finally:
            counter.handle.remove()
        assert got == want, batched
        assert (cache.hits, cache.misses, counter.n) == (2, 3, 3), (batched, cache.hits, cache.misses, counter.n)
    counter = CountForwards(target.model, shortest - 1)  # control: no cache, five prefills
    try:
        assert [plain.generate(inputs, cfg).token_ids for inputs, cfg, _ in requests] == want
    finally:
        counter.handle.remove()
    assert counter.n == 5


def test_the_key_covers_every_input_and_the_drafter_s_asks():
    """Negative controls: one pixel, one id, the visual flag or the feature layers changed: another key."""
    target = tiny_target("llava")
    (inputs, _, _), = _requests(target, [("what is in this picture", [3], 4, 0)])
    key = prompt_key(inputs, False, None)
    assert key == prompt_key({k: v.clone() for k, v in inputs.items()}, False, None)
    pixels = inputs["pixel_values"].clone()
    pixels.view(-1)[0] += 1e-3
    ids = inputs["input_ids"].clone()
    ids[0, -1] += 1
    assert len({key, prompt_key({**inputs, "pixel_values": pixels}, False, None), prompt_key({**inputs, "input_ids": ids}, False, None),
                prompt_key(inputs, True, None), prompt_key(inputs, False, (1, 2))}) == 5


def test_the_cache_keeps_its_bytes_evicting_the_least_recently_used():
    """Three prompts in a cache that holds two: the least recently used leaves, a hit refreshes."""
    target = tiny_target("llava")
    engine = SpecEngine(target, _drafter(target, "none"))
    reqs = _requests(target, [("a b c d", [], 2, 0), ("e f g h", [], 2, 0), ("i j k l", [], 2, 0)])
    probe = PromptCache(1 << 30)
    SpecEngine(target, engine.drafter, prompt_cache=probe).generate(reqs[0][0], reqs[0][1])
    one = probe.bytes
    cache = PromptCache(2 * one + one // 2)
    cached = SpecEngine(target, engine.drafter, prompt_cache=cache)
    for i in (0, 1, 0, 2):  # 0 is refreshed by its hit, so 1 is the one evicted by 2
        cached.generate(reqs[i][0], reqs[i][1])
    assert (cache.hits, cache.misses, len(cache)) == (1, 3, 2) and cache.bytes <= cache.max_bytes
    cached.generate(reqs[0][0], reqs[0][1])
    cached.generate(reqs[1][0], reqs[1][1])
    assert (cache.hits, cache.misses) == (2, 4)


def test_the_service_answers_a_repeat_from_the_cache_and_its_counters_say_so():
    """Through the HTTP service: the same request twice, the same answer, one hit and one miss on
    /metrics. Control: an engine without a cache exposes no prompt-cache series."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from conftest import metric
    from vlmspec.app import ServerSettings, create_app
    from vlmspec.app.metrics import PROMPT_CACHE_METRICS

    target = tiny_target("qwen2_5_vl")
    body = {"model": "tiny", "messages": [{"role": "user", "content": "once upon a time"}], "max_tokens": 12, "temperature": 0,
            "ignore_eos": True}
    for cache in (PromptCache(16 << 20), None):
        engine = SpecEngine(target, _drafter(target, "eagle"), prompt_cache=cache)
        with TestClient(create_app(engine, ServerSettings(model="tiny", ui=False, request_timeout_s=60))) as client:
            answers = [client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"] for _ in range(2)]
            text = client.get("/metrics").text
        assert answers[0] == answers[1]
        if cache is not None:
            assert metric(text, "vlmspec_prompt_cache_hits_total") == 1 and metric(text, "vlmspec_prompt_cache_misses_total") == 1
            assert 0 < metric(text, "vlmspec_prompt_cache_bytes") <= cache.max_bytes
        else:
            assert not [name for name in PROMPT_CACHE_METRICS if name.removesuffix("_total") in text]
