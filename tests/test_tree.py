"""Tier 1: tree masks and position ids on constructed trees."""
import torch

from vlmspec.tree import DraftTree, ancestor_mask, tree_attention_mask

#        0
#      /   \
#     1     2
#    / \     \
#   3   4     5
#   |
#   6
PARENTS = torch.tensor([-1, 0, 0, 1, 1, 2, 3])


def test_depth_children_paths():
    tree = DraftTree(torch.arange(10, 17), PARENTS)
    assert tree.depth.tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert tree.children() == [[1, 2], [3, 4], [5], [6], [], [], []]
    assert tree.path_to(6) == [0, 1, 3, 6]
    assert tree.path_to(0) == [0]


def test_ancestor_mask_exact():
    m = ancestor_mask(PARENTS).int()
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0, 0],
            [1, 0, 1, 0, 0, 0, 0],
            [1, 1, 0, 1, 0, 0, 0],
            [1, 1, 0, 0, 1, 0, 0],
            [1, 0, 1, 0, 0, 1, 0],
            [1, 1, 0, 1, 0, 0, 1],
        ]
    )
    assert torch.equal(m, expected)


def test_depth_and_mask_of_random_trees_follow_their_paths():
    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 17, 100):
        parents = torch.tensor([-1] + [int(torch.randint(i, (1,), generator=g)) for i in range(1, n)])
        tree = DraftTree(torch.arange(n), parents)
        paths = [tree.path_to(i) for i in range(n)]  # the oracle: walk up to the root
        assert tree.depth.tolist() == [len(p) - 1 for p in paths] and tree.depth.dtype == torch.long
        expected = torch.zeros(n, n, dtype=torch.bool)
        for i, p in enumerate(paths):
            expected[i, p] = True
        assert torch.equal(tree.ancestor_mask(), expected)


def test_chain_mask_is_causal():
    tree = DraftTree.chain(5, [6, 7, 8])
    assert torch.equal(tree.ancestor_mask(), torch.ones(4, 4, dtype=torch.bool).tril())


def test_4d_mask_prefix_and_tree():
    mask = tree_attention_mask(ancestor_mask(PARENTS), prefix_len=3, dtype=torch.float32)
    assert mask.shape == (1, 1, 7, 10)
    visible = mask[0, 0] == 0
    assert visible[:, :3].all()  # every node sees the whole prefix
    assert torch.equal(visible[:, 3:], ancestor_mask(PARENTS))
    assert (mask[0, 0][~visible] == torch.finfo(torch.float32).min).all()


def test_4d_mask_empty_prefix_and_non_square():
    allowed = torch.tensor([[True, False, True], [False, True, True]])
    mask = tree_attention_mask(allowed, prefix_len=0, dtype=torch.float16)
    assert mask.shape == (1, 1, 2, 3) and mask.dtype == torch.float16
    assert torch.equal(mask[0, 0] == 0, allowed)


def test_select_and_truncate_keep_structure():
    tree = DraftTree(torch.arange(10, 17), PARENTS)
    sub = tree.select(torch.tensor([0, 1, 3, 6]))
    assert sub.tokens.tolist() == [10, 11, 13, 16] and sub.parents.tolist() == [-1, 0, 1, 2]
    cut = tree.truncate_depth(1)
    assert cut.tokens.tolist() == [10, 11, 12] and cut.depth.tolist() == [0, 1, 1]


def test_first_chain_follows_first_children_and_counts_what_it_would_have_accepted():
    tree = DraftTree(torch.arange(10, 17), PARENTS)
    assert tree.first_chain(5).tokens.tolist() == [10, 11, 13, 16] and tree.first_chain(5).parents.tolist() == [-1, 0, 1, 2]
    assert tree.first_chain(2).tokens.tolist() == [10, 11, 13] and tree.first_chain(0).size == 1
    chain = DraftTree.chain(7, [8, 9])
    assert chain.first_chain(5) is chain  # already a chain: itself
    assert tree.first_chain_run([0, 1, 3, 6]) == 3  # along first children all the way
    assert tree.first_chain_run([0, 1, 4]) == 1  # the second child at depth 2: the chain stops at 1
    assert tree.first_chain_run([0, 2, 5]) == 0  # negative control: the root's second child
    assert tree.first_chain_run([0]) == 0


class _FakeTarget:
    """Just enough of Target for its position-id helper."""

    def __init__(self, mrope: bool):
        from vlmspec.target import Target

        self.device = torch.device("cpu")
        self._rope_index_fn = (lambda *a, **k: None) if mrope else None
        self.tree_position_ids = Target.tree_position_ids.__get__(self)
        self.batch_position_ids = Target.batch_position_ids.__get__(self)
        self.uses_mrope = mrope
        self.position_offset = 0  # the model counts positions from 0


def test_position_ids_1d_and_mrope():
    from vlmspec.target import TargetState

    depth = DraftTree(torch.arange(7), PARENTS).depth
    state = TargetState(cache=None, seq_len=40, rope_delta=-12)
    one_d = _FakeTarget(mrope=False).tree_position_ids(TargetState(cache=None, seq_len=40), depth)
    assert one_d.shape == (1, 7) and one_d[0].tolist() == [40, 41, 41, 42, 42, 42, 43]
    three = _FakeTarget(mrope=True).tree_position_ids(state, depth)
    # M-RoPE: 3 axes, all equal for text/draft tokens, shifted by the rope delta the images left
    assert three.shape == (3, 1, 7)
    for axis in range(3):
        assert three[axis, 0].tolist() == [28, 29, 29, 30, 30, 30, 31]



def _diagonal(blocks: list[torch.Tensor]) -> torch.Tensor:
    """The oracle: per-row additive masks [1, 1, q_b, k_b] laid on the diagonal of the dtype's min."""
    out = torch.full((1, 1, sum(b.shape[-2] for b in blocks), sum(b.shape[-1] for b in blocks)), torch.finfo(blocks[0].dtype).min)
    q = k = 0
    for b in blocks:
        out[..., q : q + b.shape[-2], k : k + b.shape[-1]] = b
        q, k = q + b.shape[-2], k + b.shape[-1]
    return out


def test_the_joint_masks_are_each_rows_mask_on_the_diagonal():
    """The drafter's joint masks are built in a fixed number of operations for any number of rows:
    the tree mask (`joint_tree_mask`, every row's frontier over its tree so far) and the causal one
    (`joint_causal_mask`, rows appending different numbers of entries); each equals laying every
    row's own `tree_attention_mask` on the diagonal, rows of different committed lengths and a
    single row included. Negative control: the rows' lengths swapped give another mask."""
    from vlmspec.draft.eagle.grow import joint_causal_mask, joint_tree_mask

    g = torch.Generator().manual_seed(0)
    for rows, f, m, committed in [(1, 3, 5, [7]), (3, 3, 6, [4, 9, 0]), (4, 2, 2, [1, 1, 5, 2])]:
        seen = torch.rand(rows, f, m, generator=g) < 0.5
        want = _diagonal([tree_attention_mask(seen[r], committed[r], torch.float32) for r in range(rows)])
        got = joint_tree_mask(seen, committed, torch.float32)
        assert got.shape == want.shape and torch.equal(got, want), (rows, committed)
    swapped = joint_tree_mask(seen, committed[::-1], torch.float32)
    assert swapped.shape == want.shape and not torch.equal(swapped, want)
    for counts, committed in [([3], [5]), ([1, 4, 2], [7, 0, 3]), ([2, 2], [1, 9])]:
        want = _diagonal([tree_attention_mask(torch.ones(n, n, dtype=torch.bool).tril(), c, torch.float32) for n, c in zip(counts, committed)])
        got = joint_causal_mask(counts, committed, torch.float32, torch.device("cpu"))
        assert got.shape == want.shape and torch.equal(got, want), (counts, committed)
    swapped = joint_causal_mask(counts, committed[::-1], torch.float32, torch.device("cpu"))
    assert swapped.shape == want.shape and not torch.equal(swapped, want)
