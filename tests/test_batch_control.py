"""Goodput over the batch (SmartSpec): the rows' depths chosen together from each row's acceptance
history and a cost per batch size; the measured cost kept in a cache file per model, drafter,
device and dtype."""
import pytest
import torch

from conftest import tiny_target
from vlmspec.policy.batch_control import BatchTiming, batch_chains, choose_depths
from vlmspec.policy.control import AcceptanceTracker, BatchCost, CostModel, FixedPolicy, GoodputPolicy, Speculation
from vlmspec.policy.cost import measured_costs
from vlmspec.draft.base import TreeConfig
from vlmspec.draft.eagle import EagleDrafter
from vlmspec.engine import GenerationConfig, SpecEngine
from vlmspec.inputs import encode_prompt

# a step's seconds by depth 0..5 at B = 1, 4 and 8: at B = 1 a drafted level costs a tenth of a
# plain step; at B = 8 a drafted step costs 2.5-3.5 steps of 8 plain rows
B1 = CostModel.fit({0: 1.0, 1: 1.1, 2: 1.2, 5: 1.5})
B4 = CostModel.fit({0: 1.6, 1: 2.2, 2: 2.6, 5: 3.2})
B8 = CostModel.fit({0: 2.0, 1: 5.0, 2: 6.4, 5: 7.0})
COST = BatchCost(((1, B1), (4, B4), (8, B8)))


def _tracker(accepted_per_step: int, steps: int = 6, depth: int = 5) -> AcceptanceTracker:
    """A request whose drafts had `accepted_per_step` tokens accepted of `depth` every step so far."""
    t = GoodputPolicy(B1).start()
    for _ in range(steps):
        t.observe(depth, accepted_per_step)
    return t


def test_batch_cost_reads_between_and_past_the_measured_sizes():
    assert COST.seconds(1, 2) == pytest.approx(1.2) and COST.seconds(8, 5) == pytest.approx(7.0)
    assert COST.seconds(6, 0) == pytest.approx((1.6 + 2.0) / 2)  # halfway between B = 4 and 8
    assert COST.seconds(16, 0) == pytest.approx(2.0 + (2.0 - 1.6) * 2)  # the 4 -> 8 line extended
    with pytest.raises(ValueError, match="starting at 1"):
        BatchCost(((4, B4),))
    assert BatchCost.from_dict(COST.as_dict()) == COST


def test_one_row_chooses_as_its_own_controller_does():
    a, b = _tracker(4), _tracker(4)
    got = choose_depths([a], [5], COST)
    assert got == [b.choose(5)] and got[0] > 0


def test_the_batch_drafts_less_as_it_grows_and_not_at_all_when_it_does_not_pay():
    """Rows that accept 2 of 5 drafted tokens: alone drafting pays; at B = 4 less deep; at B = 8 a
    drafted step costs over 3 plain steps for about 3 tokens per row, so the batch decodes plainly."""
    chosen = {b: choose_depths([_tracker(2) for _ in range(b)], [5] * b, COST) for b in (1, 4, 8)}
    assert chosen[1][0] > 0
    assert 0 < chosen[4][0] < 5 and len(set(chosen[4])) == 1
    assert chosen[8] == [0] * 8
    # negative control: rows whose drafts are all accepted keep drafting deep at B = 8
    assert choose_depths([_tracker(5) for _ in range(8)], [5] * 8, COST) == [5] * 8


def test_fresh_rows_probe_shallow_in_a_batch_as_alone():
    """Rows with no history yet (the prior's optimistic acceptance): at B = 8 a depth-1 step costs
    1.9 plain steps and a depth-5 step 2.5. The full depth looks as if it paid at the prior, but a
    fresh row's first draft is a probe (depth 1), which does not pay here: the batch decodes
    plainly. Rows whose last draft paid may go deep; negative control: without probes the fresh
    batch drafts its full depth."""
    cheap_deep = BatchCost(((1, B1), (8, CostModel.fit({0: 1.0, 1: 1.9, 5: 2.5}))))
    assert choose_depths([GoodputPolicy(B1).start() for _ in range(8)], [5] * 8, cheap_deep) == [0] * 8
    assert choose_depths([_tracker(4) for _ in range(8)], [5] * 8, cheap_deep) == [5] * 8
    no_probe = GoodputPolicy(B1, probe_depth=None)
    assert choose_depths([no_probe.start() for _ in range(8)], [5] * 8, cheap_deep) == [5] * 8
    # a probing row next to rows that paid: they go deep, and it as deep as the step already is
    mixed = [GoodputPolicy(B1).start()] + [_tracker(4) for _ in range(7)]
    assert choose_depths(mixed, [5] * 8, cheap_deep) == [5] * 8
    assert choose_depths(mixed, [5] + [2] * 7, cheap_deep) == [2] * 8  # the others' limit sets the step's depth


def test_in_a_batch_rows_are_priced_by_their_first_child_chain():
    """Rows whose trees accept 4 of 5 drafted tokens, but only ever off the first child at depth 1
    (the chain accepts nothing): alone the tree pays; in a batch, which drafts chains, nothing does.
    Negative control: rows whose accepts lie along first children draft in the batch too."""
    cheap = BatchCost(((1, B1), (4, CostModel.fit({0: 1.0, 1: 1.2, 5: 1.6}))))

    def rows(chain_accepted: int) -> list[AcceptanceTracker]:
        out = []
        for _ in range(4):
            t = GoodputPolicy(B1).start()
            for _ in range(6):
                t.observe(5, 4, chain_accepted=chain_accepted)
            out.append(t)
        return out

    off_chain = rows(0)
    assert off_chain[0].expected_tokens(5) > 3 and off_chain[0].expected_tokens(5, chain=True) < 1.5
    assert choose_depths(off_chain[:1], [5], cheap)[0] > 0  # alone: the tree
    assert choose_depths(off_chain, [5] * 4, cheap) == [0] * 4
    assert choose_depths(rows(4), [5] * 4, cheap)[0] > 0


def test_which_rows_draft_a_chain():
    goodput, fixed = GoodputPolicy(B1).start(), FixedPolicy(3).start()
    assert batch_chains([goodput, fixed, GoodputPolicy(B1).start()], COST) == [True, False, True]
    assert batch_chains([goodput], COST) == [False]  # alone: its tree
    assert batch_chains([goodput, goodput], None) == [False, False]  # no batch cost: each row chooses alone


def test_a_chain_step_teaches_the_chain_and_leaves_the_tree_to_drift_back():
    t = GoodputPolicy(B1).start()
    t.observe(3, 0, chain=True)
    t.observe(3, 0, chain=True)
    assert t.accept_rates(1, chain=True)[0] < 0.5  # two rejected chains
    assert t.reached == [] and t.accept_rates(1)[0] == pytest.approx(0.8)  # the tree's counts: untouched, the prior


def test_rows_keep_their_own_limits_and_fixed_rows_their_own_depth():
    rows = [_tracker(5), _tracker(5), FixedPolicy(3).start()]
    depths = choose_depths(rows, [5, 1, 5], COST)
    assert depths == [5, 1, 3]
    assert rows[0].chosen[-1] == 5 and rows[1].chosen[-1] == 1  # each tracker records its own depth
    assert choose_depths(rows, [5, 5, 5], None) == [rows[0].choose(5), rows[1].choose(5), 3]  # no batch cost: alone


def test_the_batchs_own_step_times_correct_its_cost():
    """Drafted steps of this batch measured at twice the model's seconds (long image prompts, say):
    at B = 4, where the model alone says drafting pays, the corrected cost says it does not, once
    `min_steps` of them are measured; a batch whose steps took what the model said keeps drafting
    (negative control)."""
    rows = lambda: [_tracker(2) for _ in range(4)]  # noqa: E731
    assert choose_depths(rows(), [5] * 4, COST)[0] > 0
    slow, exact = BatchTiming(), BatchTiming()
    for _ in range(slow.min_steps):
        slow.observe(COST, 4, 2, 2.0 * COST.seconds(4, 2))
        slow.observe(COST, 4, 0, COST.seconds(4, 0))
        exact.observe(COST, 4, 2, COST.seconds(4, 2))
    assert slow.scale(2) == pytest.approx(2.0) and slow.scale(0) == pytest.approx(1.0)
    assert choose_depths(rows(), [5] * 4, COST, slow) == [0] * 4
    assert choose_depths(rows(), [5] * 4, COST, exact)[0] > 0


def _drafted_steps(timing: BatchTiming, rows: int, gain: float, steps: int) -> None:
    """`steps` drafted steps of `rows` rows that each took what the model says and emitted `gain`
    times the tokens a plain step of those rows emits in its modelled seconds."""
    seconds = COST.seconds(rows, 2)
    for _ in range(steps):
        timing.observe(COST, rows, 2, seconds, emitted=round(gain * rows * seconds / COST.seconds(rows, 0)))


def test_drafting_waits_where_the_batchs_drafted_steps_delivered_less_than_plain_steps():
    """At B = 8 four drafted steps each emitted 0.6x what plain steps give in their time: drafting
    there waits, plain steps count towards a retry (8 of them), a losing retry doubles the wait, a
    paying one brings it back to 8, and once the last five deliver more than plain steps the wait
    is over. The same at B = 4 with steps that paid (1.5x) never waits, nor does a bucket seen
    fewer than `min_steps` times (negative controls)."""
    timing = BatchTiming()
    _drafted_steps(timing, 8, 0.6, 3)
    assert timing.allows_draft(8)  # 3 steps: too few to judge
    _drafted_steps(timing, 8, 0.6, 1)
    assert not timing.allows_draft(8) and not timing.allows_draft(7) and timing.allows_draft(4)  # 5-8 rows share a bucket
    for _ in range(7):
        timing.observe(COST, 8, 0, COST.seconds(8, 0))
    assert not timing.allows_draft(8)
    timing.observe(COST, 8, 0, COST.seconds(8, 0))
    assert timing.allows_draft(8)  # the 8th plain step: one retry
    _drafted_steps(timing, 8, 0.6, 1)  # it lost too: the wait doubles
    for _ in range(15):
        timing.observe(COST, 8, 0, COST.seconds(8, 0))
    assert not timing.allows_draft(8)
    timing.observe(COST, 8, 0, COST.seconds(8, 0))
    assert timing.allows_draft(8)
    _drafted_steps(timing, 8, 1.4, 2)  # two retries that paid: the last five still lost (0.92x), but the wait is back to 8
    assert not timing.allows_draft(8)
    for _ in range(timing.retry):
        timing.observe(COST, 8, 0, COST.seconds(8, 0))
    assert timing.allows_draft(8)
    _drafted_steps(timing, 8, 1.4, 1)  # a third: the last five paid (1.08x), drafting goes on
    assert timing.allows_draft(8)
    paying = BatchTiming()
    _drafted_steps(paying, 4, 1.5, 10)
    assert paying.allows_draft(4)


def test_a_few_drafted_steps_that_pay_much_outweigh_more_that_lose_a_little():
    """Drafted steps' tokens are skewed: rows whose drafts are accepted deep emit several tokens a
    step, the rest a little less than a plain step's worth in the time. Three of five steps at 0.8x
    and two at 2.0x deliver 1.28x plain steps' tokens per second: drafting goes on (the median of
    the steps' gains, 0.8, held it back). Negative control: two at 1.1x (0.92x over the five) wait."""
    for high, drafts in ((2.0, True), (1.1, False)):
        timing = BatchTiming()
        for gain in (0.8, high, 0.8, high, 0.8):
            _drafted_steps(timing, 4, gain, 1)
        assert timing.allows_draft(4) is drafts, (high, timing.buckets[2].gain)


def test_one_drafted_step_with_a_one_off_cost_holds_nothing_back():
    """A batch's first drafted step also reads its rows' prompts (three times the modelled seconds,
    a gain of about 0.4) and the next ones pay (1.3x): drafting goes on and the drafted steps' cost
    correction stays at 1. Negative control: the same first step followed by steps that lose
    (0.7x) makes drafting wait."""
    for later, drafts in ((1.3, True), (0.7, False)):
        timing = BatchTiming()
        seconds = COST.seconds(8, 2)
        timing.observe(COST, 8, 2, 3 * seconds, emitted=round(1.3 * 8 * seconds / COST.seconds(8, 0)))
        assert timing.buckets[3].gain < 0.5
        _drafted_steps(timing, 8, later, 4)
        assert timing.allows_draft(8) is drafts
        assert timing.draft == pytest.approx(1.0) and timing.scale(2) == pytest.approx(1.0)
    first = BatchTiming()  # that first step alone does not price drafting out (the model stands until min_steps)
    first.observe(COST, 8, 2, 3 * COST.seconds(8, 2), emitted=8)
    assert first.draft == 1.0


def test_a_batch_whose_drafted_steps_lost_decodes_plainly_where_goodput_would_draft():
    """Rows that would draft at B = 4 by their histories and the cost model, in a batch whose own
    drafted steps at B = 4 delivered 0.5x plain steps: no row drafts until a retry is due, and then
    as deep as they choose; with drafted steps that paid (the negative control) they draft as before."""
    rows = lambda: [_tracker(2) for _ in range(4)]  # noqa: E731
    losing, paying = BatchTiming(), BatchTiming()
    _drafted_steps(losing, 4, 0.5, 4)
    _drafted_steps(paying, 4, 1.5, 4)
    assert choose_depths(rows(), [5] * 4, COST, losing) == [0] * 4
    assert choose_depths(rows(), [5] * 4, COST, paying)[0] > 1
    assert choose_depths([_tracker(0) for _ in range(4)], [5] * 4, COST, losing) == [0] * 4  # rows that would not draft anyway
    assert (losing.waits, paying.waits) == (1, 0)  # the counter counts the steps the check held back, only those
    for _ in range(losing.retry):  # the wait is over: a retry, as deep as the rows choose
        losing.observe(COST, 4, 0, COST.seconds(4, 0))
    assert choose_depths(rows(), [5] * 4, COST, losing) == choose_depths(rows(), [5] * 4, COST, paying)


def _alone_and_together(batch_seconds_at_depth_3: float) -> tuple[list, list]:
    """Two greedy requests under the goodput policy, each alone and both in one batch of 2 whose
    step drafting 3 levels costs `batch_seconds_at_depth_3` plain steps (alone: 1.1)."""
    target = tiny_target("llava")
    drafter = EagleDrafter.random_init(target, TreeConfig(depth=3, top_k=2, total_tokens=6), seed=1)
    cost = BatchCost(((1, CostModel.fit({0: 1.0, 3: 1.1})), (2, CostModel.fit({0: 1.0, 3: batch_seconds_at_depth_3}))))
    engine = SpecEngine(target, drafter, Speculation("goodput", cost.by_size[0][1], cost))
    texts = ["once upon a time", "the quick brown fox jumps over"]
    requests = [(encode_prompt(target, t), GenerationConfig(max_new_tokens=10, ignore_eos=True)) for t in texts]
    alone = [engine.generate(i, c) for i, c in requests]
    together = engine.generate_many(requests, slots=2)
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert all(max(r.depths) > 0 for r in alone)  # alone, drafting looks cheap: it drafts
    return alone, together


def test_a_batch_under_a_cost_that_says_drafting_never_pays_decodes_plainly_and_losslessly():
    _, together = _alone_and_together(50.0)
    assert all(set(r.depths) == {0} for r in together)  # two rows at 50x the price: never


def test_goodput_rows_of_a_batch_draft_chains_and_answer_as_alone():
    """Under a batch cost where drafting pays, two goodput rows draft in the batch, one node per
    level (drafted nodes = levels reached), and answer what each answers alone, where its tree
    branches (negative control)."""
    alone, together = _alone_and_together(1.05)
    for r in together:
        assert 0 < r.stats.num_draft_tokens == sum(r.stats.reached_per_pos)
    assert all(r.stats.num_draft_tokens > sum(r.stats.reached_per_pos) for r in alone)


@pytest.mark.parametrize("stop_threshold", [0.0, 0.999])
def test_the_batch_cost_files_each_step_under_the_depth_it_really_drafted(stop_threshold):
    """A stop rule that ends every chain after its first level: the batch cost's table stops at
    depth 1 though depths up to 3 were asked for (and a line extends it); without the rule
    (negative control) the chains reach depth 3 and so does the table."""
    from vlmspec.policy.cost import measure_batch_cost
    from vlmspec.draft.eagle import EagleConfig, build_head

    target = tiny_target("llava")
    cfg = EagleConfig.from_target(target, "eagle1")
    cfg.acceptance_head = True
    torch.manual_seed(0)
    head = build_head(cfg, target.input_embeddings(), target.output_embeddings()).to(target.device, target.dtype)
    engine = SpecEngine(target, EagleDrafter(head, TreeConfig(depth=3, top_k=2, total_tokens=6), stop_threshold=stop_threshold))
    cost = measure_batch_cost(engine, encode_prompt(target, "once upon a time"), (2,), tokens=8, repeats=1, single=B1)
    assert len(cost.by_size[1][1].by_depth) == (1 if stop_threshold else 3)


def test_the_batch_cost_takes_its_depths_in_turn_step_by_step(monkeypatch):
    """The depths of a batch size are measured alternating, one step each, in one batch: a slow
    stretch of the machine falls on every depth alike. Every step of the measurement drafts the
    depth its turn says, and a slow-down of the last third of the steps (another process, say)
    leaves every depth's lower-quartile seconds where they were; the negative control is the same
    slow-down on one depth's steps only, which moves that depth (and the deeper ones: a table
    never falls with depth)."""
    from vlmspec.policy import cost as cost_module
    from vlmspec.engine import Batch

    target = tiny_target("llava")
    engine = SpecEngine(target, EagleDrafter.random_init(target, TreeConfig(depth=3, top_k=2, total_tokens=6), seed=1))
    real_step, clock = Batch.step, [0.0]
    seen: list[int] = []

    def timed(slow):
        def step(self):
            events = real_step(self)
            depth = max(e.depth for _, e in events)
            seen.append(depth)
            clock[0] += (1.0 + depth) * (3.0 if slow(len(seen), depth) else 1.0)  # seconds a step "takes"
            return events
        return step

    monkeypatch.setattr(cost_module.time, "perf_counter", lambda: clock[0])
    tables = []
    for slow in (lambda n, d: n > 9, lambda n, d: d == 2):
        seen.clear()
        monkeypatch.setattr(Batch, "step", timed(slow))
        cost = cost_module.measure_batch_cost(engine, encode_prompt(target, "once upon a time"), (2,), tokens=3, repeats=1, single=B1)
        assert seen == [0] + [1, 2, 3, 0] * 3  # the prefills' step (its round a plain one), then each depth in turn
        tables.append(cost.by_size[1][1])
    assert [tables[0].seconds(d) for d in range(4)] == [1.0, 2.0, 3.0, 4.0]
    assert [tables[1].seconds(d) for d in range(4)] == [1.0, 2.0, 9.0, 9.0]  # (a table never falls with depth)


def test_the_cost_model_is_measured_once_and_measured_again_when_the_model_drafter_dtype_or_attention_changes(tmp_path, monkeypatch):
    from vlmspec.policy import cost as cost_module

    calls, logs = [], []
    real = cost_module.measure_cost

    def counting(engine, inputs, *args, **kwargs):
        calls.append(engine)
        return real(engine, inputs, depths=(0, 1), tokens=4, repeats=1)

    monkeypatch.setattr(cost_module, "measure_cost", counting)
    target = tiny_target("llava")
    tree = TreeConfig(depth=2, top_k=2, total_tokens=4)
    engine = SpecEngine(target, EagleDrafter.random_init(target, tree, seed=1))
    first = measured_costs(engine, (2,), cache_dir=tmp_path, log=logs.append)
    assert len(calls) == 1 and any("measuring" in m for m in logs) and any("measured in" in m for m in logs)
    again = measured_costs(engine, (2,), cache_dir=tmp_path, log=logs.append)
    assert len(calls) == 1 and again == first  # read back, not measured
    other = SpecEngine(target, EagleDrafter.random_init(target, tree, seed=2))  # same folder-less name, other weights
    measured_costs(other, (2,), cache_dir=tmp_path, log=logs.append)
    assert len(calls) == 2
    model, processor = tiny_target("llava").model, tiny_target("llava").processor
    from vlmspec.target import Target

    bf16 = Target(type(model)._from_config(model.config, dtype=torch.bfloat16).eval(), processor, name=target.name)
    bf16.model.load_state_dict({k: v.to(torch.bfloat16) for k, v in model.state_dict().items()})
    measured_costs(SpecEngine(bf16, EagleDrafter.random_init(bf16, tree, seed=1)), (2,), cache_dir=tmp_path, log=logs.append)
    assert len(calls) == 3
    measured_costs(engine, (2, 4), cache_dir=tmp_path, log=logs.append)  # other batch sizes: measured for them
    assert len(calls) == 4
    from vlmspec.target import set_attention

    set_attention(target.model, "sdpa")  # transformers' own attention: other costs, measured for it
    try:
        measured_costs(engine, (2,), cache_dir=tmp_path, log=logs.append)
    finally:
        set_attention(target.model, "auto")
    assert len(calls) == 5
    assert len(list(tmp_path.glob("cost-*.json"))) == 5


# ms per step by depth (0: plain) of the default model's batched table, bf16, as measured today on this
# CPU: once on a quiet machine, once while the test suite ran beside it (the 4-row steps slower than
# the 8-row ones, a 2-row step drafting 4 levels at 487 ms)
QUIET = {2: [34.0, 39.5, 42.1, 46.5, 49.6, 55.9], 4: [34.8, 41.0, 45.2, 50.2, 56.2, 62.9],
         8: [37.7, 46.8, 53.5, 58.8, 72.5, 83.5], 16: [45.0, 59.1, 68.3, 78.8]}
BUSY = {2: [34.4, 39.0, 42.4, 45.3, 486.6, 486.6], 4: [102.5, 118.4, 145.1, 189.6, 579.8, 579.8],
        8: [41.4, 52.3, 59.5, 67.5, 93.6, 93.6], 16: [47.1, 60.7, 72.3, 86.9]}


def _table(ms: dict[int, list[float]]) -> BatchCost:
    return BatchCost(((1, B1), *((b, CostModel.fit({d: t / 1e3 for d, t in enumerate(row)})) for b, row in ms.items())))


def test_a_table_measured_while_the_machine_was_busy_is_implausible():
    from vlmspec.policy.cost import implausible

    assert implausible(_table(QUIET)) == [] and implausible(None) == []
    found = implausible(_table(BUSY))
    assert "a step of 2 rows drafting 4 levels measured 486.6 ms, one of 8 rows 93.6 ms" in found, found
    assert "a step of 4 rows drafting 0 levels measured 102.5 ms, one of 8 rows 41.4 ms" in found


def test_an_implausible_table_is_measured_again_and_kept_only_once_plausible(tmp_path, monkeypatch):
    from vlmspec.policy import cost as cost_module

    tables, logs = [], []
    monkeypatch.setattr(cost_module, "measure_cost", lambda engine, inputs, *a, **k: B1)
    monkeypatch.setattr(cost_module, "measure_batch_cost", lambda engine, inputs, sizes, single=None: tables.pop(0))
    target = tiny_target("llava")
    engine = SpecEngine(target, EagleDrafter.random_init(target, TreeConfig(depth=2, top_k=2, total_tokens=4), seed=1))
    sizes = (2, 4, 8, 16)
    tables += [_table(BUSY), _table(QUIET)]  # busy, then quiet: measured twice, the quiet one kept
    assert measured_costs(engine, sizes, cache_dir=tmp_path, log=logs.append)[1] == _table(QUIET)
    assert any("measuring again" in m for m in logs) and not tables
    assert measured_costs(engine, sizes, cache_dir=tmp_path, log=logs.append)[1] == _table(QUIET)  # read back
    for f in tmp_path.glob("cost-*.json"):
        f.unlink()
    tables += [_table(BUSY), _table(BUSY)]  # busy twice: used for this run, not kept
    assert measured_costs(engine, sizes, cache_dir=tmp_path, log=logs.append)[1] == _table(BUSY)
    assert "not kept" in logs[-1] and not list(tmp_path.glob("cost-*.json"))
    tables += [_table(QUIET)]  # so the next start measures again
    assert measured_costs(engine, sizes, cache_dir=tmp_path, log=logs.append)[1] == _table(QUIET) and not tables
    kept = next(tmp_path.glob("cost-*.json"))  # a busy table kept by an older version is not read back either
    kept.write_text(kept.read_text().replace(str(_table(QUIET).by_size[2][1].step_s), str(_table(BUSY).by_size[2][1].step_s)))
    tables += [_table(QUIET)]
    assert measured_costs(engine, sizes, cache_dir=tmp_path, log=logs.append)[1] == _table(QUIET) and not tables
    assert any("is implausible" in m for m in logs)
