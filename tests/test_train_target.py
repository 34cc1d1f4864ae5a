"""vlmspec train-target: a smoke run on a tiny config, export loadable by the HF auto classes, exact resume."""
import json

import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from vlmspec.train.target_sft import SFTConfig, TargetArch, train

TINY = TargetArch(vision_hidden=32, vision_layers=1, vision_heads=2, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, tokenizer_corpus=300, tokenizer_vocab=600)


def _cfg(steps):
    return SFTConfig(steps=steps, batch_size=4, warmup=2, eval_every=10**6, ckpt_every=2, eval_samples=4, arch=TINY)


def test_smoke_train_export_and_resume(tmp_path):
    export = train(tmp_path, _cfg(4), progress=False)
    state = json.loads((tmp_path / "checkpoint" / "trainer_state.json").read_text())
    assert state["step"] == 4 and len([h for h in state["history"] if "loss" in h]) == 4
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
