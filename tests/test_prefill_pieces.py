"""Chunked prefill: long prompts enter their slot in pieces, one step's budget at a time.

The oracle is each request's own batch-1 run with its prompt prefilled whole: a prompt that comes in
pieces (its images in the first) while other rows decode must give the same tokens (fp32, greedy;
seeded sampling too), and the rows already decoding must step at every step meanwhile.
"""
import pytest
import torch

from conftest import tiny_target
from test_batch import _drafter, _requests
from vlmspec.engine import SpecEngine
from vlmspec.engine import prefill as prefill_module
from vlmspec.sampling import SamplingParams
from vlmspec.target.pieces import first_piece, media_end, probe_prompt_pieces

CHUNK = 8
LONG = "please read all of the following words slowly and then describe the image in as much detail as you can manage now"
# (prompt, image seeds, max_tokens, the step it joins at): two short rows decode while long ones join
JOINING = [
    ("once upon a time", [], 30, 0),
    ("what is in this picture", [3], 26, 0),
    (LONG, [0], 12, 2),
    (LONG + " and then count the colours", [], 10, 3),
]


def run_chunked(engine, requests, slots, chunk):
    """Drive one batch with pieces of `chunk` tokens: request i is submitted at step `join`. Returns
    each request's tokens and, per step, which requests got events."""
    batch = engine.batch(slots, prefill_chunk=chunk)
    waiting = sorted(range(len(requests)), key=lambda i: requests[i][2])
    tickets, stepped, step = {}, [], 0
    while waiting or not batch.idle:
        while waiting and requests[waiting[0]][2] <= step:
            i = waiting.pop(0)
            tickets[i] = batch.submit(requests[i][0], requests[i][1])
        ids = {id(t.request): i for i, t in tickets.items() if t.request is not None}
        events = batch.step()
        ids.update({id(t.request): i for i, t in tickets.items() if t.request is not None})
        stepped.append({ids[id(r)] for r, _ in events})
        step += 1
    return [tickets[i].result.token_ids for i in range(len(requests))], stepped


@pytest.mark.parametrize("arch", ["llava", "qwen2_5_vl", "idefics3"])
@pytest.mark.parametrize("drafter", ["none", "ngram", "eagle", "eagle3"])
def test_long_prompts_in_pieces_join_a_running_batch_and_every_answer_is_its_batch_one_run(arch, drafter):
    """fp32 greedy: each answer equals its batch-1 run with the prompt prefilled whole, the long
    prompts took several steps to come in, and the rows already decoding stepped at each of them."""
    target = tiny_target(arch)
    engine = SpecEngine(target, _drafter(target, drafter))
    requests = _requests(target, JOINING)
    alone = [engine.generate(inputs, cfg).token_ids for inputs, cfg, _ in requests]
    got, stepped = run_chunked(engine, requests, 4, CHUNK)
    assert got == alone
    lengths = [int(inputs["input_ids"].shape[1]) for inputs, _, _ in requests]
    assert lengths[2] > 3 * CHUNK and lengths[3] > 3 * CHUNK
    span = [[s for s, ids in enumerate(stepped) if i in ids] for i in range(len(requests))]
    assert span[2][0] >= JOINING[2][3] + 2, "the long prompt came in whole"
    assert span[0][0] < span[2][0] and span[0][-1] > span[3][0]  # the first row decoded while the long prompts came in
    for i in (0, 1):  # a decoding row steps at every step until it is done: the pieces never held it up
        assert span[i] == list(range(span[i][0], span[i][-1] + 1))


def test_a_prompt_cut_wrong_changes_the_answer(monkeypatch):
    """Negative control: pieces that each read one prompt token wrong give another answer than the
    batch-1 run, so the test above would see a wrong cut."""
    target = tiny_target("llava")
    engine = SpecEngine(target, _drafter(target, "none"))
    requests = _requests(target, JOINING[2:3])
    alone = engine.generate(requests[0][0], requests[0][1]).token_ids
    real = prefill_module.run_pieces

    def skipping(target_, reqs, sizes, layers):
        for r in reqs:  # each piece's first token is read one token too late
            ids = r.pieces.inputs["input_ids"].clone()
            ids[0, r.pieces.done] = ids[0, r.pieces.done + 1]
            r.pieces.inputs = {**r.pieces.inputs, "input_ids": ids}
        return real(target_, reqs, sizes, layers)

    monkeypatch.setattr("vlmspec.engine.batch.run_pieces", skipping)
    got, _ = run_chunked(engine, requests, 1, CHUNK)
    assert got[0] != alone


def test_seeded_sampling_in_pieces_is_the_same_alone_and_in_a_batch():
    target = tiny_target("llava")
    engine = SpecEngine(target, _drafter(target, "ngram"))
    requests = _requests(target, JOINING, sampling=SamplingParams(temperature=1.0))
    alone = [engine.generate(inputs, cfg).token_ids for inputs, cfg, _ in requests]
    got, _ = run_chunked(engine, requests, 3, CHUNK)
    assert got == alone


def test_a_step_prefills_at_most_its_budget_and_a_first_piece_holds_every_image(monkeypatch):
    """Each step's pieces and admissions sum to at most the chunk, but for a first piece that runs to
    the prompt's last image token; a piece never splits an image."""
    target = tiny_target("llava")
    engine = SpecEngine(target, _drafter(target, "none"))
    requests = _requests(target, [(LONG, [], 4, 0), ("describe " * 12 + "the image", [1], 4, 0), (LONG, [2], 4, 0)])
    ends = [first_piece(target, inputs, CHUNK) for inputs, _, _ in requests]
    images = [media_end(target, inputs["input_ids"][0]) for inputs, _, _ in requests]
    assert ends[0] == CHUNK and images[0] == 0
    assert images[1] > CHUNK and ends[1] == images[1]  # the image ends past the chunk: the first piece runs to it
    assert ends[2] == max(CHUNK, images[2])
    spent = []
    real = prefill_module.run_pieces
    monkeypatch.setattr("vlmspec.engine.batch.run_pieces", lambda t, reqs, sizes, layers: spent.append(sum(sizes)) or real(t, reqs, sizes, layers))
    batch = engine.batch(3, prefill_chunk=CHUNK)
    tickets = [batch.submit(inputs, cfg) for inputs, cfg, _ in requests]
    while not batch.idle:
        batch.step()
    assert spent and max(spent) <= CHUNK
    assert [t.result.token_ids for t in tickets] == [engine.generate(i, c).token_ids for i, c, _ in requests]


def test_prompts_that_attend_otherwise_come_in_whole(monkeypatch):
    """A prompt with per-token inputs beside its ids (token_type_ids) is not cut; a target whose
    pieces give other logits than the whole prompt is found by the one-time check (negative control:
    the real tiny model passes it)."""
    target = tiny_target("llava")
    (inputs, _, _), = _requests(target, [(LONG, [], 4, 0)])
    length = int(inputs["input_ids"].shape[1])
    assert first_piece(target, inputs, CHUNK) == CHUNK
    assert first_piece(target, {**inputs, "token_type_ids": torch.zeros_like(inputs["input_ids"])}, CHUNK) == length
    assert probe_prompt_pieces(target) == ""
    real = type(target).forward_batch

    def off(self, states, trees, layers=None, ragged=None):
        out = real(self, states, trees, layers, ragged)
        out.logits[..., 0] += 1.0
        return out

    monkeypatch.setattr(type(target), "forward_batch", off)
    assert "other logits" in probe_prompt_pieces(target)


BURST = [("once upon a time", [], 24, 0), ("what is in this picture", [3], 20, 0)] + [
    (f"describe picture number {k} in a few words", [k], 8, 3) for k in range(4)]


def run_burst(engine, requests, prefill_first):
    """Two rows decode, then four prompts arrive at once (step 3); the step's budget admits one of them.
    Returns the answers and, per step, which requests got events."""
    budget = max(int(inputs["input_ids"].shape[1]) for inputs, _, _ in requests)
    batch = engine.batch(6, prefill_budget=budget, prefill_first=prefill_first)
    tickets, stepped, step = {}, [], 0
    while len(tickets) < len(requests) or not batch.idle:
        for i, (inputs, cfg, join) in enumerate(requests):
            if join == step:
                tickets[i] = batch.submit(inputs, cfg)
        events = batch.step()
        ids = {id(t.request): i for i, t in tickets.items() if t.request is not None}
        stepped.append({ids[id(r)] for r, _ in events})
        step += 1
    return [tickets[i].result.token_ids for i in range(len(requests))], stepped


@pytest.mark.parametrize("drafter", ["none", "eagle"])
def test_prefill_first_gives_a_burst_its_first_tokens_before_the_running_rows_step_on(drafter):
    """fp32 greedy on tiny LLaVA: with `prefill_first` the four joiners, one admitted per step, all get
    their first token before the two running rows step again, and every answer is its batch-1 run.
    Control: without it the running rows step at every step while the burst enters."""
    target = tiny_target("llava")
    engine = SpecEngine(target, _drafter(target, drafter))
    requests = _requests(target, BURST)
    alone = [engine.generate(inputs, cfg).token_ids for inputs, cfg, _ in requests]
    for prefill_first in (True, False):
        got, stepped = run_burst(engine, requests, prefill_first)
        assert got == alone
        first = {i: min(s for s, ids in enumerate(stepped) if i in ids) for i in range(2, 6)}
        assert sorted(first.values()) == [3, 4, 5, 6]  # one joiner admitted per step, in the order they came
        paused = [s for s in range(3, 6) if 0 in stepped[s] or 1 in stepped[s]]
        assert paused == ([] if prefill_first else [3, 4, 5]), (prefill_first, stepped[:8])
