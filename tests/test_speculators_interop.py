"""EAGLE-3 against the reference implementation, the `speculators` package (PyPI), not only our own
reader: it loads what `vlmspec export` writes and its draft forward gives vlmspec's logits on the
same inputs (fp32); a drafter speculators makes itself loads in vlmspec and keeps greedy parity.

speculators pins transformers<=5.19, so it runs in an environment of its own
(`bash scripts/speculators-env.sh` makes .venv-speculators, about 1.5 minutes), driven through a
subprocess (tests/interop/speculators_side.py). Without that environment the tests are skipped,
except under CI (CI=true), where .ci/run makes it and a missing one fails.
"""
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from vlmspec.draft import load_drafter
from vlmspec.draft.base import TreeConfig
from vlmspec.draft.eagle import EagleConfig, EagleDrafter, build_head
from vlmspec.draft.eagle.speculators_format import to_speculators
from vlmspec.engine import GenerationConfig, SpecEngine
from vlmspec.inputs import encode_prompt
from vlmspec.target import load_target
from testing.tiny import tiny_image

ROOT = Path(__file__).resolve().parents[1]
PYTHON = Path(os.environ.get("VLMSPEC_SPECULATORS_PYTHON", ROOT / ".venv-speculators" / "bin" / "python"))
SIDE = Path(__file__).resolve().parent / "interop" / "speculators_side.py"
# fp32 logits of the same head from two implementations: equal to float rounding (different matmul
# orders, attention kernels); the bound is far below any real difference (a wrong norm or offset moves them by O(1))
RTOL = ATOL = 1e-4

pytestmark = [
    pytest.mark.interop,
    pytest.mark.skipif(not PYTHON.is_file() and os.environ.get("CI") != "true",
                       reason=f"no speculators environment at {PYTHON} (bash scripts/speculators-env.sh makes it)"),
]


def _speculators(*args: str) -> None:
    assert PYTHON.is_file(), f"CI needs the speculators environment at {PYTHON}: bash scripts/speculators-env.sh"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="2")
    run = subprocess.run([str(PYTHON), str(SIDE), *args], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]


def _eagle3(target, k=48, seed=11):
    torch.manual_seed(seed)
    cfg = EagleConfig.from_target(target, "eagle3")
    cfg.draft_vocab_size, cfg.norm_before_residual = k, True
    head = build_head(cfg, target.input_embeddings(), target.output_embeddings(), target.attention)
    head.set_draft_vocab(torch.randperm(target.vocab_size, generator=torch.Generator().manual_seed(seed))[:k].sort().values)
    with torch.no_grad():  # every weight away from its initial value
        for name, p in head.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else p + 0.05 * torch.randn_like(p))
    return EagleDrafter(head.float().eval(), TreeConfig(4, 3, 10))


def test_speculators_loads_our_export_and_its_forward_gives_our_logits(model_dir, tmp_path):
    target = load_target(model_dir)
    drafter = _eagle3(target)
    head = drafter.head
    to_speculators(head, tmp_path / "drafter", str(model_dir), ["LlavaForConditionalGeneration"])
    g = torch.Generator().manual_seed(0)
    n = 9
    hidden = torch.randn(1, n, head.config.feature_width, generator=g)  # the target layers' states [1, n, mH]
    ids = torch.randint(target.vocab_size, (1, n), generator=g)
    pos = torch.arange(3, 3 + n)[None]
    save_file({"hidden_states": hidden, "input_ids": ids, "position_ids": pos}, str(tmp_path / "inputs.safetensors"))
    _speculators("logits", str(tmp_path / "drafter"), str(tmp_path / "inputs.safetensors"), str(tmp_path / "theirs.safetensors"))
    theirs = load_file(str(tmp_path / "theirs.safetensors"))
    with torch.no_grad():
        ours = head.logits(head(ids, hidden, pos, None, None))[0]  # [n, K], causal over the n rows
    assert torch.equal(theirs["target_ids"], head.d2t)  # their offsets give our draft vocabulary
    torch.testing.assert_close(theirs["logits"], ours, rtol=RTOL, atol=ATOL)
    # negative control: the same weights read with the other residual rule are told apart at this tolerance
    head.config.norm_before_residual = False
    with torch.no_grad():
        other = head.logits(head(ids, hidden, pos, None, None))[0]
    assert not torch.allclose(theirs["logits"], other, rtol=RTOL, atol=ATOL)


def test_a_drafter_speculators_made_loads_and_keeps_greedy_parity(model_dir, tmp_path):
    _speculators("make", str(model_dir), str(tmp_path / "made"), "64", "5")
    target = load_target(model_dir)
    drafter = load_drafter(str(tmp_path / "made"), target, TreeConfig(4, 3, 10))
    assert drafter.feature_layers == (0, 1) and drafter.head.config.draft_vocab_size == 64
    for text, seeds in (("describe the image in detail", [0]), ("once upon a time", [])):
        inputs = encode_prompt(target, text, [tiny_image(s) for s in seeds])
        ref = target.model.generate(**inputs, max_new_tokens=24, do_sample=False, eos_token_id=None)[0, inputs["input_ids"].shape[1]:]
        got = SpecEngine(target, drafter).generate(inputs, GenerationConfig(max_new_tokens=24, ignore_eos=True)).token_ids
        assert got == ref.tolist(), text
