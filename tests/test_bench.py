"""vlmspec bench: the harness runs end to end on a tiny random model and its JSON has the documented keys."""
import json

from vlmspec.cli import main
from vlmspec.target import load_target

KEYS = ("tokens_per_s", "speedup_vs_hf_generate", "speedup_vs_vlmspec_none", "mean_accepted_length", "matches_reference")


def test_bench_end_to_end_tiny(tmp_path, capsys):
    from vlmspec.testing.tiny import build_tiny

    model_dir = tmp_path / "model"
    model, processor = build_tiny("llava")
    model.save_pretrained(model_dir)
    processor.save_pretrained(model_dir)
    # a tiny random drafter folder stands in for a trained one
    from vlmspec.draft.eagle import EagleDrafter
    from vlmspec.target import Target

    EagleDrafter.random_init(load_target(model_dir)).save(tmp_path / "drafter")
    out = tmp_path / "out"
    code = main(["bench", "--model", str(model_dir), "--drafter", str(tmp_path / "drafter"), "-n", "2", "--max-new-tokens", "12", "--warmup", "0", "--out", str(out)])
    assert code == 0, capsys.readouterr().out
    report = json.loads((out / "results.json").read_text())
    assert {"hf_generate", "hf_prompt_lookup", "vlmspec_none", "vlmspec_ngram", "vlmspec_eagle"} <= set(report["methods"])
    for name, m in report["methods"].items():
        for key in KEYS:
            assert key in m, (name, key)
        if not m["error"]:
            assert m["status"] == "ok" and m["tokens_per_s"] > 0
        else:  # #22: an unavailable method is n/a with its reason, never a 0.00x a consumer could misread
            assert m["status"] == "n/a" and m["reason"] and m["tokens_per_s"] is None and m["speedup_vs_hf_generate"] is None
    for name in ("vlmspec_none", "vlmspec_ngram", "vlmspec_eagle"):
        assert report["methods"][name]["matches_reference"] is True, name
    assert report["methods"]["hf_generate"]["speedup_vs_hf_generate"] == 1.0
    # per verify forward: the plain step is the unit a drafter's per-tree cost is read in
    none, eagle = report["methods"]["vlmspec_none"], report["methods"]["vlmspec_eagle"]
    assert report["methods"]["hf_generate"]["per_step_ms"] is None and none["per_step_ms"]["verify"] > 0
    assert eagle["draft_per_step_vs_target_step"] == eagle["per_step_ms"]["draft"] / none["per_step_ms"]["verify"] > 0
    for key in ("device", "dtype", "threads", "torch", "transformers"):
        assert key in report["env"]
    table = (out / "results.md").read_text()
    assert table.startswith("device:")
    assert "warning: 2 measured generations per method" in table  # -n 2: the table says it is noise
    assert "| error" not in table
    assert (out / "results.png").stat().st_size > 0


def test_ablation_runs_end_to_end_tiny(tmp_path, capsys, monkeypatch):
    """`vlmspec bench ablate` trains each chosen variant, measures it, writes md / json / png."""
    from vlmspec.bench import ablation
    from vlmspec.bench.ablation import PARTIAL, suite
    from vlmspec.testing.tiny import build_tiny

    assert len(suite("loss")) == 6 and len(suite("vision")) == 15
    model_dir = tmp_path / "model"
    model, processor = build_tiny("llava")
    model.save_pretrained(model_dir)
    processor.save_pretrained(model_dir)
    out = tmp_path / "report"
    only = ["plain", "pool@16x"]
    args = ["bench", "ablate", "--suite", "vision", "--model", str(model_dir), "--steps", "2", "--n", "1", "--n-select", "1",
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
    from vlmspec.bench.ablation import bootstrap_tau, vision_goals

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

    from vlmspec.bench.ablation import TEACHER, finished_run
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


def test_divergences_are_located_and_their_top2_margin_measured_in_ulps():
    import torch

    from vlmspec.bench.harness import NEAR_TIE_ULPS, first_divergence, top2_margin_ulps

    assert first_divergence([1, 2, 3], [1, 2, 4]) == 2
    assert first_divergence([1, 2, 3], [1, 2]) == 2 and first_divergence([5], [6]) == 0
    # top-1 at 8.0: one bf16 ulp there is 2^(3-7) = 1/16
    tie = torch.tensor([8.0, 8.0 - 2 / 16, 1.0])
    margin, ulps = top2_margin_ulps(tie, torch.bfloat16)
    assert margin == 0.125 and ulps == 2.0 and ulps <= NEAR_TIE_ULPS
    clear = torch.tensor([8.0, 6.0, 1.0])  # negative control: 2.0 apart is 32 ulps, no tie
    assert top2_margin_ulps(clear, torch.bfloat16)[1] == 32.0 > NEAR_TIE_ULPS
    assert top2_margin_ulps(tie, torch.float32)[1] == 0.125 * 2 ** 20  # fp32's ulp at 8 is 2^-20


def test_adversarial_sets_are_what_they_say():
    from conftest import tiny_target
    from vlmspec.data.heldout import PHOTO_QUESTIONS, TEXT_PROMPTS, adversarial

    import pytest

    tok = tiny_target("llava").processor.tokenizer
    photos = adversarial("photo_unknown", 3)
    assert [c.prompt for c in photos] == list(PHOTO_QUESTIONS[:3]) and all(len(c.images) == 1 for c in photos)
    assert len({c.images[0].size for c in photos}) > 1  # different photographs in turn
    rand = adversarial("random_tokens", 2, tok, seed=4)
    assert rand[0].prompt != rand[1].prompt and not rand[0].images and rand == adversarial("random_tokens", 2, tok, seed=4)
    assert [c.prompt for c in adversarial("unseen_text", 2)] == list(TEXT_PROMPTS[:2])
    with pytest.raises(ValueError, match="tokenizer"):
        adversarial("random_tokens", 1)
    with pytest.raises(ValueError, match="unknown adversarial"):
        adversarial("nonsense", 1)


def test_bench_adaptive_times_the_three_ways_per_category(tmp_path):
    from conftest import tiny_target
    from vlmspec.bench.adaptive import WAYS, categories, format_table, measure
    from vlmspec.draft.base import TreeConfig
    from vlmspec.draft.ngram import NgramDrafter
    from vlmspec.engine import SpecEngine

    target = tiny_target("llava")
    engine = SpecEngine(target, NgramDrafter(TreeConfig(depth=3, top_k=2, total_tokens=6)))
    cats = categories(target, 1)
    assert set(cats) == {"in_domain", "photo_unknown", "random_tokens", "unseen_text"}
    report = measure(engine, cats, temperatures=(0.0, 1.5), max_new_tokens=6, repeats=1, progress=False)
    assert len(report["rows"]) == 4 * 2 and all(r[f"{w}_s"] > 0 for r in report["rows"] for w in WAYS)
    assert {(s["category"], s["temperature"]) for s in report["summary"]} == {(c, t) for c in cats for t in (0.0, 1.5)}
    for s in report["summary"]:
        assert s["goodput_vs_plain_worst"] <= s["goodput_vs_plain"] * (1 + 1e-9) and sum(s["depths"].values()) > 0
    table = format_table(report)
    assert all(c in table for c in cats) and report["cost_model"]["step_s"] > 0


def test_bench_stop_head_times_the_five_ways_and_counts_what_the_rule_saves():
    import torch

    from conftest import tiny_target
    from vlmspec.bench.stop_head import WAYS, format_table, measure
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


def test_bench_prompt_sets_name_image_and_text_only_held_out_prompts():
    from vlmspec.bench.harness import load_prompts
    from vlmspec.data.heldout import TEXT_PROMPTS

    text = load_prompts("text", 3)
    assert [c.prompt for c in text] == list(TEXT_PROMPTS[:3]) and all(not c.images for c in text)
    assert all(c.images for c in load_prompts("test", 3))  # the ToyWorld set carries its images


def test_bench_trees_times_each_shape_against_plain_on_the_same_answers():
    import torch

    from conftest import tiny_target
    from vlmspec.bench.trees import format_table, measure, parse_shape
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

    from vlmspec.bench.trees import parse_shape

    for bad in ("5,4", "a,b,c", "5,0,16"):
        with pytest.raises(ValueError):
            parse_shape(bad)


def test_verify_cost_times_trees_and_the_lm_head_cut_to_each_draft_vocabulary():
    from vlmspec.bench.verify_cost import VerifyCostOptions, format_table, measure

    report = measure(VerifyCostOptions(shape="bundled", layers=1, device="cpu", prefix=8, sizes=(1, 4), repeats=2, warmup=0,
                                       draft_vocab=(64, 10**6)))
    assert [r["tree_tokens"] for r in report["rows"]] == [1, 4] and report["rows"][0]["ratio_vs_first"] == 1.0
    # K beyond the vocabulary is the full head (the bundled shape's 1,015 tokens), at 1 and 4 rows each
    assert [(h["draft_vocab"], h["rows"]) for h in report["lm_head"]] == [(64, 1), (64, 4), (1015, 1), (1015, 4)]
    assert all(h["ms"] > 0 and h["x_step"] == h["ms"] / report["rows"][0]["ms"] for h in report["lm_head"])
    assert "| 1015 | 4 |" in format_table(report)


def test_ablation_variants_train_in_the_targets_answer_style_and_draft_vocabulary(tmp_path, monkeypatch, capsys):
    """`bench ablate --answer-style / --draft-vocab` reach every variant's training config (what the
    shipped drafter of the default model was trained with), and a K past the vocabulary is refused."""
    from vlmspec.bench import ablation

    seen = {}

    def fake_run(target, suite, steps, n, runs, base, *rest, **options):
        seen["base"] = base
        return []

    monkeypatch.setattr(ablation, "run", fake_run)
    monkeypatch.setattr(ablation, "write_report", lambda *a, **k: None)
    (tmp_path / "report").mkdir()
    (tmp_path / "report" / "ablation.md").write_text("")
    common = ["bench", "ablate", "--suite", "vision", "--model", "toy", "--out", str(tmp_path / "report")]
    assert main(common + ["--answer-style", "tally", "--draft-vocab", "64"]) == 0
    assert seen["base"].answer_style == "tally" and seen["base"].draft_vocab == 64
    assert main(common) == 0  # negative control: the defaults are the plain trainer's
    assert seen["base"].answer_style == "short" and seen["base"].draft_vocab == 0
    seen.clear()
    assert main(common + ["--draft-vocab", "100000"]) == 2
    assert "--draft-vocab must be between" in capsys.readouterr().err and not seen


def test_a_bench_json_into_a_folder_not_made_yet_is_written_not_lost(tmp_path):
    from vlmspec.bench.harness import write_json

    path = tmp_path / "new" / "deeper" / "run.json"
    write_json(path, {"tok_s": 1.5})
    assert json.loads(path.read_text()) == {"tok_s": 1.5}


def test_the_ways_runner_rotates_pairs_and_records_a_failing_way():
    """`runner.run_ways`: every way on every item, in an order rotated by item + round; warm-up
    rounds unkept; ratios paired by item and round against the reference; a way raising one of
    `fails` is recorded and skipped from then on (negative control: another exception ends the run)."""
    import pytest

    from vlmspec.bench import runner

    order, seconds = [], {"plain": 0.03, "fast": 0.01}

    def way(name):
        def call(item, rnd):
            order.append((item, rnd, name))
            if name == "broken" and item == 1:
                raise RuntimeError("out of memory\nat line 3")
            runner.time.sleep(seconds.get(name, 0.0))
            return f"{name}:{item}"

        return call

    ways = {w: way(w) for w in ("plain", "fast", "broken")}
    run = runner.run_ways(ways, n_items=2, reference="plain", repeats=2, warmup=1, fails=(RuntimeError,))
    assert [w for i, r, w in order[:3]] == ["plain", "fast", "broken"] and [w for i, r, w in order[3:6]] == ["fast", "broken", "plain"]
    assert [w for i, r, w in order if i == 1] == ["fast", "broken", "plain", "plain", "fast", "plain", "fast"]  # item 1 starts one later
    assert run.errors == {"broken": "RuntimeError: out of memory"}
    assert len(run.of("plain")) == 4 and len(run.of("broken")) == 2 and all(t.repeat in (0, 1) for t in run.runs)
    assert set(run.rounds()) == {(0, 0), (0, 1), (1, 0), (1, 1)} and run.rounds()[(1, 0)]["fast"].result == "fast:1"
    fast = run.paired("fast")
    assert len(fast.ratios) == 4 and 1.2 < fast.geomean < 4.0 and fast.lowest <= fast.median <= fast.highest
    lo, hi = fast.interval()
    assert fast.lowest <= lo <= fast.geomean <= hi <= fast.highest
    assert run.paired("plain").ratios == (1.0,) * 4 and run.paired("fast", keep=lambda i: i == 0).ratios == fast.ratios[:2]
    with pytest.raises(RuntimeError):
        runner.run_ways(ways, n_items=2, reference="plain")
    with pytest.raises(ValueError, match="reference"):
        runner.run_ways(ways, n_items=1, reference="none")
