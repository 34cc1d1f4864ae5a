"""vlmspec bench: the harness runs end to end on a tiny random model and its JSON has the documented keys."""
import json

from vlmspec.cli import main

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

    EagleDrafter.random_init(Target.load(model_dir)).save(tmp_path / "drafter")
    out = tmp_path / "out"
    code = main(["bench", "--model", str(model_dir), "--drafter", str(tmp_path / "drafter"), "-n", "2", "--max-new-tokens", "12", "--warmup", "0", "--out", str(out)])
    assert code == 0, capsys.readouterr().out
    report = json.loads((out / "results.json").read_text())
    assert {"hf_generate", "hf_prompt_lookup", "vlmspec_none", "vlmspec_ngram", "vlmspec_eagle"} <= set(report["methods"])
    for name, m in report["methods"].items():
        for key in KEYS:
            assert key in m, (name, key)
        if not m["error"]:
            assert m["tokens_per_s"] > 0
    for name in ("vlmspec_none", "vlmspec_ngram", "vlmspec_eagle"):
        assert report["methods"][name]["matches_reference"] is True, name
    assert report["methods"]["hf_generate"]["speedup_vs_hf_generate"] == 1.0
    for key in ("device", "dtype", "threads", "torch", "transformers"):
        assert key in report["env"]
    assert (out / "results.md").read_text().startswith("device:")
    assert (out / "results.png").stat().st_size > 0


def test_ablation_runs_end_to_end_tiny(tmp_path, capsys):
    """`vlmspec bench ablate` trains each chosen variant, measures it, writes md / json / png."""
    from vlmspec.bench.ablation import suite
    from vlmspec.testing.tiny import build_tiny

    assert len(suite("loss")) == 6 and len(suite("vision")) == 15
    model_dir = tmp_path / "model"
    model, processor = build_tiny("llava")
    model.save_pretrained(model_dir)
    processor.save_pretrained(model_dir)
    out = tmp_path / "report"
    only = ["plain", "pool@16x"]
    args = ["bench", "ablate", "--suite", "vision", "--model", str(model_dir), "--steps", "2", "--n", "1",
            "--max-new-tokens", "8", "--out", str(out), "--runs", str(tmp_path / "runs")]
    for name in only:
        args += ["--only", name]
    assert main(args) == 0, capsys.readouterr().out
    report = json.loads((out / "ablation.json").read_text())
    assert [r["variant"] for r in report["rows"]] == only
    for r in report["rows"]:
        assert r["tau_t0"] >= 1.0 and r["tau_t1"] >= 1.0 and r["drafter_prefill_ms"] > 0 and r["speedup_t0"] > 0
    assert (out / "ablation.png").stat().st_size > 0
    assert "| plain |" in (out / "ablation.md").read_text()
