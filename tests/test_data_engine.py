"""The data engine (`vlmspec data`, issue #71) on a tiny random LLaVA: the corpus' greedy answers
are the target's own (oracle: `engine.generate` on the corpus as it reads back), a killed run
resumes to the same bytes without losing a completed shard, a corrupt shard is reported with its
path and never read, held-out prompts and photographs never enter it, and training's reader reads it."""

from __future__ import annotations

import functools
import hashlib
import json
import random

import numpy as np
import pytest

from conftest import tiny_target
from vlmspec.cli import main
from vlmspec.data import corpus
from vlmspec.data.heldout import PHOTO_QUESTIONS, TEXT_PROMPTS
from vlmspec.data.photos import CATALOGUE, Photo, PhotoSource, available_photos, heldout_photo_hashes
from vlmspec.data.prompts import (FOLLOWUPS, PHOTO_FOLLOWUPS, PHOTO_QUESTIONS_BY_KIND, TEXT_TEMPLATES, TOPIC_FOLLOWUPS, TOPICS,
                                  is_heldout)
from vlmspec.draft.base import PlainDrafter
from vlmspec.engine import GenerationConfig, SpecEngine
from vlmspec.inputs import encode_messages, load_image_file, user_turn
from vlmspec.sampling import SamplingParams
from vlmspec.target import Target
from testing.tiny import tiny_image
from vlmspec.text import decode
from vlmspec.train.data import DataError, encode_conversations, load_jsonl, messages
from vlmspec.train.data_engine import generate_corpus
from vlmspec.train.data_plan import DataConfig, Resources, plan_shard
from vlmspec.train.magpie import usable_instruction

MODEL = {"id": "tiny-llava", "digest": "test", "dtype": "float32"}
MIX = {"text": 0.3, "followup": 0.3, "photo": 0.2, "toyworld": 0.2}


@functools.lru_cache(maxsize=None)
def _engine() -> SpecEngine:
    """Plain decoding of the tiny LLaVA, a third of its vocabulary ending a turn: a random model then
    ends its answers within a few tokens, so follow-up turns (asked after an answer that ended) happen."""
    base = tiny_target("llava")
    target = Target(base.model, base.processor, name="tiny-llava")
    target.eos_token_ids = set(range(0, target.vocab_size, 3))
    return SpecEngine(target, PlainDrafter())


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> list[Photo]:
    """Two stand-in photographs (the catalogue's need their packages; what the engine does with one is the same)."""
    folder = tmp_path_factory.mktemp("photos")
    out = []
    for i in range(2):
        path = folder / f"p{i}.png"
        tiny_image(40 + i, size=64).save(path)
        sha = hashlib.sha256(path.read_bytes()).hexdigest()
        out.append(Photo(PhotoSource("test", path.name, sha, "CC0", "a test image", "-"), path, "0"))
    return out


def _cfg(**kw) -> DataConfig:
    base = dict(samples=8, shard_size=3, shares=MIX, sampled_share=0.5, max_new_tokens=6, magpie_tokens=6, magpie_attempts=1,
                slots=4, seed=3)
    return DataConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def built(tmp_path_factory, photos):
    """One uninterrupted corpus (8 samples in shards of 3, 3 and 2)."""
    out = tmp_path_factory.mktemp("corpus")
    generate_corpus(_engine(), _cfg(), out, Resources(photos), MODEL, progress=False)
    return out


def _records(folder):
    return [json.loads(line) for f in corpus.checked_shards(folder) for line in f.read_text().splitlines()]


def _oracle_turns(folder, rec):
    """Each turn's answer as `engine.generate` alone (plain, batch of one) writes it, on the corpus as it reads back."""
    target = _engine().target
    images = [load_image_file(folder / rel) for rel in rec["images"]]
    turns = rec["conversations"]
    qs = [t["value"].replace("<image>\n", "") for t in turns[0::2]]
    answers = [t["value"] for t in turns[1::2]]
    sp = SamplingParams(rec["meta"]["sampling"]["temperature"], 0, rec["meta"]["sampling"]["top_p"])
    out = []
    for t, q in enumerate(qs):
        msgs = user_turn(q, len(images)) if t == 0 else (messages(qs[0], len(images), answers[0], list(zip(qs[1:t], answers[1:t])))
                                                         + user_turn(q, 0))
        result = _engine().generate(encode_messages(target, msgs, images), GenerationConfig(6, sp, seed=rec["meta"]["seed"] + 1000 * t))
        out.append((decode(target.tokenizer, result.token_ids).strip(), len(result.token_ids)))
    return out


def test_greedy_answers_are_the_targets_own_and_sampled_ones_are_not_greedy(built):
    recs = _records(built)
    assert {r["source"] for r in recs} == set(MIX) and any(len(r["conversations"]) > 2 for r in recs)
    greedy = [r for r in recs if r["meta"]["sampling"]["temperature"] == 0]
    sampled = [r for r in recs if r["meta"]["sampling"]["temperature"] > 0]
    assert greedy and sampled
    for r in greedy:
        oracle = _oracle_turns(built, r)
        assert [a for a, _ in oracle] == [t["value"].strip() for t in r["conversations"][1::2]], r["id"]
        assert [n for _, n in oracle] == r["meta"]["answer_tokens"]
    # the sampled rows are their seeded draws (same oracle, same seed) and not the greedy answer (negative control)
    differs = 0
    for r in sampled:
        oracle = _oracle_turns(built, r)
        assert [a for a, _ in oracle] == [t["value"].strip() for t in r["conversations"][1::2]], r["id"]
        greedy_first = _engine().generate(encode_messages(_engine().target, user_turn(r["conversations"][0]["value"].replace("<image>\n", ""), len(r["images"])),
                                                          [load_image_file(built / p) for p in r["images"]]), GenerationConfig(6))
        differs += decode(_engine().target.tokenizer, greedy_first.token_ids).strip() != r["conversations"][1]["value"].strip()
    assert differs >= 1


def test_every_record_says_what_made_it(built):
    manifest = corpus.read_manifest(built)
    assert [e["lines"] for e in manifest["shards"]] == [3, 3, 2] and manifest["totals"]["lines"] == 8
    assert manifest["model"] == MODEL and [p["file"] for p in manifest["photos"]] == ["p0.png", "p1.png"]
    for r in _records(built):
        m = r["meta"]
        assert len(m["ended"]) == len(m["answer_tokens"]) == len(m["prompt_tokens"]) == len(r["conversations"]) // 2
        assert all(n >= 1 for n in m["answer_tokens"]) and isinstance(m["seed"], int)
        assert r["open_end"] == (not m["ended"][-1])
        for rel, sha in zip(r["images"], m["image_sha256"]):
            assert hashlib.sha256((built / rel).read_bytes()).hexdigest() == sha


def test_a_killed_run_resumes_to_the_same_corpus_without_losing_a_shard(tmp_path, built, photos):
    class Killed(Exception):
        pass

    def kill_after_second(k):
        if k == 1:
            raise Killed

    with pytest.raises(Killed):
        generate_corpus(_engine(), _cfg(), tmp_path, Resources(photos), MODEL, progress=False, on_shard=kill_after_second)
    assert [e["file"] for e in corpus.read_manifest(tmp_path)["shards"]] == ["shard-00000.jsonl", "shard-00001.jsonl"]
    (tmp_path / "shard-00002.jsonl.tmp").write_text('{"half a shard')  # the shard in progress when killed
    kept = {f: (tmp_path / f).stat().st_mtime_ns for f in ("shard-00000.jsonl", "shard-00001.jsonl")}
    run = generate_corpus(_engine(), _cfg(slots=2), tmp_path, Resources(photos), MODEL, progress=False)
    assert (run.kept, run.written, run.rewritten) == (2, 1, [])
    assert {f: (tmp_path / f).stat().st_mtime_ns for f in kept} == kept  # completed shards untouched
    def content(folder):
        return [{k: v for k, v in e.items() if k != "seconds"} for e in corpus.read_manifest(folder)["shards"]]

    assert content(tmp_path) == content(built)
    for f in ("shard-00000.jsonl", "shard-00001.jsonl", "shard-00002.jsonl"):
        assert (tmp_path / f).read_bytes() == (built / f).read_bytes(), f  # the same as the uninterrupted run (fewer slots too)
    # another plan in the same folder is refused, not mixed in
    with pytest.raises(Exception, match="other options"):
        generate_corpus(_engine(), _cfg(seed=4), tmp_path, Resources(photos), MODEL, progress=False)


def test_more_samples_extend_a_corpus_and_fewer_keep_it(tmp_path, built, photos):
    first = generate_corpus(_engine(), _cfg(samples=6), tmp_path, Resources(photos), MODEL, progress=False)
    assert (first.kept, first.written) == (0, 2)
    more = generate_corpus(_engine(), _cfg(samples=8), tmp_path, Resources(photos), MODEL, progress=False)
    assert (more.kept, more.written) == (2, 1) and (tmp_path / "shard-00002.jsonl").read_bytes() == (built / "shard-00002.jsonl").read_bytes()
    fewer = generate_corpus(_engine(), _cfg(samples=3), tmp_path, Resources(photos), MODEL, progress=False)
    assert (fewer.kept, fewer.written) == (1, 0) and len(corpus.read_manifest(tmp_path)["shards"]) == 3  # nothing dropped


def test_a_corrupt_shard_is_reported_with_its_path_and_never_read(tmp_path, built, photos, capsys):
    import shutil

    folder = tmp_path / "c"
    shutil.copytree(built, folder)
    assert corpus.verify(folder).ok and main(["data", "--verify", str(folder)]) == 0  # control: intact
    capsys.readouterr()
    bad = folder / "shard-00001.jsonl"
    bad.write_bytes(bad.read_bytes().replace(b'"gpt"', b'"gpT"', 1))
    report = corpus.verify(folder)
    assert not report.ok and report.bad[0].startswith(f"{bad}: sha256") and report.good == ["shard-00000.jsonl", "shard-00002.jsonl"]
    with pytest.raises(DataError, match=str(bad)):
        load_jsonl(folder)  # what `vlmspec train --data FOLDER` reads
    assert main(["data", "--verify", str(folder)]) == 1 and str(bad) in capsys.readouterr().out
    run = generate_corpus(_engine(), _cfg(), folder, Resources(photos), MODEL, progress=False)  # a rerun writes it again
    assert run.rewritten[0].startswith(str(bad)) and run.written == 1 and bad.read_bytes() == (built / bad.name).read_bytes()
    (folder / "shard-00000.jsonl").write_text("not json\n")
    with pytest.raises(DataError, match="shard-00000.jsonl"):
        load_jsonl(folder)


def test_held_out_prompts_never_appear(tmp_path, built, photos):
    # every template the engine writes from, with every topic
    bank = [t.format(topic=x) for t in (*TEXT_TEMPLATES, *TOPIC_FOLLOWUPS) for x in TOPICS]
    bank += [*FOLLOWUPS, *PHOTO_FOLLOWUPS, *(q for qs in PHOTO_QUESTIONS_BY_KIND.values() for q in qs)]
    assert not [p for p in bank if is_heldout(p)]
    # the filter of the prompts the target writes: held out up to case and spacing, never kept; a new one kept (control)
    assert not usable_instruction("  what is the CAPITAL of france ", set()) and not usable_instruction(PHOTO_QUESTIONS[0], set())
    assert usable_instruction("What is the capital of Peru?", set())
    # a user JSONL that holds held-out prompts: they never reach the corpus, the others do
    src = tmp_path / "user.jsonl"
    prompts = [*TEXT_PROMPTS[:4], "Name a fast animal.", "Describe a quiet morning.", PHOTO_QUESTIONS[1].upper()]
    src.write_text("".join(json.dumps({"conversations": [{"from": "human", "value": p}, {"from": "gpt", "value": "x"}]}) + "\n" for p in prompts))
    from vlmspec.train.data_plan import usable_jsonl

    kept, dropped = usable_jsonl(load_jsonl(src)[0])
    out = tmp_path / "j"
    generate_corpus(_engine(), _cfg(shares={"jsonl": 1.0}, jsonl=str(src), samples=4, shard_size=4), out, Resources(photos, kept), MODEL, progress=False)
    asked = [t["value"] for r in _records(out) for t in r["conversations"][0::2]]
    assert dropped == 5 and sorted(set(asked)) == ["Describe a quiet morning.", "Name a fast animal."]
    asked = [t["value"].replace("<image>\n", "") for r in _records(built) for t in r["conversations"][0::2]]
    assert asked and not [q for q in asked if is_heldout(q)]


def test_a_row_the_engine_fails_ends_its_sample_alone(tmp_path, photos, monkeypatch, capsys):
    """A prompt whose prefill raises (here: over 120 tokens, by a patched prefill) loses that sample,
    said on stderr and counted; the others are written, the same as without it (control)."""
    target = _engine().target
    real = target.prefill

    def prefill(inputs, *a, **kw):
        if inputs["input_ids"].shape[1] > 120:
            raise ValueError("prompt over the test's limit")
        return real(inputs, *a, **kw)

    monkeypatch.setattr(target, "prefill", prefill)
    src = tmp_path / "user.jsonl"
    prompts = ["Name a fast animal.", "word " * 200, "Describe a quiet morning."]
    src.write_text("".join(json.dumps({"conversations": [{"from": "human", "value": p}, {"from": "gpt", "value": "x"}]}) + "\n" for p in prompts))
    kept = load_jsonl(src)[0]
    run = generate_corpus(_engine(), _cfg(shares={"jsonl": 1.0}, jsonl=str(src), samples=3, shard_size=3), tmp_path / "a",
                          Resources(photos, kept), MODEL, progress=False)
    totals = corpus.read_manifest(tmp_path / "a")["totals"]
    assert run.written == 1 and (totals["lines"], totals["failed_rows"], totals["dropped_empty"]) == (2, 1, 1)
    assert "left at turn 0: ValueError: prompt over the test's limit" in capsys.readouterr().err
    answers = {r["conversations"][0]["value"]: r["conversations"][1]["value"] for r in _records(tmp_path / "a")}
    assert sorted(answers) == ["Describe a quiet morning.", "Name a fast animal."]
    monkeypatch.undo()  # control: without the failure all three are written, the two others as they were
    generate_corpus(_engine(), _cfg(shares={"jsonl": 1.0}, jsonl=str(src), samples=3, shard_size=3), tmp_path / "b",
                    Resources(photos, kept), MODEL, progress=False)
    assert corpus.read_manifest(tmp_path / "b")["totals"]["failed_rows"] == 0
    again = {r["conversations"][0]["value"]: r["conversations"][1]["value"] for r in _records(tmp_path / "b")}
    assert len(again) == 3 and {q: again[q] for q in answers} == answers


def test_the_photo_catalogue_holds_no_held_out_photograph():
    held = heldout_photo_hashes()
    assert len(held) >= 5  # the five sample photographs and the ToyWorld renders in assets/images
    assert not {s.sha256 for s in CATALOGUE} & held
    assert not {s.package for s in CATALOGUE} & {"skimage", "scikit-image", "matplotlib", "sklearn", "scikit-learn", "scipy"}
    # negative control: an entry that points at a held-out photograph is left out, and says why
    from vlmspec.assets import SAMPLE_IMAGES

    sha = hashlib.sha256((SAMPLE_IMAGES / "cat.jpg").read_bytes()).hexdigest()
    entry = PhotoSource("vlmspec", "../assets/images/cat.jpg", sha, "-", "held out", "-")
    found, missing = available_photos((entry,))
    assert not found and missing == ["vlmspec/../assets/images/cat.jpg: a held-out photograph"]


def test_training_reads_the_corpus(built):
    convs, problems = load_jsonl(built)
    recs = _records(built)
    assert not problems and len(convs) == len(recs) == 8
    for c, r in zip(convs, recs):
        assert len(c.images) == len(r["images"]) and len(c.followups) == len(r["conversations"]) // 2 - 1
        assert c.answer == r["conversations"][1]["value"] and c.open_end == r["open_end"]
    enc = encode_conversations(_engine().target.processor, convs)
    assert (enc["labels"] != -100).sum(1).min() > 0  # every conversation supervises its answers


def test_the_plan_is_a_function_of_the_config_and_the_shard(photos):
    cfg = _cfg(samples=40, shard_size=20)
    a, b = plan_shard(cfg, 1, Resources(photos)), plan_shard(cfg, 1, Resources(photos))
    assert [(s.source, s.turns, s.seed, s.files) for s in a] == [(s.source, s.turns, s.seed, s.files) for s in b]
    counts = {src: sum(s.source == src for s in a) for src in MIX}
    assert counts == {"text": 6, "followup": 6, "photo": 4, "toyworld": 4}
    first = {src: sum(s.source == src for s in plan_shard(_cfg(), 0, Resources(photos))) for src in MIX}
    assert max(abs(first[s] - 3 * MIX[s]) for s in MIX) < 1  # a shard of 3 holds each source within one sample of its share
    seeds = [s.info["toyworld_seed"] for k in (0, 1) for s in plan_shard(cfg, k, Resources(photos)) if s.source == "toyworld"]
    assert len(set(seeds)) == len(seeds) == 8  # each shard takes the next ToyWorld seeds
    sampled = sum(s.sampling.temperature > 0 for k in (0, 1) for s in plan_shard(cfg, k, Resources(photos)))
    assert 8 <= sampled <= 32  # --sampled-share 0.5 of 40 (binomial, 4.7 sd either side)


def test_cli_writes_and_checks_a_corpus(tmp_path, model_dir, capsys):
    out = tmp_path / "cli"
    argv = ["data", "--model", str(model_dir), "--out", str(out), "--samples", "3", "--shard-size", "2", "--max-new-tokens", "4",
            "--photo", "0", "--followup", "0", "--json"]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["shards_written"] == 2 and summary["samples"] == 3
    assert corpus.read_manifest(out)["model"]["digest"] == corpus.folder_digest(model_dir)
    assert main(argv) == 0 and json.loads(capsys.readouterr().out.strip().splitlines()[-1])["shards_kept"] == 2
    assert main(["data", "--samples", "2"]) == 2 and "--out" in capsys.readouterr().err
    assert main(["data", "--out", str(tmp_path / "x"), "--jsonl-share", "1"]) == 2 and "--jsonl" in capsys.readouterr().err


def test_augmented_photographs_vary_with_the_seed(photos):
    from vlmspec.data.photos import augment

    base = photos[0].image()
    a, pa = augment(base, random.Random(1))
    b, pb = augment(base, random.Random(1))
    c, pc = augment(base, random.Random(2))
    assert pa == pb and a.tobytes() == b.tobytes()
    assert pa != pc and (a.size != c.size or a.tobytes() != c.tobytes())  # control: another seed, another image
    assert np.asarray(a).astype(float).std() > 0
