"""`vlmspec generate`: JSON contract, parity with HF generate, one-line errors with exit code 2."""
import json
import subprocess
import sys

import pytest

from vlmspec.cli import main
from vlmspec.testing.tiny import build_tiny, tiny_image
from vlmspec.target import load_target
from vlmspec.prompts import encode_prompt


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_llava")
    model, processor = build_tiny("llava")
    model.save_pretrained(d)
    processor.save_pretrained(d)
    return d


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
        (["--drafter", "/no/drafter"], "neither 'none', 'ngram' nor a drafter folder"),
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
