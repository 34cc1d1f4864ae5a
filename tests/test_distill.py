"""vlmspec train: the distillation loss falls, checkpoints round-trip, resume is exact, bad data is reported."""
import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import tiny_target
from vlmspec.draft.eagle import EagleDrafter
from testing.tiny import tiny_image
from vlmspec.train.data import DataError, load_jsonl
from vlmspec.train.distill import DistillConfig, train_drafter
from vlmspec.inputs import encode_prompt


def _cfg(**kw):
    base = dict(steps=8, batch_size=4, lr=3e-3, warmup=2, eval_every=10**6, eval_n=1, ckpt_every=4)
    base.update(kw)
    return DistillConfig(**base)


def _history(out):
    return json.loads((out / "checkpoint" / "trainer_state.json").read_text())["history"]


def test_loss_falls_on_tiny_target(tmp_path):
    target = tiny_target("llava")
    train_drafter(target, "toyworld", tmp_path, _cfg(steps=24, ttt_steps=2), progress=False)
    losses = [h["loss"] for h in _history(tmp_path) if "loss" in h]
    assert len(losses) == 24
    assert sum(losses[-5:]) / 5 < 0.9 * sum(losses[:5]) / 5, losses
    # the exported drafter loads back against the same target
    drafter = EagleDrafter.load(tmp_path / "drafter", target)
    assert drafter.head.config.hidden_size == target.hidden_size
    assert (tmp_path / "train_curve.png").stat().st_size > 0
    summary = json.loads((tmp_path / "train_summary.json").read_text())
    assert summary["step"] == 24 and 0 < summary["elapsed_s"] <= summary["run_wall_s"]  # steps alone vs the whole run


def test_a_trimmed_head_trains_on_the_targets_most_frequent_answer_tokens(tmp_path):
    target = tiny_target("llava")
    train_drafter(target, "toyworld", tmp_path, _cfg(steps=4, draft_vocab=64, draft_vocab_samples=8), progress=False)
    state = json.loads((tmp_path / "checkpoint" / "trainer_state.json").read_text())
    assert state["draft_vocab"]["size"] == 64 and 0.5 < state["draft_vocab"]["coverage"] <= 1.0
    drafter = EagleDrafter.load(tmp_path / "drafter", target)
    d2t = drafter.head.d2t.tolist()
    assert len(d2t) == 64 and set(target.eos_token_ids) <= set(d2t)


def test_init_from_continues_a_trained_drafter_and_refuses_one_of_another_kind(tmp_path):
    target = tiny_target("llava")
    first, cont, fresh = tmp_path / "first", tmp_path / "cont", tmp_path / "fresh"
    train_drafter(target, "toyworld", first, _cfg(steps=4, draft_vocab=64, draft_vocab_samples=8), progress=False)
    trained = load_file(str(first / "drafter" / "model.safetensors"))
    # lr 0: no step moves a weight, so what a run saves is what it started from
    train_drafter(target, "toyworld", cont, _cfg(steps=1, lr=0.0, draft_vocab=64, draft_vocab_samples=8, init_from=str(first / "drafter")), progress=False)
    train_drafter(target, "toyworld", fresh, _cfg(steps=1, lr=0.0, draft_vocab=64, draft_vocab_samples=8, seed=1), progress=False)
    kept, new = load_file(str(cont / "drafter" / "model.safetensors")), load_file(str(fresh / "drafter" / "model.safetensors"))
    assert set(kept) == set(trained)
    assert all(torch.equal(kept[k], trained[k]) for k in trained), "the continued run did not start from the drafter's weights"
    assert not torch.equal(new["fc.weight"], trained["fc.weight"])  # negative control: a fresh head is not that drafter
    assert json.loads((cont / "checkpoint" / "trainer_state.json").read_text())["config"]["init_from"] == str(first / "drafter")
    with pytest.raises(DataError, match="another kind.*draft_vocab_size"):  # a full-vocabulary run cannot start from a trimmed head
        train_drafter(target, "toyworld", tmp_path / "bad", _cfg(steps=1, init_from=str(first / "drafter")), progress=False)


def test_resume_is_exact(tmp_path):
    target = tiny_target("llava")
    straight, split = tmp_path / "straight", tmp_path / "split"
    train_drafter(target, "toyworld", straight, _cfg(), progress=False)
    train_drafter(target, "toyworld", split, _cfg(), progress=False, stop_at=4)
    saved = torch.load(split / "checkpoint" / "optimizer.pt", weights_only=True)
    assert json.loads((split / "checkpoint" / "trainer_state.json").read_text())["step"] == 4
    # resuming restores the optimizer state it saved, then continues from step 4
    train_drafter(target, "toyworld", split, _cfg(), resume=True, progress=False)
    assert [h["step"] for h in _history(split) if "loss" in h] == list(range(8))
    assert saved["state"]  # Adam moments were saved and reloaded
    a = load_file(str(straight / "checkpoint" / "head.safetensors"))
    b = load_file(str(split / "checkpoint" / "head.safetensors"))
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-6), k


def test_bad_jsonl_lines_are_reported_and_skipped(tmp_path):
    tiny_image(0).save(tmp_path / "ok.png")
    (tmp_path / "broken.png").write_bytes(b"\x89PNG not really")
    good = {"images": ["ok.png"], "conversations": [{"from": "human", "value": "<image>\nhi"}, {"from": "gpt", "value": "hello"}]}
    lines = [
        json.dumps(good),
        "{not json",
        json.dumps({"images": ["missing.png"], "conversations": good["conversations"]}),
        json.dumps({"images": ["broken.png"], "conversations": good["conversations"]}),
        json.dumps({"conversations": [{"from": "human", "value": "only a question"}]}),
    ]
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    convs, problems = load_jsonl(path)
    assert len(convs) == 1 and len(problems) == 4
    assert [p.split(":")[1] for p in problems] == ["2", "3", "4", "5"]  # file:line in every report
    with pytest.raises(DataError, match=r"data.jsonl:2"):
        load_jsonl(path, skip_bad=False)
    with pytest.raises(DataError, match="not found"):
        load_jsonl(tmp_path / "nope.jsonl")


def test_regenerated_answers_are_the_targets_own_and_cached(tmp_path):
    """ViSpec-style regeneration: the training answers become the target's greedy outputs,
    written once to OUT/answers_rank0.jsonl and reused by a resumed run."""
    from vlmspec.draft import PlainDrafter
    from vlmspec.engine import GenerationConfig, SpecEngine
    from vlmspec.train.data import Conversation
    from vlmspec.text import generate_text
    from vlmspec.train.distill import AnswerCache

    target = tiny_target("llava")
    cache = AnswerCache(tmp_path / "a.jsonl", target, max_new_tokens=8)
    c = Conversation("what is it?", "a dataset answer", [tiny_image(4)], "describe")
    got = cache(c)
    ref = generate_text(SpecEngine(target, PlainDrafter()), encode_prompt(target, c.prompt, c.images), GenerationConfig(max_new_tokens=8)).text
    assert got.answer == ref != c.answer and got.images == c.images
    again = AnswerCache(tmp_path / "a.jsonl", target, max_new_tokens=8)
    assert again(c).answer == ref and again.generated == 0, "read back from disk, not generated again"
    out = tmp_path / "run"
    train_drafter(target, "toyworld", out, _cfg(steps=2, regenerate=True, regen_max_tokens=6), progress=False)
    lines = (out / "answers_rank0.jsonl").read_text().splitlines()
    assert len(lines) == 2 * 4  # one generated answer per training sample (batch 4, 2 steps)


def test_the_acceptance_head_learns_beside_the_drafter_without_changing_it(tmp_path):
    """SpecDec++: trained on detached inputs with its own clipping, the acceptance head leaves the
    drafter's weights bit-identical to a run without it; its loss falls; the stop threshold is
    chosen from the grid on validation prompts and saved with the drafter."""
    from vlmspec.train.distill import STOP_GRID

    target = tiny_target("llava")
    with_head, without = tmp_path / "with", tmp_path / "without"
    train_drafter(target, "toyworld", with_head, _cfg(steps=12, batch_size=2, acceptance_head=True), progress=False)
    train_drafter(target, "toyworld", without, _cfg(steps=12, batch_size=2), progress=False)
    a = load_file(str(with_head / "checkpoint" / "head.safetensors"))
    b = load_file(str(without / "checkpoint" / "head.safetensors"))
    assert {k for k in a if k.startswith("accept.")} and set(b) == {k for k in a if not k.startswith("accept.")}
    assert all(torch.equal(a[k], b[k]) for k in b)
    history = [h for h in _history(with_head) if "accept_bce1" in h]
    assert len(history) == 12
    assert sum(h["accept_bce1"] for h in history[-4:]) < sum(h["accept_bce1"] for h in history[:4])
    state = json.loads((with_head / "checkpoint" / "trainer_state.json").read_text())
    chosen = state["stop_threshold"]["chosen"]
    assert chosen in STOP_GRID and [r["threshold"] for r in state["stop_threshold"]["grid"]] == list(STOP_GRID)
    best = max(r["modelled_tokens_per_s"] for r in state["stop_threshold"]["grid"])
    assert next(r for r in state["stop_threshold"]["grid"] if r["threshold"] == chosen)["modelled_tokens_per_s"] == best
    drafter = EagleDrafter.load(with_head / "drafter", target)
    assert drafter.head.accept is not None and drafter.stop_threshold == chosen


def test_magpie_pairs_take_their_share_of_each_batch_in_turn_and_resume_in_place():
    from vlmspec.train.distill import conversations

    pairs = [(f"question {i}", f"answer {i}", i % 2 == 0) for i in range(5)]
    cfg = _cfg(batch_size=8, text_pairs=5, text_share=0.25)
    stream = conversations("toyworld", cfg, 0, 0, pairs)
    batches = [next(stream) for _ in range(3)]
    for b in batches:
        assert len(b) == 8 and [c.task for c in b[6:]] == ["magpie", "magpie"] and all(c.task != "magpie" for c in b[:6])
    assert [c.prompt for b in batches for c in b[6:]] == [f"question {i % 5}" for i in range(6)]  # in turn, cycling
    assert [c.open_end for c in batches[0][6:]] == [False, True]  # a cut answer trains without an end of turn
    resumed = next(conversations("toyworld", cfg, 0, 2, pairs))
    assert [(c.prompt, c.answer) for c in resumed] == [(c.prompt, c.answer) for c in batches[2]]
    # negative control: without pairs the batch is ToyWorld's alone
    assert all(c.task != "magpie" for c in next(conversations("toyworld", _cfg(batch_size=8), 0, 0)))


def test_toyworld_answers_are_phrased_as_the_target_was_aligned():
    """`--answer-style`: the drafter's ToyWorld stream phrases answers as train-align did (same
    scenes and tasks, another wording); short stays the default; an unknown style is refused."""
    from vlmspec.train.distill import conversations

    short_stream, tally_stream = conversations("toyworld", _cfg(batch_size=8), 0, 0), conversations("toyworld", _cfg(batch_size=8, answer_style="tally"), 0, 0)
    short = [c for _ in range(6) for c in next(short_stream)]
    tally = [c for _ in range(6) for c in next(tally_stream)]
    assert [c.task for c in short] == [c.task for c in tally]  # (a description's prompt is drawn after its order)
    counts = [(s, t) for s, t in zip(short, tally) if s.task == "count" and s.sample.meta["target"]["count"]]
    assert counts, "no count question with a non-zero answer in 48 samples"
    for s, t in counts:
        assert s.prompt == t.prompt
        assert "(first)" in t.answer and "(first)" not in s.answer and t.answer.endswith(s.answer)  # the same count
    with pytest.raises(ValueError, match="answer_style"):
        _cfg(answer_style="poetic")


def test_a_drafter_trains_on_the_targets_own_text_pairs(tmp_path):
    from dataclasses import asdict

    from vlmspec.train.magpie import MagpieConfig

    target = tiny_target("llava")
    cfg = _cfg(steps=2, text_pairs=2, text_share=0.5)
    pairs = [["name a colour", "blue", True], ["say hello", "hello there", False]]  # as the target would have cached them
    mcfg = MagpieConfig(n=2, seed=0, answer_tokens=cfg.text_answer_tokens)
    (tmp_path / "magpie.json").write_text(json.dumps({"config": asdict(mcfg), "pairs": pairs}))
    train_drafter(target, "toyworld", tmp_path, cfg, progress=False)
    state = json.loads((tmp_path / "checkpoint" / "trainer_state.json").read_text())
    assert state["magpie_pairs"] == 2 and state["config"]["text_pairs"] == 2
    assert len([h for h in state["history"] if "loss" in h]) == 2


def test_a_bf16_target_trains_a_float32_head_under_autocast_and_ships_it_in_bf16(tmp_path):
    import copy

    from vlmspec.target import Target
    from testing.tiny import build_tiny

    model, processor = build_tiny("llava", seed=0)
    target = Target(copy.deepcopy(model).to(torch.bfloat16), processor, name="tiny-llava-bf16")
    train_drafter(target, "toyworld", tmp_path, _cfg(steps=3, eval_every=3, acceptance_head=False), progress=False)
    saved = load_file(str(tmp_path / "checkpoint" / "head.safetensors"))
    assert all(t.dtype == torch.float32 for t in saved.values())  # the trained weights stay float32
    history = _history(tmp_path)
    assert [h["step"] for h in history if "loss" in h] == [0, 1, 2] and any("tau" in h for h in history)
    drafter = EagleDrafter.load(tmp_path / "drafter", target)
    assert next(drafter.head.parameters()).dtype == torch.bfloat16  # inference runs in the target's dtype
