"""Drafters on their own: n-gram proposals, EAGLE head save/load and target checks."""
import json
import time

import pytest
import torch
from safetensors.torch import load_file
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoConfig

from conftest import tiny_target
from vlmspec import assets
from vlmspec.draft import load_drafter
from vlmspec.draft.base import DraftSession, Drafter, PlainDrafter, PromptContext, TreeConfig
from vlmspec.draft import eagle as eagle_module
from vlmspec.draft.eagle import DrafterLoadError, EagleConfig, EagleDrafter, EagleHead, _EagleSession, _rms_norm, build_head
from vlmspec.draft.ngram import NgramConfig, NgramDrafter
from vlmspec.engine import GenerationConfig, SpecEngine
from vlmspec.inputs import encode_prompt
from vlmspec.cache.kv_cache import KVCache
from testing.tiny import tiny_image
from vlmspec.tree import DraftTree, tree_attention_mask
from vlmspec.vision_compress import VisualConfig


def _ctx(ids, hidden=8):
    ids = torch.tensor(ids)
    return PromptContext(ids, torch.zeros(len(ids), hidden))


def test_protocol_conformance():
    target = tiny_target("llava")
    for d in (PlainDrafter(), NgramDrafter(), EagleDrafter.random_init(target)):
        assert isinstance(d, Drafter)
        assert isinstance(d.start(_ctx([1, 2, 3], target.hidden_size)), DraftSession)


def test_ngram_proposes_continuation_of_latest_match():
    d = NgramDrafter(TreeConfig(depth=3, top_k=1, total_tokens=8))
    s = d.start(_ctx([5, 6, 7, 8, 9, 1, 2, 5, 6]))
    tree = s.propose(7, max_depth=3)  # "... 5 6 | 7" matches "5 6 7" -> 8 9 1
    assert tree.tokens.tolist() == [7, 8, 9, 1] and tree.parents.tolist() == [-1, 0, 1, 2]
    assert s.propose(7, max_depth=1).tokens.tolist() == [7, 8]
    assert s.propose(7, max_depth=0).tokens.tolist() == [7]


def test_ngram_branches_and_budget():
    # "1 2" was followed by 3 and (more recently) by 4: two branches, most recent first
    d = NgramDrafter(TreeConfig(depth=2, top_k=2, total_tokens=3), NgramConfig(max_ngram=2))
    s = d.start(_ctx([1, 2, 3, 0, 1, 2, 4, 9, 1]))
    tree = s.propose(2, max_depth=2)
    assert tree.tokens.tolist()[:3] == [2, 4, 9] and tree.size - 1 <= 3
    assert 3 in tree.tokens.tolist()[1:] and int(tree.depth.max()) <= 2
    s.commit(torch.tensor([2, 4]), torch.zeros(2, 8))
    assert s.history[-2:] == [2, 4]


def test_ngram_no_match_is_root_only():
    s = NgramDrafter().start(_ctx([1, 2, 3]))
    assert s.propose(9, max_depth=4).size == 1


def test_eagle_tree_shape_follows_config():
    target = tiny_target("llava")
    cfg = TreeConfig(depth=4, top_k=3, total_tokens=10)
    d = EagleDrafter.random_init(target, cfg)
    inputs = encode_prompt(target, "hello there")
    _, out = target.prefill(inputs)
    s = d.start(PromptContext(inputs["input_ids"][0], out.features))
    tree = s.propose(5, max_depth=10)
    assert tree.size == 1 + cfg.total_tokens and int(tree.depth.max()) <= cfg.depth
    assert tree.tokens[0] == 5
    # siblings are distinct tokens
    for kids in tree.children():
        toks = [int(tree.tokens[c]) for c in kids]
        assert len(toks) == len(set(toks))
    assert s.cache.seq_len == inputs["input_ids"].shape[1]  # tree entries were dropped again


@pytest.mark.parametrize("arch", ["eagle1", "eagle3"])
def test_eagle_save_load_roundtrip(tmp_path, arch):
    target = tiny_target("llava")
    d = EagleDrafter.random_init(target, seed=3, arch=arch)
    d.save(tmp_path / "drafter")
    assert sorted(p.name for p in (tmp_path / "drafter").iterdir()) == ["config.json", "model.safetensors"]
    raw = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert raw["model_type"] == "vlmspec_eagle" and "drafter" not in raw  # the Hugging Face format
    assert isinstance(AutoConfig.from_pretrained(tmp_path / "drafter"), EagleConfig)
    loaded = load_drafter(str(tmp_path / "drafter"), target)
    for (k1, v1), (k2, v2) in zip(d.head.state_dict().items(), loaded.head.state_dict().items()):
        assert k1 == k2 and torch.equal(v1, v2)
    for name in EagleConfig.field_names():
        assert getattr(loaded.head.config, name) == getattr(d.head.config, name), name
    # the shared embedding/LM head are the target's own modules, not copies
    assert loaded.head.embed is target.input_embeddings() and loaded.head.lm_head is target.output_embeddings()


def test_eagle_visual_settings_survive_the_roundtrip(tmp_path):
    target = tiny_target("llava")
    vis = VisualConfig("gate", 4, decouple=True, global_feature=True)
    cfg = EagleConfig.from_target(target)
    cfg.extra["visual"] = vis.to_dict()
    EagleDrafter(EagleHead(cfg, target.input_embeddings(), target.output_embeddings())).save(tmp_path)
    loaded = EagleDrafter.load(tmp_path, target)
    assert loaded.head.config.visual == vis and loaded.needs_visual


def _legacy_save(drafter, folder):
    """The first format: plain JSON with "drafter": "eagle" and the config's fields."""
    drafter.save(folder)
    cfg = drafter.head.config
    legacy = {"drafter": "eagle", **{name: getattr(cfg, name) for name in EagleConfig.field_names()}}
    (folder / "config.json").write_text(json.dumps(legacy, indent=2))


def test_a_drafter_s_measured_tree_is_its_default_and_the_spec_s_knobs_still_win(tmp_path):
    from vlmspec.factory import EngineSpec, tree_config

    target = tiny_target("llava")
    cfg = EagleConfig.from_target(target)
    cfg.tree_defaults = {"cpu": [7, 3, 12]}
    EagleDrafter(EagleHead(cfg, target.input_embeddings(), target.output_embeddings())).save(tmp_path / "measured")
    EagleDrafter.random_init(target).save(tmp_path / "plain")  # records no tree: the negative control
    measured, plain = str(tmp_path / "measured"), str(tmp_path / "plain")
    assert json.loads((tmp_path / "measured" / "config.json").read_text())["tree_defaults"] == {"cpu": [7, 3, 12]}
    assert load_drafter(measured, target).tree == TreeConfig(7, 3, 12)
    assert load_drafter(plain, target).tree == TreeConfig()
    assert tree_config(EngineSpec(), "cpu", measured) == TreeConfig(7, 3, 12)
    assert tree_config(EngineSpec(tree_depth=4), "cpu", measured) == TreeConfig(4, 3, 12)  # a knob given wins, the rest stay
    assert tree_config(EngineSpec(), "cpu", plain) == tree_config(EngineSpec(), "cpu", "ngram") == TreeConfig.for_device("cpu")
    assert tree_config(EngineSpec(), "cuda", measured) == TreeConfig.for_device("cuda")  # no entry for that device
    fields = {name: getattr(cfg, name) for name in EagleConfig.field_names()}
    for bad in ({"gpu": [7, 3, 12]}, {"cpu": [7, 3]}, {"cpu": [7, 0, 12]}, {"cpu": [7, 3, 1.5]}, [7, 3, 12]):
        with pytest.raises(ValueError, match="tree_defaults"):
            EagleConfig(**{**fields, "tree_defaults": bad})


def test_the_default_model_s_drafter_records_its_measured_cpu_tree():
    cfg = json.loads((assets.ASSETS / "smolvlm-toyworld-drafter" / "config.json").read_text())
    assert EagleConfig(**{k: v for k, v in cfg.items() if k in EagleConfig.field_names()}).default_tree("cpu") == TreeConfig(7, 4, 16)


def test_eagle_legacy_folder_still_loads_and_says_how_to_convert(tmp_path, caplog):
    target = tiny_target("llava")
    d = EagleDrafter.random_init(target, seed=4)
    _legacy_save(d, tmp_path / "old")
    with caplog.at_level("WARNING", logger="vlmspec.draft"):
        loaded = load_drafter(str(tmp_path / "old"), target)
    assert "first drafter format" in caplog.text and "EagleDrafter.save" in caplog.text
    a, b = d.head.state_dict(), loaded.head.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    loaded.save(tmp_path / "new")  # converted once: the new folder loads without the warning
    caplog.clear()
    with caplog.at_level("WARNING", logger="vlmspec.draft"):
        EagleDrafter.load(tmp_path / "new", target)
    assert "first drafter format" not in caplog.text
    raw = json.loads((tmp_path / "old" / "config.json").read_text())
    raw["extra_key"] = 1
    (tmp_path / "old" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(DrafterLoadError, match="not a valid"):
        EagleDrafter.load(tmp_path / "old", target)


def test_bundled_drafter_is_a_hugging_face_artefact():
    folder = assets.BUNDLED_DRAFTER
    if not (folder / "config.json").is_file():
        pytest.skip("no bundled drafter")
    raw = json.loads((folder / "config.json").read_text())
    assert raw["model_type"] == "vlmspec_eagle"
    cfg = AutoConfig.from_pretrained(folder)
    assert isinstance(cfg, EagleConfig) and cfg.target_model_type == "vipllava" and cfg.visual.is_plain
    state = load_file(str(folder / "model.safetensors"))
    assert len(state) == 12 and sum(v.numel() for v in state.values()) == 369_280


def test_a_drafter_for_another_target_is_refused():
    """The bundled drafter (hidden 160, vocab 1015) on a tiny target (hidden 64): refused before
    any weight is read, with what differs and what to do."""
    if not (assets.BUNDLED_DRAFTER / "config.json").is_file():
        pytest.skip("no bundled drafter")
    with pytest.raises(DrafterLoadError, match=r"different target.*hidden_size: drafter 160 != target 64.*vlmspec train"):
        load_drafter(str(assets.BUNDLED_DRAFTER), tiny_target("llava"))


def test_hub_id_while_offline_fails_fast_and_clearly(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty cache
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    target = tiny_target("llava")
    t0 = time.perf_counter()
    with pytest.raises(DrafterLoadError, match=r"'someone/eagle-drafter' looks like a hub id.*not in the local cache") as info:
        load_drafter("someone/eagle-drafter", target)
    assert time.perf_counter() - t0 < 5
    assert info.value.__cause__ is None and info.value.__suppress_context__  # one clear error, no chained traceback
    with pytest.raises(DrafterLoadError, match=r"is none of 'auto', 'eagle', 'plain', 'ngram', 'self', 'self:E', 'self:E:K', nor a drafter folder"):
        load_drafter("./no/such/drafter", target)


def test_not_drafting_is_plain_and_the_old_spelling_none_still_reads_as_plain():
    """One word for not drafting: `plain` (the drafter, its name, the policy a plain run reports); `none`,
    the old spelling users may still send, is read as `plain` at every entry. Control: another unknown
    name is refused."""
    from vlmspec.draft import check_drafter_name, default_tree, recorded_target
    from vlmspec.factory import EngineSpec

    target = tiny_target("llava")
    for word in ("plain", "none"):
        drafter = load_drafter(word, target)
        assert isinstance(drafter, PlainDrafter) and drafter.name == "plain"
        assert EngineSpec(drafter=word).drafter == "plain"
        check_drafter_name(word)
        assert default_tree(word, "cpu") is None and recorded_target(word) is None
    result = SpecEngine(target, load_drafter("none", target)).generate(encode_prompt(target, "hello"), GenerationConfig(max_new_tokens=3))
    assert result.policy == "plain" and result.num_drafted == 0
    with pytest.raises(DrafterLoadError, match="is none of"):
        check_drafter_name("nothing")


@pytest.mark.parametrize("reachable", [True, False])
def test_hub_id_goes_through_the_hub_or_the_local_cache(tmp_path, monkeypatch, reachable):
    """A hub id is fetched with huggingface_hub when the hub answers, else read from the cache
    (local_files_only); either way the snapshot folder is loaded and checked like any folder."""
    import huggingface_hub

    import vlmspec.target

    target = tiny_target("llava")
    EagleDrafter.random_init(target, seed=5).save(tmp_path / "snapshot")
    calls = []

    def fake_snapshot_download(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        return str(tmp_path / "snapshot")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    monkeypatch.setattr(vlmspec.target, "hub_reachable", lambda: reachable)
    d = load_drafter("org/eagle-drafter", target, TreeConfig(3, 2, 4))
    assert isinstance(d, EagleDrafter) and d.tree == TreeConfig(3, 2, 4)
    (repo_id, kwargs), = calls
    assert repo_id == "org/eagle-drafter" and kwargs["local_files_only"] is (not reachable)
    assert {"config.json", "model.safetensors"} <= set(kwargs["allow_patterns"])


@pytest.mark.parametrize(
    "field,value,word",
    [("hidden_size", 96, "hidden_size"), ("vocab_size", 1003, "vocab_size"), ("rope_theta", 1234.0, "rope_theta"), ("max_position_embeddings", 512, "max_position")],
)
def test_eagle_for_another_target_is_refused(tmp_path, field, value, word):
    target = tiny_target("llava")
    EagleDrafter.random_init(target).save(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg[field] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DrafterLoadError, match=word):
        EagleDrafter.load(tmp_path, target)


def _trimmed(target, k=40, seed=2):
    from vlmspec.draft.eagle import draft_vocabulary

    cfg = EagleConfig.from_target(target)
    cfg.draft_vocab_size = k
    torch.manual_seed(seed)
    head = EagleHead(cfg, target.input_embeddings(), target.output_embeddings())
    counts = torch.randint(0, 50, (target.vocab_size,), generator=torch.Generator().manual_seed(seed))
    head.set_draft_vocab(draft_vocabulary(counts, k, always=tuple(target.eos_token_ids)))
    return head


def test_draft_vocabulary_maps_round_trip_and_keeps_the_most_frequent():
    from vlmspec.draft.eagle import draft_vocabulary, t2d_map

    counts = torch.tensor([5, 0, 9, 9, 1, 7, 0, 3])
    d2t = draft_vocabulary(counts, 4, always=(6,))
    assert d2t.tolist() == [2, 3, 5, 6]  # 6 always; then 9, 9 (ties by id), 7
    t2d = t2d_map(d2t, counts.numel())
    assert torch.equal(d2t[t2d[d2t]], d2t) and torch.equal(t2d[d2t], torch.arange(4))
    assert (t2d >= 0).sum() == 4 and t2d[0] == -1


def test_a_trimmed_head_drafts_only_its_vocabulary_and_keeps_greedy_parity(tmp_path):
    target = tiny_target("llava")
    head = _trimmed(target)
    inputs = encode_prompt(target, "describe the image in detail", [tiny_image(0)])
    plain = SpecEngine(target, PlainDrafter()).generate(inputs, GenerationConfig(max_new_tokens=32, ignore_eos=True)).token_ids
    tree = TreeConfig(depth=4, top_k=3, total_tokens=10)
    drafter = EagleDrafter(head, tree)
    got = SpecEngine(target, drafter).generate(inputs, GenerationConfig(max_new_tokens=32, ignore_eos=True))
    assert got.token_ids == plain and got.num_drafted > 0
    _, out = target.prefill(inputs)
    t = drafter.start(PromptContext(inputs["input_ids"][0], out.features)).propose(5, 4)
    assert set(t.tokens[1:].tolist()) <= set(head.d2t.tolist())
    # the trimmed logits are the full head's logits at the kept ids
    h = torch.randn(3, target.hidden_size)
    assert torch.allclose(head.logits(h), target.output_embeddings()(h).float()[:, head.d2t], atol=1e-5)
    # saved and loaded with its vocabulary
    drafter.save(tmp_path / "d")
    loaded = EagleDrafter.load(tmp_path / "d", target)
    assert loaded.head.config.draft_vocab_size == 40 and torch.equal(loaded.head.d2t, head.d2t)


def test_a_drafter_for_another_vocabulary_is_refused(tmp_path):
    target = tiny_target("llava")
    EagleDrafter(_trimmed(target)).save(tmp_path)
    from safetensors.torch import load_file, save_file

    state = load_file(str(tmp_path / "model.safetensors"))
    state["d2t"] = state["d2t"] + target.vocab_size  # ids of a bigger vocabulary
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(DrafterLoadError, match="another vocabulary"):
        EagleDrafter.load(tmp_path, target)
    cfg = EagleConfig.from_target(target)
    own = {name: getattr(cfg, name) for name in EagleConfig.field_names()}
    with pytest.raises(ValueError, match="draft_vocab_size"):
        EagleConfig(**{**own, "draft_vocab_size": target.vocab_size + 1})


def test_eagle_bad_checkpoints_are_refused(tmp_path):
    target = tiny_target("llava")
    with pytest.raises(DrafterLoadError, match="config.json"):
        EagleDrafter.load(tmp_path, target)
    EagleDrafter.random_init(target).save(tmp_path)
    from safetensors.torch import load_file, save_file

    state = load_file(str(tmp_path / "model.safetensors"))
    state.pop(next(iter(state)))
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(DrafterLoadError, match="missing"):
        EagleDrafter.load(tmp_path, target)
    (tmp_path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(DrafterLoadError, match="not a readable safetensors"):
        EagleDrafter.load(tmp_path, target)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(DrafterLoadError, match="not a valid"):
        EagleDrafter.load(tmp_path, target)


# ---------------------------------------------------------------- sync-free proposal == the first algorithm
@torch.no_grad()
def _reference_propose(s, root, max_depth):
    """The EAGLE-2 proposal as first written (one host read per node), kept as the oracle: the
    sync-free `propose` must draft the identical tree (tokens, parents, order, ties)."""
    head, cfg = s.head, s.tree
    if s.prompt is not None:
        toks, feats, pos, direct, fuse = s._prompt_rows(root)
    else:
        s.wait(root)
        toks, feats = s.pending_next, s.pending_feats
        pos = torch.arange(s.next_pos, s.next_pos + toks.shape[0], device=s.device)
        direct, fuse = None, None if s.global_feat is None else torch.ones_like(toks, dtype=torch.bool)
    start, n = s.cache.seq_len, toks.shape[0]
    hidden = head(toks, feats, pos, tree_attention_mask(torch.ones(n, n, dtype=torch.bool).tril(), start, s.dtype),
                  s.cache.hf, direct, fuse, s.global_feat)
    s.clear_pending()
    s.next_pos = int(pos[-1]) + 1
    committed, depth = s.cache.seq_len, min(cfg.depth, max_depth)
    if depth <= 0:
        return DraftTree.root_only(root)
    node_fuse = None if s.global_feat is None else torch.ones(1, dtype=torch.bool)
    k = cfg.top_k
    tokens, parents, scores = [root], [-1], [0.0]
    out_hidden, slot = {0: hidden[-1]}, {}
    logp = torch.log_softmax(head.logits(hidden[-1:]), -1)
    frontier = [0]
    for d in range(1, depth + 1):
        top = torch.topk(logp, k, dim=-1)
        cand = (torch.tensor([scores[f] for f in frontier])[:, None] + top.values).flatten()
        children = []
        for fi, f in enumerate(frontier):
            for j in range(k):
                tokens.append(int(top.indices[fi, j]))
                parents.append(f)
                scores.append(float(cand[fi * k + j]))
                children.append(len(tokens) - 1)
        if d == depth:
            break
        frontier = [children[b] for b in torch.topk(cand, min(k, cand.numel())).indices.tolist()]
        ftoks = torch.tensor([tokens[f] for f in frontier])
        ffeat = torch.stack([out_hidden[parents[f]] for f in frontier])
        n_tree = len(slot)
        allowed = torch.zeros(len(frontier), n_tree + len(frontier), dtype=torch.bool)
        for i, f in enumerate(frontier):
            allowed[i, n_tree + i] = True
            a = parents[f]
            while a > 0:
                allowed[i, slot[a]] = True
                a = parents[a]
        for i, f in enumerate(frontier):
            slot[f] = n_tree + i
        fpos = torch.full((len(frontier),), s.next_pos - 1 + d)
        ffuse = None if node_fuse is None else node_fuse.expand(len(frontier))
        h = head(ftoks, ffeat, fpos, tree_attention_mask(allowed, committed, s.dtype), s.cache.hf, None, ffuse, s.global_feat)
        for i, f in enumerate(frontier):
            out_hidden[f] = h[i]
        logp = torch.log_softmax(head.logits(h), -1)
    s.cache.crop(committed)
    order = sorted(range(1, len(tokens)), key=lambda i: (-scores[i], i))[: cfg.total_tokens]
    full = DraftTree(torch.tensor(tokens), torch.tensor(parents))
    return full.select(torch.tensor([0, *sorted(order)]))


def _standalone_drafter(tree, vocab=40, hidden=32, ties=False, seed=0, draft_vocab=0, dtype=torch.float32, arch="eagle1",
                        norm_before_residual=False):
    """An EAGLE head over its own small embedding / LM head (no target). ties=True: the LM head's
    rows come in equal pairs, so every distribution has exact ties to break. arch eagle3: an
    EAGLE-3 head reading three target layers (its features are [n, 3 x hidden])."""
    torch.manual_seed(seed)
    e3 = dict(arch="eagle3", feature_layers=[0, 2, 3], norm_before_residual=norm_before_residual) if arch == "eagle3" else {}
    cfg = EagleConfig(hidden_size=hidden, vocab_size=vocab, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      intermediate_size=64, max_position_embeddings=512, draft_vocab_size=draft_vocab, **e3)
    embed, lm_head = torch.nn.Embedding(vocab, hidden), torch.nn.Linear(hidden, vocab, bias=False)
    if ties:
        with torch.no_grad():
            lm_head.weight[1::2] = lm_head.weight[0::2][: vocab // 2]
    head = build_head(cfg, embed.to(dtype), lm_head.to(dtype))
    norms = (head.embed_norm, head.feat_norm) if arch == "eagle1" else (head.hidden_norm, head.norm)
    with torch.no_grad():  # norm weights away from their initial ones, so that multiplying by them is exercised
        for norm in (*norms, head.layer.input_layernorm, head.layer.post_attention_layernorm):
            norm.weight.copy_(1 + 0.2 * torch.randn(hidden))
    head = head.to(dtype)
    if draft_vocab:
        head.set_draft_vocab(torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[:draft_vocab].sort().values)
    return EagleDrafter(head, tree)


def _same_proposals(drafter, prompt, hidden, steps=3, seed=0):
    """Run the new propose and the oracle side by side over `steps` propose/commit rounds."""
    new, ref = drafter.start(prompt), drafter.start(prompt)
    g = torch.Generator().manual_seed(seed)
    root = 3
    for step in range(steps):
        a, b = new.propose(root, 10), _reference_propose(ref, root, 10)
        assert a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist(), step
        assert new.cache.seq_len == ref.cache.seq_len and new.next_pos == ref.next_pos
        path = a.path_to(min(a.size - 1, 1 + step))
        feats = torch.randn(len(path), drafter.head.config.feature_width, generator=g).to(prompt.features.dtype)
        for s in (new, ref):
            s.commit(a.tokens[path], feats)
        root = int(torch.randint(drafter.head.config.vocab_size, (1,), generator=g))


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("tree", [TreeConfig(4, 3, 10), TreeConfig(7, 10, 60), TreeConfig(1, 1, 1), TreeConfig(3, 5, 200),
                                  TreeConfig(5, 1, 3)])
@pytest.mark.parametrize("arch", ["eagle1", "eagle3"])
def test_propose_drafts_the_same_tree_as_the_reference(tree, ties, arch):
    d = _standalone_drafter(tree, ties=ties, seed=tree.depth, arch=arch, norm_before_residual=tree.depth % 2 == 1)
    g = torch.Generator().manual_seed(tree.top_k)
    for n in (1, 9):
        prompt = PromptContext(torch.randint(40, (n,), generator=g), torch.randn(n, d.head.config.feature_width, generator=g))
        _same_proposals(d, prompt, 32)


@pytest.mark.parametrize("arch", ["eagle1", "eagle3"])
def test_a_first_step_that_drafts_nothing_runs_no_head_over_the_prompt(arch):
    """A plain head's prompt pairs wait with the pending pairs: a row whose first steps draft
    nothing (a batch's plain steps) runs no head forward; its first drafted step runs them all and
    drafts the tree of a row that ran its prompt at once. Negative control: a row whose earlier
    prompt pairs differ drafts another tree (the waiting pairs are read, not just the last one)."""
    d = _standalone_drafter(TreeConfig(4, 3, 10), seed=4, arch=arch)
    g = torch.Generator().manual_seed(4)
    prompt = PromptContext(torch.randint(40, (9,), generator=g), torch.randn(9, d.head.config.feature_width, generator=g))
    other = PromptContext(prompt.token_ids, torch.cat([torch.randn(8, d.head.config.feature_width, generator=g), prompt.features[-1:]]))
    late, early, elsewhere = d.start(prompt), d.start(prompt), d.start(other)
    feats = torch.randn(2, d.head.config.feature_width, generator=g)
    for s, depth in ((late, 0), (early, 4), (elsewhere, 0)):
        assert s.propose(3, depth).size == (1 if depth == 0 else 11)
        s.commit(torch.tensor([3, 7]), feats)
    assert late.cache.seq_len == 0 and early.cache.seq_len == 9  # the prompt's 9 pairs (its last with the root) ran early only
    want = early.propose(11, 4)
    got = late.propose(11, 4)
    assert late.cache.seq_len == early.cache.seq_len == late.next_pos == 11
    assert got.tokens.tolist() == want.tokens.tolist() and got.parents.tolist() == want.parents.tolist()
    assert elsewhere.propose(11, 4).tokens.tolist() != want.tokens.tolist()


@pytest.mark.parametrize("tree", [TreeConfig(4, 3, 10), TreeConfig(7, 4, 16)])
@pytest.mark.parametrize("arch", ["eagle1", "eagle3"])
def test_propose_in_bf16_drafts_the_same_tree_as_the_reference(tree, arch):
    """bf16 is where decode() packs its weights (PackedLinear) and fuses q/k/v and gate/up: the
    reference runs the HF layer and F.linear, and every tree must still come out identical."""
    d = _standalone_drafter(tree, vocab=64, hidden=64, seed=tree.depth, dtype=torch.bfloat16, arch=arch)
    g = torch.Generator().manual_seed(5)
    for n in (1, 9):
        prompt = PromptContext(torch.randint(64, (n,), generator=g), torch.randn(n, d.head.config.feature_width, generator=g).bfloat16())
        _same_proposals(d, prompt, 64)


@pytest.mark.parametrize("arch", ["eagle1", "eagle3"])
@pytest.mark.parametrize("draft_vocab", [0, 24])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_is_forward_and_follows_weights_changed_in_place(dtype, draft_vocab, arch):
    head = _standalone_drafter(TreeConfig(3, 2, 4), vocab=64, hidden=64, seed=1, draft_vocab=draft_vocab, dtype=dtype, arch=arch).head
    g = torch.Generator().manual_seed(0)
    n, start = 5, 7
    # committed rows read the target's features; EAGLE-3's drafted rows read the head's own outputs (width H, no fc)
    toks = torch.randint(64, (start + n,), generator=g)
    committed = torch.randn(start, head.config.feature_width, generator=g).to(dtype)
    drafted = torch.randn(n, 64 if arch == "eagle3" else head.config.feature_width, generator=g).to(dtype)
    pos = torch.arange(start + n)

    def both():
        outs = []
        for run in (head.decode, head.forward):
            cache = KVCache()
            with torch.no_grad():
                run(toks[:start], committed, pos[:start], tree_attention_mask(torch.ones(start, start, dtype=torch.bool).tril(), 0, dtype), cache.hf)
                h = run(toks[start:], drafted, pos[start:], tree_attention_mask(torch.eye(n, dtype=torch.bool), start, dtype), cache.hf)
            outs.append((h, head.decode_logits(h) if run == head.decode else head.logits(h)))
        return outs

    def same(a, b):  # bf16: bit for bit; fp32: oneDNN sums in another order than F.linear's MKL
        return torch.equal(a, b) if dtype == torch.bfloat16 else torch.allclose(a, b, rtol=1e-5, atol=1e-5)

    (h1, l1), (h2, l2) = both()
    assert same(h1, h2) and same(l1, l2)
    with torch.no_grad():  # as an optimiser step writes them: in place
        head.layer.mlp.up_proj.weight.mul_(1.5)
        head.logits_module.weight.add_(0.25)
    (h3, l3), (h4, l4) = both()
    assert not same(h3, h1) and not same(l3, l1)  # the cached packed weights were rebuilt ...
    assert same(h3, h4) and same(l3, l4)  # ... to the new ones
    if draft_vocab:  # and to a new draft vocabulary
        head.set_draft_vocab(torch.arange(draft_vocab) * 2)
        (h5, l5), (h6, l6) = both()
        if arch == "eagle1":
            assert same(l5, l6) and same(l5, head.lm_head(h5).float()[..., ::2][..., :draft_vocab])
        else:  # its own LM head restarts from the target's rows of the new vocabulary
            assert same(l5, l6) and torch.equal(head.lm.weight, head.lm_head.weight[::2][:draft_vocab])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_s_rotary_table_and_fused_norm_are_the_hf_modules_numbers(dtype, monkeypatch):
    """decode() reads cos / sin from a table and runs the norms in torch's fused kernel: both must
    give the HF modules' numbers bit for bit, at every position of the table."""
    head = _standalone_drafter(TreeConfig(3, 2, 4), vocab=64, hidden=64, seed=2, dtype=dtype).head
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 64, generator=g).to(dtype)
    for positions in (torch.arange(512), torch.randint(512, (6,), generator=g), torch.tensor([511, 0, 3, 3, 200, 7])):
        n = positions.shape[0]
        cos, sin = head._rope(x[:1].expand(n, 64), positions)
        ref_cos, ref_sin = head.rotary(x[:1].expand(n, 64), positions)
        assert torch.equal(cos[:, 0], ref_cos) and torch.equal(sin[:, 0], ref_sin)
    cos, _ = head._rope(x, torch.arange(1, 7))
    assert not torch.equal(cos[:, 0], head.rotary(x, torch.arange(6))[0])  # negative control: one position off
    monkeypatch.setattr(eagle_module.head, "_ROPE_TABLE_MAX", 100)  # a longer context computes them per call
    cos, sin = head._rope(x, torch.tensor([511, 0, 3, 3, 200, 7]))
    assert torch.equal(cos[:, 0], ref_cos) and torch.equal(sin[:, 0], ref_sin)
    for scale in (1e-3, 1.0, 30.0):
        y = (torch.randn(16, 64, generator=g) * scale).to(dtype)
        assert torch.equal(_rms_norm(head.layer.input_layernorm, y), head.layer.input_layernorm(y))


@pytest.mark.parametrize("vis", [None, VisualConfig("none", global_feature=True), "eagle3"])
def test_propose_matches_the_reference_on_a_tiny_vlm(vis):
    target = tiny_target("llava")
    tree = TreeConfig(5, 4, 16)
    if vis in (None, "eagle3"):
        d = EagleDrafter.random_init(target, tree, seed=2, arch="eagle3" if vis else "eagle1")
    else:
        torch.manual_seed(2)
        cfg = EagleConfig.from_target(target)
        cfg.extra["visual"] = vis.to_dict()
        d = EagleDrafter(EagleHead(cfg, target.input_embeddings(), target.output_embeddings(), target.attention), tree)
    for text, seeds in (("describe the image", [0]), ("once upon a time", [])):
        inputs = encode_prompt(target, text, [tiny_image(s) for s in seeds])
        _, out = target.prefill(inputs, visual=d.needs_visual, layers=d.feature_layers)
        assert out.features.shape[-1] == d.head.config.feature_width
        prompt = PromptContext(inputs["input_ids"][0], out.features, inputs, out.image_mask, out.image_embeds, out.attention)
        _same_proposals(d, prompt, target.hidden_size)


class _HostReads(TorchDispatchMode):
    """Counts the ops that read a tensor's value back to Python (`.item()`, `int(t)`, `float(t)`,
    `bool(t)`, `nonzero`): each one is a host sync when the tensor lives on a GPU."""

    READS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default, torch.ops.aten.nonzero.default)

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func in self.READS
        return func(*args, **(kwargs or {}))


def test_propose_reads_the_device_once(monkeypatch):
    """Running the committed rows and growing the tree read nothing back; the whole tree comes
    back in ONE `.tolist()` of one float64 vector. The first algorithm read ~1,200 scalars."""
    d = _standalone_drafter(TreeConfig(7, 10, 60))
    prompt = PromptContext(torch.arange(5), torch.randn(5, 32))
    reads = _HostReads()
    with reads:
        _reference_propose(d.start(prompt), 1, 10)
    assert reads.n > 1000, reads.n  # negative control: the per-node reads are seen
    s = d.start(prompt)
    from vlmspec.draft.eagle import session as session_module

    for name in ("_run_committed", "grow_trees"):
        real = getattr(session_module, name)

        def counted(*args, _real=real):
            with reads:
                return _real(*args)

        monkeypatch.setattr(session_module, name, counted)
    calls = []
    real_tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: calls.append(t.dtype) or real_tolist(t))
    reads.n = 0
    for root in (1, 2):
        tree = s.propose(root, 10)
        s.commit(tree.tokens[tree.path_to(1)], torch.randn(2, 32))
    assert reads.n == 0 and calls.count(torch.float64) == 2, (reads.n, calls)  # one read per proposal


def _with_acceptance_head(target, seed=3):
    cfg = EagleConfig.from_target(target)
    cfg.acceptance_head = True
    torch.manual_seed(seed)
    return EagleHead(cfg, target.input_embeddings(), target.output_embeddings())


def _propose(drafter, target, inputs, root=5, depth=4):
    _, out = target.prefill(inputs)
    return drafter.start(PromptContext(inputs["input_ids"][0], out.features)).propose(root, depth)


def test_the_stop_rule_only_cuts_levels_off_the_eagle2_tree():
    """SpecDec++: threshold 0 is EAGLE-2's tree; a head predicting rejection stops after the
    first level (that level's nodes, nothing else); one predicting acceptance never stops."""
    target = tiny_target("llava")
    head = _with_acceptance_head(target)
    tree = TreeConfig(depth=4, top_k=3, total_tokens=10)
    inputs = encode_prompt(target, "hello there")
    full = _propose(EagleDrafter(head, tree, 0.0), target, inputs)
    assert int(full.depth.max()) >= 2
    last = head.accept.mlp[-1]
    with torch.no_grad():
        last.weight.zero_()
        last.bias.fill_(-6.0)  # every child predicted rejected (p ~ 0.0025)
    cut = _propose(EagleDrafter(head, tree, 0.1), target, inputs)
    assert int(cut.depth.max()) == 1
    level1 = sorted(int(full.tokens[i]) for i in range(full.size) if int(full.depth[i]) == 1)
    assert sorted(cut.tokens[1:].tolist()) == level1 and cut.size == 1 + tree.top_k
    with torch.no_grad():
        last.bias.fill_(6.0)  # every child predicted accepted: the rule never fires
    kept = _propose(EagleDrafter(head, tree, 0.9), target, inputs)
    assert torch.equal(kept.tokens, full.tokens) and torch.equal(kept.parents, full.parents)
    # a threshold needs the head; a head without one keeps EAGLE-2's tree
    with pytest.raises(ValueError, match="acceptance head"):
        EagleDrafter(EagleDrafter.random_init(target, tree).head, tree, 0.2)
    with pytest.raises(ValueError, match="stop_threshold"):
        cfg = EagleConfig.from_target(target)
        EagleConfig(**{**{name: getattr(cfg, name) for name in EagleConfig.field_names()}, "stop_threshold": 0.2})


def test_a_stopping_drafter_keeps_greedy_parity_and_round_trips(tmp_path):
    target = tiny_target("llava")
    head = _with_acceptance_head(target)
    head.config.stop_threshold = 0.5  # random weights: predictions scatter around it, so the depth varies step to step
    drafter = EagleDrafter(head, TreeConfig(depth=5, top_k=3, total_tokens=12))
    inputs = encode_prompt(target, "describe the image in detail", [tiny_image(0)])
    plain = SpecEngine(target, PlainDrafter()).generate(inputs, GenerationConfig(max_new_tokens=40, ignore_eos=True)).token_ids
    got = SpecEngine(target, drafter).generate(inputs, GenerationConfig(max_new_tokens=40, ignore_eos=True))
    assert got.token_ids == plain and got.num_drafted > 0
    drafter.save(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["acceptance_head"] is True and saved["stop_threshold"] == 0.5
    loaded = EagleDrafter.load(tmp_path, target, drafter.tree)
    assert loaded.stop_threshold == 0.5 and loaded.head.accept is not None
    assert all(torch.equal(a, b) for a, b in zip(loaded.head.accept.state_dict().values(), head.accept.state_dict().values()))
