"""Weights prepacked for oneDNN (vlmspec/kernels/packed_linear.py): F.linear's numbers, bit for bit in bf16."""
import pytest
import torch
from torch.nn import functional as F
from transformers import DynamicCache

from vlmspec.kernels.packed_linear import PackedLinear, packable, packs_on_this_cpu
from vlmspec.cache.kv_cache import cache_kwarg

BF16 = packs_on_this_cpu(torch.bfloat16)  # oneDNN's bf16 path: AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT
FP32 = packs_on_this_cpu(torch.float32)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 48), (4, 48), (17, 48), (1, 3, 48), (300, 48)])
def test_packed_bf16_is_f_linear_to_the_bit(shape, bias):
    g = torch.Generator().manual_seed(len(shape) * 1000 + shape[0])
    w = torch.randn(96, 48, generator=g).bfloat16()
    b = torch.randn(96, generator=g).bfloat16() if bias else None
    x = torch.randn(*shape, generator=g).bfloat16()
    lin = PackedLinear(w, b)
    assert (lin.packed is not None) == BF16  # packed wherever oneDNN's bf16 path runs on this CPU
    y = lin(x)
    assert y.shape == (*shape[:-1], 96) and y.dtype == torch.bfloat16
    assert torch.equal(y, F.linear(x, w, b))
    # negative control: the packed product is that weight's, not any other's
    assert not torch.equal(PackedLinear(w.flip(0), b)(x), y)


def test_float32_is_packed_and_equal_to_float_rounding():
    g = torch.Generator().manual_seed(1)
    w, b, x = torch.randn(96, 576, generator=g), torch.randn(96, generator=g), torch.randn(4, 576, generator=g)
    lin = PackedLinear(w, b)
    assert (lin.packed is not None) == FP32
    want = F.linear(x, w, b)  # MKL: another summation order than oneDNN's
    assert torch.allclose(lin(x), want, rtol=1e-5, atol=1e-4)
    assert not torch.allclose(PackedLinear(w.flip(0), b)(x), want, rtol=1e-5, atol=1e-4)  # negative control


def test_other_dtypes_and_mismatched_inputs_go_to_f_linear():
    w = torch.randn(8, 6).half()
    x = torch.randn(3, 6).half()
    lin = PackedLinear(w)
    assert not packable(w) and lin.packed is None
    assert torch.equal(lin(x), F.linear(x, w))
    with pytest.raises(RuntimeError):
        lin(x.float())  # F.linear refuses mixed dtypes ...
    if BF16:
        with pytest.raises(TypeError, match="packed as torch.bfloat16"):
            PackedLinear(w.bfloat16())(x.float())  # ... and so does a packed weight, saying why


# ------------------------------------------------------------------ a target's layers: packed only where exact


def _tiny_pair(dtype):
    """Two copies of one tiny LLaVA in `dtype`: one to pack, one as it is."""
    from testing.tiny import build_tiny

    return [build_tiny("llava", seed=3)[0].to(dtype).eval() for _ in range(2)]


def _steps(model):
    """Logits of a 30-token prompt (more rows than are packed), then of one- and two-token steps
    of 1 and 3 rows over its cache: [30 + 1 + 6 logits rows, V], in order."""
    g = torch.Generator().manual_seed(0)
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(3, vocab, (3, 33), generator=g)
    out = []
    with torch.no_grad():
        for rows, new in ((1, 1), (3, 2)):
            cache = DynamicCache()
            prompt = model(input_ids=ids[:rows, :30], use_cache=True, **cache_kwarg(model, cache)).logits
            out += [prompt[0]] if rows == 1 else []
            out.append(model(input_ids=ids[:rows, 30:30 + new], **cache_kwarg(model, cache)).logits.flatten(0, 1))
    return torch.cat(out)


@pytest.mark.skipif(not BF16, reason="oneDNN's bf16 path does not run on this CPU: nothing packs")
def test_packed_target_layers_give_f_linear_logits_to_the_bit():
    from vlmspec.kernels.packed_linear import ExactPackedLinear
    from vlmspec.target.packing import pack_exact_linears

    packed, plain = _tiny_pair(torch.bfloat16)
    found = pack_exact_linears(packed, most=8)
    assert found and all(r == 8 for r in found.values()), found  # bf16: equal at 1..8 rows for every shape here
    layers = [m for m in packed.modules() if isinstance(m, ExactPackedLinear)]
    assert len(layers) == sum(type(m) is torch.nn.Linear for m in plain.modules())
    assert packed.state_dict().keys() == plain.state_dict().keys()
    tied = plain.get_output_embeddings().weight is plain.get_input_embeddings().weight
    assert (packed.get_output_embeddings().weight is packed.get_input_embeddings().weight) == tied
    calls = []
    for layer in layers:
        layer._packed = _Counting(layer._packed, calls)
    assert torch.equal(_steps(packed), _steps(plain))
    assert calls and max(calls) <= 8  # the steps took the packed copies, the prompts did not


class _Counting:
    def __init__(self, packed, calls):
        self.packed, self.calls = packed, calls

    def __call__(self, x):
        self.calls.append(x.numel() // x.shape[-1])
        return self.packed(x)


@pytest.mark.skipif(not FP32, reason="torch without oneDNN packs nothing")
def test_float32_is_not_packed_and_forcing_it_changes_the_logits():
    """The negative control: in float32 (MKL against oneDNN) the probe finds no exact row count,
    and packing regardless changes the logits, which the test above would see."""
    from vlmspec.kernels.packed_linear import ExactPackedLinear
    from vlmspec.target.packing import pack_exact_linears

    packed, plain = _tiny_pair(torch.float32)
    assert set(pack_exact_linears(packed, most=8).values()) == {0}
    assert not any(isinstance(m, ExactPackedLinear) for m in packed.modules())
    for parent in list(packed.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(parent, name, ExactPackedLinear.wrap(child, 8))
    forced, want = _steps(packed), _steps(plain)
    assert not torch.equal(forced, want) and torch.allclose(forced, want, atol=1e-3)


@pytest.mark.skipif(not BF16, reason="oneDNN's bf16 path does not run on this CPU: nothing packs")
def test_exact_packed_linear_runs_f_linear_whenever_the_packed_copy_may_not_hold():
    from vlmspec.kernels.packed_linear import ExactPackedLinear

    g = torch.Generator().manual_seed(2)
    lin = torch.nn.Linear(48, 96).bfloat16()
    layer = ExactPackedLinear.wrap(lin, 4)
    x, five = torch.randn(3, 48, generator=g).bfloat16(), torch.randn(5, 48, generator=g).bfloat16()
    with torch.no_grad():
        assert torch.equal(layer(x), F.linear(x, lin.weight, lin.bias))  # 3 rows: the packed copy
        layer._packed = _Refuse()  # from here on, a use of the packed copy fails the test
        assert torch.equal(layer(five), F.linear(five, lin.weight, lin.bias))  # more rows than it was probed at
        with pytest.raises(RuntimeError):
            layer(x.float())  # another dtype: F.linear's own error
        lin.weight.mul_(2)  # the weight changed in place: the packed copy is stale
        assert torch.equal(layer(x), F.linear(x, lin.weight, lin.bias))
    y = layer(x)  # gradients wanted (the weight requires them): autograd's F.linear
    assert y.grad_fn is not None


class _Refuse:
    def __call__(self, x):
        pytest.fail("the packed copy was used")


def test_load_target_packs_bf16_on_cpu_unless_asked_not_to(model_dir):
    from vlmspec.policy.cost import cost_key
    from vlmspec.engine import SpecEngine
    from vlmspec.draft import PlainDrafter
    from vlmspec.factory import EngineSpec, load

    on = load(EngineSpec(model=str(model_dir), device="cpu", dtype="bfloat16"))
    off = load(EngineSpec(model=str(model_dir), device="cpu", dtype="bfloat16", packed_weights=False))
    fp32 = load(EngineSpec(model=str(model_dir), device="cpu", dtype="float32"))
    assert (on.packed_layers > 0) == BF16 and off.packed_layers == 0 and fp32.packed_layers == 0
    if BF16:  # a cost measured with packed layers is not read back for a target without them
        assert cost_key(SpecEngine(on, PlainDrafter()), ())["packed_layers"] != cost_key(SpecEngine(off, PlainDrafter()), ())["packed_layers"]


def test_where_onednn_cannot_pack_bf16_every_layer_runs_f_linear():
    """A CPU whose oneDNN refuses bf16 packing (AVX2 alone; here ONEDNN_MAX_CPU_ISA=AVX2 in a child):
    nothing is packed, and the products are F.linear's. Control: this process packs where its CPU can."""
    import os
    import subprocess
    import sys

    code = ("import torch; from torch.nn import functional as F; "
            "from vlmspec.kernels.packed_linear import PackedLinear, packs_on_this_cpu; "
            "w, x = torch.randn(96, 48).bfloat16(), torch.randn(3, 48).bfloat16(); lin = PackedLinear(w); "
            "print(packs_on_this_cpu(torch.bfloat16), lin.packed is None, torch.equal(lin(x), F.linear(x, w)))")
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["False", "True", "True"], run.stdout
    assert (PackedLinear(torch.randn(96, 48).bfloat16()).packed is not None) == BF16
