"""The offline feature cache (`vlmspec features`, `vlmspec train --data CACHE`): its batches are the
online teacher's (the oracle), a killed build resumes without losing a shard, a corrupt shard is
named and never trained on, and a head trains from it without a target forward."""
import json

import pytest
import torch

from conftest import tiny_target
from testing.tiny import tiny_image
from vlmspec.train.data import DataError, encode_conversations, load_jsonl
from vlmspec.train.distill import DistillConfig, train_drafter
from vlmspec.train.distill_losses import teacher
from vlmspec.train import features as F


def _corpus(folder, n: int = 6):
    """A JSONL of n conversations: with an image or without, some with a follow-up turn."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(n):
        turns = [{"from": "human", "value": ("<image>\n" if i % 2 == 0 else "") + f"Say something about thing {i}."},
                 {"from": "gpt", "value": f"Thing {i} is red and round, and it sits on a table."}]
        if i % 3 == 2:
            turns += [{"from": "human", "value": "And its colour?"}, {"from": "gpt", "value": "Red, as I said."}]
        images = []
        if i % 2 == 0:
            tiny_image(i).save(folder / f"im{i}.png")
            images = [f"im{i}.png"]
        lines.append(json.dumps({"images": images, "conversations": turns}))
    path = folder / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def target():
    return tiny_target("llava")


def _build(target, data, out, **kw):
    kw = {"shard_size": 2, "batch_size": 2, "progress": False, **kw}
    return F.build_features(target, "tiny-llava", data, out, F.FeatureSpec(None, kw.pop("top_k", target.vocab_size)), **kw)


def test_a_cached_batch_is_the_online_teachers_batch(target, tmp_path):
    """Oracle: ids, labels, features (to bf16) and the teacher's logits at every row the loss reads
    (with k = the whole vocabulary; to fp16) equal those of the online forward."""
    data = _corpus(tmp_path / "corpus")
    _build(target, data, tmp_path / "cache")
    cache = F.FeatureCache(tmp_path / "cache")
    convs, _ = load_jsonl(data)
    assert len(cache) == len(convs) == 6
    for lo in (0, 2, 4):
        online = encode_conversations(target.processor, convs[lo : lo + 2])
        feats, logits, _ = teacher(target, online)
        got = F.collate([cache[lo], cache[lo + 1]], target.vocab_size)
        T = got["input_ids"].shape[1]
        assert T == int(online["attention_mask"].sum(1).max())
        assert torch.equal(got["input_ids"], online["input_ids"][:, :T] * online["attention_mask"][:, :T])
        assert torch.equal(got["labels"], online["labels"][:, :T])
        for b in range(2):
            L = int(online["attention_mask"][b].sum())
            assert torch.equal(got["feats"][b, :L], feats[b, :L].to(torch.bfloat16).float())
            teach = torch.zeros(L, dtype=torch.bool)
            teach[:-1] = online["labels"][b, 1:L] != -100
            assert teach.any()
            assert torch.equal(got["logits"][b, :L][teach], logits[b, :L][teach].to(torch.float16).float())
            assert (got["logits"][b, :L][~teach] == torch.finfo(torch.float32).min).all()  # rows the loss never reads


def test_top_k_keeps_the_teachers_best_tokens_and_nothing_else(target, tmp_path):
    data = _corpus(tmp_path / "corpus", 2)
    _build(target, data, tmp_path / "cache", top_k=4)
    cache = F.FeatureCache(tmp_path / "cache")
    convs, _ = load_jsonl(data)
    _, logits, _ = teacher(target, encode_conversations(target.processor, convs))
    got = F.collate([cache[0], cache[1]], target.vocab_size)["logits"]
    s = cache[0]
    teach = torch.zeros(len(s.ids), dtype=torch.bool)
    teach[:-1] = s.answer[1:]
    rows = got[0, : len(s.ids)][teach]
    assert ((rows > torch.finfo(torch.float32).min).sum(-1) == 4).all()
    assert torch.equal(rows.argmax(-1), logits[0, : len(s.ids)][teach].argmax(-1))  # the teacher's choice survives


def test_a_killed_build_resumes_and_loses_no_shard(target, tmp_path, monkeypatch):
    data = _corpus(tmp_path / "corpus")
    straight = _build(target, data, tmp_path / "straight")
    real, calls = F._encode_shard, []

    def dies_on_the_third(*args, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt  # a kill while the third shard is computed
        return real(*args, **kw)

    monkeypatch.setattr(F, "_encode_shard", dies_on_the_third)
    with pytest.raises(KeyboardInterrupt):
        _build(target, data, tmp_path / "split")
    assert len(json.loads((tmp_path / "split" / "manifest.json").read_text())["shards"]) == 2
    monkeypatch.setattr(F, "_encode_shard", real)
    resumed = _build(target, data, tmp_path / "split")
    assert [s["sha256"] for s in resumed["shards"]] == [s["sha256"] for s in straight["shards"]]  # as if never killed
    with pytest.raises(F.FeatureCacheError, match="top_k differ"):  # other settings never mix into a cache
        _build(target, data, tmp_path / "split", top_k=3)


def test_a_corrupt_shard_is_named_and_never_trained_on(target, tmp_path):
    data = _corpus(tmp_path / "corpus")
    _build(target, data, tmp_path / "cache")
    shard = tmp_path / "cache" / F.shard_name(1)
    raw = bytearray(shard.read_bytes())
    raw[-5] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with pytest.raises(F.FeatureCacheError, match=str(shard)):
        F.FeatureCache(tmp_path / "cache")
    cfg = DistillConfig(steps=2, batch_size=2, warmup=1, eval_n=0, ckpt_every=1)
    with pytest.raises(DataError, match="corrupt feature shard"):
        train_drafter(target, str(tmp_path / "cache"), tmp_path / "run", cfg, progress=False)
    assert not (tmp_path / "run" / "checkpoint").exists()  # nothing trained


def test_a_head_trains_from_the_cache_without_a_target_forward(target, tmp_path, monkeypatch):
    data = _corpus(tmp_path / "corpus")
    _build(target, data, tmp_path / "cache")
    calls = []
    real_forward = target.model.forward
    monkeypatch.setattr(target.model, "forward", lambda *a, **kw: calls.append(1) or real_forward(*a, **kw))
    cfg = DistillConfig(steps=16, batch_size=2, lr=3e-3, warmup=2, eval_n=0, ckpt_every=8, draft_vocab=64, draft_vocab_samples=6)
    train_drafter(target, str(tmp_path / "cache"), tmp_path / "run", cfg, progress=False)
    assert not calls  # the teacher came from the cache
    history = json.loads((tmp_path / "run" / "checkpoint" / "trainer_state.json").read_text())["history"]
    losses = [h["loss"] for h in history if "loss" in h]
    assert len(losses) == 16 and sum(losses[-4:]) < 0.9 * sum(losses[:4]), losses
    # what a cache cannot train says so before anything runs
    with pytest.raises(DataError, match="layers"):
        train_drafter(target, str(tmp_path / "cache"), tmp_path / "e3", DistillConfig(steps=1, batch_size=2, eval_n=0, arch="eagle3"),
                      progress=False)
    with pytest.raises(DataError, match="--regenerate"):
        train_drafter(target, str(tmp_path / "cache"), tmp_path / "rg", DistillConfig(steps=1, batch_size=2, eval_n=0, regenerate=True),
                      progress=False)
