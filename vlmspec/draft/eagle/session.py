"""The drafter and its session: `EagleDrafter` (random_init, save / load / from_pretrained, start)
and `_EagleSession`, one request's drafting state, which grows the EAGLE-2 tree (with SpecDec++'s
stop rule) on the device and reads it back with one device->host transfer."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

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
from vlmspec.draft.eagle.head import EagleHead, draft_entropy, question_embedding
from vlmspec.draft.eagle.vocab import check_draft_vocab

class EagleDrafter:
    name = "eagle"

    @property
    def needs_visual(self) -> bool:
        """VLM-aware variants read the image embeddings and the target's attention at prefill."""
        return self.head.visual is not None

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
    def random_init(cls, target: Target, tree: TreeConfig | None = None, seed: int = 0) -> "EagleDrafter":
        torch.manual_seed(seed)
        head = EagleHead(EagleConfig.from_target(target), target.input_embeddings(), target.output_embeddings(), target.attention)
        return cls(head.to(device=target.device, dtype=target.dtype), tree)

    def save(self, directory: str | Path) -> None:
        """config.json (`EagleConfig.save_pretrained`) + model.safetensors (the head's weights only)."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self.head.config.save_pretrained(d)
        save_file(self.head.head_state_dict(), str(d / WEIGHTS_NAME), metadata={"format": "pt"})

    @staticmethod
    def default_tree(folder_or_hub_id: str | Path, device: str | torch.device) -> TreeConfig | None:
        """The tree a drafter's config records as measured best on `device`'s type (None: none recorded)."""
        return _read_config(_checkpoint_folder(str(folder_or_hub_id))).default_tree(device)

    @classmethod
    def from_pretrained(cls, folder_or_hub_id: str | Path, target: Target, tree: TreeConfig | None = None) -> "EagleDrafter":
        """A drafter folder, or a hub id ("org/name"): from the hub when it answers, else from the
        local Hugging Face cache (DrafterLoadError when neither has it)."""
        return cls.load(_checkpoint_folder(str(folder_or_hub_id)), target, tree)

    @classmethod
    def load(cls, directory: str | Path, target: Target, tree: TreeConfig | None = None) -> "EagleDrafter":
        """A drafter folder (either format), checked against `target`, weights loaded strictly."""
        d = Path(directory)
        w_path = d / WEIGHTS_NAME
        if not (d / CONFIG_NAME).is_file() or not w_path.is_file():
            raise DrafterLoadError(f"{d} is not a drafter folder: it needs {CONFIG_NAME} and {WEIGHTS_NAME}")
        config = _read_config(d)
        config.check_against(target)
        head = EagleHead(config, target.input_embeddings(), target.output_embeddings(), target.attention)
        try:
            state = load_file(str(w_path))
        except SafetensorError as exc:
            raise DrafterLoadError(f"{w_path}: not a readable safetensors file ({exc})") from exc
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

    def _run_committed(self, root: int) -> torch.Tensor:
        """Run the head over the committed pairs (feature_i, token_{i+1}), the last one pairing with
        the root; their entries stay in the cache. Returns the head's outputs [n, H]."""
        if self.prompt is not None:
            toks, feats, pos, direct, fuse = self._prompt_rows(root)
        else:
            toks = torch.cat([self.pending_next, to_device(torch.tensor([root]), self.device)])  # [n]
            feats = self.pending_feats
            pos = torch.arange(self.next_pos, self.next_pos + toks.shape[0], device=self.device)
            self.next_pos += toks.shape[0]
            direct = None
            fuse = None if self.global_feat is None else torch.ones_like(toks, dtype=torch.bool)
        n = toks.shape[0]
        assert n == feats.shape[0]
        causal = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()
        mask = tree_attention_mask(causal, self.cache.seq_len, self.dtype)
        hidden = self.head.decode(toks, feats, pos, mask, self.cache.hf, direct, fuse, self.global_feat)
        self.pending_feats, self.pending_next = self.pending_feats[:0], self.pending_next[:0]
        return hidden

    @torch.no_grad()
    def propose(self, root: int, max_depth: int) -> DraftTree:
        """The EAGLE-2 tree after `root` (depth <= max_depth, at most total_tokens drafted nodes).
        Node for node the same tree as the first, per-node-read algorithm (tests/test_drafters.py
        keeps it as the oracle): same top-k calls on the same numbers, same rerank on the host."""
        depth = min(self.tree.depth, max_depth)
        if depth <= 0 and self.prompt is None:  # a step without a draft runs no head: its pairs wait for the next draft
            self.pending_next = torch.cat([self.pending_next, to_device(torch.tensor([root]), self.device)])
            return DraftTree.root_only(root)
        hidden = self._run_committed(root)  # [n, H]
        committed = self.cache.seq_len
        if depth <= 0:
            return DraftTree.root_only(root)
        levels = self._grow(hidden[-1:], committed, depth)  # on the device, no sync
        self.cache.crop(committed)
        tokens, parents, scores = _read_levels(root, levels)  # the one device->host transfer
        # rerank: keep the best total_tokens drafted nodes (a child never outscores its parent,
        # ties go to the earlier node, so the selection is closed under parents)
        order = sorted(range(1, len(tokens)), key=lambda i: (-scores[i], i))[: self.tree.total_tokens]
        keep = torch.tensor([0, *sorted(order)], dtype=torch.long)
        full = DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))
        return full.select(keep)

    def _grow(self, root_hidden: torch.Tensor, committed: int, depth: int) -> list[_Level]:
        """EAGLE-2 growth, all on the device: each level gives every frontier node its top_k
        children, scored by cumulative log-prob; the top_k best children are the next frontier
        and run through the head (their KV entries go after the committed prefix, in frontier
        order). Sizes are known on the host (F = 1, then min(k, F * k)), so nothing is read back.

        root_hidden: [1, H], the head's output at the root's pair. Returns one _Level per depth
        grown: fewer than `depth` when the SpecDec++ stop rule ends the growth.
        """
        head, k, dev = self.head, self.tree.top_k, self.device
        stop = self.stop_threshold > 0
        logp = torch.log_softmax(head.decode_logits(root_hidden), -1)  # [F, V], F = 1: the root
        front_acc = torch.ones(1, device=dev)  # [F] predicted probability that each frontier node's path is accepted
        front_h = root_hidden  # [F, H] head outputs at the frontier nodes' pairs (their children's features)
        front_seen = torch.zeros(1, 0, dtype=torch.bool, device=dev)  # [F, n_tree]: tree KV entries each sees
        front_scores = torch.zeros(1, device=dev)  # [F] float32 cumulative log-probs
        fuse = None if self.global_feat is None else torch.ones(1, dtype=torch.bool, device=dev)
        levels: list[_Level] = []
        for d in range(1, depth + 1):
            top = torch.topk(logp, k, dim=-1)  # values / indices [F, k] (indices in the draft vocabulary)
            ids = head.target_ids(top.indices)  # [F, k] target token ids
            cand = (front_scores[:, None] + top.values).flatten()  # [F * k], child j of node fi at fi * k + j
            if d == depth:
                levels.append(_Level(ids, cand, None))
                break
            best = torch.topk(cand, min(k, cand.numel())).indices  # [F'] the next frontier, best first
            if stop:  # SpecDec++: grow on only while some frontier path is predicted to be accepted often enough
                child_acc = torch.sigmoid(head.accept(front_h, top.values, draft_entropy(logp)))  # [F, k]
                front_acc = (front_acc[:, None] * child_acc).flatten().index_select(0, best)  # [F']
                if float(front_acc.max()) < self.stop_threshold:  # one read per level
                    levels.append(_Level(ids, cand, None))
                    break
            levels.append(_Level(ids, cand, best))
            parent = torch.div(best, k, rounding_mode="floor")  # [F'] row of each one's parent in the frontier
            n_new = best.shape[0]
            # a node sees its parent's entries plus itself (its entry goes right after the tree's so far)
            seen = torch.cat([front_seen.index_select(0, parent), torch.eye(n_new, dtype=torch.bool, device=dev)], dim=1)
            mask = tree_attention_mask(seen, committed, self.dtype)  # [1, 1, F', committed + n_tree + F']
            ftoks = ids.flatten().index_select(0, best)  # [F']
            ffeat = front_h.index_select(0, parent)  # [F', H]: a node's feature is its parent's output
            fpos = torch.full((n_new,), self.next_pos - 1 + d, device=dev)
            ffuse = None if fuse is None else fuse.expand(n_new)
            front_h = head.decode(ftoks, ffeat, fpos, mask, self.cache.hf, None, ffuse, self.global_feat)  # [F', H]
            logp = torch.log_softmax(head.decode_logits(front_h), -1)  # [F', V]
            front_seen, front_scores = seen, cand.index_select(0, best)
        return levels


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
