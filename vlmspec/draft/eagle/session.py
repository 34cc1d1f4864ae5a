"""The drafter and its session: `EagleDrafter` (random_init, save / load / from_pretrained, start)
and `_EagleSession`, one request's drafting state, which grows the EAGLE-2 tree (with SpecDec++'s
stop rule) on the device and reads it back with one device->host transfer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from vlmspec.errors import DrafterLoadError
from vlmspec.transfer import to_device
from vlmspec.draft.base import DraftSession, PromptContext, TreeConfig
from vlmspec.kv_cache import KVCache
from vlmspec.target import Target
from vlmspec.tree import DraftTree, tree_attention_mask
from vlmspec.draft.eagle.config import CONFIG_NAME, WEIGHTS_NAME, EagleConfig, _checkpoint_folder, _read_config
from vlmspec.draft.eagle.head import EagleHead, build_head, draft_entropy, question_embedding
from vlmspec.draft.eagle.speculators_format import config_from_speculators, is_speculators, weights_from_speculators
from vlmspec.draft.eagle.vocab import check_draft_vocab

class EagleDrafter:
    name = "eagle"

    @property
    def needs_visual(self) -> bool:
        """VLM-aware variants read the image embeddings and the target's attention at prefill."""
        return self.head.visual is not None

    @property
    def feature_layers(self) -> tuple[int, ...] | None:
        """The target layers whose hidden states the head reads (EAGLE-3), concatenated as the
        features the target hands it; None: the target's last hidden state (EAGLE-1)."""
        layers = self.head.config.feature_layers
        return tuple(layers) if layers else None

    def __init__(self, head: EagleHead, tree: TreeConfig | None = None, stop_threshold: float | None = None) -> None:
        """stop_threshold: SpecDec++'s stop rule (None: the config's; 0: off, EAGLE-2's tree)."""
        self.head = head.eval()
        self.tree = tree or TreeConfig()
        self.stop_threshold = head.config.stop_threshold if stop_threshold is None else float(stop_threshold)
        if self.stop_threshold and head.accept is None:
            raise ValueError("a stop threshold needs a drafter with an acceptance head (vlmspec train --acceptance-head)")
        assert 0.0 <= self.stop_threshold < 1.0, self.stop_threshold

    # ------------------------------------------------------------ construction / io
    @classmethod
    def random_init(cls, target: Target, tree: TreeConfig | None = None, seed: int = 0, arch: str = "eagle1") -> "EagleDrafter":
        torch.manual_seed(seed)
        head = build_head(EagleConfig.from_target(target, arch), target.input_embeddings(), target.output_embeddings(), target.attention)
        return cls(head.to(device=target.device, dtype=target.dtype), tree)

    def save(self, directory: str | Path) -> None:
        """config.json (`EagleConfig.save_pretrained`) + model.safetensors (the head's weights only)."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self.head.config.save_pretrained(d)
        save_file(self.head.head_state_dict(), str(d / WEIGHTS_NAME), metadata={"format": "pt"})

    @staticmethod
    def default_tree(folder_or_hub_id: str | Path, device: str | torch.device) -> TreeConfig | None:
        """The tree a drafter's config records as measured best on `device`'s type (None: none recorded,
        or a speculators-format drafter)."""
        folder = _checkpoint_folder(str(folder_or_hub_id))
        if _speculators_raw(folder) is not None:
            return None
        return _read_config(folder).default_tree(device)

    @classmethod
    def from_pretrained(cls, folder_or_hub_id: str | Path, target: Target, tree: TreeConfig | None = None) -> "EagleDrafter":
        """A drafter folder, or a hub id ("org/name"): from the hub when it answers, else from the
        local Hugging Face cache (DrafterLoadError when neither has it)."""
        return cls.load(_checkpoint_folder(str(folder_or_hub_id)), target, tree)

    @classmethod
    def load(cls, directory: str | Path, target: Target, tree: TreeConfig | None = None) -> "EagleDrafter":
        """A drafter folder (vlmspec's format, its first one, or the speculators format of an EAGLE-3
        drafter), checked against `target`, weights loaded strictly."""
        d = Path(directory)
        w_path = d / WEIGHTS_NAME
        if not (d / CONFIG_NAME).is_file() or not w_path.is_file():
            raise DrafterLoadError(f"{d} is not a drafter folder: it needs {CONFIG_NAME} and {WEIGHTS_NAME}")
        raw = _speculators_raw(d)
        config = _read_config(d) if raw is None else config_from_speculators(raw, target, d / CONFIG_NAME)
        config.check_against(target)
        head = build_head(config, target.input_embeddings(), target.output_embeddings(), target.attention)
        try:
            state = load_file(str(w_path))
        except SafetensorError as exc:
            raise DrafterLoadError(f"{w_path}: not a readable safetensors file ({exc})") from exc
        if raw is not None:
            state = weights_from_speculators(state, config, target, w_path)
        expected = set(head.state_dict())
        missing, unexpected = expected - set(state), set(state) - expected
        if missing or unexpected:
            raise DrafterLoadError(f"{w_path}: weights do not match the config "
                                   f"(missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]})")
        head.load_state_dict(state, strict=True)
        if head.trimmed:
            try:
                check_draft_vocab(head.d2t, config.draft_vocab_size, config.vocab_size)
            except ValueError as exc:
                raise DrafterLoadError(f"{w_path}: {exc}") from None
        return cls(head.to(device=target.device, dtype=target.dtype), tree or config.default_tree(target.device))

    def start(self, prompt: PromptContext, tree: TreeConfig | None = None) -> DraftSession:
        return _EagleSession(self.head, tree or self.tree, prompt, self.stop_threshold)

    def propose_batch(self, sessions: list["_EagleSession"], roots: list[int], max_depths: list[int]) -> list[DraftTree]:
        """Every row's tree, the rows' head forwards and LM-head products run together (`propose_rows`)."""
        return propose_rows(sessions, roots, max_depths)


def _speculators_raw(folder: Path) -> dict[str, Any] | None:
    """The folder's config.json when it is in the speculators format, else None (vlmspec's formats,
    or an unreadable file: `_read_config` says what is wrong with it)."""
    try:
        raw = json.loads((folder / CONFIG_NAME).read_text())
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) and is_speculators(raw) else None


class _EagleSession:
    """One request's drafting state: the head's own KV cache over the committed pairs.

    Host <-> device traffic (CUDA): commit() and propose() each move one small token tensor to the
    device (pinned, non-blocking: no sync); propose() grows the whole tree on the device and reads
    it back with ONE device->host transfer, whatever the depth. The first propose of a VLM-aware
    variant also reads its prompt rows (boolean selections, once per request).
    """

    def __init__(self, head: EagleHead, tree: TreeConfig, prompt: PromptContext, stop_threshold: float = 0.0) -> None:
        self.head = head
        self.tree = tree
        self.stop_threshold = stop_threshold
        self.cache = KVCache()
        p = next(self.head.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.prompt: PromptContext | None = prompt  # turned into rows at the first propose (needs the root)
        self.global_feat: torch.Tensor | None = None  # [H] ViSpec global image feature
        self.next_pos = 0  # position of the next row (rows of a compressed image span are gone)
        # features not yet paired with the token that follows them
        self.pending_feats = prompt.features[:0].to(self.device, self.dtype)  # [0, H]
        self.pending_next = prompt.token_ids[:0].to(self.device)  # [0]

    def commit(self, token_ids: torch.Tensor, features: torch.Tensor) -> None:
        """token_ids [k] (root + accepted, any device), features [k, H] (the target's, on its device).
        They wait, with those of earlier steps that drafted nothing, until the next drafted step runs the head."""
        assert self.prompt is None and self.pending_next.shape[0] == self.pending_feats.shape[0], "propose() must run between commits"
        self.pending_feats = torch.cat([self.pending_feats, features.to(self.device, self.dtype)])
        self.pending_next = torch.cat([self.pending_next, to_device(token_ids[1:], self.device)])

    def _prompt_rows(self, root: int) -> tuple[torch.Tensor, ...]:
        """(tokens [n], feats [n, H], positions [n], direct [n] | None, fuse [n] | None); sets next_pos."""
        prompt, self.prompt = self.prompt, None
        ids = to_device(torch.cat([prompt.token_ids.cpu(), torch.tensor([root])]), self.device)  # [L + 1]
        feats = prompt.features.to(self.device, self.dtype)
        adaptor = self.head.visual
        if adaptor is None:
            self.next_pos = feats.shape[0]
            return ids[1:], feats, torch.arange(feats.shape[0], device=self.device), None, None
        rows = adaptor.prompt_rows(
            ids, feats, _image_mask(prompt, ids.shape[0] - 1, self.device), _to(prompt.image_embeds, self.device, self.dtype),
            _to(prompt.attention, self.device, torch.float32), question_embedding(self.head, ids[:-1], prompt.image_mask),
        ).kept()
        self.global_feat = rows.global_feat
        self.next_pos = int(rows.positions[-1]) + 1  # one read, once per request (compressed spans drop rows)
        return rows.tokens, rows.feats, rows.positions, rows.direct, rows.fuse

    def _pending_rows(self, root: int) -> tuple[torch.Tensor, ...]:
        """The committed pairs the head has not run yet, the last one pairing with the root:
        (tokens [n], feats [n, H], positions [n], direct [n] | None, fuse [n] | None)."""
        if self.prompt is not None:
            return self._prompt_rows(root)
        toks = torch.cat([self.pending_next, to_device(torch.tensor([root]), self.device)])  # [n]
        pos = torch.arange(self.next_pos, self.next_pos + toks.shape[0], device=self.device)
        self.next_pos += toks.shape[0]
        fuse = None if self.global_feat is None else torch.ones_like(toks, dtype=torch.bool)
        return toks, self.pending_feats, pos, None, fuse

    def propose(self, root: int, max_depth: int) -> DraftTree:
        """The EAGLE-2 tree after `root` (depth <= max_depth, at most total_tokens drafted nodes): a
        batch of one of `propose_rows`. Node for node the same tree as the first, per-node-read
        algorithm (tests/test_drafters.py keeps it as the oracle): same top-k calls on the same
        numbers, same rerank on the host."""
        return propose_rows([self], [root], [max_depth])[0]


@torch.no_grad()
def propose_rows(sessions: list[_EagleSession], roots: list[int], max_depths: list[int]) -> list[DraftTree]:
    """One tree per session (row), each after its root and within its own depth and tree shape.

    Rows of one head run together: their pending committed pairs go through the head as one
    forward, then each level of growth is one head forward and one LM-head product over every
    row's frontier (`_JointCache` keeps each row's entries in its own cache; a block-diagonal mask
    keeps rows apart). A VLM-aware head's rows (their own global image feature) run one by one.
    A row with depth 0 drafts nothing and runs nothing: its pairs wait for its next draft.
    """
    trees: list[DraftTree | None] = [None] * len(sessions)
    run = []
    for i, (s, root, max_depth) in enumerate(zip(sessions, roots, max_depths)):
        if min(s.tree.depth, max_depth) <= 0 and s.prompt is None:
            s.pending_next = torch.cat([s.pending_next, to_device(torch.tensor([root]), s.device)])
            trees[i] = DraftTree.root_only(root)
        else:
            run.append(i)
    joint = all(sessions[i].head is sessions[run[0]].head and sessions[i].head.visual is None for i in run) if run else False
    for group in ([run] if joint else [[i] for i in run]):
        rows = [sessions[i] for i in group]
        hiddens = _run_committed(rows, [roots[i] for i in group])
        committed = [s.cache.seq_len for s in rows]
        depths = [min(s.tree.depth, max_depths[i]) for s, i in zip(rows, group)]
        grow = [b for b, d in enumerate(depths) if d > 0]
        levels = _grow([rows[b] for b in grow], [hiddens[b][-1:] for b in grow], [committed[b] for b in grow], [depths[b] for b in grow])
        for b, i in enumerate(group):
            trees[i] = DraftTree.root_only(roots[i])
        for b, lv in zip(grow, levels):
            s, i = rows[b], group[b]
            s.cache.crop(committed[b])
            tokens, parents, scores = _read_levels(roots[i], lv)  # the row's one device->host transfer
            # rerank: keep the best total_tokens drafted nodes (a child never outscores its parent,
            # ties go to the earlier node, so the selection is closed under parents)
            order = sorted(range(1, len(tokens)), key=lambda j: (-scores[j], j))[: s.tree.total_tokens]
            keep = torch.tensor([0, *sorted(order)], dtype=torch.long)
            trees[i] = DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long)).select(keep)
    return trees  # type: ignore[return-value]


class _JointCache:
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


def _joint_mask(blocks: list[torch.Tensor]) -> torch.Tensor:
    """Per-row additive masks [1, 1, q_b, k_b] -> the block-diagonal [1, 1, sum q_b, sum k_b]."""
    if len(blocks) == 1:
        return blocks[0]
    first = blocks[0]
    out = torch.full((1, 1, sum(b.shape[-2] for b in blocks), sum(b.shape[-1] for b in blocks)), torch.finfo(first.dtype).min,
                     dtype=first.dtype, device=first.device)
    q = k = 0
    for b in blocks:
        out[..., q : q + b.shape[-2], k : k + b.shape[-1]] = b
        q, k = q + b.shape[-2], k + b.shape[-1]
    return out


def _decode_rows(rows: list[_EagleSession], toks: list[torch.Tensor], feats: list[torch.Tensor], pos: list[torch.Tensor],
                 masks: list[torch.Tensor], direct: torch.Tensor | None = None, fuse: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The head over every row's new entries in one forward -> each row's outputs [n_b, H]."""
    counts = [t.shape[0] for t in toks]
    cache = _JointCache([s.cache.hf for s in rows], counts)
    hidden = rows[0].head.decode(_cat(toks), _cat(feats), _cat(pos), _joint_mask(masks), cache,  # type: ignore[arg-type]
                                 direct, fuse, rows[0].global_feat)
    return list(hidden.split(counts))


def _run_committed(rows: list[_EagleSession], roots: list[int]) -> list[torch.Tensor]:
    """Run the head over each row's committed pairs (feature_i, token_{i+1}), the last one pairing
    with its root; their entries stay in the row's cache. Returns each row's outputs [n_b, H]."""
    parts = [s._pending_rows(root) for s, root in zip(rows, roots)]
    masks = []
    for s, (toks, *_) in zip(rows, parts):
        n = toks.shape[0]
        causal = torch.ones(n, n, dtype=torch.bool, device=s.device).tril()
        masks.append(tree_attention_mask(causal, s.cache.seq_len, s.dtype))
    assert len(rows) == 1 or all(p[3] is None and p[4] is None for p in parts), "rows with their own image rows run alone"
    direct, fuse = (parts[0][3], parts[0][4]) if len(rows) == 1 else (None, None)
    hiddens = _decode_rows(rows, [p[0] for p in parts], [p[1] for p in parts], [p[2] for p in parts], masks, direct, fuse)
    for s in rows:
        s.pending_feats, s.pending_next = s.pending_feats[:0], s.pending_next[:0]
    return hiddens


class _Front:
    """One row's frontier while its tree grows, on the device (F = the frontier's size)."""

    def __init__(self, session: _EagleSession, root_hidden: torch.Tensor, committed: int, depth: int) -> None:
        dev = session.device
        self.s, self.committed, self.depth = session, committed, depth
        self.acc = torch.ones(1, device=dev)  # [F] predicted probability that each frontier node's path is accepted
        self.h = root_hidden  # [F, H] head outputs at the frontier nodes' pairs (their children's features)
        self.seen = torch.zeros(1, 0, dtype=torch.bool, device=dev)  # [F, n_tree]: tree KV entries each sees
        self.scores = torch.zeros(1, device=dev)  # [F] float32 cumulative log-probs
        self.logp: torch.Tensor | None = None  # [F, V] the frontier's children's draft log-probs
        self.levels: list[_Level] = []


def _grow(rows: list[_EagleSession], root_hidden: list[torch.Tensor], committed: list[int], depths: list[int]) -> list[list[_Level]]:
    """EAGLE-2 growth of every row's tree, all on the device: each level gives every frontier node
    its top_k children, scored by cumulative log-prob; the top_k best children are the next frontier
    and run through the head (their KV entries go after the row's committed prefix, in frontier
    order), every row's frontier in one forward. Sizes are known on the host (F = 1, then
    min(k, F * k)), so nothing is read back but the SpecDec++ stop rule's one number per row and
    level (one read per level for all rows).

    root_hidden: per row [1, H], the head's output at the root's pair. Returns each row's levels:
    fewer than its depth when the stop rule ended its growth.
    """
    if not rows:
        return []
    head = rows[0].head
    fronts = [_Front(s, h, c, d) for s, h, c, d in zip(rows, root_hidden, committed, depths)]
    for f, logp in zip(fronts, _log_probs(head, [f.h for f in fronts])):
        f.logp = logp
    growing = list(fronts)
    for d in range(1, max(depths) + 1):
        step = []  # (front, ids, cand, best, top values) of rows that grow past this level
        for f in growing:
            assert f.logp is not None
            k = f.s.tree.top_k
            top = torch.topk(f.logp, k, dim=-1)  # values / indices [F, k] (indices in the draft vocabulary)
            ids = head.target_ids(top.indices)  # [F, k] target token ids
            cand = (f.scores[:, None] + top.values).flatten()  # [F * k], child j of node fi at fi * k + j
            if d == f.depth:
                f.levels.append(_Level(ids, cand, None))
                continue
            step.append((f, ids, cand, torch.topk(cand, min(k, cand.numel())).indices, top.values))  # best: the next frontier, best first
        stopping = [x for x in step if x[0].s.stop_threshold > 0]
        if stopping:  # SpecDec++: grow on only while some frontier path is predicted to be accepted often enough
            for f, _, _, best, values in stopping:
                child_acc = torch.sigmoid(head.accept(f.h, values, draft_entropy(f.logp)))  # [F, k]
                f.acc = (f.acc[:, None] * child_acc).flatten().index_select(0, best)  # [F']
            best_acc = torch.stack([f.acc.max() for f, *_ in stopping]).tolist()  # one read for every row
            stop = {id(x[0]) for x, a in zip(stopping, best_acc) if a < x[0].s.stop_threshold}
            for f, ids, cand, _, _ in (x for x in step if id(x[0]) in stop):
                f.levels.append(_Level(ids, cand, None))
            step = [x for x in step if id(x[0]) not in stop]
        if not step:
            break
        toks, feats, pos, masks = [], [], [], []
        for f, ids, cand, best, _ in step:
            f.levels.append(_Level(ids, cand, best))
            parent = torch.div(best, f.s.tree.top_k, rounding_mode="floor")  # [F'] row of each one's parent in the frontier
            n_new = best.shape[0]
            # a node sees its parent's entries plus itself (its entry goes right after the tree's so far)
            f.seen = torch.cat([f.seen.index_select(0, parent), torch.eye(n_new, dtype=torch.bool, device=f.s.device)], dim=1)
            masks.append(tree_attention_mask(f.seen, f.committed, f.s.dtype))  # [1, 1, F', committed + n_tree + F']
            toks.append(ids.flatten().index_select(0, best))  # [F']
            feats.append(f.h.index_select(0, parent))  # [F', H]: a node's feature is its parent's output
            pos.append(torch.full((n_new,), f.s.next_pos - 1 + d, device=f.s.device))
            f.scores = cand.index_select(0, best)
        fuse = None if rows[0].global_feat is None else torch.ones(sum(t.shape[0] for t in toks), dtype=torch.bool, device=rows[0].device)
        outs = _decode_rows([x[0].s for x in step], toks, feats, pos, masks, None, fuse)
        for (f, *_), h, logp in zip(step, outs, _log_probs(head, outs)):
            f.h, f.logp = h, logp
        growing = [x[0] for x in step]
    return [f.levels for f in fronts]


def _log_probs(head: EagleHead, hidden: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each row's draft log-probs [F_b, V'] from its head outputs [F_b, H], in one LM-head product."""
    counts = [h.shape[0] for h in hidden]
    return list(torch.log_softmax(head.decode_logits(_cat(hidden)), -1).split(counts))


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    """The rows' tensors end to end (one row: itself, not a copy)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


class _Level(NamedTuple):
    """One level of growth, on the device (F = that level's frontier size, k = top_k)."""

    indices: torch.Tensor  # [F, k] long: the children's tokens, per frontier node
    scores: torch.Tensor  # [F * k] float32: the children's cumulative log-probs (child j of node fi at fi * k + j)
    best: torch.Tensor | None  # [F'] long: flat ids of the children that form the next frontier; None at the last level


def _read_levels(root: int, levels: list[_Level]) -> tuple[list[int], list[int], list[float]]:
    """The drafted nodes in order (tokens, parents, cumulative log-probs; node 0 = root), read from
    the device with ONE transfer: every level's numbers go into one float64 vector (exact for
    token ids and float32 scores) and come back with a single `.tolist()`."""
    parts = [t.reshape(-1).to(torch.float64) for lvl in levels for t in lvl if t is not None]
    values = torch.cat(parts).tolist()
    tokens, parents, scores = [root], [-1], [0.0]
    frontier, at = [0], 0
    for lvl in levels:
        n = lvl.indices.numel()  # F * k, known from the shape
        ids, cand = values[at : at + n], values[at + n : at + 2 * n]
        at += 2 * n
        k = lvl.indices.shape[1]
        first = len(tokens)  # node id of child j of frontier node fi: first + fi * k + j
        for i in range(n):
            tokens.append(int(ids[i]))
            parents.append(frontier[i // k])
            scores.append(cand[i])
        if lvl.best is not None:
            m = lvl.best.numel()
            frontier = [first + int(b) for b in values[at : at + m]]
            at += m
    return tokens, parents, scores


def _to(x: torch.Tensor | None, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
    return None if x is None else x.to(device, dtype)


def _image_mask(prompt: PromptContext, length: int, device: torch.device) -> torch.Tensor:
    if prompt.image_mask is None:
        return torch.zeros(length, dtype=torch.bool, device=device)
    return prompt.image_mask.to(device)
