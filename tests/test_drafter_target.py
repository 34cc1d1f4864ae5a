"""A trained drafter records its target (#75): `vlmspec train` writes the target's name and a digest
of the config fields the head depends on into the drafter's config (`trained_for`); `export`,
`generate` and `serve` take that target when no --model is given; a --model of another digest is
refused with a message that names both; drafters written before this (no record) load as before."""

from __future__ import annotations

import json
import shutil

import pytest

from vlmspec import assets, factory
from vlmspec.cli import main
from vlmspec.draft.eagle import EagleDrafter
from vlmspec.draft.eagle.config import fields_digest, target_fields
from vlmspec.errors import ConfigError, DrafterLoadError

pytestmark = pytest.mark.skipif(assets.bundled_target() is None, reason="needs the committed toy model (assets/toyworld-vlm)")


def run(capsys, argv: list[str]) -> tuple[int, str, str]:
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """An EAGLE-3 head trained for two steps on the toy by `vlmspec train` (what export writes)."""
    out = tmp_path_factory.mktemp("e3")
    assert main(["train", "--target", "toy", "--arch", "eagle3", "--steps", "2", "--batch-size", "2", "--eval-n", "0",
                 "--out", str(out), "--json"]) == 0
    return out / "drafter"


@pytest.fixture(scope="module")
def toy():
    return factory.load(factory.EngineSpec(model="toy", device="cpu", dtype="float32"))


def test_train_records_the_target_and_a_digest_of_its_fields(trained, toy):
    record = json.loads((trained / "config.json").read_text())["trained_for"]
    assert record["model"] == "toy" and record["path"] == ""  # the toy is found by name on any machine
    assert record["fields"] == target_fields(toy) and record["digest"] == fields_digest(target_fields(toy))
    assert record["fields"]["hidden_size"] == 160 and record["fields"]["num_hidden_layers"] == 8
    assert factory.resolve_model(None, str(trained)) == str(assets.BUNDLED_TARGET)
    assert factory.resolve_model("elsewhere", str(trained)) == "elsewhere"  # a --model given wins
    assert factory.resolve_model(None, f"{trained}+suffix") == str(assets.BUNDLED_TARGET)  # beside the suffix drafter: the same


def test_export_needs_no_model_and_a_mismatched_one_names_both(trained, tmp_path, capsys, model_dir):
    code, out, err = run(capsys, ["export", str(trained), "--format", "speculators", "--out", str(tmp_path / "spec")])
    assert code == 0, err
    assert f"verifier {assets.BUNDLED_TARGET.resolve()}" in out  # the recorded target, not the default model
    code, _, err = run(capsys, ["export", str(trained), "--format", "speculators", "--out", str(tmp_path / "bad"), "--model", str(model_dir)])
    assert code == 2 and not (tmp_path / "bad").exists()
    line = err.strip().splitlines()[-1]
    assert f"trained for a different target: for toy, and the model given is {model_dir.name}" in line, line
    assert "hidden_size: drafter 160 != target" in line and "Leave --model out" in line and "--model toy" in line
    # the speculators folder names its verifier: it is that drafter's default --model too
    assert factory.resolve_model(None, str(tmp_path / "spec")) == str(assets.BUNDLED_TARGET.resolve())


def test_generate_and_serve_take_the_recorded_target(model_dir, tmp_path, capsys, monkeypatch):
    """A drafter recorded for another folder (the tiny LLaVA): generate without --model loads that
    folder, not the default; serve says it loads it."""
    target = factory.load(factory.EngineSpec(model=str(model_dir), device="cpu", dtype="float32"))
    drafter = tmp_path / "d"
    EagleDrafter.random_init(target, None, seed=0).save(drafter)
    record = json.loads((drafter / "config.json").read_text())["trained_for"]
    assert record["model"] == model_dir.name and record["path"] == str(model_dir.resolve())
    code, out, err = run(capsys, ["generate", "--drafter", str(drafter), "--prompt", "hello there", "--max-new-tokens", "4",
                                  "--policy", "fixed", "--json"])
    assert code == 0, err
    assert json.loads(out)["drafter"] == "eagle" and 1 <= len(json.loads(out)["token_ids"]) <= 4

    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")

    def stop(spec):
        raise ConfigError(f"stopped before loading {spec.model}")

    monkeypatch.setattr(factory, "build_engine", stop)
    code, _, err = run(capsys, ["serve", "--drafter", str(drafter), "--port", "0"])
    assert code == 2 and f"loading {model_dir.resolve()} (drafter: {drafter})" in err, err


def test_a_recorded_target_that_is_not_here_says_what_to_pass(trained, tmp_path):
    moved = tmp_path / "d"
    shutil.copytree(trained, moved)
    raw = json.loads((moved / "config.json").read_text())
    raw["trained_for"].update(model="my-vlm", path=str(tmp_path / "gone" / "my-vlm"))
    (moved / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=r"trained for my-vlm \(at .*gone/my-vlm\), which is not on this machine: pass --model"):
        factory.resolve_model(None, str(moved))


def test_a_digest_of_other_fields_is_refused_and_a_drafter_without_a_record_loads(trained, toy, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(trained, other)
    raw = json.loads((other / "config.json").read_text())
    raw["trained_for"]["fields"]["num_hidden_layers"] = 9  # same width and vocabulary: only the digest tells them apart
    raw["trained_for"]["digest"] = fields_digest(raw["trained_for"]["fields"])
    (other / "config.json").write_text(json.dumps(raw))
    with pytest.raises(DrafterLoadError, match=r"for toy, and the model given is toy \(num_hidden_layers: drafter's target 9 != target 8\)"):
        EagleDrafter.load(other, toy)
    old = tmp_path / "old"  # as drafters were written before #75: no trained_for
    shutil.copytree(trained, old)
    raw = json.loads((old / "config.json").read_text())
    del raw["trained_for"]
    (old / "config.json").write_text(json.dumps(raw))
    assert EagleDrafter.load(old, toy).head.config.trained_for == {}
    assert factory.resolve_model(None, str(old)) == factory.resolve_model(None)  # today's default


def test_the_bundled_drafters_record_their_targets(toy):
    for drafter, name in ((assets.BUNDLED_DRAFTER, "toy"), (assets.DEFAULT_DRAFTER, assets.DEFAULT_TARGET_NAME)):
        record = json.loads((drafter / "config.json").read_text())["trained_for"]
        assert record["model"] == name and record["path"] == "" and record["digest"] == fields_digest(record["fields"])
    assert json.loads((assets.BUNDLED_DRAFTER / "config.json").read_text())["trained_for"]["fields"] == target_fields(toy)
    assert factory.resolve_model(None, str(assets.BUNDLED_DRAFTER)) == str(assets.BUNDLED_TARGET)
    if assets.default_target() is None:  # the default model's drafter names a model make setup builds
        with pytest.raises(ConfigError, match=r"trained for smolvlm-toyworld, which is not on this machine \(`make setup` builds it\)"):
            factory.resolve_model(None, str(assets.DEFAULT_DRAFTER))
    else:
        assert factory.resolve_model(None, str(assets.DEFAULT_DRAFTER)) == str(assets.DEFAULT_TARGET)
