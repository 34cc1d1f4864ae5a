"""The drafter and its session: `EagleDrafter` (random_init, save / load / from_pretrained, start)
and `_EagleSession`, one request's drafting state; `propose_rows` drafts a batch of them (the
EAGLE-2 trees, with SpecDec++'s stop rule, grow on the device in `grow` and come back with one
device->host transfer)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from vlmspec.errors import DrafterLoadError
from vlmspec.runtime.transfer import to_device
from vlmspec.draft.base import DraftSession, PromptContext, TreeConfig
from vlmspec.cache.kv_cache import KVCache
from vlmspec.target import Target
from vlmspec.tree import DraftTree
from vlmspec.draft.eagle.config import CONFIG_NAME, WEIGHTS_NAME, EagleConfig, _checkpoint_folder, _read_config
from vlmspec.draft.eagle.grow import cat_rows, decode_rows, grow_trees, joint_causal_mask, read_trees
from vlmspec.draft.eagle.head import EagleHead, build_head, question_embedding
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

    def propose_batch(self, sessions: list["_EagleSession"], roots: list[int], max_depths: list[int],
                      chains: list[bool] | None = None) -> list[DraftTree]:
        """Every row's tree, the rows' head forwards and LM-head products run together (`propose_rows`)."""
        return propose_rows(sessions, roots, max_depths, chains)


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
        self.global_feat: torch.Tensor | None = None  # [H] ViSpec global image feature
        self.next_pos = 0  # position of the next row (rows of a compressed image span are gone)
        # A plain head's prompt pairs wait with the committed pairs the head has not run yet, for the
        # row's first drafted step: a row of a batch that steps plain runs no head forward over its
        # prompt. A row with that many pairs waiting runs them in a forward of its own, not the
        # batch's joint one, whose block-diagonal mask and attention would grow with the square of
        # all the rows' pairs together (`propose_rows`). A VLM-aware head's prompt becomes rows at
        # its first propose (`_prompt_rows`: compressed image spans, the global feature).
        self.prompt: PromptContext | None = prompt if head.visual is not None else None
        pairs = 0 if self.prompt is not None else prompt.features.shape[0]  # prompt pairs pending from the start
        # the pending pairs: features, and the tokens that follow them, kept in chunks (one per step,
        # joined when the head runs them: a row that drafts nothing for many steps copies nothing)
        self._feats = [prompt.features[:pairs].to(self.device, self.dtype)]  # chunks [n_i, H]
        self._next = [to_device(prompt.token_ids.cpu()[1:pairs], self.device)]  # chunks [m_i]: the root pairs with the last feature
        self._n_feats, self._n_next = pairs, max(pairs - 1, 0)  # pending features, pending next tokens

    @property
    def pending_feats(self) -> torch.Tensor:  # [n, H]: the features of the pairs the head has not run
        return _joined(self._feats)

    @property
    def pending_next(self) -> torch.Tensor:  # [n] after `wait` / [n - 1] after `commit`: the tokens that follow them
        return _joined(self._next)

    def commit(self, token_ids: torch.Tensor, features: torch.Tensor) -> None:
        """token_ids [k] (root + accepted, any device), features [k, H] (the target's, on its device).
        They wait, with those of earlier steps that drafted nothing, until the next drafted step runs the head."""
        assert self.prompt is None and self._n_feats == self._n_next, "propose() must run between commits"
        self._feats.append(features.to(self.device, self.dtype))
        self._next.append(to_device(token_ids[1:], self.device))
        self._n_feats += features.shape[0]
        self._n_next += token_ids.shape[0] - 1

    def wait(self, root: int) -> None:
        """The root joins the pending tokens (it pairs with the last pending feature): at a step that
        drafts nothing, where it waits for the next drafted step, and before the head runs them."""
        self._next.append(to_device(torch.tensor([root]), self.device))
        self._n_next += 1

    def clear_pending(self) -> None:
        """The head has run the pending pairs."""
        self._feats, self._next = [self._feats[0][:0]], [self._next[0][:0]]
        self._n_feats = self._n_next = 0

    def _prompt_rows(self, root: int) -> tuple[torch.Tensor, ...]:
        """A VLM-aware head's prompt rows: (tokens [n], feats [n, H], positions [n], direct [n] | None,
        fuse [n] | None); sets next_pos."""
        prompt, self.prompt = self.prompt, None
        adaptor = self.head.visual
        assert prompt is not None and adaptor is not None, "a plain head's prompt pairs are pending from the start"
        ids = to_device(torch.cat([prompt.token_ids.cpu(), torch.tensor([root])]), self.device)  # [L + 1]
        feats = prompt.features.to(self.device, self.dtype)
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
        self.wait(root)
        toks, feats = self.pending_next, self.pending_feats  # [n], [n, H]
        self.clear_pending()
        pos = torch.arange(self.next_pos, self.next_pos + toks.shape[0], device=self.device)
        self.next_pos += toks.shape[0]
        fuse = None if self.global_feat is None else torch.ones_like(toks, dtype=torch.bool)
        return toks, feats, pos, None, fuse

    def read(self, root: int) -> None:
        """Run the head over every pair it has not run yet (the prompt's rows at first), the last
        pairing with `root`, and draft nothing: the first forward of a drafted step, on its own (what
        the prefill ablation times)."""
        _run_committed([self], [root])

    def propose(self, root: int, max_depth: int) -> DraftTree:
        """The EAGLE-2 tree after `root` (depth <= max_depth, at most total_tokens drafted nodes): a
        batch of one of `propose_rows`. Node for node the same tree as the first, per-node-read
        algorithm (tests/test_drafters.py keeps it as the oracle): same top-k calls on the same
        numbers, same rerank on the host."""
        return propose_rows([self], [root], [max_depth])[0]


@torch.no_grad()
def propose_rows(sessions: list[_EagleSession], roots: list[int], max_depths: list[int], chains: list[bool] | None = None) -> list[DraftTree]:
    """One tree per session (row), each after its root and within its own depth and tree shape (a
    chain, top-1 per level, for a row with `chains[b]`).

    Rows of one head run together: their pending committed pairs go through the head as one
    forward, then each level of growth is one head forward and one LM-head product over every
    row's frontier, the rows of one tree width stacked (`grow.grow_trees`; `grow.JointCache` keeps
    each row's entries in its own cache, a block-diagonal mask keeps rows apart). A VLM-aware
    head's rows (their own global image feature) run one by one.
    A row with depth 0 drafts nothing and runs nothing: its pairs wait for its next draft.
    """
    trees: list[DraftTree | None] = [None] * len(sessions)
    shapes = [_chain(s.tree) if c else s.tree for s, c in zip(sessions, chains or [False] * len(sessions))]
    run = []
    for i, (s, root, max_depth) in enumerate(zip(sessions, roots, max_depths)):
        if min(s.tree.depth, max_depth) <= 0 and s.prompt is None:
            s.wait(root)
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
        levels = grow_trees([rows[b] for b in grow], [hiddens[b][-1:] for b in grow], [committed[b] for b in grow], [depths[b] for b in grow],
                            [shapes[group[b]].top_k for b in grow])
        for b in (b for b, d in enumerate(depths) if d <= 0):
            trees[group[b]] = DraftTree.root_only(roots[group[b]])
        grown = read_trees([roots[group[b]] for b in grow], levels)  # every row's tree: one device->host transfer
        for b, (tokens, parents, scores) in zip(grow, grown):
            s, i = rows[b], group[b]
            s.cache.crop(committed[b])
            # rerank: keep the best total_tokens drafted nodes (a child never outscores its parent,
            # ties go to the earlier node, so the selection is closed under parents)
            order = sorted(range(1, len(tokens)), key=lambda j: (-scores[j], j))[: shapes[i].total_tokens]
            keep = [0, *sorted(order)]
            new_id = {node: n for n, node in enumerate(keep)}  # on the host: the kept nodes renumbered
            trees[i] = DraftTree(torch.tensor([tokens[j] for j in keep], dtype=torch.long),
                                 torch.tensor([-1, *(new_id[parents[j]] for j in keep[1:])], dtype=torch.long),
                                 path_probs=torch.tensor(scores, dtype=torch.float64)[keep].exp().float())  # cumulative draft probs
    return trees  # type: ignore[return-value]


def _chain(tree: TreeConfig) -> TreeConfig:
    """`tree` grown one node per level: its top-1 chain."""
    return dataclasses.replace(tree, top_k=1, total_tokens=tree.depth)


ALONE_PAIRS = 32  # a row with more pending pairs than this (a prompt, a long plain stretch) runs them in a forward of its own


def _run_committed(rows: list[_EagleSession], roots: list[int]) -> list[torch.Tensor]:
    """Run the head over each row's committed pairs (feature_i, token_{i+1}), the last one pairing
    with its root; their entries stay in the row's cache. Returns each row's outputs [n_b, H].
    Rows with few pairs waiting run in one joint forward; a row with more than `ALONE_PAIRS` runs
    alone, so no forward's mask and attention grow with the square of several rows' long runs."""
    parts = [s._pending_rows(root) for s, root in zip(rows, roots)]
    counts = [p[0].shape[0] for p in parts]
    long = [b for b, n in enumerate(counts) if n > ALONE_PAIRS] if len(rows) > 1 else []
    groups = [[b] for b in long] + [[b for b in range(len(rows)) if b not in long]]
    out: list[torch.Tensor | None] = [None] * len(rows)
    for group in (g for g in groups if g):
        hidden = _run_pairs([rows[b] for b in group], [parts[b] for b in group])
        for b, h in zip(group, hidden):
            out[b] = h
    return out  # type: ignore[return-value]


def _run_pairs(rows: list[_EagleSession], parts: list[tuple[torch.Tensor, ...]]) -> list[torch.Tensor]:
    """`_run_committed`'s one forward over `rows`' pending pairs (`_pending_rows` of each) laid end to end."""
    assert len(rows) == 1 or all(p[3] is None and p[4] is None for p in parts), "rows with their own image rows run alone"
    direct, fuse = (parts[0][3], parts[0][4]) if len(rows) == 1 else (None, None)
    counts = [p[0].shape[0] for p in parts]
    mask = joint_causal_mask(counts, [s.cache.seq_len for s in rows], rows[0].dtype, rows[0].device)
    hidden = decode_rows(rows, cat_rows([p[0] for p in parts]), cat_rows([p[1] for p in parts]), cat_rows([p[2] for p in parts]),
                         mask, counts, direct, fuse)
    return list(hidden.split(counts))


def _joined(chunks: list[torch.Tensor]) -> torch.Tensor:
    """The chunks end to end (`cat_rows`), kept as one chunk from then on."""
    chunks[:] = [cat_rows(chunks)]
    return chunks[0]


def _to(x: torch.Tensor | None, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
    return None if x is None else x.to(device, dtype)


def _image_mask(prompt: PromptContext, length: int, device: torch.device) -> torch.Tensor:
    if prompt.image_mask is None:
        return torch.zeros(length, dtype=torch.bool, device=device)
    return prompt.image_mask.to(device)
