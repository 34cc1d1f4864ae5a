"""The Triton tree-attention kernel and its transformers attention function.

Kernel exactness runs under Triton's interpreter on CPU. TRITON_INTERPRET is read when a kernel
is jit-decorated (vlmspec decorates lazily, at the first launch), and it changes triton globally,
so the interpreter cases run in ONE subprocess (this file executed as a script with
TRITON_INTERPRET=1) that reports every case as JSON; the tests below look their case up. Nothing
in the pytest process itself changes the environment.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import zlib

import pytest
import torch

from vlmspec.kernels import tree_attention as ta
from vlmspec.cache.kv_cache import cache_kwarg
from vlmspec.tree import ancestor_mask, tree_attention_mask

# ---------------------------------------------------------------------------------------------
# Cases run under the interpreter (a covering set, not the full product)
# ---------------------------------------------------------------------------------------------

# id: (batch, kv heads, gqa ratio, N, prefix P, head dim, dtype, mask kind, num_splits, extra)
KERNEL_CASES = {
    "g1_n1_p0_d64_f32": (1, 2, 1, 1, 0, 64, "float32", "chain", None, ""),
    "g1_n7_p300_d128_f32_split3": (1, 1, 1, 7, 300, 128, "float32", "random", 3, ""),
    "g4_n7_p0_d64_f32": (2, 1, 4, 7, 0, 64, "float32", "random", None, ""),
    "g4_n64_p1_d64_f32": (1, 1, 4, 64, 1, 64, "float32", "random", None, ""),
    "g8_n7_p300_d64_f32_split5": (1, 1, 8, 7, 300, 64, "float32", "random", 5, ""),
    "g8_n64_p300_d128_f32": (1, 1, 8, 64, 300, 128, "float32", "random", None, ""),
    "g1_n64_p1_d128_f32_chain": (1, 1, 1, 64, 1, 128, "float32", "chain", 2, ""),
    "g4_n1_p300_d128_f32": (1, 2, 4, 1, 300, 128, "float32", "chain", None, ""),
    "g1_n40_p70_d64_f32_packed": (1, 2, 1, 40, 70, 64, "float32", "random", None, "packed"),
    "g1_n33_p64_d32_f32_split2": (1, 1, 1, 33, 64, 32, "float32", "random", 2, ""),
    "g4_n7_p1_d64_f32_noncontig_q": (1, 2, 4, 7, 1, 64, "float32", "random", None, "noncontig"),
    "g1_n7_p300_d64_f16": (1, 2, 1, 7, 300, 64, "float16", "random", None, ""),
    "g4_n64_p0_d128_f16_split2": (1, 1, 4, 64, 0, 128, "float16", "random", 2, ""),
    "g8_n1_p1_d64_f16": (1, 1, 8, 1, 1, 64, "float16", "chain", None, ""),
    "g1_n7_p300_d128_bf16_split3": (1, 1, 1, 7, 300, 128, "bfloat16", "random", 3, ""),
    "g4_n64_p1_d64_bf16_chain": (1, 1, 4, 64, 1, 64, "bfloat16", "chain", None, ""),
    "g8_n7_p0_d128_bf16": (1, 1, 8, 7, 0, 128, "bfloat16", "random", None, ""),
    "g1_n16_p64_d256_f32": (1, 1, 1, 16, 64, 256, "float32", "random", None, ""),
    "g1_n16_p10_d16_f16": (1, 1, 1, 16, 10, 16, "float16", "random", None, ""),
    # batched verify: each row its own prefix length (up to P) and its own tree; keys after a row's tree unread
    "ragged_b3_g4_n7_p300_d64_f32": (3, 1, 4, 7, 300, 64, "float32", "random", None, "ragged"),
    "ragged_b4_g1_n9_p200_d64_f32_split4": (4, 2, 1, 9, 200, 64, "float32", "random", 4, "ragged"),
    "ragged_b2_g2_n40_p70_d128_f32_packed": (2, 1, 2, 40, 70, 128, "float32", "random", None, "ragged packed"),
    "ragged_b3_g4_n16_p90_d64_bf16_split2": (3, 1, 4, 16, 90, 64, "bfloat16", "random", 2, "ragged"),
}
# |out - ref| <= atol + rtol * |ref| elementwise (a 1-ulp rounding difference of the output passes)
TOL = {"float32": (1e-5, 1e-5), "float16": (1e-3, 2e-3), "bfloat16": (8e-3, 1.6e-2)}


def _tol_ratio(out: torch.Tensor, ref: torch.Tensor, dtype_name: str) -> float:
    """max over elements of |out - ref| / (atol + rtol * |ref|): <= 1 passes."""
    atol, rtol = TOL[dtype_name]
    diff = (out.float() - ref.float()).abs()
    return float((diff / (atol + rtol * ref.float().abs())).max())


def random_parents(n: int, gen: torch.Generator) -> torch.Tensor:
    par = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
    return torch.tensor(par, dtype=torch.long)


def _make_mask(n: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    parents = torch.arange(-1, n - 1) if kind == "chain" else random_parents(n, gen)
    return ancestor_mask(parents)


def _run_kernel_case(spec: tuple) -> dict:
    bsz, hkv, g, n, p, d, dtype_name, kind, splits, extra = spec
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(zlib.crc32(repr(spec).encode()))  # not hash(): salted per process
    mask = _make_mask(n, kind, gen)
    lengths = p
    if "ragged" in extra:  # row 0 the longest, the others shorter (one with no prefix at all), each its own tree
        lengths = torch.tensor([p] + [int(torch.randint(0, p, (1,), generator=gen)) for _ in range(bsz - 2)] + [0][: bsz - 1])
        mask = torch.stack([mask] + [_make_mask(n, kind, gen) for _ in range(bsz - 1)])
    if extra == "noncontig":  # like HF: [B, N, Hq, D] viewed as [B, Hq, N, D]
        q = torch.randn(bsz, n, hkv * g, d, generator=gen).to(dtype).transpose(1, 2)
    else:
        q = torch.randn(bsz, hkv * g, n, d, generator=gen).to(dtype)
    k = torch.randn(bsz, hkv, p + n, d, generator=gen).to(dtype)
    v = torch.randn(bsz, hkv, p + n, d, generator=gen).to(dtype)
    scale = 1.0 / math.sqrt(d)
    tree = torch.stack([ta.pack_tree_mask(m) for m in mask.reshape(-1, n, n)]) if "packed" in extra else mask
    if "ragged" in extra:  # the keys after each shorter row's tree hold garbage the kernel must not read
        for b, length in enumerate(lengths.tolist()):
            k[b, :, length + n :] = float("nan")
            v[b, :, length + n :] = float("nan")
    out = ta.tree_attention(q, k, v, tree, lengths, scale, num_splits=splits)
    ref = ta.tree_attention_reference(q, k, v, mask, lengths, scale)
    assert out.shape == ref.shape and out.dtype == dtype
    return {"err": float((out.float() - ref.float()).abs().max()), "ratio": _tol_ratio(out, ref, dtype_name)}


def _tiny_llama(impl: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=97, hidden_size=128, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=512,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    model.set_attn_implementation(impl)
    return model


def _tree_logits(model, prefix_ids: torch.Tensor, tree_tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=prefix_ids[None], **cache_kwarg(model, cache), use_cache=True)
        p = prefix_ids.shape[0]
        dev = prefix_ids.device
        amask = ancestor_mask(parents.cpu())
        depth = (amask.sum(-1) - 1).to(dev)
        mask4d = tree_attention_mask(amask.to(dev), p, torch.float32)
        out = model(
            input_ids=tree_tokens[None], attention_mask=mask4d, position_ids=(p + depth)[None],
            **cache_kwarg(model, cache), use_cache=True,
        )
    return out.logits[0]


def _run_hf_case() -> dict:
    name = ta.register()
    gen = torch.Generator().manual_seed(7)
    prefix = torch.randint(0, 97, (37,), generator=gen)
    parents = random_parents(9, gen)
    tokens = torch.randint(0, 97, (9,), generator=gen)
    ref = _tree_logits(_tiny_llama("sdpa"), prefix, tokens, parents)
    ta.reset_stats()
    model = _tiny_llama(name)
    got = _tree_logits(model, prefix, tokens, parents)
    stats = dict(ta.STATS)
    return {
        "max_err": float((got - ref).abs().max()),
        "impl": model.config._attn_implementation,
        "stats": stats,
    }


def _interpreter_main() -> int:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    results: dict = {}
    for cid, spec in KERNEL_CASES.items():
        try:
            results[cid] = _run_kernel_case(spec)
        except Exception as exc:  # reported per case
            results[cid] = {"error": f"{type(exc).__name__}: {exc}"}
    try:
        results["hf_llama"] = _run_hf_case()
    except Exception as exc:
        results["hf_llama"] = {"error": f"{type(exc).__name__}: {exc}"}
    print("RESULTS " + json.dumps(results))
    return 0


# ---------------------------------------------------------------------------------------------
# Interpreter-backed tests
# ---------------------------------------------------------------------------------------------

_triton_ok = ta._HAS_TRITON


@pytest.fixture(scope="module")
def interp_results() -> dict:
    if not _triton_ok:
        pytest.skip("triton is not installed")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="2")
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__)], env=env, capture_output=True, text=True, timeout=900
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, f"interpreter run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULTS "):])


@pytest.mark.parametrize("case_id", list(KERNEL_CASES))
def test_kernel_matches_reference_interpreter(interp_results: dict, case_id: str) -> None:
    res = interp_results[case_id]
    assert "error" not in res, res.get("error")
    assert res["ratio"] <= 1.0, f"{case_id}: max abs err {res['err']}, tolerance ratio {res['ratio']}"


def test_hf_llama_tree_forward_matches_sdpa_interpreter(interp_results: dict) -> None:
    res = interp_results["hf_llama"]
    assert "error" not in res, res.get("error")
    assert res["impl"] == ta.DEFAULT_NAME
    # 2 layers: the tree forward ran the kernel in both, the mask was analysed once (cached across
    # layers), and the prefill (no 4D mask) went to SDPA in both layers.
    assert res["stats"] == {"kernel": 2, "fallback": 2, "mask_analyses": 1}, res["stats"]
    assert res["max_err"] < 1e-4, res["max_err"]


# ---------------------------------------------------------------------------------------------
# Plain in-process tests (no interpreter)
# ---------------------------------------------------------------------------------------------


def test_pack_tree_mask_hand_case() -> None:
    m = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    assert ta.pack_tree_mask(m).tolist() == [[1], [3], [5]]
    # bit 31 is the int32 sign bit; bit 32 starts word 1
    big = torch.zeros(2, 33, dtype=torch.bool)
    big[0, 31] = True
    big[1, 0] = big[1, 32] = True
    packed = ta.pack_tree_mask(big)
    assert packed.dtype == torch.int32 and packed.shape == (2, 2)
    assert packed.tolist() == [[-(2**31), 0], [1, 1]]
    assert torch.equal(ta.unpack_tree_mask(packed, 33), big)


def test_pack_roundtrip_random_tree() -> None:
    gen = torch.Generator().manual_seed(3)
    m = ancestor_mask(random_parents(70, gen))
    packed = ta.pack_tree_mask(m)
    assert packed.shape == (70, 3)
    assert torch.equal(ta.unpack_tree_mask(packed, 70), m)


def test_reference_hand_case() -> None:
    # one prefix key, two tree keys; query 0 sees [prefix, tree 0], query 1 sees all three
    q = torch.ones(1, 1, 2, 1)
    k = torch.tensor([0.0, math.log(3.0), math.log(2.0)]).view(1, 1, 3, 1)
    v = torch.tensor([1.0, 2.0, 4.0]).view(1, 1, 3, 1)
    mask = torch.tensor([[True, False], [True, True]])
    out = ta.tree_attention_reference(q, k, v, mask, prefix_len=1, scale=1.0)
    # weights: q0 -> [1, 3] / 4; q1 -> [1, 3, 2] / 6
    assert torch.allclose(out.view(2), torch.tensor([7 / 4, 15 / 6]), atol=1e-6)
    # packed bits are accepted too, and GQA shares the KV head
    out2 = ta.tree_attention_reference(q.expand(1, 3, 2, 1), k, v, ta.pack_tree_mask(mask), 1, 1.0)
    assert torch.allclose(out2, out.expand(1, 3, 2, 1))


def test_reference_matches_sdpa_with_tree_mask() -> None:
    gen = torch.Generator().manual_seed(1)
    n, p = 9, 13
    m = ancestor_mask(random_parents(n, gen))
    q = torch.randn(1, 4, n, 16, generator=gen)
    k = torch.randn(1, 2, p + n, 16, generator=gen)
    v = torch.randn(1, 2, p + n, 16, generator=gen)
    add = tree_attention_mask(m, p, torch.float32)
    sd = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=add
    )
    assert torch.allclose(ta.tree_attention_reference(q, k, v, m, p), sd, atol=1e-5)


def test_register_makes_name_valid() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = ta.register("vlmspec_tree_test")
    assert name == "vlmspec_tree_test"
    assert ALL_ATTENTION_FUNCTIONS[name] is ta.triton_tree_attention_forward
    assert AttentionInterface()[name] is ta.triton_tree_attention_forward
    assert ALL_MASK_ATTENTION_FUNCTIONS[name] is sdpa_mask


def test_analyse_mask_accepts_tree_rejects_others() -> None:
    gen = torch.Generator().manual_seed(5)
    m = ancestor_mask(random_parents(6, gen))
    add = tree_attention_mask(m, 4, torch.float16)
    assert torch.equal(ta._analyse_mask(add, 6)[0], ta.pack_tree_mask(m))
    booled = add == 0
    assert torch.equal(ta._analyse_mask(booled, 6)[0], ta.pack_tree_mask(m))
    hidden_prefix = add.clone()
    hidden_prefix[0, 0, 2, 1] = torch.finfo(torch.float16).min
    assert ta._analyse_mask(hidden_prefix, 6) is None
    biased = add.clone()
    biased[0, 0, 0, 0] = -1.0  # not a 0 / min mask (e.g. ALiBi-like bias): leave it to SDPA
    assert ta._analyse_mask(biased, 6) is None


def test_mask_cache_not_fooled_by_in_place_edit() -> None:
    ta.clear_mask_cache()
    m = ancestor_mask(torch.tensor([-1, 0, 0, 1]))
    add = tree_attention_mask(m, 3, torch.float32)
    first = ta._tree_bits_for(add, 4)
    assert ta._tree_bits_for(add, 4) is first  # cached (same object, same version)
    add[0, 0, 3, 3 + 1] = torch.finfo(torch.float32).min  # node 3 no longer sees node 1
    second = ta._tree_bits_for(add, 4)
    assert second is not first and not torch.equal(second[0], first[0])
    ta.clear_mask_cache()


def test_a_described_mask_is_read_without_analysis_until_edited() -> None:
    ta.clear_mask_cache()
    ta.reset_stats()
    m = ancestor_mask(torch.tensor([-1, 0, 0, 1]))
    add = tree_attention_mask(m, 3, torch.float32).expand(2, 1, 4, 7).clone()
    bits, lengths = ta.pack_tree_mask(m)[None].expand(2, 4, 1), torch.tensor([3, 2], dtype=torch.int32)
    ta.describe_mask(add, bits, lengths)
    got = ta._tree_bits_for(add, 4)
    assert torch.equal(got[0], bits) and torch.equal(got[1], lengths) and ta.STATS["mask_analyses"] == 0
    add[1, 0, 0, 0] = torch.finfo(torch.float32).min  # edited after the description: analysed again
    again = ta._tree_bits_for(add, 4)
    assert ta.STATS["mask_analyses"] == 1 and again is None  # the rows now differ: not one tree for all
    ta.clear_mask_cache()


@pytest.mark.skipif(ta._interpret_mode(), reason="this process runs the interpreter")
def test_hf_function_falls_back_to_sdpa_on_cpu() -> None:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    class _Mod(torch.nn.Module):
        num_key_value_groups = 2
        is_causal = True

    gen = torch.Generator().manual_seed(2)
    m = ancestor_mask(random_parents(5, gen))
    q = torch.randn(1, 4, 5, 32, generator=gen)
    k = torch.randn(1, 2, 12, 32, generator=gen)
    v = torch.randn(1, 2, 12, 32, generator=gen)
    add = tree_attention_mask(m, 7, torch.float32)
    ta.reset_stats()
    got, _ = ta.triton_tree_attention_forward(_Mod(), q, k, v, add, scaling=0.2)
    want, _ = sdpa_attention_forward(_Mod(), q, k, v, add, scaling=0.2)
    assert got.shape == (1, 5, 4, 32)
    assert torch.equal(got, want)
    assert ta.STATS["fallback"] == 1 and ta.STATS["kernel"] == 0
    assert not ta.kernel_available() or torch.cuda.is_available()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit")
def test_kernel_bench_needs_gpu(capsys: pytest.CaptureFixture) -> None:
    from vlmspec.cli import main

    assert main(["bench", "kernel", "--prefix", "64", "--tree", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert "GPU" in err and "\n" not in err


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not (torch.cuda.is_available() and _triton_ok), reason="needs CUDA + triton")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("g", [1, 4, 8])
@pytest.mark.parametrize("n,p", [(1, 0), (16, 1024), (64, 4096), (33, 300)])
@pytest.mark.parametrize("d", [64, 128])
def test_kernel_cuda(dtype: torch.dtype, g: int, n: int, p: int, d: int) -> None:
    gen = torch.Generator().manual_seed(n * 1000 + p)
    mask = ancestor_mask(random_parents(n, gen)).cuda()
    hkv = 32 // g if g > 1 else 8
    q = torch.randn(1, hkv * g, n, d, device="cuda", dtype=dtype)
    k = torch.randn(1, hkv, p + n, d, device="cuda", dtype=dtype)
    v = torch.randn(1, hkv, p + n, d, device="cuda", dtype=dtype)
    ref = ta.tree_attention_reference(q, k, v, mask, p)
    for splits in (None, 1, 3):
        out = ta.tree_attention(q, k, v, mask, p, num_splits=splits)
        assert _tol_ratio(out, ref, str(dtype).removeprefix("torch.")) <= 1.0, splits


@pytest.mark.gpu
@needs_cuda
def test_kernel_bench_runs(tmp_path) -> None:
    from vlmspec.cli import main

    out = tmp_path / "bench.json"
    assert main(["bench", "kernel", "--prefix", "128", "--tree", "16", "--repeats", "5", "--warmup", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 1 and rows[0]["max_abs_err_vs_fp32_reference"]["triton"] < 0.05


@pytest.mark.gpu
@needs_cuda
def test_hf_llama_cuda() -> None:
    name = ta.register()
    gen = torch.Generator().manual_seed(11)
    prefix = torch.randint(0, 97, (300,), generator=gen).cuda()
    parents = random_parents(24, gen)
    tokens = torch.randint(0, 97, (24,), generator=gen).cuda()
    ref = _tree_logits(_tiny_llama("sdpa").cuda(), prefix, tokens, parents)
    ta.reset_stats()
    got = _tree_logits(_tiny_llama(name).cuda(), prefix, tokens, parents)
    assert ta.STATS["kernel"] == 2
    assert (got - ref).abs().max().item() < 1e-3


if __name__ == "__main__":
    sys.exit(_interpreter_main())
