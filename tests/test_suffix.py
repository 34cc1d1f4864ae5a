"""The suffix drafter (SuffixDecoding) and the EAGLE + suffix hybrid: the index on constructed token
sequences, the bounded cross-request store, tenant isolation, and through the engine: fp32 greedy
parity with HF generate alone and in a batch, seeded sampling alone and in a batch, and a repeated
prompt's second pass accepting far more than its first."""
import random
import tracemalloc

import pytest
import torch

from conftest import tiny_target
from test_batch import RAGGED, _requests, run_ragged
from vlmspec.draft import load_drafter
from vlmspec.draft.base import DraftSession, Drafter, PromptContext, TreeConfig
from vlmspec.draft.eagle import EagleDrafter
from vlmspec.draft.hybrid import HybridDrafter
from vlmspec.draft.suffix import SuffixConfig, SuffixDrafter
from vlmspec.draft.suffix_index import DraftLimits, IndexConfig, Match, SuffixIndex, SuffixStore, frequency_tree, suffix_tree
from vlmspec.engine import GenerationConfig, SpecEngine
from vlmspec.inputs import encode_prompt
from vlmspec.sampling import SamplingParams
from testing.tiny import tiny_image
from vlmspec.tree import DraftTree

NEW = 48
TREE = TreeConfig(depth=4, top_k=3, total_tokens=10)
DEEP = TreeConfig(depth=16, top_k=3, total_tokens=16)


def _ctx(ids, tenant=None, remember=True):
    ids = torch.tensor(ids)
    return PromptContext(ids, torch.zeros(len(ids), 4), tenant=tenant, remember=remember)


# ------------------------------------------------------------------------------------------ the index
def test_the_longest_suffix_wins_and_its_occurrences_are_the_most_recent_first():
    ix = SuffixIndex(IndexConfig(max_ngram=2, max_match=8))
    a = ix.add([1, 2, 3, 4, 5])
    b = ix.add([9, 2, 3, 4, 6])
    c = ix.add([7, 3, 4, 5, 8])
    # "2 3 4" occurs in a and b (3 tokens, past max_ngram: extended backwards), "3 4" in c too
    assert ix.match([0, 2, 3, 4]) == Match(3, ((b, 3), (a, 3)))
    assert ix.match([0, 7, 3, 4]) == Match(3, ((c, 2),))  # "7 3 4" only in c
    assert ix.match([5, 5, 4]) == Match(1, ((c, 2), (b, 3), (a, 3)))  # only "4" matches
    assert ix.match([42]) == Match()
    assert ix.match([1, 2, 3, 4, 5]) == Match(3, ((c, 3),))  # a's "1 2 3 4 5" ends its document: nothing follows it


def test_children_are_ordered_by_observed_frequency_and_scored_by_its_product():
    # after the match: 8 9 twice, 8 7 once, 6 once
    tree = frequency_tree(5, [[8, 9], [6], [8, 7], [8, 9]], budget=10)
    assert tree.tokens.tolist() == [5, 8, 6, 9, 7]
    assert tree.parents.tolist() == [-1, 0, 0, 1, 1]
    assert tree.path_probs.tolist() == pytest.approx([1.0, 0.75, 0.25, 0.5, 0.25])  # 3/4 x 2/3 = 1/2
    assert tree.expected_accepted() == pytest.approx(1.75)
    assert tree.first_chain(5).tokens.tolist() == [5, 8, 9]  # the likeliest path first


def test_the_tree_keeps_the_best_nodes_within_budget_depth_probability_and_width():
    conts = [[1, 2, 3, 4]] * 6 + [[1, 2, 5]] * 3 + [[6]]
    assert frequency_tree(0, conts, budget=3).tokens.tolist() == [0, 1, 2, 3]  # 1.0, 0.9, 0.6
    assert frequency_tree(0, conts, budget=10, min_prob=0.2).tokens.tolist() == [0, 1, 2, 3, 5, 4]  # 6 (0.1) dropped
    assert frequency_tree(0, conts, budget=10, top_k=1).tokens.tolist() == [0, 1, 2, 3, 4]  # one child a node
    ix = SuffixIndex()
    ix.add([7, 1, 2, 3, 4, 5, 6, 7, 8, 9])
    tree, length = suffix_tree(ix, [0, 2, 3], depth=4, budget=10, limits=DraftLimits(spec_factor=1.0))
    assert length == 2 and tree.tokens.tolist() == [3, 4, 5]  # 2 nodes for a 2-token match
    tree, _ = suffix_tree(ix, [0, 2, 3], depth=4, budget=10, limits=DraftLimits(spec_factor=4.0))
    assert tree.tokens.tolist() == [3, 4, 5, 6, 7]  # depth 4
    assert int(tree.depth.max()) == 4 and tree.size - 1 <= 10


def test_the_store_stays_within_its_budget_over_a_soak_evicting_the_oldest_first():
    store = SuffixStore(max_tokens=500, index=IndexConfig(max_ngram=3))
    rng = random.Random(0)
    docs = []
    for i in range(400):
        doc = [rng.randrange(50) for _ in range(rng.randrange(1, 40))]
        docs.append(doc)
        store.add(doc, tenant=("a", "b", None)[i % 3])
        assert store.tokens <= 500
    assert store.stats.evicted_docs > 300 and store.stats.added_tokens - store.stats.evicted_tokens == store.tokens
    assert store.entries <= 3 * store.tokens  # max_ngram positions a token at most
    held = [d for ix in store._tenants.values() for d in ix.docs.values()]
    assert sum(map(len, held)) == store.tokens and held  # what is left: the newest documents
    assert sorted(map(tuple, held)) == sorted(map(tuple, docs[-len(held):]))
    store.add(list(range(2000)))  # longer than the budget: its last tokens
    assert store.tokens == 500 and store.match([1998]).length == 1


def test_documents_extended_out_of_order_are_evicted_whole_whatever_the_order():
    """Answers written as they decode interleave their positions in the n-grams' deques; after any
    mix of extends and evictions every deque holds exactly the live documents' positions (the
    index rebuilt from its documents is the oracle), and a match never reads an evicted document."""
    rng = random.Random(3)
    ix = SuffixIndex(IndexConfig(max_ngram=3, max_match=8))
    for _ in range(400):
        live = list(ix.docs)
        op = rng.random()
        if op < 0.15 or not live:
            ix.add([rng.randrange(6) for _ in range(rng.randrange(3))])
        elif op < 0.85:
            assert ix.extend(rng.choice(live), [rng.randrange(6) for _ in range(rng.randrange(1, 4))])
        else:
            gone = next(iter(ix.docs))
            ix.evict_oldest()
            assert not ix.extend(gone, [1])  # an evicted document takes nothing more
        want: dict[tuple, set] = {}
        for doc, seq in ix.docs.items():
            for end in range(len(seq)):
                for n in range(1, min(3, end + 1) + 1):
                    want.setdefault(tuple(seq[end - n + 1 : end + 1]), set()).add(doc << 32 | end)
        assert {k: set(v) for k, v in ix.grams.items()} == want
        assert ix.tokens == sum(map(len, ix.docs.values()))
        ix.match([rng.randrange(6) for _ in range(5)])  # reads only live documents (KeyError otherwise)
    assert ix._late  # the interleaving happened (negative control of the fast path's shortcut)


def test_the_store_s_memory_follows_its_budget_not_its_traffic():
    def traced(docs):
        store = SuffixStore(max_tokens=2_000)
        tracemalloc.start()
        for doc in docs:
            store.add(doc)
        size = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        return size, store

    rng = random.Random(1)
    docs = [[rng.randrange(300) for _ in range(30)] for _ in range(1_000)]  # 30k tokens through a 2k budget
    small, _ = traced(docs[:70])  # about the budget
    large, store = traced(docs)
    assert store.tokens <= 2_000 and store.stats.evicted_tokens > 25_000
    assert large < 1.5 * small, (small, large)
    control = SuffixStore(max_tokens=10**9)
    tracemalloc.start()
    for doc in docs:
        control.add(doc)
    grown = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert grown > 5 * large  # negative control: without the budget it grows with the traffic


# ------------------------------------------------------------------------------------------ the drafter
def _answer(drafter, prompt, answer, tenant=None, remember=True):
    """A request that emitted `answer`, its answer then kept (what the engine does at the end)."""
    _answer_with(drafter, _ctx(prompt, tenant, remember), answer)


def _answer_with(drafter, context, answer):
    s = drafter.start(context)
    s.propose(answer[0], 4)
    s.commit(torch.tensor(answer), torch.zeros(len(answer), 4))
    s.finish(answer)


def test_protocol_and_the_pool_drafts_a_repeated_answer_whole():
    d = SuffixDrafter(DEEP, store=SuffixStore())
    assert isinstance(d, Drafter) and isinstance(d.start(_ctx([1, 2])), DraftSession)
    _answer(d, [40, 41, 42], [50, 51, 52, 53, 54, 55, 56])
    again = d.start(_ctx([40, 41, 42]))
    tree = again.propose(50, 10)
    # the match: the prompt's fingerprint, its 3 tokens and the root: 5 tokens, 5 nodes (spec_factor 1)
    assert tree.tokens.tolist() == [50, 51, 52, 53, 54, 55] and tree.expected_accepted() == 5.0 and again.sure
    assert d.counters.hits == 1 and d.counters.global_hits == 1 and d.index_tokens == 1 + 3 + 7


def test_a_repeat_drafts_from_its_original_while_the_original_still_decodes():
    d = SuffixDrafter(DEEP, store=SuffixStore())
    original = d.start(_ctx([40, 41, 42]))
    original.propose(50, 4)
    original.commit(torch.tensor([50, 51, 52, 53, 54]), torch.zeros(5, 4))  # no finish: it is still decoding
    repeat = d.start(_ctx([40, 41, 42]))
    assert repeat.propose(50, 10).tokens.tolist() == [50, 51, 52, 53, 54] and d.counters.global_hits == 1
    original.finish([50, 51, 52, 53, 54, 55])  # the last (never committed) token is written at the end
    assert d.store.tokens == 1 + 3 + 6
    quiet = SuffixDrafter(DEEP, store=SuffixStore())  # negative control: the original keeps nothing
    hidden = quiet.start(_ctx([40, 41, 42], remember=False))
    hidden.commit(torch.tensor([50, 51, 52, 53, 54]), torch.zeros(5, 4))
    assert quiet.start(_ctx([40, 41, 42])).propose(50, 10).size == 1 and quiet.store.tokens == 0


def test_a_request_never_drafts_from_its_own_answer_in_the_pool():
    d = SuffixDrafter(DEEP, SuffixConfig(local=False), store=SuffixStore())
    first = d.start(_ctx([40, 41, 42]))
    first.commit(torch.tensor([7, 8, 9, 7, 8]), torch.zeros(5, 4))
    assert first.propose(9, 10).size == 1  # its own "9 -> 7 8" is not read from the pool
    second = d.start(_ctx([40, 41, 42]))  # the control: another request reads it
    second.commit(torch.tensor([7, 8, 9, 7, 8]), torch.zeros(5, 4))
    assert second.propose(9, 10).tokens.tolist()[:3] == [9, 7, 8]


def test_the_fingerprint_tells_the_same_prompt_from_another_image_with_the_same_question():
    d = SuffixDrafter(DEEP, store=SuffixStore())
    question = torch.tensor([40, 41, 42])
    image = {"pixel_values": torch.ones(2, 3, 8, 8)}
    _answer_with(d, PromptContext(question, torch.zeros(3, 4), dict(image)), [50, 51, 52, 53, 54, 55])
    same = d.start(PromptContext(question, torch.zeros(3, 4), {"pixel_values": torch.ones(2, 3, 8, 8)}))
    assert same.propose(50, 10).size == 6 and same.sure
    other = d.start(PromptContext(question, torch.zeros(3, 4), {"pixel_values": torch.zeros(2, 3, 8, 8)}))
    tree = other.propose(50, 10)  # the same question's answer is still proposed, from a shorter match, and not as sure
    assert tree.tokens.tolist()[:2] == [50, 51] and tree.size == 5 and not other.sure


def test_a_tenant_is_never_drafted_another_tenant_s_answer():
    d = SuffixDrafter(DEEP, store=SuffixStore())
    secret = [90, 91, 92, 93, 94, 95]
    _answer(d, [40, 41, 42], secret, tenant="a")
    other = d.start(_ctx([40, 41, 42], tenant="b")).propose(90, 10)
    assert not set(other.tokens.tolist()[1:]) & set(secret)
    shared = d.start(_ctx([40, 41, 42])).propose(90, 10)  # the shared pool (no tenant) holds none of it either
    assert shared.size == 1
    # negative control: the same request under the owner's key is drafted the answer
    assert d.start(_ctx([40, 41, 42], tenant="a")).propose(90, 10).tokens.tolist()[1:] == secret[1:]
    # and without tenant keys (both None) the other request IS drafted it
    d2 = SuffixDrafter(DEEP, store=SuffixStore())
    _answer(d2, [40, 41, 42], secret)
    assert d2.start(_ctx([40, 41, 42])).propose(90, 10).tokens.tolist()[1:] == secret[1:]


def test_memory_can_be_turned_off_per_drafter_and_per_request():
    off = SuffixDrafter(DEEP, store=None)
    _answer(off, [40, 41], [60, 61, 62, 63])
    assert off.start(_ctx([40, 41])).propose(60, 8).size == 1 and off.index_tokens == 0
    d = SuffixDrafter(DEEP, store=SuffixStore())
    _answer(d, [40, 41], [60, 61, 62, 63], remember=False)
    assert d.index_tokens == 0
    # the request's own text still drafts: "61 62" seen in the prompt
    s = d.start(_ctx([61, 62, 63, 7, 61]))
    assert s.propose(62, 8).tokens.tolist()[:2] == [62, 63]
    assert SuffixDrafter(DEEP, SuffixConfig(local=False)).start(_ctx([61, 62, 63, 7, 61])).propose(62, 8).size == 1


def test_factory_names_build_the_drafters_with_the_store_passed_in():
    target = tiny_target("llava")
    store = SuffixStore(1000)
    d = load_drafter("suffix", target, store=store)
    assert isinstance(d, SuffixDrafter) and d.store is store and d.tree.depth > TreeConfig().depth
    from vlmspec.factory import EngineSpec, drafter_for

    assert drafter_for(EngineSpec(model="toy", drafter="suffix", suffix_memory=0), target).store is None
    built = drafter_for(EngineSpec(model="toy", drafter="suffix", suffix_memory=123), target)
    assert built.store.max_tokens == 123


# ------------------------------------------------------------------------------------------ through the engine
def _hf_greedy(target, inputs, n):
    out = target.model.generate(**inputs, max_new_tokens=n, do_sample=False, eos_token_id=None)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def _hybrid(target, store=None):
    return HybridDrafter(EagleDrafter.random_init(target, TREE, seed=1), SuffixDrafter(DEEP, store=store or SuffixStore()))


@pytest.mark.parametrize("arch", ["llava", "qwen2_5_vl", "idefics3"])
def test_greedy_parity_with_hf_on_both_passes_and_the_second_accepts_far_more(arch):
    target = tiny_target(arch)
    inputs = encode_prompt(target, "describe the image in detail", [tiny_image(0)])
    ref = _hf_greedy(target, inputs, NEW)
    config = GenerationConfig(max_new_tokens=NEW, ignore_eos=True)
    for drafter in (SuffixDrafter(DEEP, store=SuffixStore()), _hybrid(target)):
        engine = SpecEngine(target, drafter)
        first, second = engine.generate(inputs, config), engine.generate(inputs, config)
        assert first.token_ids == ref and second.token_ids == ref, drafter.name
        assert second.mean_accepted_length >= 3 * first.mean_accepted_length, (first.mean_accepted_length, second.mean_accepted_length)
        assert second.mean_accepted_length >= 8, second.mean_accepted_length  # 48 tokens in at most 6 forwards
    assert drafter.counters.eagle_skipped > 0 and drafter.counters.eagle_trees > 0  # the head drafted the fresh pass


@pytest.mark.parametrize("arch", ["llava", "qwen2_5_vl", "idefics3"])
def test_a_ragged_batch_gives_each_request_its_batch_one_tokens(arch):
    target = tiny_target(arch)
    requests = _requests(target, RAGGED)
    for make in (lambda: SuffixDrafter(TREE, store=SuffixStore()), lambda: _hybrid(target)):
        engine = SpecEngine(target, make())
        alone = [engine.generate(inputs, cfg).token_ids for inputs, cfg, _ in requests]  # the store learns them
        got = run_ragged(engine, requests, slots=3)  # drafted from the store now
        assert got == alone, engine.drafter.name
        assert engine.drafter.metrics()["global_hits"] > 0


def test_seeded_sampling_is_the_same_alone_and_in_a_batch():
    """With the store's content fixed (remember=False), a seed fixes each request's samples, alone or
    batched; another seed gives other tokens (the negative control)."""
    target = tiny_target("llava")
    requests = _requests(target, RAGGED[:4], SamplingParams(temperature=1.0, top_p=0.95))
    requests[1][1].sampling = SamplingParams(temperature=0.5)
    requests[2][1].sampling = SamplingParams()  # greedy in the same batch
    for make in (lambda s: SuffixDrafter(TREE, store=s), lambda s: _hybrid(target, s)):
        store = SuffixStore()
        engine = SpecEngine(target, make(store))
        for inputs, cfg, _ in requests:  # the store learns one sampled answer of each
            engine.generate(inputs, cfg)
        for _, cfg, _ in requests:
            cfg.remember = False
        alone = [engine.generate(inputs, cfg).token_ids for inputs, cfg, _ in requests]
        assert run_ragged(engine, requests, slots=4) == alone
        assert engine.drafter.metrics()["hits"] > 0
        other = GenerationConfig(max_new_tokens=requests[0][1].max_new_tokens, ignore_eos=True, seed=7,
                                 sampling=requests[0][1].sampling, remember=False)
        assert engine.generate(requests[0][0], other).token_ids != alone[0]


def test_tenants_through_the_engine():
    target = tiny_target("qwen2_5_vl")
    inputs = encode_prompt(target, "once upon a time", [])
    engine = SpecEngine(target, SuffixDrafter(DEEP, store=SuffixStore()))
    config = GenerationConfig(max_new_tokens=32, ignore_eos=True, tenant="a")
    engine.generate(inputs, config)
    counters = engine.drafter.counters
    b = engine.generate(inputs, GenerationConfig(max_new_tokens=32, ignore_eos=True, tenant="b"))
    assert counters.global_hits == 0
    a = engine.generate(inputs, config)  # negative control: the owner's repeat is drafted from the pool
    assert counters.global_hits > 0 and a.token_ids == b.token_ids
    assert a.mean_accepted_length > 3 * b.mean_accepted_length


# ------------------------------------------------------------------------------------------ the hybrid's choice
class _Head:
    """A model drafter whose every tree is a chain of `depth` tokens 100, 101, ... with path probabilities
    `probs` (its own estimate); it records the depths it was asked for."""

    name, needs_visual = "head", False

    def __init__(self, probs):
        self.tree, self.probs, self.asked = TreeConfig(depth=len(probs), top_k=1, total_tokens=len(probs)), probs, []

    def start(self, prompt, tree=None):
        return self

    def propose(self, root, max_depth):
        self.asked.append(max_depth)
        n = min(max_depth, len(self.probs))
        chain = DraftTree.chain(root, list(range(100, 100 + n)))
        return DraftTree(chain.tokens, chain.parents, path_probs=torch.tensor([1.0, *self.probs[:n]]))

    def commit(self, token_ids, features):
        return None


def test_the_hybrid_takes_the_likelier_tree_skips_the_head_where_it_cannot_win_and_learns_whom_to_trust():
    head = _Head([0.9, 0.8, 0.7])  # E = 2.4
    hybrid = HybridDrafter(head, SuffixDrafter(DEEP, store=SuffixStore()))
    fresh = hybrid.start(_ctx([40, 41, 42]))
    assert fresh.propose(7, 8).tokens.tolist() == [7, 100, 101, 102]  # nothing in the store: the head's tree
    _answer(hybrid.suffix, [40, 41, 42], [50, 51, 52, 53, 54, 55])
    head.asked.clear()
    again = hybrid.start(_ctx([40, 41, 42]))
    assert again.propose(50, 8).tokens.tolist()[:3] == [50, 51, 52] and head.asked == [0]  # a sure repeat: the head ran nothing
    assert hybrid.counters.eagle_skipped == 1
    # another image's answer to the same question: a 4-node tree (E 4 > 2.4) taken while it is trusted ...
    other = PromptContext(torch.tensor([40, 41, 42]), torch.zeros(3, 4), {"pixel_values": torch.zeros(1)})
    for _ in range(12):  # ... and each time the target rejects its first token
        s = hybrid.start(other)
        picked = s.propose(50, 8)
        s.commit(torch.tensor([50]), torch.zeros(1, 4))
    assert picked.tokens.tolist() == [50, 100, 101, 102]  # by now the head's tree is the likelier
    assert hybrid.calibration.scale("suffix") < 0.4 < hybrid.calibration.scale("suffix_sure") == 1.0


def test_the_repeating_workload_and_its_passes():
    from vlmspec.bench.repeat import pass_markdown, pass_report, repeat_plan

    plan = repeat_plan(4, 0.5)
    assert plan.items == (0, 1, 2, 3, 0, 1, 2, 3) and plan.repeat == (False,) * 4 + (True,) * 4 and plan.share == 0.5
    assert repeat_plan(4, 0.2).items == (0, 1, 2, 3, 0) and repeat_plan(3, 0.0).repeat == (False,) * 3
    with pytest.raises(ValueError):
        repeat_plan(4, 1.0)
    seen = []

    def summarise(keep):
        seen.append([i for i in range(8) if keep(i)])
        return {"hf_generate": {"tokens_per_s": 1.0, "speedup_vs_hf_generate": 1.0, "mean_accepted_length": None},
                "vlmspec_suffix": {"tokens_per_s": 3.0, "speedup_vs_hf_generate": 3.0, "mean_accepted_length": 6.0}}

    report = pass_report(plan, summarise, lambda m, keep: [2.0, 3.0, 4.0] if keep(7) else [1.0], ["vlmspec_suffix"])
    assert seen == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert report["repeat"]["vs_hf_generate"]["vlmspec_suffix"]["median"] == 3.0
    assert "repeats (prompts asked before)" in pass_markdown(report) and "3.00x [2.00, 4.00]" in pass_markdown(report)


def test_bench_load_sends_the_repeating_mix_in_order():
    from vlmspec.bench.load import LoadOptions, bodies

    today = bodies("bench", LoadOptions((1,), 2, 8, 3, 0), "goodput")
    mixed = bodies("bench", LoadOptions((1,), 2, 8, 3, 0, repeat_share=0.5), "goodput")
    assert len(today) == 3 and mixed == today + today  # three distinct requests, then each again


def test_under_the_goodput_policy_a_repeat_still_drafts_deep_and_parity_holds():
    from vlmspec.policy.control import CostModel, Speculation
    from vlmspec.policy.cost import cost_depths

    assert cost_depths(24) == (0, 1, 2, 3, 4, 5, 6, 7, 8, 12, 18, 24) and cost_depths(5) == (0, 1, 2, 3, 4, 5)
    target = tiny_target("llava")
    inputs = encode_prompt(target, "describe the image in detail", [tiny_image(0)])
    ref = _hf_greedy(target, inputs, NEW)
    cost = CostModel.fit({0: 1.0, 1: 1.2, 8: 1.4, 16: 1.6})  # a 16-node chain verifies in 1.6 plain steps
    engine = SpecEngine(target, SuffixDrafter(DEEP, store=SuffixStore()), Speculation("goodput", cost))
    config = GenerationConfig(max_new_tokens=NEW, ignore_eos=True)
    first, second = engine.generate(inputs, config), engine.generate(inputs, config)
    assert first.token_ids == ref == second.token_ids and first.policy == "goodput"
    assert second.mean_accepted_length >= 3 * first.mean_accepted_length and max(second.depths) == DEEP.depth
