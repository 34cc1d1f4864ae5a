"""EAGLE-3 drafters: training (`vlmspec train --arch eagle3`), the target's layer features, the
speculators format (export, import, the refusals naming their field, the round trip)."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import tiny_target
from vlmspec.draft import load_drafter
from vlmspec.draft.base import TreeConfig
from vlmspec.draft.eagle import DrafterLoadError, EagleConfig, EagleDrafter, build_head, default_feature_layers
from vlmspec.draft.eagle.speculators_format import to_speculators
from vlmspec.engine import GenerationConfig, SpecEngine
from vlmspec.inputs import encode_prompt
from vlmspec.target.model import layer_features
from testing.tiny import tiny_image
from vlmspec.train.distill import DistillConfig, train_drafter

TREE = TreeConfig(depth=4, top_k=3, total_tokens=10)


def test_default_layers_are_eagle3s_and_distinct_on_shallow_targets():
    assert default_feature_layers(32) == [2, 16, 29] and default_feature_layers(30) == [2, 15, 27]  # vLLM's (2, n // 2, n - 3)
    for n in range(1, 12):
        ids = default_feature_layers(n)
        assert ids == sorted(set(ids)) and 0 <= ids[0] and ids[-1] < n, (n, ids)


def test_layer_features_are_the_hidden_states_the_chosen_layers_read():
    target = tiny_target("llava")
    inputs = encode_prompt(target, "describe the image", [tiny_image(0)])
    out = target.model(**inputs, output_hidden_states=True)
    hs = out.hidden_states
    feats = layer_features(hs, (0, 1))
    assert feats.shape[-1] == 2 * target.hidden_size
    assert torch.equal(feats[..., : target.hidden_size], hs[0]) and torch.equal(feats[..., target.hidden_size :], hs[1])
    assert torch.equal(layer_features(hs, None), hs[-1])  # EAGLE-1: the last (normed) hidden state
    # the adapter's prefill hands the same numbers, from its one forward
    _, pre = target.prefill(inputs, layers=(0, 1))
    torch.testing.assert_close(pre.features, feats[0], rtol=1e-5, atol=1e-5)


def _greedy(target, drafter, inputs, n=24):
    return SpecEngine(target, drafter).generate(inputs, GenerationConfig(max_new_tokens=n, ignore_eos=True)).token_ids


def _peaky_target():
    """A tiny LLaVA whose LM head is scaled up: a random tiny model's next-token distribution is
    near uniform, so a head trained on it only on tokens would have nothing to learn."""
    from vlmspec.target import Target
    from testing.tiny import build_tiny

    model, processor = build_tiny("llava", seed=7)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(40.0)
    return Target(model, processor, name="tiny-llava-peaky")


def test_eagle3_trains_its_loss_falls_and_the_drafter_keeps_parity(tmp_path):
    target = _peaky_target()
    cfg = DistillConfig(steps=16, batch_size=4, lr=1e-2, w_ce=1.0, warmup=2, eval_every=10**6, eval_n=1, ckpt_every=8, arch="eagle3",
                        draft_vocab=64, draft_vocab_samples=8)
    train_drafter(target, "toyworld", tmp_path, cfg, progress=False)
    history = json.loads((tmp_path / "checkpoint" / "trainer_state.json").read_text())["history"]
    losses = [h["loss"] for h in history if "loss" in h]
    assert len(losses) == 16 and sum(losses[-4:]) / 4 < 0.6 * sum(losses[:4]) / 4, losses
    assert not any(k.startswith("feat") for h in history for k in h)  # no feature regression: EAGLE-3 distils tokens only
    drafter = EagleDrafter.load(tmp_path / "drafter", target, TREE)
    c = drafter.head.config
    assert c.arch == "eagle3" and c.feature_layers == default_feature_layers(target.text_config.num_hidden_layers)
    raw = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert raw["arch"] == "eagle3" and raw["feature_layers"] == c.feature_layers  # recorded
    # its own LM head was trained (it no longer equals the target's rows it started from)
    assert not torch.equal(drafter.head.lm.weight, target.output_embeddings().weight[drafter.head.d2t])
    inputs = encode_prompt(target, "describe the image in detail", [tiny_image(0)])
    ref = target.model.generate(**inputs, max_new_tokens=24, do_sample=False, eos_token_id=None)[0, inputs["input_ids"].shape[1]:]
    assert _greedy(target, drafter, inputs) == ref.tolist()


def test_eagle3_refuses_the_visual_variants():
    with pytest.raises(ValueError, match="EAGLE-1"):
        DistillConfig(arch="eagle3", visual={"kind": "pool"})
    DistillConfig(arch="eagle3")  # control


# ------------------------------------------------------------------------------------ speculators format
def _drafter(target, k=40, seed=3, norm_before_residual=True):
    """A random EAGLE-3 drafter over a trimmed vocabulary, its norms away from 1."""
    torch.manual_seed(seed)
    cfg = EagleConfig.from_target(target, "eagle3")
    cfg.draft_vocab_size, cfg.norm_before_residual = k, norm_before_residual
    head = build_head(cfg, target.input_embeddings(), target.output_embeddings(), target.attention)
    head.set_draft_vocab(torch.randperm(target.vocab_size, generator=torch.Generator().manual_seed(seed))[:k].sort().values)
    with torch.no_grad():
        for norm in (head.hidden_norm, head.norm, head.layer.input_layernorm, head.layer.post_attention_layernorm):
            norm.weight.copy_(1 + 0.2 * torch.randn_like(norm.weight))
        head.lm.weight.add_(0.1 * torch.randn_like(head.lm.weight))
    return EagleDrafter(head.to(target.dtype), TREE)


def test_export_writes_the_speculators_format_with_offsets_and_the_verifier(tmp_path):
    target = tiny_target("llava")
    d = _drafter(target)
    to_speculators(d.head, tmp_path, verifier="org/tiny-llava", verifier_architectures=["LlavaForConditionalGeneration"])
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["speculators_model_type"] == "eagle3" and raw["architectures"] == ["Eagle3Speculator"]
    assert raw["draft_vocab_size"] == 40 and raw["target_hidden_size"] == target.hidden_size and raw["norm_before_residual"] is True
    assert raw["eagle_aux_hidden_state_layer_ids"] == d.head.config.feature_layers
    assert raw["transformer_layer_config"]["vocab_size"] == target.vocab_size and raw["transformer_layer_config"]["model_type"] == "llama"
    sc = raw["speculators_config"]
    assert sc["algorithm"] == "eagle3" and sc["verifier"] == {"name_or_path": "org/tiny-llava", "architectures": ["LlavaForConditionalGeneration"]}
    assert sc["proposal_methods"][0]["proposal_type"] == "greedy" and sc["default_proposal_method"] == "greedy"
    w = load_file(str(tmp_path / "model.safetensors"))
    ids = d.head.d2t
    assert torch.equal(torch.arange(40) + w["d2t"], ids)  # OFFSETS: target id = draft index + d2t[index]
    assert not torch.equal(w["d2t"], ids)  # (negative control: they are not the ids themselves)
    assert w["t2d"].dtype == torch.bool and int(w["t2d"].sum()) == 40 and bool(w["t2d"][ids].all())
    assert w["fc.weight"].shape == (target.hidden_size, target.hidden_size * len(d.head.config.feature_layers))
    assert w["layers.0.self_attn.q_proj.weight"].shape[1] == 2 * target.hidden_size
    assert torch.equal(w["lm_head.weight"], d.head.lm.weight) and torch.equal(w["embed_tokens.weight"], target.input_embeddings().weight)


def test_round_trip_through_the_speculators_format_gives_identical_drafts(tmp_path):
    target = tiny_target("llava")
    d = _drafter(target)
    to_speculators(d.head, tmp_path / "spec", verifier="org/tiny", verifier_architectures=["LlavaForConditionalGeneration"])
    back = load_drafter(str(tmp_path / "spec"), target, TREE)
    assert back.head.config.arch == "eagle3" and back.feature_layers == d.feature_layers
    for (k1, v1), (k2, v2) in zip(d.head.state_dict().items(), back.head.state_dict().items()):
        assert k1 == k2 and torch.equal(v1, v2), k1
    for text, seeds in (("describe the image", [0]), ("once upon a time", [])):
        inputs = encode_prompt(target, text, [tiny_image(s) for s in seeds])
        _, out = target.prefill(inputs, layers=d.feature_layers)
        from vlmspec.draft.base import PromptContext
        trees = []
        for drafter in (d, back):
            s = drafter.start(PromptContext(inputs["input_ids"][0], out.features, inputs))
            trees.append(s.propose(7, 4))
        assert trees[0].tokens.tolist() == trees[1].tokens.tolist() and trees[0].parents.tolist() == trees[1].parents.tolist()
        assert _greedy(target, d, inputs, 16) == _greedy(target, back, inputs, 16)


def test_an_eagle1_drafter_is_refused_with_the_reason(tmp_path):
    target = tiny_target("llava")
    with pytest.raises(ValueError, match="embed_norm.*input_layernorm.*--arch eagle3"):
        to_speculators(EagleDrafter.random_init(target).head, tmp_path, "org/x", [])


def _edit(folder, fn):
    raw = json.loads((folder / "config.json").read_text())
    fn(raw)
    (folder / "config.json").write_text(json.dumps(raw))


@pytest.mark.parametrize("field, edit", [
    ("transformer_layer_config.vocab_size", lambda r: r["transformer_layer_config"].update(vocab_size=r["transformer_layer_config"]["vocab_size"] + 1)),
    ("transformer_layer_config.hidden_size", lambda r: r["transformer_layer_config"].update(hidden_size=128)),
    ("target_hidden_size", lambda r: r.update(target_hidden_size=128)),
    ("eagle_aux_hidden_state_layer_ids", lambda r: r.update(eagle_aux_hidden_state_layer_ids=[0, 1, 2])),
    ("transformer_layer_config.rope_theta", lambda r: r["transformer_layer_config"]["rope_parameters"].update(rope_theta=12345.0)),
    ("rope_type", lambda r: r["transformer_layer_config"]["rope_parameters"].update(rope_type="llama3")),
    ("transformer_layer_config.model_type", lambda r: r["transformer_layer_config"].update(model_type="qwen3")),
    ("norm_before_fc", lambda r: r.update(norm_before_fc=True)),
    ("speculators_model_type", lambda r: r.update(speculators_model_type="eagle")),
])
def test_a_speculators_drafter_that_does_not_fit_is_refused_naming_the_field(tmp_path, field, edit):
    target = tiny_target("llava")
    to_speculators(_drafter(target).head, tmp_path / "ok", "org/x", [])
    load_drafter(str(tmp_path / "ok"), target)  # negative control: the folder as written loads
    to_speculators(_drafter(target).head, tmp_path / "bad", "org/x", [])
    _edit(tmp_path / "bad", edit)
    with pytest.raises(DrafterLoadError, match=field.replace(".", r"\.")):
        load_drafter(str(tmp_path / "bad"), target)


def test_speculators_weights_that_do_not_fit_are_refused(tmp_path):
    target = tiny_target("llava")
    to_speculators(_drafter(target).head, tmp_path, "org/x", [])
    w = load_file(str(tmp_path / "model.safetensors"))
    for name, change, word in (
        ("d2t", lambda t: t.__setitem__("d2t", torch.zeros_like(t["d2t"])), "d2t"),  # ids, not offsets: repeats
        ("embed_tokens.weight", lambda t: t.__setitem__("embed_tokens.weight", t["embed_tokens.weight"] + 1), "embed_tokens"),
        ("fc.weight", lambda t: t.pop("fc.weight"), "missing"),
    ):
        bad = dict(w)
        change(bad)
        save_file(bad, str(tmp_path / "model.safetensors"))
        with pytest.raises(DrafterLoadError, match=word):
            load_drafter(str(tmp_path), target)
    save_file(w, str(tmp_path / "model.safetensors"))
    load_drafter(str(tmp_path), target)  # control


def test_cli_export_writes_the_format_and_refuses_an_eagle1_drafter_in_one_line(capsys, model_dir, tmp_path):
    from vlmspec.cli import main
    from vlmspec.target import load_target

    target = load_target(model_dir)
    EagleDrafter.random_init(target, seed=2, arch="eagle3").save(tmp_path / "e3")
    EagleDrafter.random_init(target, seed=2).save(tmp_path / "e1")
    assert main(["export", str(tmp_path / "e3"), "--format", "speculators", "--model", str(model_dir), "--out", str(tmp_path / "out")]) == 0
    raw = json.loads((tmp_path / "out" / "config.json").read_text())
    assert raw["speculators_config"]["verifier"]["name_or_path"] == str(model_dir.resolve())
    assert raw["speculators_config"]["verifier"]["architectures"] == ["LlavaForConditionalGeneration"]
    back = load_drafter(str(tmp_path / "out"), target)  # and it reads back
    assert back.feature_layers == tuple(raw["eagle_aux_hidden_state_layer_ids"])
    capsys.readouterr()
    assert main(["export", str(tmp_path / "e1"), "--model", str(model_dir), "--out", str(tmp_path / "no")]) == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if "error" in line]  # (weight-loading progress aside)
    assert len(err) == 1 and err[0].startswith("vlmspec export: error:") and "EAGLE-1 drafter does not export exactly" in err[0]
    assert "--arch eagle3" in err[0]
    assert not (tmp_path / "no").exists()


def test_chosen_feature_layers_are_the_heads_and_bad_choices_are_refused_at_the_edge():
    from vlmspec.cli.options import UsageError
    from vlmspec.cli.train import feature_layer_ids
    from vlmspec.train.distill import new_head

    assert feature_layer_ids("27,15,2", 30) == (2, 15, 27)
    for bad in ("a,b", "15", "2,2", "2,30", "-1,4"):
        with pytest.raises(UsageError, match="--feature-layers"):
            feature_layer_ids(bad, 30)
    with pytest.raises(ValueError, match="eagle3"):
        DistillConfig(arch="eagle1", feature_layers=(0, 1))
    target = tiny_target("llava")
    assert new_head(target, DistillConfig(arch="eagle3")).config.feature_layers == [0, 1]  # the default on 2 layers
    assert new_head(target, DistillConfig(arch="eagle3", feature_layers=(1, 0))).config.feature_layers == [1, 0]  # the choice, as given
