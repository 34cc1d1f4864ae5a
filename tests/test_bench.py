"""vlmspec bench: the harness runs end to end on a tiny random model and its JSON has the documented keys."""
import json

import pytest

from vlmspec.cli import main
from vlmspec.target import load_target

KEYS = ("tokens_per_s", "speedup_vs_hf_generate", "speedup_vs_vlmspec_plain", "mean_accepted_length", "matches_reference")


def test_bench_end_to_end_tiny(tmp_path, capsys):
    from testing.tiny import build_tiny

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
    assert {"hf_generate", "hf_prompt_lookup", "vlmspec_plain", "vlmspec_ngram", "vlmspec_eagle"} <= set(report["methods"])
    for name, m in report["methods"].items():
        for key in KEYS:
            assert key in m, (name, key)
        if not m["error"]:
            assert m["status"] == "ok" and m["tokens_per_s"] > 0
        else:  # #22: an unavailable method is n/a with its reason, never a 0.00x a consumer could misread
            assert m["status"] == "n/a" and m["reason"] and m["tokens_per_s"] is None and m["speedup_vs_hf_generate"] is None
    for name in ("vlmspec_plain", "vlmspec_ngram", "vlmspec_eagle"):
        assert report["methods"][name]["matches_reference"] is True, name
    assert report["methods"]["hf_generate"]["speedup_vs_hf_generate"] == 1.0
    # per verify forward: the plain step is the unit a drafter's per-tree cost is read in
    none, eagle = report["methods"]["vlmspec_plain"], report["methods"]["vlmspec_eagle"]
    assert report["methods"]["hf_generate"]["per_step_ms"] is None and none["per_step_ms"]["verify"] > 0
    assert eagle["draft_per_step_vs_target_step"] == eagle["per_step_ms"]["draft"] / none["per_step_ms"]["verify"] > 0
    for key in ("device", "dtype", "threads", "torch", "transformers"):
        assert key in report["env"]
    table = (out / "results.md").read_text()
    assert table.startswith("device:")
    assert "warning: 2 measured generations per method" in table  # -n 2: the table says it is noise
    assert "| error" not in table
    assert (out / "results.png").stat().st_size > 0


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


def test_bench_prompt_sets_name_image_and_text_only_held_out_prompts():
    from vlmspec.bench.harness import load_prompts
    from vlmspec.data.heldout import TEXT_PROMPTS

    text = load_prompts("text", 3)
    assert [c.prompt for c in text] == list(TEXT_PROMPTS[:3]) and all(not c.images for c in text)
    assert all(c.images for c in load_prompts("test", 3))  # the ToyWorld set carries its images


def test_verify_cost_times_trees_and_the_lm_head_cut_to_each_draft_vocabulary():
    from vlmspec.bench.verify_cost import VerifyCostOptions, format_table, measure

    report = measure(VerifyCostOptions(shape="bundled", layers=1, device="cpu", prefix=8, sizes=(1, 4), repeats=2, warmup=0,
                                       draft_vocab=(64, 10**6)))
    assert [r["tree_tokens"] for r in report["rows"]] == [1, 4] and report["rows"][0]["ratio_vs_first"] == 1.0
    # K beyond the vocabulary is the full head (the bundled shape's 1,015 tokens), at 1 and 4 rows each
    assert [(h["draft_vocab"], h["rows"]) for h in report["lm_head"]] == [(64, 1), (64, 4), (1015, 1), (1015, 4)]
    assert all(h["ms"] > 0 and h["x_step"] == h["ms"] / report["rows"][0]["ms"] for h in report["lm_head"])
    assert "| 1015 | 4 |" in format_table(report)


def test_verify_cost_times_rows_padded_and_laid_end_to_end_where_the_target_takes_them():
    """`--rows`: a tiny VLM with the CPU's attention times one batched forward both ways; the
    synthetic shapes run transformers' SDPA, which cannot take rows laid end to end: a clear error."""
    import pytest

    from conftest import tiny_target
    from vlmspec.bench.verify_cost import VerifyCostOptions, measure
    from vlmspec.errors import ConfigError
    from vlmspec.target.timing import time_ragged_forward

    times = time_ragged_forward(tiny_target("llava"), prefix=6, sizes=[1, 1, 5], repeats=2, warmup=0)
    assert set(times) == {"padded", "laid end to end"} and min(times.values()) > 0
    with pytest.raises(ConfigError, match="--model DIR --dtype bfloat16 on a CPU"):
        measure(VerifyCostOptions(shape="bundled", layers=1, device="cpu", prefix=8, sizes=(1,), repeats=1, warmup=0, rows=(1, 3)))


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


def test_bf16_divergences_at_near_ties_are_reported_not_failed_and_fp32_ones_fail():
    """`vlmspec bench run` exits 1 on `mismatched`: in bf16 only for a divergence that is not at a near-tie;
    in fp32 for any. Constructed reports (the measured margins come from `divergence`, tested above)."""
    from vlmspec.bench.harness import mismatched, near_tie_divergences

    def report(dtype, *near):
        methods = {"hf_generate": {"matches_reference": True, "divergences": []},
                   "vlmspec_plain": {"matches_reference": True, "divergences": []},
                   "vlmspec_eagle": {"matches_reference": not near, "divergences": [{"near_tie": t} for t in near]}}
        return {"env": {"dtype": dtype}, "methods": methods}

    assert mismatched(report("torch.bfloat16", True, True)) == []
    assert near_tie_divergences(report("torch.bfloat16", True, True)) == {"vlmspec_eagle": 2}
    assert mismatched(report("torch.bfloat16", True, False)) == ["vlmspec_eagle"]  # one not at a near-tie
    assert mismatched(report("torch.float32", True)) == ["vlmspec_eagle"]  # fp32 is exact: a near-tie is no excuse
    assert mismatched(report("torch.bfloat16")) == [] and near_tie_divergences(report("torch.bfloat16")) == {}


def test_bench_batch_runs_every_size_and_way_and_finds_batched_answers_equal(tmp_path):
    """vlmspec bench batch on a tiny model (fp32): every (B, way) cell, each batched answer compared
    with its batch-1 run (all equal), the per-step timings and the goal ratios in the table."""
    from conftest import tiny_target
    from vlmspec.bench import batch as bench_batch
    from vlmspec.draft.base import TreeConfig
    from vlmspec.draft.eagle import EagleDrafter

    target = tiny_target("llava")
    drafter = EagleDrafter.random_init(target, TreeConfig(depth=3, top_k=2, total_tokens=6), seed=1)
    opts = bench_batch.BatchBenchOptions(sizes=(1, 3), trees=(4,), max_new_tokens=6, repeats=1)
    report = bench_batch.measure(target, drafter, opts, progress=False)
    cells = {(c["batch"], c["way"]): c for c in report["cells"]}
    assert set(cells) == {(b, w) for b in (1, 3) for w in ("plain", "eagle 4 nodes")}
    for c in cells.values():
        assert c["mismatched"] == 0 and c["requests"] == c["batch"] and c["tokens_per_s"] > 0
        assert 0 < c["step_ms"]["median"] <= c["step_ms"]["max"] and c["rounds"] >= 1
    table = bench_batch.markdown(report)
    assert "B=3 best tree (eagle 4 nodes) / B=1 speculative" in table and "| 3 | plain |" in table
    bench_batch.plot(report, tmp_path / "batch.png")
    assert (tmp_path / "batch.png").stat().st_size > 0


def test_bench_batch_report_of_a_sweep_without_batch_1():
    """`--sizes 8,16` measures no B = 1 cell: the table keeps the ratio over batched plain decoding
    and leaves out the one over the batch-1 engine (it raised KeyError at the end of the run)."""
    from vlmspec.bench import batch as bench_batch

    cell = lambda b, way, tps: {"batch": b, "way": way, "tokens_per_s": tps}  # noqa: E731
    report = {"cells": [cell(8, "plain", 100.0), cell(8, "eagle 2 nodes", 110.0), cell(16, "plain", 150.0), cell(16, "eagle 2 nodes", 140.0)]}
    assert bench_batch.ratios(report) == {"B=8 best tree / B=8 plain": pytest.approx(1.1)}
    report["cells"] += [cell(1, "plain", 20.0), cell(1, "eagle 2 nodes", 30.0)]  # with B = 1 (control): both ratios
    assert bench_batch.ratios(report)["B=8 best tree (eagle 2 nodes) / B=1 speculative"] == pytest.approx(110.0 / 30.0)
