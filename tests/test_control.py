"""Adaptive speculation (vlmspec.policy.control): the goodput choice on constructed acceptance histories
and cost models, and the engine under policies that change the tree every step (greedy parity)."""
import pytest
import torch

from conftest import tiny_target
from drafters import OracleDrafter
from vlmspec.policy.control import AcceptanceTracker, CostModel, FixedPolicy, GoodputPolicy, Speculation, SpeculationOptions, depth_summary
from vlmspec.draft.base import PlainDrafter, TreeConfig
from vlmspec.draft.eagle import EagleDrafter
from vlmspec.draft.ngram import NgramDrafter
from vlmspec.draft.self_spec import SelfSpecDrafter
from vlmspec.engine import GenerationConfig, SpecEngine
from vlmspec.policy.cost import measure_cost
from vlmspec.inputs import encode_prompt
from vlmspec.sampling import SamplingParams
from testing.tiny import tiny_image

# drafting a level costs a tenth of a target step, plus a fixed tenth
CHEAP = CostModel(step_s=1.0, draft_s=0.1, per_level_s=0.1)
# in between
MID = CostModel(step_s=1.0, draft_s=0.2, per_level_s=0.1)
# drafting costs as much as verifying (the toy's regime)
DEAR = CostModel(step_s=1.0, draft_s=0.5, per_level_s=0.4)


def test_cost_model_fit_recovers_a_linear_cost_and_refuses_too_little():
    truth = CostModel(step_s=0.05, draft_s=0.01, per_level_s=0.004)
    fitted = CostModel.fit({d: truth.seconds(d) for d in (0, 1, 3, 5)})
    assert fitted.step_s == pytest.approx(0.05) and fitted.draft_s == pytest.approx(0.01) and fitted.per_level_s == pytest.approx(0.004)
    one = CostModel.fit({0: 1.0, 4: 1.8})  # one drafted depth: all of the extra per level
    assert one.seconds(4) == pytest.approx(1.8) and one.draft_s == 0
    assert CostModel.fit({0: 1.0, 2: 0.9}).seconds(2) == 1.0  # noise below the base: drafting is not free, but not negative
    # every depth measured: the table is what it says, a dip is read as noise, the line goes on past it
    steps = CostModel.fit({0: 1.0, 1: 1.3, 2: 1.7, 3: 1.65, 4: 1.9})
    assert [steps.seconds(d) for d in range(5)] == pytest.approx([1.0, 1.3, 1.7, 1.7, 1.9])
    assert steps.seconds(6) == pytest.approx(1.0 + steps.draft_s + 6 * steps.per_level_s)
    assert CostModel.fit({0: 1.0, 1: 1.2, 3: 1.6}).seconds(2) == pytest.approx(1.4)  # between measured depths: read linearly
    with pytest.raises(ValueError, match="positive measured"):
        CostModel(step_s=1.0, by_depth=(1.2, 0.0))
    with pytest.raises(ValueError, match="depth 0"):
        CostModel.fit({1: 1.0, 2: 1.2})
    with pytest.raises(ValueError, match="step_s > 0"):
        CostModel(step_s=0.0)


def _history(policy: GoodputPolicy, steps: list[tuple[int, int]]) -> AcceptanceTracker:
    ctl = policy.start()
    for depth, accepted in steps:
        ctl.observe(depth, accepted)
    return ctl


def test_expected_tokens_follow_the_conditional_acceptance_chain():
    # 10 steps at depth 3: depth 1 always accepted, depth 2 half the time, depth 3 never
    ctl = _history(GoodputPolicy(CHEAP, prior_weight=1e-9, decay=1.0), [(3, 1)] * 5 + [(3, 2)] * 5)
    assert ctl.accept_rates(3) == pytest.approx([1.0, 0.5, 0.0], abs=1e-6)
    assert ctl.expected_tokens(0) == 1.0 and ctl.expected_tokens(3) == pytest.approx(1 + 1 + 0.5 + 0, abs=1e-6)
    assert ctl.choose(3) == 2  # depth 3 costs more and adds nothing


def test_goodput_stops_drafting_when_acceptance_collapses_and_goes_deep_when_it_is_high():
    policy = GoodputPolicy(MID, prior_accept=0.5)
    high = _history(policy, [(5, 5)] * 8)
    assert high.choose(5) == 5
    assert high.choose(2) == 2  # never past max_depth
    collapsed = _history(policy, [(5, 5)] * 8 + [(5, 0)] * 10)
    assert collapsed.choose(5) == 0
    # negative control: the same collapsed history with a free drafter still drafts (nothing to lose)
    free = _history(GoodputPolicy(CostModel(step_s=1.0), prior_accept=0.5), [(5, 5)] * 8 + [(5, 0)] * 10)
    assert free.choose(5) > 0
    # where drafting is dear, a middling acceptance is not worth it; where it is cheap, it is
    middling = [(3, 1), (3, 2), (3, 0), (3, 1)] * 3
    assert _history(GoodputPolicy(DEAR, prior_accept=0.5), middling).choose(3) == 0
    assert _history(GoodputPolicy(CHEAP, prior_accept=0.5), middling).choose(3) > 0


def test_a_gain_inside_the_margin_is_not_drafted_and_a_clear_one_is():
    """min_gain: a depth-1 step costing 1.5 plain steps that accepts 57.5% promises 1.05x goodput,
    under the default 10% margin -> plain; at 90% (1.27x) it drafts. Negative control: without the
    margin the 1.05x step is drafted."""
    cost = CostModel(step_s=1.0, by_depth=(1.5,))
    exact = dict(prior_weight=1e-9, decay=1.0)
    marginal = [(1, 1)] * 23 + [(1, 0)] * 17
    assert _history(GoodputPolicy(cost, **exact), marginal).goodput(1) == pytest.approx(1.575 / 1.5)
    assert _history(GoodputPolicy(cost, **exact), marginal).choose(1) == 0
    assert _history(GoodputPolicy(cost, min_gain=0.0, **exact), marginal).choose(1) == 1
    assert _history(GoodputPolicy(cost, **exact), [(1, 1)] * 9 + [(1, 0)]).choose(1) == 1
    with pytest.raises(ValueError, match="min_gain"):
        GoodputPolicy(cost, min_gain=-0.1)


def test_after_a_collapse_the_estimates_drift_back_and_drafting_is_tried_again():
    policy = GoodputPolicy(MID, prior_accept=0.7, decay=0.8)
    ctl = _history(policy, [(4, 0)] * 6)
    assert ctl.choose(4) == 0
    tried = None
    for step in range(40):  # no-draft steps teach nothing; the old evidence fades
        depth = ctl.choose(4)
        if depth > 0:
            tried = step
            break
        ctl.observe(0, 0)
    assert tried is not None and tried > 0


def test_a_dearer_retry_comes_less_often():
    # the same collapse; retries at full depth (no probe cap): a drafted depth-4 step costs 0.6 plain
    # steps extra under MID (price 1: the plain drift) and 2.1 under DEAR, whose evidence then fades
    # 2.1 times slower per plain step
    cheap, dear = _history(GoodputPolicy(MID, probe_depth=None), [(4, 0)] * 6), _history(GoodputPolicy(DEAR, probe_depth=None), [(4, 0)] * 6)
    assert cheap.retry_price() == 1.0 and dear.retry_price() == pytest.approx(2.1)
    before = cheap.reached[0]
    assert dear.reached[0] == before
    for _ in range(10):
        cheap.observe(0, 0)
        dear.observe(0, 0)
    assert cheap.reached[0] == pytest.approx(before * 0.97 ** 10)
    assert dear.reached[0] == pytest.approx(before * 0.97 ** (10 / 2.1))


def _retry_gaps(ctl: AcceptanceTracker, retries: int, accepted_on_retry: int) -> list[int]:
    """Plain steps before each of `retries` retries, every retry accepting `accepted_on_retry` tokens."""
    gaps, plain = [], 0
    while len(gaps) < retries and plain < 10_000:
        depth = ctl.choose(4)
        if depth == 0:
            plain += 1
            ctl.observe(0, 0)
            continue
        gaps.append(plain)
        plain = 0
        ctl.observe(depth, min(accepted_on_retry, depth))
    return gaps


def test_failed_retries_back_off_and_a_retry_that_pays_resets_the_wait():
    # no margin: the gaps then come from the drift and the back-off alone
    policy = GoodputPolicy(MID, prior_accept=0.7, decay=0.8, max_backoff=3, min_gain=0.0)
    failing = _retry_gaps(_history(policy, [(4, 0)] * 6), 5, accepted_on_retry=0)
    assert len(failing) == 5 and failing[0] > 0
    # each failed retry in a row doubles the wait (up to 2 ** max_backoff): the waits grow, then level off
    assert all(b >= a - 1 for a, b in zip(failing, failing[1:])) and failing[3] > 3 * failing[1] and failing[4] < 1.5 * failing[3]
    ctl = _history(policy, [(4, 0)] * 6)
    _retry_gaps(ctl, 3, accepted_on_retry=0)
    assert ctl.retry_misses == 3 and ctl.retry_price() == pytest.approx(8.0)
    ctl.observe(4, 4)  # a drafted step that pays: back to the undoubled price
    assert ctl.retry_misses == 0 and ctl.retry_price() == 1.0
    # negative control: without back-off the waits stay where the first one was
    flat = _retry_gaps(_history(GoodputPolicy(MID, prior_accept=0.7, decay=0.8, max_backoff=0, min_gain=0.0), [(4, 0)] * 6), 5,
                       accepted_on_retry=0)
    assert max(flat) <= failing[0] + 1 and sum(flat) < sum(failing) / 2
    with pytest.raises(ValueError):
        GoodputPolicy(MID, max_backoff=-1)


def test_first_drafts_and_retries_are_shallow_probes_and_a_probe_that_pays_goes_deep():
    policy = GoodputPolicy(CHEAP, prior_accept=0.7)
    ctl = policy.start()
    assert ctl.choose(5) == 1  # the request's first draft: a probe
    ctl.observe(1, 1)  # it paid
    assert ctl.choose(5) >= 4
    ctl.observe(5, 0)  # a drafted step that accepted nothing: the next draft probes again
    assert ctl.choose(5) == 1
    ctl = _history(policy, [(5, 0)] * 6)  # a collapse, then plain steps until the estimates drift back
    retry = next(d for d in (ctl.choose(5) for _ in range(400)) if d > 0 or ctl.observe(0, 0))
    assert retry == 1  # the retry is a probe too
    # its price, what paces the retries, is the probe's: (CHEAP depth 1: 0.2 plain steps extra) -> 1
    assert ctl.retry_price() == 1.0
    # negative control: without the cap the same histories draft the full depth at once
    free = GoodputPolicy(CHEAP, prior_accept=0.7, probe_depth=None)
    assert free.start().choose(5) >= 4
    assert _history(free, [(5, 0)]).choose(5) > 1
    with pytest.raises(ValueError, match="probe_depth"):
        GoodputPolicy(CHEAP, probe_depth=0)


def test_measured_step_times_correct_the_cost_model_per_request():
    # acceptance that pays under the model (MID: a depth-3 step costs 1.5 plain steps) ...
    steps = [(3, 1), (3, 2), (3, 1), (3, 1)] * 3
    assert _history(GoodputPolicy(MID, prior_accept=0.5), steps).choose(3) > 0
    # ... but not once the request measures its drafted steps at twice the model's seconds
    dear = GoodputPolicy(MID, prior_accept=0.5).start()
    for depth, accepted in steps:
        dear.observe(depth, accepted, 2.0 * MID.seconds(depth))
    assert dear.draft_scale == pytest.approx(2.0, rel=0.05) and dear.plain_scale == 1.0
    assert dear.choose(3) == 0
    # negative control: timings equal to the model change nothing
    exact = GoodputPolicy(MID, prior_accept=0.5).start()
    for depth, accepted in steps:
        exact.observe(depth, accepted, MID.seconds(depth))
    assert exact.draft_scale == pytest.approx(1.0) and exact.choose(3) == _history(GoodputPolicy(MID, prior_accept=0.5), steps).choose(3)
    # plain steps found slower than modelled make drafting relatively cheaper again
    slow_plain = GoodputPolicy(MID, prior_accept=0.5).start()
    for depth, accepted in steps:
        slow_plain.observe(depth, accepted, 2.0 * MID.seconds(depth))
    for _ in range(12):
        slow_plain.observe(0, 0, 2.0 * MID.seconds(0))
    assert slow_plain.plain_scale == pytest.approx(2.0, rel=0.05) and slow_plain.seconds(3) / slow_plain.seconds(0) == pytest.approx(1.5, rel=0.05)
    # time_weight 0: the model as given
    fixed_model = GoodputPolicy(MID, prior_accept=0.5, time_weight=0.0).start()
    fixed_model.observe(3, 1, 10.0)
    assert fixed_model.seconds(3) == MID.seconds(3)
    with pytest.raises(ValueError):
        GoodputPolicy(MID, time_weight=1.5)


def test_policies_validate_and_fixed_is_the_full_depth():
    assert FixedPolicy().start().choose(7) == 7 and FixedPolicy(2).start().choose(7) == 2 and FixedPolicy(2).start().choose(1) == 1
    with pytest.raises(ValueError):
        GoodputPolicy(CHEAP, prior_accept=1.0)
    with pytest.raises(ValueError):
        GoodputPolicy(CHEAP, decay=0.0)


class CyclingPolicy:
    """Changes the depth every step (0, 1, ..., 5, 0, ...): the engine must stay exact whatever
    the controller picks."""

    name = "cycling"

    def start(self):
        return self

    def __init__(self):
        self.n = 0
        self.seen = []

    def choose(self, max_depth: int) -> int:
        self.n += 1
        return min(self.n % 6, max_depth)

    def observe(self, depth: int, num_accepted: int, seconds: float | None = None, chain_accepted: int | None = None,
                chain: bool = False) -> None:
        self.seen.append((depth, num_accepted))


@pytest.mark.parametrize("kind", ["image", "text"])
def test_greedy_parity_under_every_policy(kind):
    target = tiny_target("llava")
    inputs = encode_prompt(target, "describe the image in detail" if kind == "image" else "once upon a time", [tiny_image(0)] if kind == "image" else [])
    new = 40
    plain = SpecEngine(target, PlainDrafter()).generate(inputs, GenerationConfig(max_new_tokens=new, ignore_eos=True)).token_ids
    tree = TreeConfig(depth=5, top_k=3, total_tokens=12)
    drafters = {"ngram": NgramDrafter(tree), "eagle_random": EagleDrafter.random_init(target, tree, seed=1),
                "oracle": OracleDrafter(plain, depth=5, vocab=target.vocab_size), "self": SelfSpecDrafter(target, tree)}
    for name, drafter in drafters.items():
        engine = SpecEngine(target, drafter)
        cost = measure_cost(engine, inputs, tokens=6, repeats=1)
        for policy in (FixedPolicy(), FixedPolicy(0), GoodputPolicy(cost), GoodputPolicy(DEAR), CyclingPolicy()):
            got = engine.generate(inputs, GenerationConfig(max_new_tokens=new, ignore_eos=True, policy=policy))
            assert got.token_ids == plain, f"{kind}/{name}/{policy.name} diverged from plain decoding"
        if name == "oracle":  # the oracle is always right: goodput keeps drafting, and deep
            ctl = GoodputPolicy(CHEAP).start()
            engine.generate(inputs, GenerationConfig(max_new_tokens=new, ignore_eos=True, policy=_Keep(ctl)))
            assert ctl.chosen and sum(d > 0 for d in ctl.chosen) >= len(ctl.chosen) - 1


class _Keep:
    """A policy handing out one given controller (to read its choices afterwards)."""

    name = "keep"

    def __init__(self, ctl):
        self.ctl = ctl

    def start(self):
        return self.ctl


def test_a_fixed_depth_zero_is_plain_decoding_and_sampling_stays_seeded():
    target = tiny_target("llava")
    inputs = encode_prompt(target, "once upon a time", [])
    engine = SpecEngine(target, NgramDrafter(TreeConfig(depth=3, top_k=2, total_tokens=6)))
    r = engine.generate(inputs, GenerationConfig(max_new_tokens=16, ignore_eos=True, policy=FixedPolicy(0)))
    assert r.num_drafted == 0 and r.num_target_forwards == 16
    cfg = dict(max_new_tokens=16, ignore_eos=True, sampling=SamplingParams(temperature=1.0), seed=3)
    a = engine.generate(inputs, GenerationConfig(**cfg, policy=GoodputPolicy(CHEAP)))
    b = engine.generate(inputs, GenerationConfig(**cfg, policy=GoodputPolicy(CHEAP)))
    assert a.token_ids == b.token_ids


def test_steps_without_a_draft_run_no_drafter_forward():
    """A plain step under the controller costs the target's step only: the EAGLE head's pairs wait
    for the next drafted step (then run in one forward) instead of running every step."""
    target = tiny_target("llava")
    inputs = encode_prompt(target, "once upon a time", [])
    drafter = EagleDrafter.random_init(target, TreeConfig(depth=3, top_k=2, total_tokens=6), seed=2)
    calls = []
    real = drafter.head.decode  # what drafting runs (forward: training and the tests' reference)
    drafter.head.decode = lambda *a, **k: calls.append(a[0].shape[-1]) or real(*a, **k)
    plain = SpecEngine(target, PlainDrafter()).generate(inputs, GenerationConfig(max_new_tokens=12, ignore_eos=True)).token_ids
    got = SpecEngine(target, drafter).generate(inputs, GenerationConfig(max_new_tokens=12, ignore_eos=True, policy=FixedPolicy(0)))
    assert got.token_ids == plain and calls == []  # nothing: the prompt's pairs wait with the others for a drafted step
    calls.clear()

    class ThenDraft(CyclingPolicy):  # four plain steps, then one drafted step
        def choose(self, max_depth):
            self.n += 1
            return 0 if self.n <= 5 else max_depth

    got = SpecEngine(target, drafter).generate(inputs, GenerationConfig(max_new_tokens=12, ignore_eos=True, policy=ThenDraft()))
    assert got.token_ids == plain
    prompt = inputs["input_ids"].shape[1]
    assert calls[0] == prompt + 5 and len(calls) > 1  # the prompt's pairs and the 5 plain steps' in one forward, then the tree's levels


def test_the_controller_chooses_within_the_drafters_tree():
    target = tiny_target("llava")
    inputs = encode_prompt(target, "once upon a time", [])
    engine = SpecEngine(target, NgramDrafter(TreeConfig(depth=3, top_k=2, total_tokens=6)))
    ctl = GoodputPolicy(CostModel(step_s=1.0), probe_depth=None).start()  # free drafting, no probes: always as deep as allowed
    engine.generate(inputs, GenerationConfig(max_new_tokens=20, ignore_eos=True, policy=_Keep(ctl)))
    assert max(ctl.chosen) == 3
    ctl = GoodputPolicy(CostModel(step_s=1.0), probe_depth=None).start()
    engine.generate(inputs, GenerationConfig(max_new_tokens=20, ignore_eos=True, policy=_Keep(ctl), tree=TreeConfig(depth=2, top_k=2, total_tokens=4)))
    assert max(ctl.chosen) == 2  # the request's own tree


# ------------------------------------------------------------------------ per-request knobs (#21 item 4)


def test_speculation_options_validate_and_the_engine_default_resolves_the_policy():
    with pytest.raises(ValueError, match="policy"):
        SpeculationOptions(policy="greedy")
    with pytest.raises(ValueError, match="max_depth"):
        SpeculationOptions(max_depth=-1)
    with pytest.raises(ValueError, match="tree_tokens"):
        SpeculationOptions(tree_tokens=0)
    with pytest.raises(ValueError, match="default"):
        Speculation(default="always")
    cost = CostModel(step_s=1.0, draft_s=0.1)
    assert isinstance(Speculation("goodput", cost).policy(), GoodputPolicy)
    assert Speculation("goodput", cost).policy().cost == cost
    assert isinstance(Speculation("goodput", cost).policy("fixed"), FixedPolicy)
    assert isinstance(Speculation("fixed", cost).policy("goodput"), GoodputPolicy)
    assert isinstance(Speculation("goodput", None).policy(), FixedPolicy)  # no cost model: fixed, and the result says so
    assert depth_summary([0, 0, 5, 5, 5, 2]) == "0x2 2x1 5x3"


def test_request_knobs_travel_with_the_request_and_leave_the_engine_alone():
    """max_depth 0 is plain decoding, max_depth and tree_tokens cap what is drafted, the result names
    the policy and the depth of every step; the next request without knobs gets the defaults."""
    target = tiny_target("llava")
    inputs = encode_prompt(target, "once upon a time", [tiny_image(0)])
    tree = TreeConfig(depth=4, top_k=2, total_tokens=8)
    engine = SpecEngine(target, EagleDrafter.random_init(target, tree, seed=3), Speculation("goodput", CostModel(step_s=1.0, per_level_s=0.01)))
    plain = SpecEngine(target, PlainDrafter()).generate(inputs, GenerationConfig(max_new_tokens=16, ignore_eos=True)).token_ids

    def run(**knobs):
        return engine.generate(inputs, GenerationConfig(max_new_tokens=16, ignore_eos=True, speculation=SpeculationOptions(**knobs)))

    off = run(max_depth=0)
    assert off.token_ids == plain and off.num_drafted == 0 and set(off.depths) == {0}
    assert len(off.depths) == off.stats.num_drafts  # one entry per verify forward
    capped = run(policy="fixed", max_depth=2, tree_tokens=3)
    assert capped.token_ids == plain and capped.policy == "fixed"
    assert max(capped.depths) == 2 and capped.num_drafted <= 3 * capped.stats.num_drafts
    assert len(capped.stats.reached_per_pos) == 2  # nothing was drafted deeper than 2
    full = run(policy="fixed")  # the request's caps did not stay behind
    assert full.token_ids == plain and max(full.depths) == 4
    default = run()
    assert default.token_ids == plain and default.policy == "goodput" and default.depths[0] == 1  # its first draft is a probe
    assert engine.drafter.tree == tree and engine.speculation.default == "goodput"  # nothing shared was changed


def test_with_policy_measures_a_cost_model_only_for_a_drafter_that_drafts():
    from vlmspec.factory import with_policy

    target = tiny_target("llava")
    engine = with_policy(SpecEngine(target, NgramDrafter(TreeConfig(depth=3, top_k=2, total_tokens=6))), "goodput")
    cost = engine.speculation.cost
    assert cost is not None and cost.step_s > 0 and engine.speculation.policy().name == "goodput"
    assert with_policy(SpecEngine(target, PlainDrafter()), "goodput").speculation.cost is None
    assert with_policy(engine, "fixed", cost).speculation.policy().name == "fixed"


def test_measured_cost_charges_verifying_full_trees_even_when_the_drafter_found_nothing(monkeypatch):
    """n-gram on a prompt without repeats proposes one-node trees while the cost is measured; the
    model still charges each drafted level what verifying a full tree of that depth costs."""
    from vlmspec.policy import cost as cost_module

    calls = []

    def fake_tree_extras(target, prefix, sizes, rounds, warmup):  # 2 ms per node over the one-token step
        calls.extend(sizes)
        return {n: 2.0 * (n - 1) for n in sizes}

    monkeypatch.setattr(cost_module, "time_tree_extras", fake_tree_extras)
    target = tiny_target("llava")
    tree = TreeConfig(depth=5, top_k=4, total_tokens=16)
    engine = SpecEngine(target, NgramDrafter(tree))
    inputs = encode_prompt(target, "a quick brown fox", [])
    cost = measure_cost(engine, inputs, tokens=4, repeats=3)
    assert calls == sorted({1 + cost_module.tree_nodes(tree, d) for d in range(1, 6)}) == [5, 9, 13, 17]  # each size timed once
    # the charged verify is exact (faked); the steps around it are measured, so a loaded machine
    # moves each depth's time by a few ms: the bounds leave that room, not the charge's size
    extra = cost.seconds(5) - cost.seconds(0)  # 16 nodes x 2 ms of verify, plus the n-gram's own (small) time, measured
    assert 0.032 - 0.003 <= extra < 0.032 + 0.05
    assert cost.seconds(1) - cost.seconds(0) >= 0.008 - 0.003  # 4 nodes at depth 1
    assert len(cost.by_depth) == 5  # every depth measured


def test_measured_cost_times_the_nodes_an_eagle_tree_actually_verifies(monkeypatch):
    """EAGLE-2 fills its node budget from depth 2 on (depth 2 of a top-2 tree: 2 + 2 x 2 = 6 nodes,
    more than the 4 of `tree_nodes`): the engine's own steps time the trees it verified, and nothing
    is added (the verify-only timing is for drafters that proposed less than `tree_nodes`)."""
    from vlmspec.policy import cost as cost_module

    calls = []
    monkeypatch.setattr(cost_module, "time_tree_extras", lambda target, prefix, sizes, rounds, warmup: calls.extend(sizes) or {n: 2.0 * (n - 1) for n in sizes})
    target = tiny_target("llava")
    tree = TreeConfig(depth=3, top_k=2, total_tokens=6)
    cost = measure_cost(SpecEngine(target, EagleDrafter.random_init(target, tree, seed=3)), encode_prompt(target, "a quick brown fox", []),
                        tokens=4, repeats=1)
    assert calls == []
    assert cost_module.tree_nodes(tree, 2) == 4 and len(cost.by_depth) == 3
