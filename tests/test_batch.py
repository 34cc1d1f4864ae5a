"""Batched decoding: several requests in one target forward, each in its own slot of one KV cache.

The oracle of every batched run is each request's own batch-1 run (and HF `generate`): requests of
different prompt lengths, with no image, one or two, different max_tokens, joining and finishing at
different steps, must each get exactly their own tokens (fp32, greedy; seeded sampling too).
"""
import pytest
import torch

from conftest import tiny_target
from vlmspec.draft.base import PlainDrafter, TreeConfig
from vlmspec.draft.eagle import EagleDrafter
from vlmspec.draft.ngram import NgramDrafter
from vlmspec.engine import GenerationConfig, SpecEngine
from vlmspec.errors import ContextLengthError
from vlmspec.inputs import encode_prompt
from vlmspec.sampling import SamplingParams
from vlmspec.target import Target
from vlmspec.target.attention import GQA_SDPA, RaggedRows
from testing.tiny import tiny_image
from vlmspec.tree import DraftTree

TREE = TreeConfig(depth=4, top_k=3, total_tokens=10)
# (prompt, image seeds, max_tokens, the step it joins at)
RAGGED = [
    ("describe the image in detail", [0], 28, 0),
    ("once upon a time", [], 40, 0),
    ("compare the first image with the second image, then say which is brighter", [1, 2], 18, 0),
    ("the quick brown fox jumps over the lazy dog and the dog", [], 24, 3),
    ("what is in this picture", [3], 12, 7),
]


def _drafter(target, name):
    if name == "none":
        return PlainDrafter()
    if name == "ngram":
        return NgramDrafter(TREE)
    return EagleDrafter.random_init(target, TREE, seed=1, arch="eagle3" if name == "eagle3" else "eagle1")


def _requests(target, specs, sampling=None):
    out = []
    for i, (text, seeds, max_tokens, join) in enumerate(specs):
        inputs = encode_prompt(target, text, [tiny_image(s) for s in seeds])
        cfg = GenerationConfig(max_new_tokens=max_tokens, ignore_eos=True, sampling=sampling or SamplingParams(), seed=100 + i)
        out.append((inputs, cfg, join))
    return out


def run_ragged(engine, requests, slots, cancel=None):
    """Drive one batch: request i is submitted at step `join` (and admitted by the first step with a
    free slot); `cancel = (i, step)` takes request i out after that step. Returns each request's tokens."""
    batch = engine.batch(slots)
    waiting = sorted(range(len(requests)), key=lambda i: requests[i][2])
    running, step = {}, 0
    while waiting or not batch.idle:
        while waiting and requests[waiting[0]][2] <= step:
            i = waiting.pop(0)
            running[i] = batch.submit(requests[i][0], requests[i][1])
        batch.step()
        if cancel is not None and cancel[1] == step and cancel[0] in running:
            batch.cancel(running[cancel[0]])
        step += 1
    return [running[i].result.token_ids for i in range(len(requests))]


def _hf_greedy(target, inputs, n):
    out = target.model.generate(**inputs, max_new_tokens=n, do_sample=False, eos_token_id=None)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


@pytest.mark.parametrize("arch", ["llava", "llava_next", "qwen2_5_vl", "idefics3"])
@pytest.mark.parametrize("drafter", ["none", "ngram", "eagle", "eagle3"])
def test_ragged_batch_equals_each_requests_batch_one_run_and_hf(arch, drafter):
    target = tiny_target(arch)
    engine = SpecEngine(target, _drafter(target, drafter))
    requests = _requests(target, RAGGED)
    alone = [engine.generate(inputs, cfg).token_ids for inputs, cfg, _ in requests]
    if drafter == "none":  # the oracle's oracle: HF generate, once per architecture
        assert alone == [_hf_greedy(target, inputs, cfg.max_new_tokens) for inputs, cfg, _ in requests]
    got = run_ragged(engine, requests, slots=3)
    for i, (a, b) in enumerate(zip(got, alone)):
        assert a == b, f"{arch}/{drafter}: request {i} differs from its batch-1 run at token {_first_diff(a, b)}"
    assert [len(t) for t in got] == [r[1].max_new_tokens for r in requests]


def _first_diff(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _batched_vs_alone(target, monkeypatch=None, wrong_positions=False):
    """Max |logit| difference between two rows' trees verified in one forward and each alone."""
    texts = ["once upon a time", "the quick brown fox jumps over the lazy dog and the dog"]
    trees = [DraftTree(torch.tensor([5, 6, 7, 9]), torch.tensor([-1, 0, 0, 1])), DraftTree.chain(8, [9])]
    alone = []
    for text, tree in zip(texts, trees):
        state, _ = target.prefill(encode_prompt(target, text, []))
        alone.append(target.forward_tree(state, tree).logits)
    cache = target.new_cache(2)
    states = [target.prefill(encode_prompt(target, text, []), cache=cache, slot=i)[0] for i, text in enumerate(texts)]
    if wrong_positions:  # every row given the first row's positions, as a batch that forgot the rows' own lengths
        real = Target.batch_position_ids
        monkeypatch.setattr(Target, "batch_position_ids", lambda self, st, d: real(self, [st[0]] * len(st), d))
    out = target.forward_batch(states, trees).logits
    return [float((out[b, : t.size] - a).abs().max()) for b, (t, a) in enumerate(zip(trees, alone))]


@pytest.mark.parametrize("arch", ["llava", "qwen2_5_vl"])
def test_rows_of_different_lengths_verified_together_give_their_own_logits(arch, monkeypatch):
    """fp32: each row's logits in the batch are its own (to float rounding); the negative control,
    every row at the first row's positions, moves the second row's logits far past that bound."""
    target = tiny_target(arch)
    right = _batched_vs_alone(target)
    assert max(right) < 1e-5, right
    wrong = _batched_vs_alone(target, monkeypatch, wrong_positions=True)
    assert wrong[0] < 1e-5 and wrong[1] > 1e-3, wrong


def test_negative_control_rows_given_one_rows_mask_differ(monkeypatch):
    target = tiny_target("qwen2_5_vl")
    engine = SpecEngine(target, PlainDrafter())
    requests = _requests(target, RAGGED[:3])
    alone = [engine.generate(inputs, cfg).token_ids for inputs, cfg, _ in requests]
    real = Target.batch_masks

    def first_rows_mask(self, states, trees, n):
        mask = real(self, states, trees, n)
        return mask[:1].expand_as(mask) if len(states) > 1 else mask

    monkeypatch.setattr(Target, "batch_masks", first_rows_mask)
    assert run_ragged(engine, requests, slots=3) != alone


def test_cancelling_one_request_leaves_the_others_unchanged():
    target = tiny_target("qwen2_5_vl")
    engine = SpecEngine(target, NgramDrafter(TREE))
    requests = _requests(target, RAGGED)
    alone = [engine.generate(inputs, cfg).token_ids for inputs, cfg, _ in requests]
    got = run_ragged(engine, requests, slots=3, cancel=(0, 4))
    assert 0 < len(got[0]) < requests[0][1].max_new_tokens and got[0] == alone[0][: len(got[0])]
    assert got[1:] == alone[1:]


@pytest.mark.parametrize("arch", ["eagle1", "eagle3"])
def test_seeded_sampling_is_the_same_alone_and_in_a_batch_of_mixed_temperatures(arch):
    target = tiny_target("llava")
    engine = SpecEngine(target, EagleDrafter.random_init(target, TREE, seed=1, arch=arch))
    requests = _requests(target, RAGGED[:4], SamplingParams(temperature=1.0, top_p=0.95))
    requests[1][1].sampling = SamplingParams(temperature=0.5)
    requests[2][1].sampling = SamplingParams()  # greedy in the same batch
    alone = [engine.generate(inputs, cfg).token_ids for inputs, cfg, _ in requests]
    assert run_ragged(engine, requests, slots=4) == alone
    reseeded = _requests(target, RAGGED[:1], SamplingParams(temperature=1.0, top_p=0.95))
    reseeded[0][1].seed = 7  # negative control: another seed, other tokens
    assert engine.generate(reseeded[0][0], reseeded[0][1]).token_ids != alone[0]


def test_a_slot_is_free_at_once_and_reused():
    target = tiny_target("llava")
    engine = SpecEngine(target, NgramDrafter(TREE))
    requests = _requests(target, RAGGED)
    results = engine.generate_many([(i, c) for i, c, _ in requests], slots=2)
    alone = [engine.generate(inputs, cfg).token_ids for inputs, cfg, _ in requests]
    assert [r.token_ids for r in results] == alone


def test_a_bounded_batch_refuses_what_would_not_fit_and_reports_its_memory():
    target = tiny_target("llava")
    engine = SpecEngine(target, NgramDrafter(TREE))
    (inputs, cfg, _), = _requests(target, RAGGED[1:2])
    batch = engine.batch(2, capacity=inputs["input_ids"].shape[1] + 8)
    with pytest.raises(ContextLengthError, match="lower max_tokens"):
        batch.submit(inputs, cfg)
    assert batch.free == [0, 1] and not batch.requests and not batch.waiting  # nothing taken
    batch = engine.batch(2, capacity=batch.need(inputs, cfg))
    req = batch.submit(inputs, cfg)
    while not batch.idle:
        batch.step()
    assert req.result.token_ids == engine.generate(inputs, cfg).token_ids
    layers = target.text_config.num_hidden_layers
    kv = target.text_config.num_key_value_heads * (target.hidden_size // target.text_config.num_attention_heads)
    assert batch.cache.nbytes() == 2 * layers * 2 * kv * batch.capacity * 4  # K and V, 2 slots, fp32
    # the pool is fixed: more requests through its slots leave it as it was, and nothing may grow it
    tickets = [batch.submit(inputs, cfg) for _ in range(3)]
    while not batch.idle:
        batch.step()
    assert all(t.result.token_ids == req.result.token_ids for t in tickets)
    assert batch.cache.nbytes() == 2 * layers * 2 * kv * batch.capacity * 4
    with pytest.raises(AssertionError, match="never grows"):
        batch.cache.reserve(batch.capacity + 1)
    # negative control: a batch without a capacity grows its slots as asked
    grows = engine.batch(2)
    grows.submit(inputs, cfg)
    grows.step()
    size = grows.cache.nbytes()
    grows.cache.reserve(grows.cache.layers[0].capacity + 1)
    assert grows.cache.nbytes() > size


def test_a_model_that_cannot_batch_exactly_says_so():
    from vlmspec.errors import ConfigError
    from testing.families import build_family

    target = Target(build_family("lfm2_vl"), None, name="lfm2-tiny")
    with pytest.raises(ConfigError, match="one request at a time"):
        SpecEngine(target, PlainDrafter()).batch(2)
    SpecEngine(target, PlainDrafter()).batch(1)  # control: one slot is fine


@pytest.mark.parametrize("arch,stop_threshold,mixed", [("eagle1", 0.0, False), ("eagle3", 0.0, False), ("eagle1", 0.4, False),
                                                       ("eagle3", 0.4, False), ("eagle1", 0.0, True), ("eagle1", 0.4, True)])
def test_eagle_drafts_every_row_together_as_it_drafts_each_alone(stop_threshold, arch, mixed):
    """Rows of different lengths and depths (0 included), with and without the SpecDec++ stop rule,
    with one tree shape or two (rows of each width grow as one stack): the joint forwards propose
    each row's own tree, over several propose / commit rounds."""
    from vlmspec.draft.base import PromptContext
    from vlmspec.draft.eagle import EagleConfig, build_head
    from vlmspec.draft.eagle.session import propose_rows

    target = tiny_target("llava")
    cfg = EagleConfig.from_target(target, arch)
    cfg.acceptance_head = bool(stop_threshold)
    torch.manual_seed(5)
    head = build_head(cfg, target.input_embeddings(), target.output_embeddings()).to(target.device, target.dtype)
    drafter = EagleDrafter(head, TreeConfig(depth=5, top_k=3, total_tokens=12), stop_threshold=stop_threshold)
    prompts = []
    for text, seeds in [(t, s) for t, s, _, _ in RAGGED[:4]]:
        inputs = encode_prompt(target, text, [tiny_image(s) for s in seeds])
        _, out = target.prefill(inputs, layers=drafter.feature_layers)
        prompts.append(PromptContext(inputs["input_ids"][0].cpu(), out.features, inputs))
    # rows of two tree widths (per-request trees) grow in two groups; each row's tree is its own
    trees = [None, TreeConfig(depth=4, top_k=2, total_tokens=7), None, TreeConfig(depth=5, top_k=2, total_tokens=9)] if mixed else [None] * 4
    joint = [drafter.start(p, t) for p, t in zip(prompts, trees)]
    alone = [drafter.start(p, t) for p, t in zip(prompts, trees)]
    g = torch.Generator().manual_seed(0)
    roots, sizes = [5, 9, 11, 13], []
    for depths in ([5, 3, 0, 5], [2, 5, 5, 1], [5, 0, 4, 5]):
        a = propose_rows(joint, roots, depths)
        b = [propose_rows([s], [r], [d])[0] for s, r, d in zip(alone, roots, depths)]
        for i, (x, y) in enumerate(zip(a, b)):
            assert x.tokens.tolist() == y.tokens.tolist() and x.parents.tolist() == y.parents.tolist(), (depths, i)
            assert int(x.depth.max()) <= depths[i]
        sizes += [t.size for t in a]
        for s_j, s_a, t in zip(joint, alone, a):
            path = t.path_to(min(t.size - 1, 2))
            feats = torch.randn(len(path), cfg.feature_width, generator=g).to(target.device)
            s_j.commit(t.tokens[path], feats)
            s_a.commit(t.tokens[path], feats)
        roots = [int(x) for x in torch.randint(target.vocab_size, (4,), generator=g)]
    assert len(set(sizes)) > 2  # rows did grow different trees


def test_rows_with_long_waiting_runs_read_them_alone_and_draft_their_own_trees(monkeypatch):
    """A batch's first drafted step after plain steps: each row's prompt pairs are still waiting. A
    row with more than `ALONE_PAIRS` of them runs them in a forward of its own, the rest in one joint
    forward, and every row drafts the tree it drafts alone. Negative control: with the bound past
    every row's count the rows share one forward (whose mask covers all their pairs at once)."""
    from vlmspec.draft.base import PromptContext
    from vlmspec.draft.eagle import session as session_module

    target = tiny_target("llava")
    drafter = EagleDrafter.random_init(target, TreeConfig(depth=3, top_k=2, total_tokens=5), seed=2)
    prompts = []
    for text in ("a cat", "the quick brown fox jumps over the lazy dog and then the dog sleeps in the sun all day long", "hi"):
        inputs = encode_prompt(target, text, [])
        _, out = target.prefill(inputs, layers=drafter.feature_layers)
        prompts.append(PromptContext(inputs["input_ids"][0].cpu(), out.features, inputs))
    lengths = [int(p.token_ids.shape[0]) for p in prompts]
    bound = sorted(lengths)[1] + 1  # pairs waiting: the longest prompt's are over it, the other two's are not
    queries = []
    real = drafter.head.decode
    monkeypatch.setattr(drafter.head, "decode", lambda *a, **k: queries.append(a[0].shape[0]) or real(*a, **k))

    feats = torch.randn(3, 1, drafter.head.config.feature_width, generator=torch.Generator().manual_seed(0))

    def plain_step(rows, roots):
        session_module.propose_rows(rows, roots, [0] * len(rows))  # drafts nothing: the prompts wait
        for row, root, f in zip(rows, roots, feats):
            row.commit(torch.tensor([root]), f)

    def first_drafted_step(alone_bound):
        monkeypatch.setattr(session_module, "ALONE_PAIRS", alone_bound)
        rows = [drafter.start(p) for p in prompts]
        plain_step(rows, [5, 6, 7])
        queries.clear()
        return session_module.propose_rows(rows, [8, 9, 10], [3, 3, 3])

    trees = first_drafted_step(bound)
    long = max(lengths) + 1  # its prompt pairs and the plain step's pair
    assert queries[:2] == [long, sum(lengths) + 3 - long]  # the long row alone, then the two others together
    for i, (p, t) in enumerate(zip(prompts, trees)):
        row = drafter.start(p)
        session_module.propose_rows([row], [5 + i], [0])
        row.commit(torch.tensor([5 + i]), feats[i])
        oracle = session_module.propose_rows([row], [8 + i], [3])[0]
        assert t.tokens.tolist() == oracle.tokens.tolist() and t.parents.tolist() == oracle.parents.tolist()
    first_drafted_step(10**6)
    assert queries[0] == sum(lengths) + 3  # negative control: one joint forward over every row's pairs


def test_eagle_rows_asked_for_a_chain_grow_their_top1_chain_beside_tree_rows():
    """A row asked for a chain (a goodput row of a batch) grows one node per level: the tree of a
    session whose own shape is top-1, whether it drafts alone or beside rows growing their trees
    (which stay their own)."""
    from vlmspec.draft.base import PromptContext
    from vlmspec.draft.eagle.session import propose_rows

    target = tiny_target("llava")
    wide, narrow = TreeConfig(depth=4, top_k=3, total_tokens=9), TreeConfig(depth=4, top_k=1, total_tokens=4)
    drafter = EagleDrafter.random_init(target, wide, seed=3)
    prompts = []
    for text, seeds in [(t, s) for t, s, _, _ in RAGGED[:3]]:
        inputs = encode_prompt(target, text, [tiny_image(s) for s in seeds])
        _, out = target.prefill(inputs, layers=drafter.feature_layers)
        prompts.append(PromptContext(inputs["input_ids"][0].cpu(), out.features, inputs))
    chains, roots, depths = [True, False, True], [5, 9, 11], [4, 4, 3]
    joint = propose_rows([drafter.start(p) for p in prompts], roots, depths, chains)
    for i, (p, c) in enumerate(zip(prompts, chains)):
        oracle = propose_rows([drafter.start(p, narrow if c else None)], [roots[i]], [depths[i]])[0]
        assert joint[i].tokens.tolist() == oracle.tokens.tolist() and joint[i].parents.tolist() == oracle.parents.tolist(), i
    assert [t.parents.tolist() for t, c in zip(joint, chains) if c] == [[-1, 0, 1, 2, 3], [-1, 0, 1, 2]]
    assert joint[1].size > joint[1].depth.max() + 1  # negative control: the tree row branches


def test_batched_drafting_does_little_host_work_per_row():
    """What a batch of EAGLE rows costs the host (the pace-setter on a GPU whose kernels are small):
    operations dispatched per proposal, counted for 1 and 5 rows. The rows' trees grow stacked, so a
    row adds a few dozen operations, not a proposal's worth. Negative control: proposing each row on
    its own adds a whole proposal's operations per row."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from vlmspec.draft.base import PromptContext
    from vlmspec.draft.eagle import EagleConfig, build_head
    from vlmspec.draft.eagle.session import propose_rows

    class Ops(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += not func.is_view  # views launch nothing
            return func(*args, **(kwargs or {}))

    target = tiny_target("llava")
    torch.manual_seed(5)
    head = build_head(EagleConfig.from_target(target), target.input_embeddings(), target.output_embeddings()).to(target.device, target.dtype)
    drafter = EagleDrafter(head, TreeConfig(depth=4, top_k=3, total_tokens=10))
    prompts = []
    for text, seeds, _, _ in RAGGED:
        inputs = encode_prompt(target, text, [tiny_image(s) for s in seeds])
        _, out = target.prefill(inputs)
        prompts.append(PromptContext(inputs["input_ids"][0].cpu(), out.features, inputs))

    def ops(rows: int, together: bool) -> int:
        sessions = [drafter.start(p) for p in prompts[:rows]]
        for _ in range(2):  # the first proposal runs the prompts; the second is a step's
            with Ops() as count:
                trees = propose_rows(sessions, [7] * rows, [4] * rows) if together else \
                    [propose_rows([s], [7], [4])[0] for s in sessions]
            for s, t in zip(sessions, trees):
                s.commit(t.tokens[t.path_to(1)], torch.randn(2, target.hidden_size).to(target.device))
        return count.n

    one, five = ops(1, True), ops(5, True)
    per_row = (five - one) / 4
    alone_per_row = (ops(5, False) - one) / 4
    print(f"operations per proposal: 1 row {one}, 5 rows {five} ({per_row:.0f} per row; one by one {alone_per_row:.0f} per row)")
    assert per_row <= 60 < one <= alone_per_row, (one, five, alone_per_row)


TEXTS = ["once upon a time", "the quick brown fox jumps over the lazy dog and the dog", "hello"]
UNEQUAL = [DraftTree(torch.tensor([5, 6, 7, 9]), torch.tensor([-1, 0, 0, 1])), DraftTree.chain(8, [9]), DraftTree.root_only(4)]


def _layouts(target, monkeypatch):
    """Trees of 4, 2 and 1 nodes after three prompts: (the rows' states, padded forward, the forward's
    own choice, laid end to end by force, whether the choice laid them out)."""
    cache = target.new_cache(3)
    states = [target.prefill(encode_prompt(target, t, []), cache=cache, slot=i)[0] for i, t in enumerate(TEXTS)]
    padded = target.forward_batch(states, UNEQUAL, (1,), ragged=False)
    target.verifies_ragged  # the one-time check, run before `begin` is watched
    seen = []
    real_begin = type(cache).begin
    monkeypatch.setattr(type(cache), "begin", lambda self, rows, starts, counts=None: seen.append(counts) or real_begin(self, rows, starts, counts))
    chosen = target.forward_batch(states, UNEQUAL, (1,))
    forced = target.forward_batch(states, UNEQUAL, (1,), ragged=True)
    assert seen[0] in (None, [4, 2, 1]) and seen[1] == [4, 2, 1]
    return states, padded, chosen, forced, seen[0] is not None


def _gap(a, b) -> float:
    return max(float((a.logits[i, : t.size] - b.logits[i, : t.size]).abs().max()) for i, t in enumerate(UNEQUAL))


@pytest.mark.parametrize("arch", ["llava", "qwen2_5_vl", "idefics3"])
def test_fp32_pads_unequal_trees_and_a_forced_layout_is_the_padded_forward_up_to_rounding(arch, monkeypatch):
    """fp32 (answers promised equal in any batch): unequal trees are padded, never laid end to end,
    since laid out every linear layer multiplies another number of rows and CPU kernels follow the
    row count. Laid out by force (M-RoPE rows included) the logits are the padded ones up to
    rounding; negative control: the layout told to attention with the rows' sizes reversed mixes
    the rows up."""
    target = tiny_target(arch)
    assert not target.verifies_ragged
    states, padded, chosen, forced, laid = _layouts(target, monkeypatch)
    assert not laid
    for b, tree in enumerate(UNEQUAL):
        assert torch.equal(chosen.logits[b, : tree.size], padded.logits[b, : tree.size])
        assert torch.equal(chosen.features[b, : tree.size], padded.features[b, : tree.size])
    assert _gap(forced, padded) <= 1e-5 * float(padded.logits.abs().max())
    real_of = RaggedRows.of
    monkeypatch.setattr(RaggedRows, "of", classmethod(lambda cls, sizes, device: real_of(sizes[::-1], device)))
    wrong = target.forward_batch(states, UNEQUAL, (1,), ragged=True)
    assert all(float((wrong.logits[b, : t.size] - padded.logits[b, : t.size]).abs().max()) > 1e-3 for b, t in enumerate(UNEQUAL))


def _bf16_target():
    from vlmspec.target import set_attention
    from testing.tiny import build_tiny

    model, processor = build_tiny("llava", seed=0)
    model = model.to(torch.bfloat16)
    set_attention(model, "auto")
    return Target(model, processor, name="tiny-llava-bf16")


def test_bf16_lays_unequal_trees_end_to_end_where_the_check_passes_and_refuses_a_wrong_layout(monkeypatch):
    """bf16 (answers promised up to near-ties): the one-time check (`verifies_ragged`) passes for a
    tiny Llama-based VLM, the forward then lays unequal trees end to end, and its logits are the padded
    forward's within the check's bound. Negative control: a layout whose outputs are off by far more
    than rounding is refused by the check, and unequal trees are then padded."""
    target = _bf16_target()
    assert target.verifies_ragged
    _, padded, chosen, forced, laid = _layouts(target, monkeypatch)
    assert laid and _gap(chosen, forced) == 0.0
    assert _gap(chosen, padded) <= 5e-2 * max(1.0, float(padded.logits.abs().max()))
    real_pad = RaggedRows.pad
    monkeypatch.setattr(RaggedRows, "pad", lambda self, x: real_pad(self, x) + 1.0)
    monkeypatch.setattr(target, "_ragged", None)
    assert not target.verifies_ragged


def test_a_target_without_the_attention_that_takes_laid_out_rows_pads_them():
    """transformers' own SDPA does not take rows laid end to end: the target pads (negative control
    of `verifies_ragged`), and the batched runs stay each request's own."""
    target = tiny_target("llava")
    from vlmspec.target import set_attention

    set_attention(target.model, "sdpa")
    try:
        assert not target.verifies_ragged
        engine = SpecEngine(target, NgramDrafter(TREE))
        requests = _requests(target, RAGGED[:3])
        alone = [engine.generate(inputs, cfg).token_ids for inputs, cfg, _ in requests]
        assert run_ragged(engine, requests, slots=3) == alone
    finally:
        set_attention(target.model, "auto")
    assert target.attention == GQA_SDPA


COMPANIONS = ["a", "once upon a time there was a fox", "the quick brown fox jumps over the lazy dog and the dog",
              "hello there", "what is in this picture, and why is it there", "one two three four five six", "x y"]


def _row_logits_beside(target, others: int, tree: DraftTree, lie: int = 0) -> torch.Tensor:
    """Row 0's tree logits [N, V] in one forward beside `others` rows of other lengths and tree sizes
    (`lie`: row 0's committed length told `lie` tokens short: the negative control)."""
    texts = ["describe the image in detail please", *COMPANIONS[:others]]
    cache = target.new_cache(len(texts))
    states = [target.prefill(encode_prompt(target, t, []), cache=cache, slot=i)[0] for i, t in enumerate(texts)]
    states[0].seq_len -= lie
    trees = [tree, *(DraftTree.chain(3 + i, [4 + j for j in range(i % 4)]) for i in range(others))]
    return target.forward_batch(states, trees).logits[0, : tree.size]


@pytest.mark.parametrize("arch", ["llava", "qwen2_5_vl"])
def test_a_rows_fp32_logits_beside_1_3_and_7_other_rows_are_its_own_up_to_rounding(arch):
    """The batch promise in fp32, as it holds on any CPU: a row's logits beside 1, 3 and 7 other rows
    of different lengths and tree sizes are its logits alone up to rounding (CPU kernels block a
    product by its row count, so the bits may differ: measured here on a grid, docs/batching.md
    "Exact on any CPU"), and so its greedy choices are the same wherever its top two logits are
    further apart than that. Negative control: the row's committed length told one token short
    (the mask and positions of a wrong row) moves its logits far past the bound."""
    target = tiny_target(arch)
    tree = DraftTree(torch.tensor([5, 6, 7, 9, 2]), torch.tensor([-1, 0, 0, 1, 3]))
    alone = _row_logits_beside(target, 0, tree)
    bound = 1e-5 * float(alone.abs().max())
    for others in (1, 3, 7):
        beside = _row_logits_beside(target, others, tree)
        assert float((beside - alone).abs().max()) <= bound, others
        top2 = alone.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * bound
        assert torch.equal(beside.argmax(-1)[clear], alone.argmax(-1)[clear])
    assert float((_row_logits_beside(target, 3, tree, lie=1) - alone).abs().max()) > 1e3 * bound


def test_the_batch_admits_under_its_prefill_budget_first_come_first_served():
    """A budget of fewer prompt tokens than two prompts: each step admits one waiting request (the
    first always, so a prompt longer than the budget is not starved), in the order submitted, and
    every answer is its batch-1 run's. Negative control: without a budget one step admits all."""
    target = tiny_target("llava")
    engine = SpecEngine(target, NgramDrafter(TREE))
    requests = _requests(target, [(t, [], 6, 0) for t in ("once upon a time", "hello there you", "a b c d e f g")])
    lengths = [int(inputs["input_ids"].shape[1]) for inputs, _, _ in requests]
    for budget, per_step in ((max(lengths) + 1, [1, 1, 1]), (None, [3])):
        batch = engine.batch(3, prefill_budget=budget)
        tickets = [batch.submit(inputs, cfg) for inputs, cfg, _ in requests]
        admitted = []
        while batch.waiting:
            before = sum(not t.waiting for t in tickets)
            batch.step()
            admitted.append(sum(not t.waiting for t in tickets) - before)
        assert admitted == per_step
        while not batch.idle:
            batch.step()
        assert [t.result.token_ids for t in tickets] == [engine.generate(i, c).token_ids for i, c, _ in requests]


def test_a_request_whose_prefill_raises_fails_alone(monkeypatch):
    """One of three requests raises in its prefill: its ticket carries the error, its slot is free
    for the next, and the others' answers are their batch-1 runs. Negative control: without the
    fault no ticket has an error."""
    target = tiny_target("llava")
    engine = SpecEngine(target, NgramDrafter(TREE))
    requests = _requests(target, [(t, [], 8, 0) for t in ("once upon a time", "hello there you", "a b c d e f g", "x y z")])
    alone = [engine.generate(i, c).token_ids for i, c, _ in requests]
    real_open = engine._open
    bad = requests[1][0]

    def failing(inputs, config, cache, slot, end=None):
        if inputs is bad:
            raise RuntimeError("injected prefill fault")
        return real_open(inputs, config, cache, slot, end)

    for inject in (True, False):
        monkeypatch.setattr(engine, "_open", failing if inject else real_open)
        batch = engine.batch(2)
        tickets = [batch.submit(i, c) for i, c, _ in requests]
        while not batch.idle:
            batch.step()
        errors = [t.error for t in tickets]
        assert (isinstance(errors[1], RuntimeError) and "injected" in str(errors[1])) == inject
        assert all(e is None for k, e in enumerate(errors) if k != 1)
        assert [t.result.token_ids for k, t in enumerate(tickets) if not (inject and k == 1)] == \
            [a for k, a in enumerate(alone) if not (inject and k == 1)]
        assert sorted(batch.free) == [0, 1]


def test_a_waiting_ticket_can_be_cancelled_before_it_is_admitted():
    target = tiny_target("llava")
    engine = SpecEngine(target, NgramDrafter(TREE))
    (a, cfg, _), (b, _, _) = _requests(target, [("once upon a time", [], 6, 0), ("hello", [], 6, 0)])
    batch = engine.batch(1)
    first, second = batch.submit(a, cfg), batch.submit(b, cfg)
    batch.step()
    assert first.request is not None and second.waiting
    batch.cancel(second)
    while not batch.idle:
        batch.step()
    assert second.result is None and second.request is None and first.result.token_ids == engine.generate(a, cfg).token_ids
