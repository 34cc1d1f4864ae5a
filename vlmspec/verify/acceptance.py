"""Lossless acceptance of a draft tree against the target's logits.

Words, used with one meaning each across vlmspec:
- accepted tokens: drafted tokens on the path the verifier keeps (root excluded);
- recovered token: what the target emits at the first node where every drafted child was
  rejected (sampled from the residual distribution, or the argmax when greedy);
- bonus token: what the target emits after a leaf whose path was fully accepted.
Either way one target-sampled token ends the step, so a forward pass emits
len(accepted) + 1 tokens: the accepted length tau of that pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlmspec.sampling import SamplingParams, argmax, logits_to_probs
from vlmspec.tree import DraftTree


@dataclass
class Verdict:
    path: list[int]  # node ids root-first: [0, a_1, ..., a_k]; nodes a_i are the accepted tokens
    next_token: int  # the recovered or bonus token, emitted after the accepted tokens
    is_bonus: bool  # True: the path ended at a leaf (bonus); False: a rejection (recovered)

    @property
    def num_accepted(self) -> int:
        return len(self.path) - 1


def verify_greedy(tree: DraftTree, target_logits: torch.Tensor) -> Verdict:
    """Longest root-to-node path whose every token equals the target's argmax, plus one token.

    target_logits: [N, V], row i = the target's logits for the token after node i.
    """
    assert target_logits.shape[0] == tree.size
    return _greedy_path(tree, argmax(target_logits).tolist())


def _greedy_path(tree: DraftTree, best: list[int]) -> Verdict:
    """verify_greedy on the host, given the target's argmax after each node ([N])."""
    tokens = tree.tokens.tolist()
    children = tree.children()
    node, path = 0, [0]
    while True:
        want = best[node]
        nxt = next((c for c in children[node] if tokens[c] == want), None)
        if nxt is None:
            return Verdict(path, want, is_bonus=not children[node])
        node = nxt
        path.append(node)


def verify_sampling(tree: DraftTree, target_probs: torch.Tensor, generator: torch.Generator | None) -> Verdict:
    """Recursive rejection sampling over siblings; the emitted tokens follow the target exactly.

    target_probs: [N, V] float, row i = the target's (temperature/top-k/top-p shaped) distribution
    after node i. At each node the children are tried in order: child x is accepted with
    probability min(1, p(x) / q(x)); on rejection p <- norm(max(p - q, 0)) and x is removed from
    q (children were drawn from q without replacement). q is one-hot per child when the tree
    has no draft_probs, so rejecting x just zeroes p(x). If no child is accepted the recovered
    token is drawn from the residual p; at a leaf the bonus token is drawn from p.

    No device syncs in the loop: the probabilities come to the host in one transfer and all the
    uniforms of the step are drawn in one call (node i's acceptance test uses u[i], each at most
    once, so they stay independent). `generator` is a CPU generator (or None: the default one).
    """
    assert target_probs.shape[0] == tree.size
    probs, draft = _on_host(target_probs, tree.draft_probs)  # [N, V] float32 each (draft: None or [N, V])
    u = torch.rand(tree.size, generator=generator).tolist()  # [N]; u[0] (the root) is never used
    tokens = tree.tokens.tolist()
    children = tree.children()
    node, path = 0, [0]
    while True:
        p = probs[node].clone()
        kids = children[node]
        q = None if draft is None else draft[node].clone()
        accepted = None
        for child in kids:
            x = tokens[child]
            ratio = p[x] if q is None else p[x] / q[x].clamp_min(1e-30)
            if u[child] < float(ratio):
                accepted = child
                break
            if q is None:
                p[x] = 0.0
            else:
                p = (p - q).clamp_min(0.0)
                q[x] = 0.0
                q_sum = q.sum()
                if q_sum > 0:
                    q = q / q_sum
            total = p.sum()
            if total <= 0:  # only reachable through rounding when p == q: fall back to the target
                p = probs[node].clone()
                total = p.sum()
            p = p / total
        if accepted is None:
            token = int(torch.multinomial(p, 1, generator=generator))
            return Verdict(path, token, is_bonus=not kids)
        node = accepted
        path.append(node)


def _on_host(target_probs: torch.Tensor, draft_probs: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[N, V] target (and draft) probabilities as float32 host tensors, with at most one
    device->host transfer (both go in one copy when both are on the same device)."""
    if draft_probs is not None and draft_probs.device == target_probs.device and target_probs.device.type != "cpu":
        both = torch.stack([target_probs.float(), draft_probs.float()]).cpu()  # [2, N, V]
        return both[0], both[1]
    return target_probs.float().cpu(), None if draft_probs is None else draft_probs.float().cpu()


def verify_rows(
    trees: list[DraftTree],
    target_logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> list[Verdict]:
    """Every row of a batch step: row b's tree against target_logits[b, :N_b] ([B, N, V], N = max N_b),
    with row b's own sampling parameters and generator (so its draws never depend on the other rows).
    The greedy rows' argmaxes come to the host in one transfer for all of them."""
    assert target_logits.shape[0] == len(trees) == len(params) == len(generators)
    greedy = [b for b, p in enumerate(params) if p.greedy]
    rows = target_logits if len(greedy) == len(trees) else target_logits[greedy]  # every row greedy: no copy
    best = argmax(rows).tolist() if greedy else []  # [len(greedy), N]
    out: list[Verdict | None] = [None] * len(trees)
    for b, am in zip(greedy, best):
        out[b] = _greedy_path(trees[b], am[: trees[b].size])
    for b, (tree, p, g) in enumerate(zip(trees, params, generators)):
        if not p.greedy:
            out[b] = verify_sampling(tree, logits_to_probs(target_logits[b, : tree.size], p), g)
    return out  # type: ignore[return-value]


def verify(
    tree: DraftTree,
    target_logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None = None,
) -> Verdict:
    """Greedy or lossless-sampling verification of `tree` against target_logits [N, V]."""
    if params.greedy:
        return verify_greedy(tree, target_logits)
    return verify_sampling(tree, logits_to_probs(target_logits, params), generator)
