"""Engine-level greedy parity through the Triton tree kernel (Triton's interpreter on CPU, or CUDA)."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    from testing.tiny import build_tiny, tiny_image
    from vlmspec.target import Target, set_attention
    from vlmspec.inputs import encode_prompt
    from vlmspec.engine import SpecEngine, GenerationConfig
    from vlmspec.draft import TreeConfig
    from vlmspec.draft.eagle import EagleDrafter
    from vlmspec.kernels import tree_attention as ta

    out = {}
    for arch in sys.argv[1].split(","):
        model, processor = build_tiny(arch)
        target = Target(model, processor)
        inputs = encode_prompt(target, "describe the image", [tiny_image(0)])
        ref = model.generate(**inputs, max_new_tokens=12, do_sample=False, eos_token_id=None)[0, inputs["input_ids"].shape[1]:].tolist()
        impl = set_attention(target.model, "triton")
        ta.reset_stats()
        # a random EAGLE head always drafts a full tree (and runs its own layer through the kernel)
        drafter = EagleDrafter.random_init(target, TreeConfig(depth=3, top_k=2, total_tokens=6))
        r = SpecEngine(target, drafter).generate(inputs, GenerationConfig(max_new_tokens=12, ignore_eos=True))
        out[arch] = {"impl": impl, "match": r.token_ids == ref, "kernel_calls": ta.STATS["kernel"], "drafted": r.num_drafted}
    print(json.dumps(out))
    """
)


def _run(script: str, archs: str, cuda: bool = False) -> dict:
    """Run a script in its own process (TRITON_INTERPRET is read at the first kernel call) under
    Triton's interpreter, or on CUDA; returns the JSON it printed last."""
    if cuda:
        import torch

        if not torch.cuda.is_available():
            pytest.skip("needs CUDA")
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        script = script.replace("target = Target(model, processor)", "target = Target(model.cuda(), processor)")
    else:
        env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", script, archs], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_engine_greedy_parity_through_kernel_interpreter():
    for arch, r in _run(SCRIPT, "llava,qwen2_5_vl,idefics3").items():
        assert r["impl"] == "vlmspec_tree", r
        assert r["match"], f"{arch}: kernel path diverged from HF generate"
        assert r["drafted"] > 0 and r["kernel_calls"] > 0, f"{arch}: the kernel never ran ({r})"


@pytest.mark.gpu
def test_engine_greedy_parity_through_kernel_cuda():
    for arch, r in _run(SCRIPT, "llava,qwen2_5_vl,idefics3", cuda=True).items():
        assert r["match"] and r["kernel_calls"] > 0, (arch, r)


# A batch of requests of different prompt lengths verified through the kernel: each row at its own
# offset with its own tree (the masks described by the target, never analysed: no host sync), every
# request's tokens those of its batch-1 run through SDPA.
BATCH_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    from testing.tiny import build_tiny, tiny_image
    from vlmspec.target import Target, set_attention
    from vlmspec.inputs import encode_prompt
    from vlmspec.engine import SpecEngine, GenerationConfig
    from vlmspec.draft import TreeConfig
    from vlmspec.draft.eagle import EagleDrafter
    from vlmspec.kernels import tree_attention as ta

    out = {}
    prompts = [("describe the image", [0]), ("once upon a time there was", []), ("compare the two images in detail please", [1, 2])]
    for arch in sys.argv[1].split(","):
        model, processor = build_tiny(arch)
        target = Target(model, processor)
        engine = SpecEngine(target, EagleDrafter.random_init(target, TreeConfig(depth=3, top_k=2, total_tokens=6), seed=1))
        requests = [(encode_prompt(target, text, [tiny_image(s) for s in seeds]), GenerationConfig(max_new_tokens=10 + 3 * i, ignore_eos=True))
                    for i, (text, seeds) in enumerate(prompts)]
        alone = [engine.generate(inputs, cfg).token_ids for inputs, cfg in requests]
        impl = set_attention(target.model, "triton")
        ta.reset_stats()
        got = [r.token_ids for r in engine.generate_many(requests, slots=3)]
        out[arch] = {"impl": impl, "match": got == alone, "stats": dict(ta.STATS)}
    print(json.dumps(out))
    """
)


def _check_batch(result: dict) -> None:
    for arch, r in result.items():
        assert r["impl"] == "vlmspec_tree", r
        assert r["match"], f"{arch}: a request in the batch through the kernel differs from its batch-1 run"
        assert r["stats"]["kernel"] > 0, f"{arch}: the kernel never ran ({r})"
        assert r["stats"]["mask_analyses"] == 0, f"{arch}: a batched mask was analysed (a host sync) instead of described ({r})"


def test_batched_rows_through_kernel_interpreter():
    _check_batch(_run(BATCH_SCRIPT, "llava,qwen2_5_vl"))


@pytest.mark.gpu
def test_batched_rows_through_kernel_cuda():
    _check_batch(_run(BATCH_SCRIPT, "llava,qwen2_5_vl,idefics3", cuda=True))
