"""The default target's alignment recipe (`python -m recipes train-align`,
vlmspec/recipes/train/align.py) on a tiny in-process `fast_vlm`: exact resume, warm starts,
autocast, the batches, the probes; and the recipes' command line (train-align, eval-target)."""
import json

import pytest
import torch

from test_assemble import tiny_fast_vlm
from recipes.__main__ import main as recipes_main
from recipes.train.align import AlignConfig
from vlmspec.target import assemble


def _tiny_base(folder):
    """A tiny fast_vlm folder with a processor (the toy's tokenizer, 96 px -> 3 x 3 = 9 image tokens,
    one per ToyWorld cell, so the trainer's cell probes apply)."""
    from transformers import AutoTokenizer

    from vlmspec import assets as vassets

    tok = AutoTokenizer.from_pretrained(vassets.BUNDLED_TARGET)
    model = tiny_fast_vlm()
    from transformers import FastVlmForConditionalGeneration

    cfg = model.config
    cfg.text_config.vocab_size = len(tok)
    cfg.image_token_index = tok.convert_tokens_to_ids("<image>")
    torch.manual_seed(0)
    model = FastVlmForConditionalGeneration(cfg).eval()
    model.save_pretrained(folder)
    assemble.build_processor(tok, 96).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("variant", [dict(), dict(autocast=True)], ids=["fp32", "bf16-autocast"])
def test_train_align_resumes_exactly_and_its_parts_build(tmp_path, variant):
    from safetensors.torch import load_file

    from recipes.train.align import AlignConfig, train_align

    from dataclasses import asdict

    from vlmspec.train.magpie import MagpieConfig

    base = _tiny_base(tmp_path / "base")
    cfg = dict(batch_size=2, lora_rank=2, lora_alpha=4.0, eval_every=1000, eval_samples=2, ckpt_every=1, warmup=1,
               probe_steps=2, probe_batch=2, followups=2, text_pairs=2, text_per_step=1, tower_tail=2, **variant)
    pairs = [["name three red fruits", "Apples, cherries and strawberries.", True], ["say hello", "Hello! I am", False]]
    for run in "ab":  # the base model's own pairs, as magpie would have cached them (a random tiny model writes none)
        (tmp_path / run).mkdir()
        (tmp_path / run / "magpie.json").write_text(__import__("json").dumps({"config": asdict(MagpieConfig(n=2, seed=0)), "pairs": pairs}))
    straight = train_align(base, tmp_path / "a", AlignConfig(steps=3, **cfg), progress=False)
    train_align(base, tmp_path / "b", AlignConfig(steps=3, minutes=1e-9, **cfg), progress=False)  # stops after one step
    assert load_file(str(tmp_path / "b" / "checkpoint" / "trained.safetensors")) and \
        __import__("json").loads((tmp_path / "b" / "checkpoint" / "trainer_state.json").read_text())["step"] == 1
    after_one = load_file(str(tmp_path / "b" / "checkpoint" / "trained.safetensors"))
    resumed = train_align(base, tmp_path / "b", AlignConfig(steps=3, **cfg), resume=True, progress=False)
    a, b = load_file(str(straight)), load_file(str(resumed))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert all(v.dtype == torch.float32 for v in a.values())  # fp32 master weights, also under bf16 autocast
    base_state = load_file(str(base / "model.safetensors"))
    assert any(not torch.equal(a[k], base_state[k]) for k in a if k in base_state)  # the projector moved
    tower = [k for k in a if k.startswith("model.vision_tower.")]  # the tower's trained tail ships, and moved
    assert tower and all(".blocks.5." in k or ".blocks.6." in k or ".conv_head." in k or ".bn2." in k for k in tower)
    assert any(not torch.equal(a[k], base_state[k]) for k in tower)  # (in stage 0 at least)
    # the tail trains in stage 0 only: SFT's steps 2 and 3 leave it as step 1 did
    assert all(torch.equal(after_one[k], b[k]) for k in tower)
    from transformers import FastVlmForConditionalGeneration

    model = FastVlmForConditionalGeneration.from_pretrained(base)
    assert assemble.apply_trained(model, straight)["steps"] == "3"


def test_warm_start_begins_from_the_source_runs_parts_and_refuses_another_shape(tmp_path):
    """`--warm-start RUN` (attempt 10: attempt 9's parts, then the "scan" answer style): the new
    run's first weights are RUN's (with every learning rate 0 its exported parts equal RUN's), stage
    0 is not run again; a source of another LoRA rank is refused with the flag to change."""
    from dataclasses import asdict

    from safetensors.torch import load_file

    from recipes.train.align import AlignConfig, WarmStartError, train_align
    from vlmspec.train.magpie import MagpieConfig

    base = _tiny_base(tmp_path / "base")
    cfg = dict(batch_size=2, lora_rank=2, lora_alpha=4.0, eval_every=1000, eval_samples=2, ckpt_every=1, warmup=1, probe_steps=2,
               probe_batch=2, followups=1, text_pairs=2, text_per_step=1, tower_tail=2, word_weight=1.0)
    pairs = [["say hello", "Hello! I am", False], ["name a fruit", "An apple.", True]]
    for run in ("src", "next", "other"):
        (tmp_path / run).mkdir()
        (tmp_path / run / "magpie.json").write_text(__import__("json").dumps({"config": asdict(MagpieConfig(n=2, seed=0)), "pairs": pairs}))
    src = load_file(str(train_align(base, tmp_path / "src", AlignConfig(steps=2, **cfg), progress=False)))
    frozen = dict(cfg, lr=0.0, lora_lr=0.0, tower_lr=0.0, probe_lr=0.0)
    nxt = train_align(base, tmp_path / "next", AlignConfig(steps=1, answer_style="scan", warm_start=str(tmp_path / "src"), **frozen), progress=False)
    got = load_file(str(nxt))
    assert set(got) == set(src) and all(torch.equal(got[k], src[k]) for k in src)
    state = __import__("json").loads((tmp_path / "next" / "checkpoint" / "trainer_state.json").read_text())
    assert state["warm_start"]["step"] == 2 and not any("vision_step" in h for h in state["history"])
    # negative control: the same call from scratch does not give the source's parts
    fresh = load_file(str(train_align(base, tmp_path / "other", AlignConfig(steps=1, **frozen), progress=False)))
    assert any(not torch.equal(fresh[k], src[k]) for k in src)
    with pytest.raises(WarmStartError, match="lora_rank=2.*lora_rank=4"):
        train_align(base, tmp_path / "bad", AlignConfig(steps=1, warm_start=str(tmp_path / "src"), **{**cfg, "lora_rank": 4}), progress=False)


def test_autocast_runs_the_forward_in_bf16_and_keeps_the_loss_close(tmp_path):
    """`--autocast`: the answer loss under `amp(cfg)` is computed from bf16 matmuls (it differs from
    the fp32 loss: the negative control that autocast is on) yet stays within bf16's resolution of it;
    the gradients land on the fp32 weights."""
    from transformers import AutoProcessor, FastVlmForConditionalGeneration

    from recipes.train.align import AlignConfig, align_batches, amp
    from recipes.train.target_sft import answer_loss

    base = _tiny_base(tmp_path / "base")
    model = FastVlmForConditionalGeneration.from_pretrained(base)
    _, batch, _ = next(align_batches(0, AlignConfig(batch_size=2, followups=1, text_per_step=0), AutoProcessor.from_pretrained(base)))
    with amp(AlignConfig(autocast=False)):
        fp32 = answer_loss(model, batch)
    with amp(AlignConfig(autocast=True)):
        bf16 = answer_loss(model, batch)
    assert fp32.dtype == bf16.dtype == torch.float32
    assert not torch.equal(fp32, bf16) and torch.allclose(fp32, bf16, rtol=3e-2)
    bf16.backward()
    grad = model.model.multi_modal_projector.linear_1.weight.grad
    assert grad is not None and grad.dtype == torch.float32 and grad.abs().sum() > 0


def test_align_batches_carry_the_text_pairs_in_turn(tmp_path):
    from transformers import AutoProcessor

    from recipes.train.align import AlignConfig, align_batches

    processor = AutoProcessor.from_pretrained(_tiny_base(tmp_path / "base"))
    pairs = [("name three red fruits", "apples and cherries", True), ("say hello to me", "hello there", True)]
    batches = align_batches(0, AlignConfig(batch_size=2, followups=1, text_per_step=1), processor, pairs)
    for step in range(3):
        got, batch, scenes = next(batches)
        assert got == step and batch["input_ids"].shape[0] == 3 and len(scenes) == 2  # two image dialogues + one text pair
        labels = batch["labels"][2]
        answer = processor.tokenizer.decode(labels[labels != -100], skip_special_tokens=True)
        assert pairs[step % 2][1] in answer and pairs[(step + 1) % 2][1] not in answer
    none = next(align_batches(0, AlignConfig(batch_size=2, followups=1, text_per_step=0), processor, pairs))
    assert none[1]["input_ids"].shape[0] == 2


def test_cell_pooling_averages_each_cells_tokens():
    from recipes.train.align import pool_cells

    g, h = 6, 5  # a 6 x 6 token map -> 3 x 3 cells of 2 x 2 tokens
    tokens = torch.randn(2, g * g, h)
    pooled = pool_cells(tokens)
    assert pooled.shape == (2, 9, h)
    grid = tokens.view(2, g, g, h)
    for r in range(3):
        for c in range(3):
            want = grid[:, 2 * r : 2 * r + 2, 2 * c : 2 * c + 2].mean((1, 2))
            assert torch.allclose(pooled[:, 3 * r + c], want, atol=1e-6)
    with pytest.raises(AssertionError, match="do not pool"):
        pool_cells(torch.randn(1, 16, h))  # a 4 x 4 map does not split into 3 x 3 cells


def test_projector_rescale_moves_the_image_tokens_and_keeps_the_probes_logits():
    from recipes.train.align import Probes, ProjectorTap, cell_tokens, image_token_rms, pool_cells, projected_tokens, rescale_projector, text_rms

    from recipes.train.vision_pretrain import SIGN_GROUP, WORD_GROUPS, pretrain_scenes, scene_labels

    model = tiny_fast_vlm()
    hidden = model.config.text_config.hidden_size
    g = torch.Generator().manual_seed(4)
    vectors = {name: torch.randn(len(words), hidden, generator=g) * 0.1 for name, words, _, _ in WORD_GROUPS + (SIGN_GROUP,)}
    probe = Probes(hidden, AlignConfig(), vectors)
    pixels = torch.randn(2, 3, 96, 96, generator=torch.Generator().manual_seed(3))
    labels = scene_labels(pretrain_scenes(5, 2, chart_frac=0.0))
    with torch.no_grad():
        probe.words.scale.fill_(5.0)  # logits that depend on the tokens (at its starting scale they hardly do)
        for lin in (model.model.multi_modal_projector.linear_1, model.model.multi_modal_projector.linear_2):
            lin.bias.normal_(0, 1.0, generator=g)  # the random tiny tower's features are ~0: tokens from the biases
        before, logits = image_token_rms(model, pixels), probe.scene.obj(cell_tokens(model, pixels))
        word_loss, _ = probe.words(projected_tokens(model, pixels), labels)
        rescale_projector(model, probe, 0.25)
        assert image_token_rms(model, pixels) == pytest.approx(before * 0.25, rel=1e-5)
        assert torch.allclose(probe.scene.obj(cell_tokens(model, pixels)), logits, atol=1e-5)
        assert torch.allclose(probe.words(projected_tokens(model, pixels), labels)[0], word_loss, atol=1e-5)
        # negative control: the tokens rescaled without the probes' correction move the word probe's loss
        model.model.multi_modal_projector.linear_2.weight.mul_(4.0)
        model.model.multi_modal_projector.linear_2.bias.mul_(4.0)
        assert not torch.allclose(probe.words(projected_tokens(model, pixels), labels)[0], word_loss, atol=1e-3)
    assert 0 < text_rms(model) < 1
    # the tap sees the tokens of the model's own forward: pooled, they are cell_tokens' output
    tap = ProjectorTap(model)
    with torch.no_grad():
        model.model.get_image_features(pixel_values=pixels)
        assert torch.allclose(pool_cells(tap.take()), cell_tokens(model, pixels), atol=1e-6)
    tap.remove()



def test_word_probe_reads_place_object_and_sign_words_and_keeps_its_logits_when_rescaled():
    import toyworld
    from recipes.train.vision_pretrain import SIGN_GROUP, WORD_GROUPS, WordProbe, scene_labels, token_cells

    # orthogonal "word embeddings": one axis per word of every group, two spare axes (empty cell, no sign)
    groups = WORD_GROUPS + (SIGN_GROUP,)
    hidden = sum(len(words) for _, words, _, _ in groups) + 2
    empty, no_sign, axis, vectors = hidden - 2, hidden - 1, iter(range(hidden)), {}
    axis_vec = lambda a: torch.nn.functional.one_hot(torch.tensor(a), hidden).float()  # noqa: E731
    for name, words, _, _ in groups:
        vectors[name] = torch.stack([axis_vec(next(axis)) for _ in words])
    probe = WordProbe(vectors)
    with torch.no_grad():
        probe.scale.fill_(30.0)
        probe.none.copy_(torch.stack([axis_vec(empty)] * 3 + [axis_vec(no_sign)]))
    scenes = [{"kind": "objects", "objects": [{"row": 0, "col": 2, "shape": "star", "color": "blue", "size": "large"},
                                               {"row": 2, "col": 1, "shape": "circle", "color": "red", "size": "small"}],
               "sign": {"row": 1, "word": "CAT"}},
              {"kind": "chart", "bars": []}]
    y = scene_labels(scenes)
    cells = token_cells(36)  # a 6 x 6 map
    tokens = torch.zeros(2, 36, hidden)
    tokens[:, :, empty] = 1.0  # "nothing here", taken back where an object is
    tokens[:, :, no_sign] = 1.0  # "no sign in this row", taken back in the sign's row
    for t, cell in enumerate(cells.tolist()):  # each token: its row and column words
        r, c = divmod(cell, 3)
        tokens[:, t] += vectors["row"][r] + vectors["col"][c]
    for o in scenes[0]["objects"]:  # the object's words in every token of its cell
        at = cells == o["row"] * 3 + o["col"]
        tokens[0, at, empty] = 0.0
        tokens[0, at] += vectors["color"][toyworld.COLOR_NAMES.index(o["color"])] + vectors["shape"][toyworld.SHAPES.index(o["shape"])] \
            + vectors["size"][toyworld.SIZES.index(o["size"])]
    sign_row = (cells // 3) == 1
    tokens[0, sign_row, no_sign] = 0.0
    tokens[0, sign_row] += vectors["sign"][toyworld.WORDS.index("CAT")]
    with torch.no_grad():
        loss, acc = probe(tokens, y)
        assert set(acc) == {"w_row", "w_col", "w_color", "w_shape", "w_size", "w_sign"}
        assert all(v == 1.0 for v in acc.values()) and float(loss) < 0.05, acc
        # negative control: tokens carrying another token's place and content
        wrong, wrong_acc = probe(tokens[:, cells.argsort(descending=True)], y)
        assert float(wrong) > 1.0 and wrong_acc["w_row"] < 0.5 and wrong_acc["w_color"] < 1.0
        shifted = probe(tokens.roll(12, dims=1), y)[1]  # one cell row down: the sign's word in the wrong row
        assert shifted["w_sign"] < 1.0 and shifted["w_row"] < 0.5
        # the projector's output scaled by 0.25 and the probe told: the same loss
        probe.rescale(0.25)
        assert torch.allclose(probe(tokens * 0.25, y)[0], loss, atol=1e-5)


@pytest.mark.skipif(not __import__("vlmspec.assets", fromlist=["x"]).bundled_target(), reason="needs assets/toyworld-vlm")
def test_eval_target_json_and_every_answer_written(capsys, tmp_path):
    answers = tmp_path / "answers.json"
    assert recipes_main(["eval-target", "--model", "toy", "--device", "cpu", "--n", "6", "--json", "--answers", str(answers)]) == 0
    result = json.loads(capsys.readouterr().out)  # stdout is the one JSON object (progress goes to stderr)
    items = json.loads(answers.read_text())
    assert len(items) == 2 * result["n"] == 12 and {i["image"] for i in items} == {"real", "noise"}
    for metric in ("counting", "attribute", "text_reading", "description_coverage"):
        real = [i["scores"][metric] for i in items if i["image"] == "real" and metric in i["scores"]]
        noise = [i["scores"][metric] for i in items if i["image"] == "noise" and metric in i["scores"]]
        assert real and sum(real) / len(real) == pytest.approx(result[metric])
        assert sum(noise) / len(noise) == pytest.approx(result["noise_image"][metric])
    assert all(i["answer"] and i["reference"] for i in items if i["image"] == "real")


@pytest.mark.parametrize("flags, message", [(["--warm-start", "nowhere"], "no checkpoint in nowhere"),
                                            (["--warm-start", "nowhere", "--resume"], "give one of them")])
def test_train_align_flags_that_need_another_are_one_line(capsys, model_dir, tmp_path, flags, message):
    assert recipes_main(["train-align", "--base", str(model_dir), "--out", str(tmp_path / "run"), *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and not (tmp_path / "run").exists()
