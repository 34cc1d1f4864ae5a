"""On CUDA the engine never takes cuDNN's SDPA backend (vlmspec/target/sdpa.py): cuDNN plans each
shape it has not met, at 68 ms to 1.7 s a call on an H200, and decoding meets new key lengths at
nearly every step. Counted with torch's profiler, not guessed."""
import contextlib

import pytest
import torch

import vlmspec.engine.batch
from vlmspec.draft.base import TreeConfig
from vlmspec.draft.eagle import EagleDrafter
from vlmspec.engine import GenerationConfig, SpecEngine
from vlmspec.inputs import encode_prompt
from vlmspec.target import Target
from testing.tiny import build_tiny, tiny_image

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CUDNN_SDPA = "aten::_cudnn_attention_forward"
SDPA = "aten::scaled_dot_product_attention"


def _op_counts(run) -> dict[str, int]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run()
    return {e.key: e.count for e in prof.key_averages() if e.key in (CUDNN_SDPA, SDPA)}


def test_a_batched_generation_never_takes_cudnns_sdpa(monkeypatch):
    """Three requests of different prompts decoded together in bf16 with an EAGLE drafter (its
    attention is masked SDPA; the tiny target's too) call SDPA and never cuDNN's backend. Negative
    control: the same generation with the engine's context replaced by torch's own choice takes
    cuDNN's backend (skipped where this torch and GPU never would)."""
    model, processor = build_tiny("llava", seed=0)
    target = Target(model.to(device="cuda", dtype=torch.bfloat16), processor, name="tiny-llava-cuda-bf16")
    drafter = EagleDrafter.random_init(target, TreeConfig(depth=3, top_k=2, total_tokens=6), seed=0)
    engine = SpecEngine(target, drafter)
    prompts = [encode_prompt(target, "describe the image in detail", [tiny_image(0)]),
               encode_prompt(target, "once upon a time", []),
               encode_prompt(target, "what is in this picture, and why is it there", [tiny_image(1)])]
    config = GenerationConfig(max_new_tokens=12, ignore_eos=True)

    def generate() -> None:
        engine.generate_many([(p, config) for p in prompts], slots=3)

    generate()  # warm-up
    ours = _op_counts(generate)
    monkeypatch.setattr(vlmspec.engine.batch, "decoding_sdpa", lambda device: contextlib.nullcontext())
    torchs = _op_counts(generate)
    print(f"\nSDPA calls, cuDNN's among them: engine {ours}; torch's own choice {torchs}")
    assert ours.get(SDPA, 0) > 0
    assert ours.get(CUDNN_SDPA, 0) == 0
    if torchs.get(CUDNN_SDPA, 0) == 0:
        pytest.skip("torch never picks cuDNN's SDPA for these shapes on this GPU: the negative control cannot show it")


def test_auto_attention_on_cuda_is_sdpa_and_the_kernel_is_asked_for():
    """'auto' on CUDA picks transformers' SDPA (run without cuDNN's backend by the engine), not the
    Triton tree kernel, which took 2-5x SDPA's time per call on an H200 (docs/batching.md).
    Negative control: asking for 'triton' registers the kernel where Triton is importable."""
    from vlmspec.kernels import tree_attention
    from vlmspec.target import set_attention

    model, _ = build_tiny("llava", seed=0)
    model = model.to("cuda")
    assert set_attention(model, "auto") == "sdpa"
    if tree_attention.kernel_available():
        assert set_attention(model, "triton") != "sdpa"
