"""Tier 1: the verifier on constructed logits: greedy tables, lossless sampling statistics."""
import math

import pytest
import torch

from vlmspec.sampling import SamplingParams, argmax, logits_to_probs
from vlmspec.verify.acceptance import verify, verify_greedy, verify_sampling
from vlmspec.tree import DraftTree

V = 64


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_argmax_is_torchs_first_index_on_ties(dtype):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(6, 5, 4096, generator=g) * 2).round().to(dtype)  # whole numbers: many exact ties for the top
    assert torch.equal(argmax(logits), logits.argmax(-1))
    last = logits.shape[-1] - 1 - logits.flip(-1).argmax(-1)  # negative control: ties are there, and last != first
    assert not torch.equal(last, logits.argmax(-1))


def _logits_with_argmax(rows):
    """[len(rows), V] logits whose row i has argmax rows[i]."""
    logits = torch.zeros(len(rows), V)
    for i, tok in enumerate(rows):
        logits[i, tok] = 5.0
    return logits


# ---------------------------------------------------------------- greedy tables
def test_greedy_full_match_gives_bonus():
    tree = DraftTree.chain(1, [7, 8, 9])
    v = verify_greedy(tree, _logits_with_argmax([7, 8, 9, 42]))
    assert v.path == [0, 1, 2, 3] and v.next_token == 42 and v.is_bonus and v.num_accepted == 3


def test_greedy_early_mismatch_recovers_target_token():
    tree = DraftTree.chain(1, [7, 8, 9])
    v = verify_greedy(tree, _logits_with_argmax([7, 5, 9, 42]))
    assert v.path == [0, 1] and v.next_token == 5 and not v.is_bonus


def test_greedy_first_token_rejected_and_empty_draft():
    v = verify_greedy(DraftTree.chain(1, [7, 8]), _logits_with_argmax([3, 8, 9]))
    assert v.path == [0] and v.next_token == 3
    v = verify_greedy(DraftTree.root_only(1), _logits_with_argmax([11]))
    assert v.path == [0] and v.next_token == 11 and v.is_bonus


def test_greedy_picks_matching_sibling_anywhere_in_order():
    #   0 -> {1: tok 4, 2: tok 7}; 2 -> {3: tok 9}
    tree = DraftTree(torch.tensor([1, 4, 7, 9]), torch.tensor([-1, 0, 0, 2]))
    v = verify_greedy(tree, _logits_with_argmax([7, 0, 9, 33]))
    assert v.path == [0, 2, 3] and v.next_token == 33


# ---------------------------------------------------------------- sampling helpers
def test_top_k_and_top_p_shaping():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    p = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(p, torch.tensor([0.625, 0.375, 0, 0]))
    p = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.8))  # 0.5 + 0.3 reaches 0.8
    assert torch.allclose(p, torch.tensor([0.625, 0.375, 0, 0]))
    p = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.81))
    assert torch.allclose(p, torch.tensor([0.5, 0.3, 0.15, 0]) / 0.95)
    assert logits_to_probs(logits, SamplingParams()).tolist() == [1, 0, 0, 0]


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2)])
def test_sampling_params_validate(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


# ---------------------------------------------------------------- lossless sampling statistics
def _tv(counts: torch.Tensor, p: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - p).abs().sum())


def _tv_bound(n: int, k: int = V, delta: float = 1e-6) -> float:
    """P(TV(empirical of n draws, truth) >= eps) <= 2^k exp(-2 n eps^2) (Bretagnolle-Huber-Carol)."""
    return math.sqrt((k * math.log(2) + math.log(1 / delta)) / (2 * n))


def _world(seed=0):
    g = torch.Generator().manual_seed(seed)
    p_root = torch.softmax(torch.randn(V, generator=g) * 2, -1)
    table = torch.softmax(torch.randn(V, V, generator=g) * 2, -1)  # p(next | previous token)
    q_root = torch.softmax(torch.randn(V, generator=g) * 2, -1)  # a draft that disagrees with p
    q_table = torch.softmax(torch.randn(V, V, generator=g) * 2, -1)
    return p_root, table, q_root, q_table


def _fixed_tree(p_root):
    """Deterministic drafts (q = one-hot): root -> 3 siblings (a likely, a middling, an unlikely
    token) -> grandchildren. Children order = the order siblings are tried."""
    order = torch.argsort(p_root, descending=True).tolist()
    a, b, c = order[0], order[10], order[40]
    tokens = torch.tensor([0, c, a, b, 5, 6, 7])
    parents = torch.tensor([-1, 0, 0, 0, 1, 2, 2])
    return DraftTree(tokens, parents)


def _target_probs(tree, p_root, table):
    rows = [p_root] + [table[t] for t in tree.tokens[1:].tolist()]
    return torch.stack(rows)


def _emitted(tree, verdict):
    return tree.tokens[verdict.path[1:]].tolist() + [verdict.next_token]


def _sample_tree_with_q(q_root, q_table, g, k=3):
    """Children drawn WITHOUT replacement from the draft distribution q (depth 2)."""
    kids = torch.multinomial(q_root, k, replacement=False, generator=g).tolist()
    tokens, parents = [0] + kids, [-1] + [0] * k
    probs = [q_root] + [q_table[t] for t in kids]
    for i, t in enumerate(kids):
        grand = torch.multinomial(q_table[t], 2, replacement=False, generator=g).tolist()
        for gt in grand:
            tokens.append(gt)
            parents.append(1 + i)
            probs.append(q_table[gt])  # unused: leaves have no children
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.stack(probs))


def _run(n, make_tree, verifier, p_root, table, seed=1):
    g = torch.Generator().manual_seed(seed)
    first = torch.zeros(V)
    second: dict[int, torch.Tensor] = {}
    for _ in range(n):
        tree = make_tree(g)
        out = _emitted(tree, verifier(tree, _target_probs(tree, p_root, table), g))
        first[out[0]] += 1
        if len(out) > 1:
            second.setdefault(out[0], torch.zeros(V))[out[1]] += 1
    return first, second


def _always_accept(tree, probs, g):
    """NEGATIVE CONTROL: accepts the first child at every node. Not lossless."""
    children, node, path = tree.children(), 0, [0]
    while children[node]:
        node = children[node][0]
        path.append(node)
    from vlmspec.verify.acceptance import Verdict

    return Verdict(path, int(torch.multinomial(probs[node], 1, generator=g)), True)


N_SAMPLES = 20_000


def _check_lossless(first, second, p_root, table):
    n = int(first.sum())
    assert _tv(first, p_root) < _tv_bound(n), (_tv(first, p_root), _tv_bound(n))
    # the token after an accepted/recovered first token follows the target too
    tok, counts = max(second.items(), key=lambda kv: kv[1].sum())
    assert _tv(counts, table[tok]) < _tv_bound(int(counts.sum()))


def test_sampling_lossless_one_hot_drafts_and_negative_control():
    p_root, table, _, _ = _world()
    fixed = _fixed_tree(p_root)
    first, second = _run(N_SAMPLES, lambda g: fixed, verify_sampling, p_root, table)
    _check_lossless(first, second, p_root, table)
    # the same measurement must catch a verifier that is not lossless
    first_bad, _ = _run(N_SAMPLES, lambda g: fixed, _always_accept, p_root, table)
    assert _tv(first_bad, p_root) > _tv_bound(N_SAMPLES)


def test_sampling_lossless_with_draft_probabilities():
    p_root, table, q_root, q_table = _world(seed=3)
    first, second = _run(N_SAMPLES, lambda g: _sample_tree_with_q(q_root, q_table, g), verify_sampling, p_root, table)
    _check_lossless(first, second, p_root, table)
    first_bad, _ = _run(N_SAMPLES // 4, lambda g: _sample_tree_with_q(q_root, q_table, g), _always_accept, p_root, table)
    assert _tv(first_bad, p_root) > _tv_bound(N_SAMPLES // 4)


def _on_subset(q: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """q restricted to the token ids `keep` (a trimmed draft vocabulary) and renormalised: zero elsewhere."""
    out = torch.zeros_like(q)
    out[..., keep] = q[..., keep]
    return out / out.sum(-1, keepdim=True)


def test_sampling_lossless_with_draft_probabilities_on_a_subset_of_the_vocabulary():
    """A trimmed draft vocabulary: q is zero outside 16 of the 64 tokens, including where the
    target puts most of its mass; the emitted tokens still follow the target exactly."""
    p_root, table, q_root, q_table = _world(seed=5)
    keep = torch.randperm(V, generator=torch.Generator().manual_seed(1))[:16]
    top = int(p_root.argmax())
    keep = keep[keep != top]  # the target's favourite first token is never drafted: recovered only
    q_root, q_table = _on_subset(q_root, keep), _on_subset(q_table, keep)
    first, second = _run(N_SAMPLES, lambda g: _sample_tree_with_q(q_root, q_table, g), verify_sampling, p_root, table)
    assert set(first.nonzero().flatten().tolist()) - set(keep.tolist())  # tokens outside the subset do come out
    _check_lossless(first, second, p_root, table)
    first_bad, _ = _run(N_SAMPLES // 4, lambda g: _sample_tree_with_q(q_root, q_table, g), _always_accept, p_root, table)
    assert _tv(first_bad, p_root) > _tv_bound(N_SAMPLES // 4)  # negative control: accepting the draft is not lossless


def test_sampling_is_seeded():
    p_root, table, _, _ = _world()
    tree = _fixed_tree(p_root)
    logits = torch.log(_target_probs(tree, p_root, table))
    params = SamplingParams(temperature=1.0)

    def draw(seed):
        g = torch.Generator().manual_seed(seed)
        return [(v.path, v.next_token) for v in (verify(tree, logits, params, g) for _ in range(50))]

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


def test_sampling_draws_a_steps_uniforms_in_one_call(monkeypatch):
    """One `torch.rand(N)` per verify step (child i tests against u[i]), not one call per child."""
    p_root, table, q_root, q_table = _world(seed=5)
    calls = []
    real = torch.rand
    monkeypatch.setattr(torch, "rand", lambda *a, **k: calls.append(a) or real(*a, **k))
    g = torch.Generator().manual_seed(0)
    trees = [_fixed_tree(p_root)] + [_sample_tree_with_q(q_root, q_table, g) for _ in range(5)]
    for tree in trees:
        probs = _target_probs(tree, p_root, table)
        before = probs.clone()
        verify_sampling(tree, probs, g)
        assert torch.equal(probs, before), "the caller's probabilities are not modified"
    assert calls == [(tree.size,) for tree in trees]


def test_a_row_inside_a_batch_of_mixed_temperatures_keeps_its_distribution():
    """verify_rows: the middle row (T=1 over log p) emits tokens distributed as p within the TV bound,
    beside a greedy row and a T=0.5 row with their own generators. Negative control: the same row given
    its neighbour's temperature is caught by the same bound."""
    from vlmspec.sampling import SamplingParams
    from vlmspec.verify.acceptance import verify_rows

    p_root, table, _, _ = _world(seed=5)
    tree = _fixed_tree(p_root)
    g = torch.Generator().manual_seed(9)
    others = torch.randn(2, tree.size, V, generator=g) * 3
    logits = torch.stack([others[0], _target_probs(tree, p_root, table).log(), others[1]])  # [3, N, V]
    params = [SamplingParams(), SamplingParams(temperature=1.0), SamplingParams(temperature=0.5)]

    def first_tokens(row_params, n=10_000):
        gens = [None, torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)]
        counts = torch.zeros(V)
        for _ in range(n):
            verdict = verify_rows([tree] * 3, logits, row_params, gens)[1]
            counts[_emitted(tree, verdict)[0]] += 1
        return counts

    counts = first_tokens(params)
    assert _tv(counts, p_root) < _tv_bound(10_000), _tv(counts, p_root)
    wrong = first_tokens([params[0], params[2], params[2]])  # the row at its neighbour's temperature
    assert _tv(wrong, p_root) > _tv_bound(10_000)
