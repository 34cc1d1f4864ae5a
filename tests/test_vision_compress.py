"""VLM-aware drafting (issue #5): compressor shapes and positions (1-D and M-RoPE), the gate's
gradient, the target-attention capture, training and save/load of every variant, and greedy
parity with the target for every variant."""
import pytest
import torch

from conftest import tiny_target
from vlmspec.draft.base import PlainDrafter, TreeConfig
from vlmspec.draft.eagle import EagleConfig, EagleDrafter, EagleHead
from vlmspec.engine import GenerationConfig, SpecEngine
from testing.tiny import tiny_image
from vlmspec.train.distill import DistillConfig, train_drafter
from vlmspec.vision_compress import FIXED, VisualAdaptor, VisualConfig, build, image_spans
from vlmspec.vision_compress.compressors import Gate, cross_attention, kept_tokens, token_grid
from vlmspec.inputs import encode_prompt
from vlmspec.target import set_attention

H = 16


@pytest.mark.parametrize("name", FIXED)
@pytest.mark.parametrize("n", [9, 16, 10])
@pytest.mark.parametrize("ratio", [4, 16])
def test_compressor_shapes_and_anchor_positions(name, n, ratio):
    torch.manual_seed(0)
    x = torch.randn(n, H)
    att = torch.rand(n)
    out, anchors = build(name, H, ratio)(x, ratio, att)
    m = kept_tokens(name, n, ratio)
    assert out.shape == (m, H) and anchors.shape == (m,)
    assert m == 0 if name == "text_only" else 1 <= m <= max(1, -(-n // 2))
    if m:
        assert anchors.min() >= 0 and anchors.max() < n
        assert (anchors[1:] > anchors[:-1]).all(), "anchors (and so positions) must increase"
        # M-RoPE positions ([3, n]) are gathered the same way as 1-D ones
        pos3 = torch.stack([torch.full((n,), 7), torch.arange(n) // 4, torch.arange(n) % 4]) + 100
        assert torch.equal(pos3[:, anchors], torch.stack([pos3[a][anchors] for a in range(3)]))


@pytest.mark.parametrize("hidden,heads,m", [(32, 4, 1), (32, 4, 5), (32, 4, 16), (16, 1, 9)])
def test_cross_attention_equals_multihead_attention_with_its_gradients(hidden, heads, m):
    """The resampler's cross-attention folds the key / value projections when that is cheaper
    (m * (heads - 1) < H: the first two and the last cases) and calls the module otherwise; either
    way it is nn.MultiheadAttention's function, gradients included."""
    torch.manual_seed(0)
    attn = torch.nn.MultiheadAttention(hidden, heads, batch_first=True)
    with torch.no_grad():  # non-zero biases, so dropping the key bias is really tested
        attn.in_proj_bias.normal_()
        attn.out_proj.bias.normal_()
    q, x = torch.randn(m, hidden, requires_grad=True), torch.randn(50, hidden, requires_grad=True)
    got = cross_attention(q, x, attn)
    grads = torch.autograd.grad(got.square().sum(), [q, x, attn.in_proj_weight, attn.in_proj_bias])
    want = attn(q[None], x[None], x[None], need_weights=False)[0][0]
    want_grads = torch.autograd.grad(want.square().sum(), [q, x, attn.in_proj_weight, attn.in_proj_bias])
    assert got.shape == (m, hidden)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(grads[3][hidden:2 * hidden], torch.zeros(hidden), atol=1e-5, rtol=0)  # key bias: softmax ignores it


def test_pool_is_the_window_mean_and_anchors_are_window_corners():
    x = torch.arange(16 * H, dtype=torch.float32).view(16, H)
    out, anchors = build("pool", H, 4)(x, 4)
    assert token_grid(16) == (4, 4)
    assert anchors.tolist() == [0, 2, 8, 10]
    assert torch.allclose(out[0], x[[0, 1, 4, 5]].mean(0))
    # a ragged 3x3 grid: the edge windows average only the tokens they cover
    y, a3 = build("pool", H, 4)(x[:9], 4)
    assert a3.tolist() == [0, 2, 6, 8] and torch.allclose(y[3], x[8])


def test_conv_starts_as_pooling_and_attention_prune_keeps_most_attended():
    torch.manual_seed(0)
    x = torch.randn(16, H)
    conv, _ = build("conv", H, 4)(x, 4)
    pool, _ = build("pool", H, 4)(x, 4)
    assert torch.allclose(conv, pool, atol=1e-6)
    att = torch.zeros(16)
    att[[3, 11, 12, 15]] = torch.tensor([0.4, 0.3, 0.2, 0.1])
    out, idx = build("attention", H, 4)(x, 4, att)
    assert idx.tolist() == [3, 11, 12, 15] and torch.equal(out, x[idx])
    with pytest.raises(ValueError, match="attention"):
        build("attention", H, 4)(x, 4, None)


def test_gate_picks_its_argmax_at_inference_and_any_choice_when_forced():
    torch.manual_seed(0)
    cfg = VisualConfig("gate", ratio=4)
    ad = VisualAdaptor(cfg, H).eval()
    L = 14
    ids = torch.tensor([1, 2] + [9] * 9 + [3, 4, 5, 6])  # [L + 1], 9 image tokens
    mask = ids[:L] == 9
    args = (ids, torch.randn(L, H), mask, torch.randn(9, H), torch.rand(L), torch.randn(H))
    assert ad.prompt_rows(*args).choice == cfg.gate_choices[0]  # zero-initialised gate: first choice
    with torch.no_grad():
        ad.gate.proj.bias[3] = 1.0
    rows = ad.prompt_rows(*args)
    assert rows.choice == cfg.gate_choices[3] and rows.gate_logits.shape == (len(cfg.gate_choices),)
    for name in cfg.gate_choices:
        forced = ad.prompt_rows(*args, force=name).kept()
        assert forced.choice == name and int(forced.fixed.sum()) == kept_tokens(name, 9, 4)
    assert torch.allclose(ad.kept_fractions(9), torch.tensor([kept_tokens(c, 9, 4) / 9 for c in cfg.gate_choices]))
    assert Gate(H, 3)(torch.randn(2, H)).shape == (2, 3)


def test_gated_loss_sends_gradient_to_the_gate_and_every_learnable_compressor():
    from vlmspec.train.data import encode_conversations, toyworld_conversation
    from vlmspec.train.distill import gated_losses, teacher

    target = tiny_target("llava")
    vis = VisualConfig("gate", 4, gate_cost=0.1)
    head = _variant(target, vis).head.float().train()
    convs = [toyworld_conversation(10**6 + i, t) for i, t in enumerate(("count", "describe", "attribute"))]
    batch = encode_conversations(target.processor, convs)
    feats, logits, captured = teacher(target, batch, visual=True)
    captured["inputs_embeds"] = captured["inputs_embeds"].float()
    torch.manual_seed(0)
    loss, stats = gated_losses(head, batch["input_ids"], feats.float(), captured, logits, batch["labels"], DistillConfig(), vis.gate_cost)
    loss.backward()
    assert torch.isfinite(loss) and 0 < stats["gate_kept"] <= 1 and stats["gate_entropy"] > 0
    assert head.visual.gate.proj.weight.grad.abs().sum() > 0, "the gate learns from the choices' losses"
    for name in ("conv", "resampler"):  # the choices with parameters all train
        grads = [p.grad for p in head.visual.compressors[name].parameters()]
        assert any(g is not None and g.abs().sum() > 0 for g in grads), name


def test_resampler_queries_are_sized_for_the_targets_image_and_old_configs_keep_64():
    """At 576 image tokens and 4x the resampler needs 144 queries: `sized_for` gives them (never
    fewer than a config has), a config without the field (an older drafter) keeps its 64, and an
    image past a resampler's queries is refused with what to do."""
    hidden, n = 32, 576
    small = VisualConfig("resampler", 4)
    assert small.max_queries == 64 and VisualConfig.from_dict({"compressor": "resampler", "ratio": 4.0}) == small
    sized = small.sized_for(n)
    assert sized.max_queries == 144 and VisualConfig.from_dict(sized.to_dict()) == sized
    assert VisualConfig("resampler", 16).sized_for(n).max_queries == 64, "36 queries fit in 64"
    assert VisualConfig("resampler", 4, max_queries=200).sized_for(n).max_queries == 200
    assert small.sized_for(None) == small
    assert VisualConfig("pool", 4).sized_for(n).max_queries == 64, "no resampler, nothing to size"
    gated = VisualConfig("gate", 4).sized_for(n)
    assert gated.max_queries == 144
    adaptor = VisualAdaptor(gated, hidden)
    assert adaptor.compressors["resampler"].queries.shape == (144, hidden)
    x = torch.randn(n, hidden)
    out, anchors = adaptor.compressors["resampler"](x, 4.0)
    assert out.shape == (144, hidden) and anchors.shape == (144,)
    with pytest.raises(ValueError, match="needs 144 at 4x: use a drafter trained at this image size"):
        VisualAdaptor(small, hidden).compressors["resampler"](x, 4.0)
    with pytest.raises(ValueError, match="max_queries"):
        VisualConfig("resampler", 4, max_queries=0)


def test_image_spans_edge_cases():
    cases = {(): [], (True,): [(0, 1)], (False,): [], (True,) * 5: [(0, 5)], (True, False, True): [(0, 1), (2, 3)],
             (False, True, True, False, False, True): [(1, 3), (5, 6)]}
    for mask, want in cases.items():
        assert image_spans(torch.tensor(mask, dtype=torch.bool)) == want, mask


def test_prompt_rows_keep_positions_and_hand_the_next_token_on():
    ids = torch.tensor([1, 2] + [9] * 9 + [3, 4, 5, 6])
    L = 14
    mask = ids[:L] == 9
    assert image_spans(mask) == [(2, 11)]
    feats = torch.randn(L, H)
    for cfg in (VisualConfig("pool", 4), VisualConfig("text_only"), VisualConfig("uniform", 16, decouple=True)):
        rows = VisualAdaptor(cfg, H).prompt_rows(ids, feats, mask, torch.randn(9, H), torch.rand(L), torch.randn(H)).kept()
        assert (rows.positions[1:] > rows.positions[:-1]).all()
        # text rows after the image keep their original positions, features and tokens
        tail = rows.positions >= 11
        assert torch.equal(rows.positions[tail], torch.arange(11, L))
        assert torch.equal(rows.feats[tail], feats[11:])
        # the first text token after the image is still read (by the last row before the text)
        last_before = int((rows.positions < 11).nonzero().max())
        assert int(rows.tokens[last_before]) == 3
        assert bool(rows.direct.any()) == cfg.decouple


def test_mrope_positions_of_compressed_tokens_come_from_the_target():
    target = tiny_target("qwen2_5_vl")
    inputs = encode_prompt(target, "what is it?", [tiny_image(2, size=56)])
    pos, _ = target._prefill_positions(inputs)  # [3, 1, L]
    mask = inputs["input_ids"][0] == target.model.config.image_token_id
    span = image_spans(mask)[0]
    n = span[1] - span[0]
    img_pos = pos[:, 0, span[0] : span[1]]  # [3, n]: (t, h, w) of each image token
    for name in FIXED[:-1]:
        _, anchors = build(name, H, 4)(torch.randn(n, H), 4, torch.rand(n))
        kept = img_pos[:, anchors]
        # every compressed token sits at a real image position, in increasing (h, w) order
        assert all(any(torch.equal(kept[:, i], img_pos[:, j]) for j in range(n)) for i in range(kept.shape[1]))
        hw = kept[1] * 1000 + kept[2]
        assert (hw[1:] > hw[:-1]).all()


def _variant(target, vis: VisualConfig, seed=0):
    torch.manual_seed(seed)
    cfg = EagleConfig.from_target(target)
    cfg.extra["visual"] = vis.to_dict()
    head = EagleHead(cfg, target.input_embeddings(), target.output_embeddings(), target.attention)
    return EagleDrafter(head.to(target.dtype), TreeConfig(depth=3, top_k=3, total_tokens=8))


VARIANTS = [
    VisualConfig("none", decouple=True),
    VisualConfig("none", global_feature=True),
    *[VisualConfig(c, 4) for c in FIXED],
    VisualConfig("conv", 16),
    VisualConfig("gate", 4, decouple=True, global_feature=True),
]


def test_captured_attention_equals_eager_attention(arch):
    target = tiny_target(arch)
    inputs = encode_prompt(target, "what is this?", [tiny_image(1)])
    _, out = target.prefill(inputs, visual=True)
    assert out.image_embeds.shape == (int(out.image_mask.sum()), target.hidden_size)
    pos, _ = target._prefill_positions(inputs)
    saved = target.attention
    set_attention(target.model, "eager")
    try:
        kw = {**inputs, **({"position_ids": pos} if pos is not None else {})}
        ref = target.model(**kw, output_attentions=True, return_dict=True).attentions[-1][0, :, -1].float().mean(0)
    finally:
        set_attention(target.model, saved if saved in ("sdpa", "eager") else "auto")
    assert torch.allclose(out.attention, ref, atol=1e-6)


def test_greedy_parity_for_every_variant(arch):
    target = tiny_target(arch)
    inputs = encode_prompt(target, "describe the picture", [tiny_image(3)])
    gc = GenerationConfig(max_new_tokens=20)
    ref = SpecEngine(target, PlainDrafter()).generate(inputs, gc).token_ids
    for vis in VARIANTS:
        out = SpecEngine(target, _variant(target, vis)).generate(inputs, gc)
        assert out.token_ids == ref, vis.label()


def test_every_variant_drafts_in_bfloat16():
    """The shipped heads run in the target's dtype: a bf16 head reads float32 inputs (the gate's
    question embedding) without a dtype clash, and still drafts tokens the target accepts."""
    import copy

    from vlmspec.target import Target
    from testing.tiny import build_tiny

    model, processor = build_tiny("llava", seed=0)
    target = Target(copy.deepcopy(model).to(torch.bfloat16), processor, name="tiny-llava-bf16")
    inputs = encode_prompt(target, "describe the picture", [tiny_image(3)])
    gc = GenerationConfig(max_new_tokens=12)
    ref = SpecEngine(target, PlainDrafter()).generate(inputs, gc).token_ids
    for vis in (*VARIANTS, VisualConfig("gate", 16, gate_cost=0.05)):
        drafter = _variant(target, vis)
        assert next(drafter.head.parameters()).dtype == torch.bfloat16
        out = SpecEngine(target, drafter).generate(inputs, gc)
        assert out.token_ids == ref, vis.label()  # (a random tiny model: no near-tie on these 12 tokens)
        if drafter.head.visual.gate is not None:
            logits = drafter.head.visual.gate(torch.randn(target.hidden_size))  # a float32 question
            assert logits.dtype == torch.float32


def test_variants_train_save_and_load(tmp_path):
    target = tiny_target("llava")
    assert target.image_tokens == 16
    for vis in (VisualConfig("gate", 4, decouple=True, global_feature=True, gate_cost=0.1), VisualConfig("attention", 16),
                VisualConfig("resampler", 2, max_queries=4)):  # 16 image tokens at 2x need 8: training sizes it
        out = tmp_path / vis.compressor
        cfg = DistillConfig(steps=4, batch_size=4, lr=3e-3, warmup=1, eval_every=10**6, eval_n=1, ckpt_every=4, visual=vis.to_dict())
        trained = train_drafter(target, "toyworld", out, cfg, progress=False)
        loaded = EagleDrafter.load(out / "drafter", target)
        assert loaded.head.config.visual == vis.sized_for(target.image_tokens) and loaded.needs_visual
        if vis.compressor == "resampler":
            assert loaded.head.visual.compressors["resampler"].queries.shape[0] == 8 != vis.max_queries
        a, b = trained.head.state_dict(), loaded.head.state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        inputs = encode_prompt(target, "how many?", [tiny_image(5)])
        gc = GenerationConfig(max_new_tokens=12)
        assert SpecEngine(target, loaded).generate(inputs, gc).token_ids == SpecEngine(target, PlainDrafter()).generate(inputs, gc).token_ids


def test_a_resampler_with_too_few_queries_for_the_targets_images_is_refused_at_load(tmp_path):
    """Tiny llava's images take 16 tokens: a resampler of 4 queries at 2x reads 8 and is refused
    when loaded, saying why; the same drafter sized for the target loads (the control)."""
    from vlmspec.draft.eagle import DrafterLoadError

    target = tiny_target("llava")
    small = VisualConfig("resampler", 2, max_queries=4)
    _variant(target, small).save(tmp_path / "small")
    with pytest.raises(DrafterLoadError, match="resampler reads images of up to 8 tokens at 2x and this target's take 16"):
        EagleDrafter.load(tmp_path / "small", target)
    _variant(target, small.sized_for(target.image_tokens)).save(tmp_path / "sized")
    assert EagleDrafter.load(tmp_path / "sized", target).head.visual.compressors["resampler"].queries.shape[0] == 8


def test_prefill_at_llava_scale_is_timed_round_robin_and_none_past_a_resamplers_capacity():
    from recipes.bench.ablation import prefill_at_scale

    target = tiny_target("llava")
    variants = {"plain": VisualConfig(), "resampler@4x": VisualConfig("resampler", 4), "resampler@16x": VisualConfig("resampler", 16),
                "pool@16x": VisualConfig("pool", 16)}
    got = prefill_at_scale(target, {n: _variant(target, v) for n, v in variants.items()}, rounds=3, blocks=2)
    assert got["resampler@4x"] == {"ms": None, "vs_baseline": None, "vs_baseline_blocks": None, "gflop": None}, "64 queries < 576 / 4"
    for name in ("plain", "resampler@16x", "pool@16x"):
        assert isinstance(got[name]["ms"], float) and got[name]["ms"] > 0 and got[name]["vs_baseline"] > 0, got
        blocks = got[name]["vs_baseline_blocks"]
        assert len(blocks) == 2 and min(blocks) <= got[name]["vs_baseline"] * (1 + 1e-9) and got[name]["gflop"] > 0
    assert got["plain"]["vs_baseline"] == 1.0 and got["plain"]["vs_baseline_blocks"] == [1.0, 1.0], "the baseline against itself, round by round"
    no_base = prefill_at_scale(target, {"pool@16x": _variant(target, variants["pool@16x"])}, rounds=1)
    assert no_base["pool@16x"]["ms"] > 0 and no_base["pool@16x"]["vs_baseline"] is None


def test_read_flops_of_the_plain_head_match_its_matrix_products_and_attention():
    """The FLOP count the ablation reports, checked against the head's shapes: fc, q/k/v/o, the
    MLP's three projections and attention (QK^T and PV over every key) for each of the n rows."""
    from recipes.bench.ablation import read_flops, scale_prompt

    target = tiny_target("llava")
    drafter = _variant(target, VisualConfig())
    c = drafter.head.config
    n_image, n_text = 64, 8
    ctx, root = scale_prompt(target, n_image, n_text)
    n, h, i = n_image + n_text, c.hidden_size, c.intermediate_size
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    matmuls = 2 * n * (2 * h * h + h * q + 2 * h * kv + q * h + 3 * h * i)
    attention = 4 * c.num_attention_heads * n * n * c.head_dim
    assert read_flops(drafter, ctx, root) == matmuls + attention
    pooled = read_flops(_variant(target, VisualConfig("pool", 16)), ctx, root)  # 64 image rows -> 4
    assert pooled < read_flops(drafter, ctx, root) / 4
