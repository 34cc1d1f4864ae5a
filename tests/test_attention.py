"""The target's CPU attention (`vlmspec.target.attention`): SDPA reading grouped key / value heads in
place gives transformers' SDPA numbers bit for bit, and a batched one-token step the numbers of a
step alone."""

from types import SimpleNamespace

import pytest
import torch
from transformers.integrations import sdpa_attention

from conftest import tiny_target
from vlmspec.inputs import encode_prompt
from vlmspec.target import set_attention
from vlmspec.target import attention
from vlmspec.target.attention import GQA_SDPA, PACKED_QUERIES, RAGGED_KWARG, RaggedRows, gqa_sdpa_forward, packing_is_exact, packs
from vlmspec.target.sdpa import decoding_sdpa
from vlmspec.tree import DraftTree

MODULE = SimpleNamespace(num_key_value_groups=3, is_causal=True, training=False)  # 9 query heads over 3 key / value heads


def _case(rows, n, cached, dtype, seed=0):
    """q [rows, 9, n, 16], k / v [rows, 3, cached + n, 16], an additive mask [rows, 1, n, cached + n]:
    row b sees its cached entries from the (3 b)-th on (rows of different lengths) and its own
    queries causally."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, 9, n, 16, generator=g).to(dtype)
    k, v = (torch.randn(rows, 3, cached + n, 16, generator=g).to(dtype) for _ in range(2))
    lo = torch.finfo(dtype).min
    mask = torch.zeros(rows, 1, n, cached + n, dtype=dtype)
    mask[..., cached:] = lo * torch.ones(n, n, dtype=dtype).triu(1)
    for b in range(rows):
        mask[b, :, :, : 3 * b] = lo
    return q, k, v, mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,n", [(1, 7), (4, 2), (3, 5)])
def test_grouped_heads_in_place_are_transformers_sdpa_to_the_bit(dtype, rows, n):
    q, k, v, mask = _case(rows, n, 40, dtype)
    with torch.no_grad():
        ours, _ = gqa_sdpa_forward(MODULE, q, k, v, mask, scaling=0.25)
        ref, _ = sdpa_attention.sdpa_attention_forward(MODULE, q, k, v, mask, scaling=0.25)
    assert ours.shape == ref.shape == (rows, n, 9, 16)
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_masked_lone_query_gets_the_unmasked_steps_numbers(dtype):
    """A batched plain step (one query per row, a mask for the rows' lengths) against a step alone
    (no mask: what a batch of one runs). Reading the grouped heads in place, they agree to the bit;
    transformers' own path, which packs a lone query's heads under a mask, does not (the negative
    control: in fp32 it differs on most of these cases)."""
    same_ours = same_theirs = 0
    for seed in range(12):
        q, k, v, _ = _case(2, 1, 60 + seed, dtype, seed)
        mask = torch.zeros(2, 1, 1, k.shape[2], dtype=dtype)  # nothing hidden: the row's whole length
        with torch.no_grad():
            alone, _ = sdpa_attention.sdpa_attention_forward(MODULE, q, k, v, None)
            same_ours += torch.equal(gqa_sdpa_forward(MODULE, q, k, v, mask)[0], alone)
            same_theirs += torch.equal(sdpa_attention.sdpa_attention_forward(MODULE, q, k, v, mask)[0], alone)
    assert same_ours == 12
    if dtype == torch.float32:
        assert same_theirs < 12


def test_calls_it_does_not_change_go_to_transformers(monkeypatch):
    """No mask, no grouping, a gradient or a position bias: transformers' function, unchanged."""
    calls = []
    real = sdpa_attention.sdpa_attention_forward
    monkeypatch.setattr(sdpa_attention, "sdpa_attention_forward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v, mask = _case(2, 3, 10, torch.float32)
    with torch.no_grad():
        gqa_sdpa_forward(MODULE, q, k, v, mask)
        assert calls == []  # the negative control: the one kind of call it serves itself
        gqa_sdpa_forward(MODULE, q, k, v, None)
        gqa_sdpa_forward(SimpleNamespace(num_key_value_groups=1), q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), mask)
        gqa_sdpa_forward(MODULE, q, k, v, mask, position_bias=torch.zeros_like(mask))
    assert len(calls) == 3
    q.requires_grad_(True)
    out, _ = gqa_sdpa_forward(MODULE, q, k, v, mask)
    out.sum().backward()
    assert len(calls) == 4 and q.grad is not None


def test_auto_on_cpu_runs_it_and_a_batched_tree_forward_keeps_sdpas_logits():
    """A tiny Llama-based VLM (grouped heads): 'auto' on CPU picks it, and two rows' trees verified
    together give the logits transformers' SDPA gives, bit for bit (on the trees' nodes: the padding
    position of the smaller tree is a copy of its root when the rows are laid end to end)."""
    target = tiny_target("llava")
    assert target.attention == GQA_SDPA
    texts = ["once upon a time", "the quick brown fox jumps over the lazy dog"]
    trees = [DraftTree(torch.tensor([5, 6, 7, 9]), torch.tensor([-1, 0, 0, 1])), DraftTree.chain(8, [9, 4])]

    def logits():
        cache = target.new_cache(2)
        states = [target.prefill(encode_prompt(target, t, []), cache=cache, slot=i)[0] for i, t in enumerate(texts)]
        return target.forward_batch(states, trees).logits

    ours = logits()
    set_attention(target.model, "sdpa")
    try:
        assert target.attention == "sdpa"
        ref = logits()
    finally:
        set_attention(target.model, "auto")
    for b, tree in enumerate(trees):
        assert torch.equal(ours[b, : tree.size], ref[b, : tree.size])


def _packable_case(rows, n, groups, cached, seed):
    """bf16 q [rows, 3 * groups, n, 64] in the layout the models hand over (a transposed view), k / v
    [rows, 3, cached + n, 64], and an additive mask: rows of different lengths, causal new entries."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, n, 3 * groups, 64, generator=g).to(torch.bfloat16).transpose(1, 2)
    k, v = (torch.randn(rows, 3, cached + n, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    allowed = torch.zeros(rows, 1, n, cached + n, dtype=torch.bool)
    for b in range(rows):
        allowed[b, :, :, : cached - 5 * b] = True
        allowed[b, :, :, cached:] = torch.ones(n, n, dtype=torch.bool).tril()
    return q, k, v, torch.zeros(allowed.shape, dtype=torch.bfloat16).masked_fill(~allowed, torch.finfo(torch.bfloat16).min)


@pytest.mark.parametrize("rows", [4, 16])
def test_packed_query_heads_follow_the_probe_and_keep_the_grouped_calls_numbers_in_bf16(rows):
    """bf16, several rows of a few queries: `gqa_sdpa_forward` lays a group's query heads along the
    query axis exactly where the shape allows it (`groups * n <= PACKED_QUERIES`) and this machine's
    one-time check (`packing_is_exact`) found the packed call equal to the grouped one; either way its
    output is the grouped call's, to the bit. Whether the kernel packs exactly is the CPU's (AVX-512
    here, the AVX2 path too; another CPU's did not): the test holds the decision, not the outcome."""
    checked = 0
    for n in (2, 3, 5, 10):
        for groups in (2, 3, 4):
            module = SimpleNamespace(num_key_value_groups=groups, is_causal=True, training=False)
            exact = packing_is_exact(64, groups, torch.get_num_threads())
            for cached in (30, 200):
                q, k, v, mask = _packable_case(rows, n, groups, cached, seed=rows + n + cached)
                grouped = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
                with torch.no_grad():
                    ours, _ = gqa_sdpa_forward(module, q, k, v, mask)
                assert packs(q, k, mask) == (groups * n <= PACKED_QUERIES and exact)
                assert torch.equal(ours, grouped.transpose(1, 2))
                checked += packs(q, k, mask)
    assert checked >= 20 or not all(packing_is_exact(64, g, torch.get_num_threads()) for g in (2, 3, 4))


def test_the_packing_check_finds_a_packed_call_that_differs(monkeypatch):
    """The negative control of `packing_is_exact`: a packed call one bf16 step off in one number is
    found, and then nothing packs (the grouped call's numbers)."""
    real = attention._packed_sdpa

    def off_by_one_step(*args):
        out = real(*args)
        out.view(-1)[0] = torch.nextafter(out.view(-1)[0], torch.tensor(float("inf"), dtype=out.dtype))
        return out

    monkeypatch.setattr(attention, "_packed_sdpa", off_by_one_step)
    attention.packing_is_exact.cache_clear()
    try:
        assert not attention.packing_is_exact(64, 3, torch.get_num_threads())
        q, k, v, mask = _packable_case(4, 3, 3, 30, seed=0)
        assert not packs(q, k, mask)
        with torch.no_grad():
            ours, _ = gqa_sdpa_forward(MODULE, q, k, v, mask)
        grouped = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        assert torch.equal(ours, grouped.transpose(1, 2))
    finally:
        attention.packing_is_exact.cache_clear()


def test_one_query_few_rows_and_fp32_keep_the_grouped_call():
    q, k, v, mask = _packable_case(8, 1, 3, 40, seed=0)
    assert not packs(q, k, mask)  # one query: a plain step
    q, k, v, mask = _packable_case(2, 3, 3, 40, seed=0)
    assert not packs(q, k, mask)  # two rows
    q, k, v, mask = _packable_case(8, 3, 3, 40, seed=0)
    assert packs(q, k, mask) == packing_is_exact(64, 3, torch.get_num_threads())  # bf16: where the check found it exact
    assert not packs(q.float(), k.float(), mask.float())


def test_a_bf16_batched_tree_forward_packs_and_keeps_the_grouped_logits(monkeypatch):
    """A tiny Llama-based VLM in bf16, four rows' chains and trees in one forward: the packed attention
    runs where this machine's check found it exact (negative control: with packing off it does not)
    and the logits are the grouped call's, bit for bit."""
    from vlmspec.target import Target
    from testing.tiny import build_tiny

    model, processor = build_tiny("llava", seed=0)
    model = model.to(torch.bfloat16)
    set_attention(model, "auto")
    target = Target(model, processor, name="tiny-llava-bf16")
    texts = ["once upon a time", "the quick brown fox jumps over the lazy dog", "a cat", "what is in this picture, and why"]
    trees = [DraftTree(torch.tensor([5, 6, 7, 9]), torch.tensor([-1, 0, 0, 1])), DraftTree.chain(8, [9, 4]),
             DraftTree.chain(3, [2]), DraftTree.root_only(11)]
    text = model.config.text_config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    exact = packing_is_exact(head_dim, text.num_attention_heads // text.num_key_value_heads, torch.get_num_threads())
    packed_calls = []
    real = attention._packed_sdpa
    monkeypatch.setattr(attention, "_packed_sdpa", lambda *a: packed_calls.append(1) or real(*a))

    def logits():
        cache = target.new_cache(len(texts))
        states = [target.prefill(encode_prompt(target, t, []), cache=cache, slot=i)[0] for i, t in enumerate(texts)]
        return target.forward_batch(states, trees).logits

    ours = logits()
    assert bool(packed_calls) == exact, "four rows of up to four bf16 queries are packed where the check found it exact"
    monkeypatch.setattr(attention, "PACKED_QUERIES", 0)
    calls = len(packed_calls)
    ref = logits()
    assert len(packed_calls) == calls
    assert torch.equal(ours, ref)


def _sdpa_flags() -> tuple[bool, bool, bool, bool]:
    cuda = torch.backends.cuda
    return cuda.cudnn_sdp_enabled(), cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(), cuda.math_sdp_enabled()


def test_decoding_sdpa_leaves_out_cudnn_on_cuda_only():
    """On CUDA the engine's forwards run without cuDNN's SDPA, which plans every new shape
    (vlmspec.target.sdpa), every other backend kept, and the flags are back afterwards. Negative
    control: on CPU nothing changes."""
    before = _sdpa_flags()
    assert before[0], "torch allows cuDNN's SDPA by default: the case this leaves out"
    with decoding_sdpa(torch.device("cuda")):
        assert _sdpa_flags() == (False, *before[1:])
    assert _sdpa_flags() == before
    with decoding_sdpa(torch.device("cpu")):
        assert _sdpa_flags() == before


def test_the_engine_prefills_and_steps_inside_decoding_sdpa(monkeypatch):
    """Every prefill and batched forward of a generation runs inside `decoding_sdpa` of the
    target's device. Negative control: a prefill called outside the engine is not inside it."""
    import contextlib

    from vlmspec.engine import batch as engine_module  # where the batch's steps and prefills call it
    from vlmspec.draft import PlainDrafter
    from vlmspec.engine import GenerationConfig, SpecEngine

    target = tiny_target("llava")
    inside, devices, seen = [], [], []

    @contextlib.contextmanager
    def recording(device):
        devices.append(device)
        inside.append(True)
        try:
            yield
        finally:
            inside.pop()

    monkeypatch.setattr(engine_module, "decoding_sdpa", recording)
    for name in ("prefill", "forward_batch"):
        real = getattr(target, name)
        monkeypatch.setattr(target, name, lambda *a, _real=real, _name=name, **k: seen.append((_name, bool(inside))) or _real(*a, **k))
    prompt = encode_prompt(target, "once upon a time", [])
    SpecEngine(target, PlainDrafter()).generate(prompt, GenerationConfig(max_new_tokens=4))
    assert {name for name, _ in seen} == {"prefill", "forward_batch"}
    assert all(was_inside for _, was_inside in seen)
    assert devices and all(d == target.device for d in devices)
    seen.clear()
    target.prefill(prompt)
    assert seen == [("prefill", False)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_laid_end_to_end_get_the_padded_calls_numbers(dtype):
    """Rows of 1, 3 and 2 queries laid end to end ([1, 9, 6, 16]) and `RaggedRows`: the same outputs,
    to the bit, as the rows padded to 3 queries in one call (padding queries see only themselves).
    Negative control: the rows' sizes given in the wrong order read other rows' queries."""
    sizes = [1, 3, 2]
    q, k, v, mask = _case(3, 3, 30, dtype)
    for b, size in enumerate(sizes):  # padding queries: their own entry only, as `Target.batch_masks` lays them
        for j in range(size, 3):
            mask[b, 0, j] = torch.finfo(dtype).min
            mask[b, 0, j, 30 + j] = 0
    laid = torch.cat([q[b, :, :size] for b, size in enumerate(sizes)], dim=1)[None]  # [1, 9, 6, 16]
    with torch.no_grad():
        padded, _ = gqa_sdpa_forward(MODULE, q, k, v, mask)  # [3, 3, 9, 16]
        ours, _ = gqa_sdpa_forward(MODULE, laid, k, v, mask, **{RAGGED_KWARG: RaggedRows.of(sizes, q.device)})
        wrong, _ = gqa_sdpa_forward(MODULE, laid, k, v, mask, **{RAGGED_KWARG: RaggedRows.of([3, 1, 2], q.device)})
    want = torch.cat([padded[b, :size] for b, size in enumerate(sizes)])[None]  # [1, 6, 9, 16]
    assert ours.shape == want.shape == (1, 6, 9, 16)
    assert torch.equal(ours, want)
    assert not torch.allclose(wrong, want)
    assert torch.equal(RaggedRows.of(sizes, q.device).pad(laid[0].transpose(0, 1))[1], q[1].transpose(0, 1))
