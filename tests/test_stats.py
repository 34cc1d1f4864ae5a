"""Tier 1: speculation counters and the figures derived from them."""
import pytest

from vlmspec.stats import SpecStats, rotated


def test_counters_and_derived_figures():
    s = SpecStats()
    s.observe(num_drafted=10, num_accepted=3, tree_depth=5)  # 4 tokens from this forward
    s.observe(num_drafted=8, num_accepted=0, tree_depth=2)  # 1 token
    s.observe(num_drafted=0, num_accepted=0, tree_depth=0)  # root only: plain step
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (3, 18, 3)
    assert s.reached_per_pos == [2, 2, 1, 1, 1] and s.accepted_per_pos == [1, 1, 1, 0, 0]
    assert s.mean_accepted_length == pytest.approx((3 + 3) / 3)
    assert s.acceptance_by_position == [0.5, 0.5, 1.0, 0.0, 0.0]


def test_merging_equals_observing_everything_in_one():
    steps = [(12, 4, 5), (3, 1, 3), (0, 0, 0), (16, 5, 7), (9, 0, 4)]
    one, parts = SpecStats(), [SpecStats(), SpecStats()]
    for i, step in enumerate(steps):
        one.observe(*step)
        parts[i % 2].observe(*step)
    merged = SpecStats()
    merged += parts[0]
    merged += parts[1]
    assert merged == one and merged.to_dict() == one.to_dict()


def test_plain_decoding_has_tau_one_and_no_positions():
    s = SpecStats()
    for _ in range(7):
        s.observe(0, 0, 0)
    assert s.mean_accepted_length == 1.0 and s.acceptance_by_position == [] and s.num_emitted_tokens == 7
    assert SpecStats().mean_accepted_length == 1.0


def test_impossible_observation_is_refused():
    with pytest.raises(AssertionError):
        SpecStats().observe(num_drafted=2, num_accepted=3, tree_depth=3)


def test_geometric_mean_and_its_bootstrap_interval():
    import math

    from vlmspec.stats import bootstrap_geomean, geomean

    assert geomean([1.0, 4.0]) == 2.0 and math.isnan(geomean([]))
    xs = [0.9, 1.0, 1.1, 1.05, 0.95, 1.2, 0.85, 1.0]
    lo, hi = bootstrap_geomean(xs)
    assert min(xs) <= lo <= geomean(xs) <= hi <= max(xs)
    assert bootstrap_geomean(xs) == (lo, hi)  # seeded
    assert bootstrap_geomean([1.0] * 5) == (1.0, 1.0)  # no spread, no interval


def test_rotated_gives_every_method_each_place_in_turn():
    ways = ("plain", "fixed", "goodput")
    assert rotated(ways, 0) == list(ways) and rotated(ways, 1) == ["fixed", "goodput", "plain"] and rotated(ways, 4) == rotated(ways, 1)
    assert {rotated(ways, k)[0] for k in range(3)} == set(ways)  # over a full cycle each goes first once


def test_one_beta_prior_acceptance_estimate_for_the_controller_and_self_speculation():
    """The posterior mean under a Beta prior: the prior mean before any observation, the observed
    rate once the counts outweigh the prior; the goodput controller and self-speculation read it."""
    from types import SimpleNamespace

    from vlmspec.policy.control import CostModel, GoodputPolicy
    from vlmspec.draft.self_spec import SelfSpecConfig, _ExitStats, _SelfSession
    from vlmspec.stats import posterior_acceptance

    assert posterior_acceptance(0.0, 0.0, 0.8, 2.0) == 0.8
    assert posterior_acceptance(3.0, 4.0, 0.8, 2.0) == pytest.approx((3 + 1.6) / 6)
    assert posterior_acceptance(30.0, 40.0, 0.8, 1e-9) == pytest.approx(0.75)
    ctl = GoodputPolicy(CostModel(step_s=1.0), prior_accept=0.8, prior_weight=2.0).start()
    ctl.observe(2, 1)  # depth 1 accepted, depth 2 rejected
    a1 = posterior_acceptance(1.0, 1.0, 0.8, 2.0)
    assert ctl.accept_rates(2) == [a1, posterior_acceptance(0.0, 1.0, a1, 2.0)]
    session = SimpleNamespace(drafter=SimpleNamespace(config=SelfSpecConfig(prior_accept=0.6, prior_weight=2.0)),
                              stats={4: _ExitStats(drafted=3.0, accepted=2.0)})
    assert _SelfSession.accept_rate(session, 4) == posterior_acceptance(2.0, 3.0, 0.6, 2.0) == pytest.approx(3.2 / 5)
