"""python -m recipes train-target: a smoke run on a tiny config, export loadable by the HF auto classes, exact resume."""
import json

import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from recipes.train.target_sft import SFTConfig, TargetArch, train

TINY = TargetArch(vision_hidden=32, vision_layers=1, vision_heads=2, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, tokenizer_corpus=300, tokenizer_vocab=600)


def _cfg(steps, vision_steps=3):
    return SFTConfig(steps=steps, batch_size=4, warmup=2, eval_every=10**6, ckpt_every=2, eval_samples=4, arch=TINY,
                     vision_steps=vision_steps, vision_batch_size=4)


def test_scene_labels_name_each_cell_sign_row_and_bar():
    import random

    import toyworld
    from recipes.train.vision_pretrain import N_CELLS, scene_labels

    rng = random.Random(3)
    scene = toyworld._sample_objects_scene(rng, with_sign=True)
    chart = toyworld._sample_chart(rng)
    y = scene_labels([scene, chart])
    assert y.obj.shape == (2, N_CELLS) and y.is_chart.tolist() == [False, True]
    for o in scene["objects"]:
        cell = o["row"] * 3 + o["col"]
        shape, color = divmod(int(y.obj[0, cell]) - 1, len(toyworld.COLOR_NAMES))
        assert (toyworld.SHAPES[shape], toyworld.COLOR_NAMES[color]) == (o["shape"], o["color"])
    assert int((y.obj[0] > 0).sum()) == len(scene["objects"])
    row = scene["sign"]["row"]
    assert toyworld.WORDS[int(y.word[0, row * 3]) - 1] == scene["sign"]["word"]
    assert [int(v) for v in y.bar_value[1, : len(chart["bars"])]] == [b["value"] for b in chart["bars"]]


def test_smoke_train_export_and_resume(tmp_path):
    # --stop-at ends the first run at step 2; resume continues the same schedule
    train(tmp_path, _cfg(4), progress=False, stop_at=2)
    state = json.loads((tmp_path / "checkpoint" / "trainer_state.json").read_text())
    assert state["step"] == 2 and state["vision_step"] == 3
    assert len([h for h in state["history"] if "probe_loss" in h]) == 3, "stage 0 ran its 3 steps"
    export = train(tmp_path, _cfg(4), resume=True, progress=False)
    state = json.loads((tmp_path / "checkpoint" / "trainer_state.json").read_text())
    assert state["step"] == 4 and [h["step"] for h in state["history"] if "loss" in h] == [0, 1, 2, 3]
    assert len([h for h in state["history"] if "probe_loss" in h]) == 3, "stage 0 is not repeated on resume"
    assert (tmp_path / "loss.png").stat().st_size > 0
    # the export is a standard HF folder: the auto classes load it offline
    model = AutoModelForImageTextToText.from_pretrained(export)
    processor = AutoProcessor.from_pretrained(export)
    assert model.config.model_type == "vipllava" and model.config.text_config.num_hidden_layers == 2
    assert processor.tokenizer.convert_tokens_to_ids("<image>") == model.config.image_token_index
    # resume continues at step 4 with the saved optimizer state, and ends at the new total
    before = torch.load(tmp_path / "checkpoint" / "optimizer.pt", weights_only=True)
    train(tmp_path, _cfg(6), resume=True, progress=False)
    state = json.loads((tmp_path / "checkpoint" / "trainer_state.json").read_text())
    assert state["step"] == 6
    assert [h["step"] for h in state["history"] if "loss" in h] == list(range(6))
    assert before["state"], "optimizer moments were saved"


def test_task_mix_parses_and_steers_the_training_samples():
    import pytest

    from recipes.train.target_sft import parse_task_mix, sample_for

    mix = parse_task_mix(" count=0.3, attribute=0.7 ")
    assert mix == {"count": 0.3, "attribute": 0.7}
    for bad, msg in (("count", "TASK=WEIGHT"), ("cout=1", "TASK=WEIGHT"), ("count=x", "not a number"),
                     ("count=-1", ">= 0"), ("count=0", "positive weight"), ("", "positive weight")):
        with pytest.raises(ValueError, match=msg):
            parse_task_mix(bad)
    cfg = SFTConfig(task_mix=mix)
    tasks = [sample_for(s, cfg).task for s in range(200)]
    assert set(tasks) == {"count", "attribute"} and 0.5 < tasks.count("attribute") / 200 < 0.9
    assert [sample_for(s, cfg).prompt for s in range(5)] == [sample_for(s, cfg).prompt for s in range(5)], "a pure function of the seed"
    assert sample_for(7, SFTConfig()).task == __import__("toyworld").make_sample(7).task


def test_init_from_starts_from_every_weight_of_an_export(tmp_path):
    import pytest

    from recipes.train.target_sft import TargetArch

    first = train(tmp_path / "a", _cfg(2), progress=False)
    # steps=0: nothing trains, so the new export must be the starting weights exactly
    second = train(tmp_path / "b", SFTConfig(**{**_cfg(0).__dict__, "vision_steps": 0, "task_mix": {"count": 1.0}}),
                   progress=False, init_from=first)
    a = AutoModelForImageTextToText.from_pretrained(first).state_dict()
    b = AutoModelForImageTextToText.from_pretrained(second).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert AutoProcessor.from_pretrained(second).tokenizer.get_vocab() == AutoProcessor.from_pretrained(first).tokenizer.get_vocab()
    # a run of another architecture cannot start from it
    other = TargetArch(**{**TINY.__dict__, "layers": 3})
    with pytest.raises(ValueError, match="do not match this architecture"):
        train(tmp_path / "c", SFTConfig(**{**_cfg(0).__dict__, "vision_steps": 0, "arch": other}), progress=False, init_from=first)


def test_cli_init_from_errors(tmp_path, capsys):
    from recipes.__main__ import main

    for args, msg in ((["--init-from", str(tmp_path)], "not an exported model folder"),
                      (["--init-from", str(tmp_path), "--resume"], "--resume: no checkpoint"),
                      (["--task-mix", "count=abc"], "--task-mix"),
                      (["--hidden", "100", "--heads", "8"], "heads of an even size"),
                      (["--heads", "6"], "equal key/value groups")):
        assert main(["train-target", "--out", str(tmp_path / "run"), *args]) == 2
        assert msg in capsys.readouterr().err
