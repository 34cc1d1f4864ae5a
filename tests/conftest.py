import functools
import os

import pytest
import torch

torch.set_num_threads(min(2, torch.get_num_threads()))


@functools.lru_cache(maxsize=None)
def tiny_target(arch: str, seed: int = 0):
    """A Target over a tiny random HF VLM of `arch` (built once per test session)."""
    from vlmspec.target import Target
    from vlmspec.testing.tiny import build_tiny

    model, processor = build_tiny(arch, seed=seed)
    # VLMSPEC_TEST_DEVICE=cuda runs the tiny-model tests on a GPU (scripts/gpu-check.sh does, for the batch tests)
    return Target(model.to(os.environ.get("VLMSPEC_TEST_DEVICE", "cpu")), processor, name=f"tiny-{arch}")


@pytest.fixture(params=["llava", "qwen2_5_vl", "idefics3"])
def arch(request):
    return request.param


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny LLaVA saved as a model folder (what the CLI and the trainers load from disk)."""
    from vlmspec.testing.tiny import build_tiny

    d = tmp_path_factory.mktemp("tiny_llava")
    model, processor = build_tiny("llava")
    model.save_pretrained(d)
    processor.save_pretrained(d)
    return d
