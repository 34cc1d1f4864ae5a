"""The research suites of recipes/bench (`python -m recipes ablate|adaptive|stop-head|trees`):
each runs end to end on a tiny model, its figures and refusals as when they were `vlmspec bench` commands."""
import json

import pytest

from recipes.__main__ import main


def _help(capsys, *argv):
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--help"])
    assert exc.value.code == 0
    return capsys.readouterr().out


def test_recipes_help_lists_the_research_suites(capsys):
    out = _help(capsys)
    for which in ("ablate", "adaptive", "stop-head", "trees"):
        assert which in out
    assert "--n-select" in _help(capsys, "ablate")
    assert "acceptance head" in _help(capsys, "stop-head")
    assert "D,K,N" in _help(capsys, "trees")


@pytest.mark.slow  # a research suite end to end (recipes, apart from the product): 50 s of CI
def test_ablation_runs_end_to_end_tiny(tmp_path, capsys, monkeypatch):
    """`python -m recipes ablate` trains each chosen variant, measures it, writes md / json / png."""
    from recipes.bench import ablation
    from recipes.bench.ablation import PARTIAL, suite
    from testing.tiny import build_tiny

    assert len(suite("loss")) == 6 and len(suite("vision")) == 15
    model_dir = tmp_path / "model"
    model, processor = build_tiny("llava")
    model.save_pretrained(model_dir)
    processor.save_pretrained(model_dir)
    out = tmp_path / "report"
    only = ["plain", "pool@16x"]
    args = ["ablate", "--suite", "vision", "--model", str(model_dir), "--steps", "2", "--n", "1", "--n-select", "1",
            "--max-new-tokens", "8", "--out", str(out), "--runs", str(tmp_path / "runs"), "--blocks", "2", "--pause", "0"]
    for name in only:
        args += ["--only", name]
    assert main(args) == 0, capsys.readouterr().out
    report = json.loads((out / "ablation.json").read_text())
    assert [r["variant"] for r in report["rows"]] == only
    for r in report["rows"]:
        assert r["tau_t0"] >= 1.0 and r["tau_t1"] >= 1.0 and r["drafter_prefill_ms"] > 0 and r["speedup_t0"] > 0 and r["plain_t0_s"] > 0
        assert r["drafter_prefill_ms_576"] > 0 and r["tau_t0_ci"][0] - 1e-9 <= r["tau_t0"] <= r["tau_t0_ci"][1] + 1e-9
        per = r["per_prompt_t0"]
        assert len(per["emitted"]) == len(per["forwards"]) == 7 and abs(sum(per["emitted"]) / sum(per["forwards"]) - r["tau_t0"]) < 1e-9
        assert len(r["per_prompt_select"]["forwards"]) == 7 and r["tau_select"] >= 1.0  # the val-split selection prompts
    assert report["rows"][0]["prefill_576_vs_plain"] == 1.0 and report["rows"][1]["prefill_576_vs_plain"] > 0
    assert (out / "ablation.png").stat().st_size > 0
    md = (out / "ablation.md").read_text()
    assert "| plain |" in md and "2 blocks of 21 rounds, seconds apart" in md
    assert all(len(r["prefill_576_vs_plain_blocks"]) == 2 for r in report["rows"])
    lo, hi = min(report["rows"][1]["prefill_576_vs_plain_blocks"]), max(report["rows"][1]["prefill_576_vs_plain_blocks"])
    assert f"x cheaper ({lo:.1f}-{hi:.1f})" in md, "the blocks' range beside the pooled ratio"

    # --reuse loads the finished runs instead of retraining them; the measurements are the same
    assert main(args + ["--reuse", "--rounds", "2"]) == 0, capsys.readouterr().out
    again = json.loads((out / "ablation.json").read_text())
    assert [r["reused_run"] for r in report["rows"]] == [False, False] and [r["reused_run"] for r in again["rows"]] == [True, True]
    for a, b in zip(report["rows"], again["rows"]):
        assert a["per_prompt_t0"] == b["per_prompt_t0"] and a["per_prompt_t1"] == b["per_prompt_t1"] and a["train_s"] == b["train_s"]
    assert not (out / PARTIAL).exists(), "a finished suite leaves its report, not the rows so far"

    # interrupted before its report: the rows measured so far are on disk
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(ablation, "prefill_at_scale", interrupted)
    assert main(args + ["--reuse", "--rounds", "2"]) == 130  # Ctrl-C's exit status
    partial = json.loads((out / PARTIAL).read_text())
    assert partial["complete"] is False and [r["per_prompt_t0"] for r in partial["rows"]] == [r["per_prompt_t0"] for r in report["rows"]]


def test_bootstrap_interval_and_vision_goals_on_constructed_rows():
    from recipes.bench.ablation import bootstrap_tau, vision_goals

    same = {"emitted": [50, 40, 60, 55], "forwards": [10, 10, 10, 10]}
    lo, hi = bootstrap_tau([same])
    assert lo <= 5.125 <= hi and 4.0 <= lo and hi <= 6.0
    assert bootstrap_tau([same, same], [1.0, -1.0]) == (0.0, 0.0), "a run against itself differs by exactly 0"
    better = {"emitted": [e + 10 for e in same["emitted"]], "forwards": same["forwards"]}
    lo, hi = bootstrap_tau([better, same], [1.0, -1.0])
    assert lo == hi == 1.0, "a constant per-prompt gain of one token per forward"

    def row(name, t0, t1, ms):
        return {"variant": name, "tau_t0": t0, "tau_t1": t1, "drafter_prefill_ms_576": ms, "per_prompt_t0": same}

    rows = [row("plain", 5.0, 4.8, 10.0), row("pool@16x", 4.9, 4.7, 2.0), row("conv@16x", 4.5, 4.6, 3.0),
            row("pool@4x", 5.1, 4.9, 4.0), row("gate@16x", 5.1, 4.8, 2.5)]
    rows[-1]["gate_picks"] = {"pool": 3, "text_only": 1}
    text = "\n".join(vision_goals(rows))
    assert "pool@16x: accepted length 4.90 / 4.70 at T=0 / T=1 = 98%" in text and "5.0x cheaper in time (goal >= 4x: met)" in text
    assert "conv@16x: accepted length 4.50 / 4.60 at T=0 / T=1 = 90% of the plain head's at worst (goal >= 97%: NOT met)" in text
    assert "3.3x cheaper in time (goal >= 4x: NOT met)" in text and "FLOPs" not in text and "bound" not in text
    # with FLOP counts and a text-only row: FLOPs beside the time, and text-only as the bound
    flops = {"plain": 1.0, "pool@16x": 0.1, "conv@16x": 0.125, "text_only@4x": 0.05}
    bounded = [dict(r, prefill_576_gflop=flops.get(r["variant"])) for r in rows] + [
        dict(row("text_only@4x", 4.9, 4.7, 1.6), prefill_576_gflop=0.05)]
    text = "\n".join(vision_goals(bounded))
    assert "5.0x cheaper in time (goal >= 4x: met), 10.0x fewer FLOPs" in text and "3.3x cheaper in time (goal >= 4x: NOT met), 8.0x fewer FLOPs" in text
    assert "- bound: text_only@4x (no image row at all) is 6.2x cheaper in time (20.0x fewer FLOPs)" in text
    assert ("gate@16x vs the best fixed compressor (pool@4x, picked on the test prompts themselves) at T=0: 5.10 vs 5.10 "
            "(goal: at least as good: met); paired 95% interval of the difference [+0.00, +0.00], so no worse by more than 3% (0.15): met") in text
    assert "the gate picked pool 3x, text_only 1x" in text
    assert "best variant pool@4x (picked on the test prompts themselves) 5.10 vs the plain head 5.00 at T=0 (goal: beats it: met)" in text

    # with selection prompts, the competitors are picked there and compared on the test prompts
    worse = {"emitted": [e - 5 for e in same["emitted"]], "forwards": same["forwards"]}
    for r, sel in zip(rows, (5.0, 4.0, 5.3, 4.1, 4.5)):
        r["tau_select"] = sel
    rows[2]["per_prompt_t0"] = better  # conv@16x: picked on selection, 1 token per forward better on test
    rows[-1]["per_prompt_t0"] = worse  # the gate: 0.5 worse per forward on every test prompt
    text = "\n".join(vision_goals(rows))
    assert "best fixed compressor (conv@16x, picked on the selection prompts) at T=0: 5.10 vs 4.50 (goal: at least as good: met)" in text
    assert "paired 95% interval of the difference [-1.50, -1.50], so no worse by more than 3% (0.14): NOT met" in text
    assert "best variant conv@16x (picked on the selection prompts) 4.50 vs the plain head 5.00" in text
    assert "paired 95% interval of the difference [+1.00, +1.00], above 0: yes" in text


def test_reuse_needs_the_same_steps_config_and_target(tmp_path):
    from dataclasses import asdict

    from recipes.bench.ablation import TEACHER, finished_run
    from vlmspec.train.distill import DistillConfig

    cfg = DistillConfig(steps=7)
    (tmp_path / "drafter").mkdir()
    (tmp_path / "train_summary.json").write_text(json.dumps({"step": 7, "config": asdict(cfg)}))
    assert not finished_run(tmp_path, cfg, "abc"), "no record of the target it was trained on"
    (tmp_path / TEACHER).write_text(json.dumps({"sha256": "abc"}))
    assert finished_run(tmp_path, cfg, "abc")
    assert not finished_run(tmp_path, cfg, "def"), "trained on another target"
    assert not finished_run(tmp_path, DistillConfig(steps=8), "abc"), "another step count"
    assert not finished_run(tmp_path, DistillConfig(steps=7, lr=5e-4), "abc"), "another config"
    older = {k: v for k, v in asdict(cfg).items() if k != "text_style"}  # recorded before DistillConfig had the field
    (tmp_path / "train_summary.json").write_text(json.dumps({"step": 7, "config": older}))
    assert finished_run(tmp_path, cfg, "abc"), "a field added since, at its default, trains as the run did"
    assert not finished_run(tmp_path, DistillConfig(steps=7, text_style="varied"), "abc"), "... and not otherwise"
    # the same for a field VisualConfig gained since (the suite's variants carry their visual dict in full)
    from vlmspec.vision_compress import VisualConfig

    vis = VisualConfig("resampler", 4).to_dict()
    old_vis = {k: v for k, v in vis.items() if k != "max_queries"}
    (tmp_path / "train_summary.json").write_text(json.dumps({"step": 7, "config": {**asdict(cfg), "visual": old_vis}}))
    assert finished_run(tmp_path, DistillConfig(steps=7, visual=vis), "abc"), "max_queries at its default: the run's 64 queries"
    assert not finished_run(tmp_path, DistillConfig(steps=7, visual={**vis, "max_queries": 144}), "abc"), "... and not otherwise"


def test_bench_adaptive_times_the_three_ways_per_category(tmp_path):
    from conftest import tiny_target
    from recipes.bench.adaptive import WAYS, categories, format_table, measure
    from vlmspec.draft.base import TreeConfig
    from vlmspec.draft.ngram import NgramDrafter
    from vlmspec.engine import SpecEngine

    target = tiny_target("llava")
    engine = SpecEngine(target, NgramDrafter(TreeConfig(depth=3, top_k=2, total_tokens=6)))
    cats = categories(target, 2)
    assert set(cats) == {"in_domain", "photo_unknown", "random_tokens", "unseen_text"}
    report = measure(engine, cats, temperatures=(0.0, 1.5), max_new_tokens=6, repeats=3, progress=False)
    assert len(report["rows"]) == 4 * 2 * 2 * 3 and all(r[f"{w}_s"] > 0 for r in report["rows"] for w in WAYS)
    assert {(s["category"], s["temperature"]) for s in report["summary"]} == {(c, t) for c in cats for t in (0.0, 1.5)}
    for s in report["summary"]:
        assert s["goodput_vs_plain_worst"] <= s["goodput_vs_plain"] * (1 + 1e-9) and sum(s["depths"].values()) > 0
        # each prompt's median over its 3 runs: no lower than the worst single run, and the worst prompt's is the least
        assert len(s["goodput_vs_plain_per_prompt"]) == 2 and s["goodput_vs_plain_worst_prompt"] == min(s["goodput_vs_plain_per_prompt"])
        assert s["goodput_vs_plain_worst_prompt"] >= s["goodput_vs_plain_worst"]
    table = format_table(report)
    assert all(c in table for c in cats) and report["cost_model"]["step_s"] > 0
    probe = measure(engine, {"unseen_text": cats["unseen_text"]}, temperatures=(0.0,), max_new_tokens=6, repeats=1, progress=False, no_probe=True)
    assert all(r["goodput-no-probe_s"] > 0 for r in probe["rows"]) and "goodput, no probe / plain" in format_table(probe)


def test_bench_stop_head_times_the_five_ways_and_counts_what_the_rule_saves():
    import torch

    from conftest import tiny_target
    from recipes.bench.stop_head import WAYS, format_table, measure
    from vlmspec.data.heldout import heldout
    from vlmspec.draft.base import TreeConfig
    from vlmspec.draft.eagle import EagleConfig, EagleDrafter, EagleHead
    from vlmspec.engine import SpecEngine

    target = tiny_target("llava")
    cfg = EagleConfig.from_target(target)
    cfg.acceptance_head = True
    torch.manual_seed(0)
    head = EagleHead(cfg, target.input_embeddings(), target.output_embeddings())
    with torch.no_grad():  # predicted rejection everywhere: the rule stops every tree after its first level
        head.accept.mlp[-1].weight.zero_()
        head.accept.mlp[-1].bias.fill_(-6.0)
    tree = TreeConfig(depth=3, top_k=2, total_tokens=6)
    report = measure(SpecEngine(target, EagleDrafter(head, tree, 0.3)), heldout("bench", 1), temperatures=(0.0,),
                     max_new_tokens=12, repeats=1, progress=False)
    assert [r["way"] for r in report["rows"]] == list(WAYS)  # prompt 0, repeat 0: no rotation
    by = {s["way"]: s for s in report["summary"]}
    # at most one level per step (a step near the token limit may draft none), the full tree deeper
    assert by["fixed+stop"]["levels_per_step"] <= 1.0 < by["fixed"]["levels_per_step"]
    assert by["plain"]["vs_plain"] == 1.0 and all(s["tok_s"] > 0 for s in report["summary"])
    assert by["plain"]["drafted_per_accepted"] is None  # nothing drafted: no ratio (and valid JSON, no NaN)
    json.dumps(report, allow_nan=False)
    assert "fixed+stop" in format_table(report)


def test_bench_trees_times_each_shape_against_plain_on_the_same_answers():
    import torch

    from conftest import tiny_target
    from recipes.bench.trees import format_table, measure, parse_shape
    from vlmspec.data.heldout import heldout
    from vlmspec.draft.base import TreeConfig
    from vlmspec.draft.eagle import EagleDrafter
    from vlmspec.engine import SpecEngine

    target = tiny_target("llava")
    torch.manual_seed(0)
    engine = SpecEngine(target, EagleDrafter.random_init(target, TreeConfig(5, 4, 16)))
    shapes = (parse_shape("2,1,2"), parse_shape("3,2,5"))
    report = measure(engine, heldout("bench", 2), shapes, max_new_tokens=10, progress=False)
    assert [r["shape"] for r in report["rows"][:3]] == ["plain", "d2 k1 n2", "d3 k2 n5"]  # prompt 0: no rotation
    assert report["rows"][3]["shape"] == "d2 k1 n2"  # prompt 1 starts one later
    for i in range(2):  # T=0: every shape writes plain decoding's answer, so the times compare
        assert len({r["tokens"] for r in report["rows"] if r["prompt"] == i}) == 1
    by = {s["shape"]: s for s in report["summary"]}
    assert by["plain"]["tau"] == 1.0 and by["plain"]["vs_plain"] == 1.0
    assert all(1.0 <= by[n]["tau"] <= 1 + t.depth for n, t in zip(("d2 k1 n2", "d3 k2 n5"), shapes))
    assert "d3 k2 n5" in format_table(report)


def test_bench_trees_refuses_a_malformed_shape():
    import pytest

    from recipes.bench.trees import parse_shape

    for bad in ("5,4", "a,b,c", "5,0,16"):
        with pytest.raises(ValueError):
            parse_shape(bad)


def test_ablation_variants_train_in_the_targets_answer_style_and_draft_vocabulary(tmp_path, monkeypatch, capsys):
    """`ablate --answer-style / --draft-vocab` reach every variant's training config (what the
    shipped drafter of the default model was trained with), and a K past the vocabulary is refused."""
    from recipes.bench import ablation

    seen = {}

    def fake_run(target, suite, steps, n, runs, base, *rest, **options):
        seen["base"] = base
        return []

    monkeypatch.setattr(ablation, "run", fake_run)
    monkeypatch.setattr(ablation, "write_report", lambda *a, **k: None)
    (tmp_path / "report").mkdir()
    (tmp_path / "report" / "ablation.md").write_text("")
    common = ["ablate", "--suite", "vision", "--model", "toy", "--out", str(tmp_path / "report")]
    assert main(common + ["--answer-style", "tally", "--draft-vocab", "64"]) == 0
    assert seen["base"].answer_style == "tally" and seen["base"].draft_vocab == 64
    assert main(common) == 0  # negative control: the defaults are the plain trainer's
    assert seen["base"].answer_style == "short" and seen["base"].draft_vocab == 0
    seen.clear()
    assert main(common + ["--draft-vocab", "100000"]) == 2
    assert "--draft-vocab must be between" in capsys.readouterr().err and not seen


def test_bench_stop_head_without_an_acceptance_head_is_one_line(capsys, model_dir):
    assert main(["stop-head", "--model", str(model_dir), "--drafter", "ngram"]) == 2
    err = capsys.readouterr().err
    assert "--acceptance-head" in err and "Traceback" not in err


def test_bench_trees_checks_its_shapes_and_needs_a_drafter_that_drafts(capsys, model_dir):
    with pytest.raises(SystemExit) as exc:
        main(["trees", "--model", str(model_dir), "--shape", "5,4"])
    assert exc.value.code == 2 and "DEPTH,TOP_K,TOKENS" in capsys.readouterr().err
    assert main(["trees", "--model", str(model_dir), "--drafter", "none"]) == 2
    err = capsys.readouterr().err
    assert "drafter that drafts" in err and "Traceback" not in err


def test_ablate_validates_its_numbers_like_every_subcommand(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["ablate", "--suite", "vision", "--out", "x", "--pause", "-1"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--pause must be in" in err and "Traceback" not in err


def test_ablate_rejects_an_unknown_variant(capsys, tmp_path):
    assert main(["ablate", "--suite", "loss", "--out", str(tmp_path), "--only", "nope"]) == 2
    assert "is not a variant of the 'loss' suite" in capsys.readouterr().err


def test_the_kernel_timings_live_in_the_recipes_not_in_the_product(capsys):
    """The CPU kernels' timing scripts (#74: no `__main__` timing code in product modules) run as
    `python -m recipes kernels WHICH`; a missing --model is one line."""
    import vlmspec.kernels.packed_linear
    import vlmspec.runtime.onednn
    import vlmspec.target.attention
    import vlmspec.target.packing

    for module in (vlmspec.runtime.onednn, vlmspec.target.attention, vlmspec.target.packing, vlmspec.kernels.packed_linear):
        assert not hasattr(module, "main") and "__main__" not in open(module.__file__).read(), module.__name__
    assert main(["kernels", "packing"]) == 2
    assert "kernels packing needs --model DIR" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["kernels", "--help"])
    assert "packed-linear" in capsys.readouterr().out
