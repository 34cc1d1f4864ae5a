"""Weights prepacked for oneDNN (vlmspec/kernels/packed_linear.py): F.linear's numbers, bit for bit in bf16."""
import pytest
import torch
from torch.nn import functional as F

from vlmspec.kernels.packed_linear import PackedLinear, packable

ONEDNN = torch.backends.mkldnn.is_available()


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 48), (4, 48), (17, 48), (1, 3, 48), (300, 48)])
def test_packed_bf16_is_f_linear_to_the_bit(shape, bias):
    g = torch.Generator().manual_seed(len(shape) * 1000 + shape[0])
    w = torch.randn(96, 48, generator=g).bfloat16()
    b = torch.randn(96, generator=g).bfloat16() if bias else None
    x = torch.randn(*shape, generator=g).bfloat16()
    lin = PackedLinear(w, b)
    assert (lin.packed is not None) == ONEDNN  # packed wherever torch has oneDNN (every x86 CPU wheel)
    y = lin(x)
    assert y.shape == (*shape[:-1], 96) and y.dtype == torch.bfloat16
    assert torch.equal(y, F.linear(x, w, b))
    # negative control: the packed product is that weight's, not any other's
    assert not torch.equal(PackedLinear(w.flip(0), b)(x), y)


def test_float32_is_packed_and_equal_to_float_rounding():
    g = torch.Generator().manual_seed(1)
    w, b, x = torch.randn(96, 576, generator=g), torch.randn(96, generator=g), torch.randn(4, 576, generator=g)
    lin = PackedLinear(w, b)
    assert (lin.packed is not None) == ONEDNN
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
    if ONEDNN:
        with pytest.raises(TypeError, match="packed as torch.bfloat16"):
            PackedLinear(w.bfloat16())(x.float())  # ... and so does a packed weight, saying why
