"""EAGLE-2 tree growth for a batch of rows, on the device, and its one read back.

Rows (drafting sessions) that share a tree width (top_k) grow together, their tensors stacked on a
leading row axis: every level is the same few operations whatever the number of rows (top-k of
the children, the next frontier, the mask, one head forward, one LM-head product). The frontier
has the same size in every row of a group (1, then top_k), so nothing is ragged but each row's
committed prefix, which only the attention mask sees. A row leaves its group when it reaches its
depth or SpecDec++'s stop rule ends it; the rows still growing are selected once per such level.

`read_trees` brings every row's tree back with ONE device->host transfer. The sessions are
duck-typed (`vlmspec.draft.eagle.session._EagleSession`: head, cache, next_pos, stop_threshold, ...);
the caller gives each row's top_k for the step.
"""

from __future__ import annotations

from itertools import accumulate
from typing import Any, NamedTuple

import torch

from vlmspec.draft.eagle.head import EagleHead, draft_entropy
from vlmspec.runtime.transfer import to_device
from vlmspec.tree import additive_mask, tree_attention_mask


class Level(NamedTuple):
    """One level of one group's growth, on the device (G = the group's rows at this level, F = the
    frontier's size, k = top_k, C = the rows that grow past it, F' = the next frontier's size)."""

    rows: list[int]  # the rows (indices into `grow_trees`' inputs) in the tensors' order
    indices: torch.Tensor  # [G, F, k] long: the children's target token ids, per frontier node
    scores: torch.Tensor  # [G, F * k] float32: the children's cumulative log-probs (child j of node fi at fi * k + j)
    best: torch.Tensor | None  # [C, F'] long: flat ids of the children that form the next frontier; None: no row grows on
    grown: list[int]  # positions in `rows` of best's rows, in order


def cat_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """The rows' tensors end to end (one row: itself, not a copy)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def log_probs(head: EagleHead, hidden: torch.Tensor) -> torch.Tensor:
    """Draft log-probs [G, F, V'] from head outputs [G, F, H], in one LM-head product over G * F rows."""
    g, f, width = hidden.shape
    return torch.log_softmax(head.decode_logits(hidden.reshape(g * f, width)), -1).view(g, f, -1)


class JointCache:
    """Several rows' head caches seen by one forward as one sequence laid end to end: `update`
    appends each row's new entries (`counts[b]` of them, in row order) to that row's own cache and
    returns every row's entries concatenated. One row: its cache, nothing copied."""

    def __init__(self, caches: list[Any], counts: list[int]) -> None:
        self.caches, self.counts = caches, counts

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if len(self.caches) == 1:
            return self.caches[0].update(keys, values, layer_idx)
        out = [c.update(k, v, layer_idx) for c, k, v in zip(self.caches, keys.split(self.counts, 2), values.split(self.counts, 2))]
        return torch.cat([k for k, _ in out], 2), torch.cat([v for _, v in out], 2)


def _laid_end_to_end(lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of `lens[b]` entries laid end to end -> (each entry's row, its index within the row),
    [sum(lens)] long each, on the host."""
    row = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    return row, torch.arange(sum(lens)) - torch.tensor([0, *accumulate(lens)][:-1])[row]


def joint_tree_mask(seen: torch.Tensor, committed: list[int], dtype: torch.dtype) -> torch.Tensor:
    """The block-diagonal additive mask of G rows' frontiers over their own keys, built in a fixed
    number of operations: row g's F queries see its `committed[g]` prefix entries and the tree
    entries `seen[g]` allows; its keys (committed[g] + M of them) follow row g - 1's.

    seen: [G, F, M] bool. Returns [1, 1, G * F, sum_g (committed[g] + M)]: each row's
    `tree_attention_mask` on the diagonal, the dtype's min elsewhere."""
    g, f, m = seen.shape
    if g == 1:
        return tree_attention_mask(seen[0], committed[0], dtype)
    key_row, key_off = _laid_end_to_end([c + m for c in committed])  # [K] each
    tree_col = key_off - torch.tensor(committed)[key_row]  # >= 0: the key's tree entry
    maps = to_device(torch.stack([key_row, tree_col.clamp(min=0), (tree_col < 0).long()]), seen.device)  # [3, K]: one transfer
    q_row = torch.arange(g, device=seen.device).repeat_interleave(f)  # [G * F]
    tree_seen = seen.reshape(g * f, m).gather(1, maps[1][None, :].expand(g * f, -1))  # [G * F, K] (m >= F >= 1)
    allowed = (q_row[:, None] == maps[0][None, :]) & (maps[2].bool()[None, :] | tree_seen)  # [G * F, K]
    return additive_mask(allowed, dtype)


def joint_causal_mask(counts: list[int], committed: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The block-diagonal additive mask of rows appending `counts[b]` new entries after their
    `committed[b]` ones: each new entry sees its row's prefix and its row's new entries up to itself.
    Built from index vectors (one transfer) in a fixed number of operations: each row's
    `tree_attention_mask(causal, committed[b])` on the diagonal, the dtype's min elsewhere.
    Returns [1, 1, sum(counts), sum(committed[b] + counts[b])]."""
    if len(counts) == 1:
        causal = torch.ones(counts[0], counts[0], dtype=torch.bool, device=device).tril()
        return tree_attention_mask(causal, committed[0], dtype)
    q_row, q_idx = _laid_end_to_end(counts)  # [Q] each
    q_last = torch.tensor(committed)[q_row] + q_idx  # the query's own key, within its row
    key_row, key_off = _laid_end_to_end([c + n for c, n in zip(committed, counts)])  # [K] each
    q_maps, k_maps = to_device(torch.cat([q_row, q_last, key_row, key_off]), device).split([2 * len(q_row), 2 * len(key_row)])
    q_row, q_last = q_maps.view(2, -1)
    key_row, key_off = k_maps.view(2, -1)
    return additive_mask((q_row[:, None] == key_row[None, :]) & (key_off[None, :] <= q_last[:, None]), dtype)


def decode_rows(rows: list[Any], toks: torch.Tensor, feats: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, counts: list[int],
                direct: torch.Tensor | None = None, fuse: torch.Tensor | None = None) -> torch.Tensor:
    """The head over every row's new entries (`counts[b]` of row b's, laid end to end) in one forward.

    toks [n], feats [n, H], pos [n] with n = sum(counts); mask [1, 1, n, keys]. Returns [n, H]."""
    cache = JointCache([s.cache.hf for s in rows], counts)
    return rows[0].head.decode(toks, feats, pos, mask, cache, direct, fuse, rows[0].global_feat)  # type: ignore[arg-type]


def grow_trees(rows: list[Any], root_hidden: list[torch.Tensor], committed: list[int], depths: list[int], widths: list[int]) -> list[Level]:
    """EAGLE-2 growth of every row's tree, all on the device: each level gives every frontier node
    its top_k children, scored by cumulative log-prob; the top_k best children are the next frontier
    and run through the head (their KV entries go after the row's committed prefix, in frontier
    order), every row's frontier in one forward. Nothing is read back but the SpecDec++ stop rule's
    one number per row and level (one read per level for all rows).

    root_hidden: per row [1, H], the head's output at the root's pair; depths: each >= 1; widths:
    each row's top_k this step. Returns the levels of every group of rows sharing top_k (`read_trees`
    reads them)."""
    groups: dict[int, list[int]] = {}
    for b, k in enumerate(widths):
        groups.setdefault(k, []).append(b)
    levels: list[Level] = []
    for k, group in groups.items():
        levels += _grow_group([rows[b] for b in group], group, cat_rows([root_hidden[b] for b in group]),
                              [committed[b] for b in group], [depths[b] for b in group], k)
    return levels


def _grow_group(rows: list[Any], ids_of: list[int], root_hidden: torch.Tensor, committed: list[int], depths: list[int], k: int) -> list[Level]:
    """`grow_trees` for rows of one top_k `k`, stacked (G rows; ids_of: their indices in the caller's list)."""
    s0 = rows[0]
    head, dev = s0.head, s0.device
    live = list(range(len(rows)))  # the rows still growing, in the tensors' order
    h = root_hidden[:, None]  # [G, F, H]: head outputs at the frontier nodes' pairs (their children's features)
    logp = log_probs(head, h)  # [G, F, V']: the frontier's children's draft log-probs
    scores = torch.zeros(len(rows), 1, device=dev)  # [G, F] float32 cumulative log-probs
    acc = torch.ones(len(rows), 1, device=dev)  # [G, F] predicted probability that each frontier node's path is accepted
    seen = torch.zeros(len(rows), 1, 0, dtype=torch.bool, device=dev)  # [G, F, n_tree]: tree KV entries each sees
    base = to_device(torch.tensor([s.next_pos - 1 for s in rows]), dev)  # [G]: a level-d node's position is base + d
    levels: list[Level] = []
    for d in range(1, max(depths) + 1):
        top = torch.topk(logp, k, dim=-1)  # values / indices [G, F, k] (indices in the draft vocabulary)
        ids = head.target_ids(top.indices)  # [G, F, k] target token ids
        cand = (scores[:, :, None] + top.values).flatten(1)  # [G, F * k], child j of node fi at fi * k + j
        on = [j for j, r in enumerate(live) if depths[r] > d]  # positions in `live` of the rows that may grow past d
        best = torch.topk(cand, min(k, cand.shape[1])).indices if on else None  # [G, F']: the next frontier, best first
        if on and any(rows[live[j]].stop_threshold > 0 for j in on):  # SpecDec++: grow on only while a path is likely enough
            child_acc = torch.sigmoid(head.accept(h, top.values, draft_entropy(logp)))  # [G, F, k]
            acc = (acc[:, :, None] * child_acc).flatten(1).gather(1, best)  # [G, F']
            best_acc = acc.max(1).values.tolist()  # one read for every row
            on = [j for j in on if not best_acc[j] < rows[live[j]].stop_threshold]
        if not on:
            levels.append(Level([ids_of[r] for r in live], ids, cand, None, on))
            break
        assert best is not None
        pick = to_device(torch.tensor(on), dev) if len(on) < len(live) else None  # the rows that grow on, when not all
        if pick is not None:
            best = best.index_select(0, pick)
        levels.append(Level([ids_of[r] for r in live], ids, cand, best, on))
        if pick is not None:
            ids, cand, h, seen, acc, base = (t.index_select(0, pick) for t in (ids, cand, h, seen, acc, base))
        live = [live[j] for j in on]
        g, n_new = best.shape
        parent = torch.div(best, k, rounding_mode="floor")  # [G, F'] each one's parent in the frontier
        # a node sees its parent's entries plus itself (its entry goes right after the tree's so far)
        eye = torch.eye(n_new, dtype=torch.bool, device=dev).expand(g, n_new, n_new)
        seen = torch.cat([seen.gather(1, parent[..., None].expand(g, n_new, seen.shape[2])), eye], dim=2)  # [G, F', n_tree + F']
        toks = ids.flatten(1).gather(1, best)  # [G, F']
        feats = h.gather(1, parent[..., None].expand(g, n_new, h.shape[2]))  # [G, F', H]: a node's feature is its parent's output
        pos = (base + d)[:, None].expand(g, n_new)
        scores = cand.gather(1, best)  # [G, F']
        members = [rows[r] for r in live]
        mask = joint_tree_mask(seen, [committed[r] for r in live], s0.dtype)
        fuse = None if s0.global_feat is None else torch.ones(g * n_new, dtype=torch.bool, device=dev)
        h = decode_rows(members, toks.reshape(-1), feats.reshape(g * n_new, -1), pos.reshape(-1), mask, [n_new] * g, None, fuse)
        h = h.view(g, n_new, -1)
        logp = log_probs(head, h)
    return levels


def read_trees(roots: list[int], levels: list[Level]) -> list[tuple[list[int], list[int], list[float]]]:
    """Every row's drafted nodes in order (tokens, parents, cumulative log-probs; node 0 = its root),
    read from the device with ONE transfer for all rows: every level's numbers go into one float64
    vector (exact for token ids and float32 scores) and come back with a single `.tolist()`."""
    parts = [t.reshape(-1).to(torch.float64) for lvl in levels for t in (lvl.indices, lvl.scores, lvl.best) if t is not None]
    values = torch.cat(parts).tolist() if parts else []
    trees = [([root], [-1], [0.0]) for root in roots]
    frontier: list[list[int]] = [[0] for _ in roots]
    at = 0
    for lvl in levels:
        g, f, k = lvl.indices.shape
        n = f * k  # children per row at this level
        ids, cand = values[at : at + g * n], values[at + g * n : at + 2 * g * n]
        at += 2 * g * n
        first = []  # node id of row j's child i: first[j] + i
        for j, b in enumerate(lvl.rows):
            tokens, parents, scores = trees[b]
            first.append(len(tokens))
            tokens.extend(int(x) for x in ids[j * n : (j + 1) * n])
            parents.extend(frontier[b][i // k] for i in range(n))
            scores.extend(cand[j * n : (j + 1) * n])
        if lvl.best is not None:
            m = lvl.best.shape[1]
            for c, j in enumerate(lvl.grown):
                frontier[lvl.rows[j]] = [first[j] + int(x) for x in values[at + c * m : at + (c + 1) * m]]
            at += lvl.best.numel()
    return trees
