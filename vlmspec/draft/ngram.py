"""Model-free n-gram (prompt lookup) drafter.

Finds earlier occurrences of the longest recent n-gram (n from max_ngram down to min_ngram) in
the prompt plus the generated text, and proposes what followed them. Distinct continuations
become sibling branches (most recent match first), merged into one trie.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlmspec.draft.base import DraftSession, PromptContext, TreeConfig
from vlmspec.tree import DraftTree


@dataclass(frozen=True)
class NgramConfig:
    max_ngram: int = 4
    min_ngram: int = 1
    max_matches: int = 8  # how many earlier occurrences to look at, most recent first

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self}")


class NgramDrafter:
    name = "ngram"
    needs_visual = False

    def __init__(self, tree: TreeConfig | None = None, config: NgramConfig | None = None) -> None:
        self.tree = tree or TreeConfig()
        self.config = config or NgramConfig()

    def start(self, prompt: PromptContext, tree: TreeConfig | None = None) -> DraftSession:
        return _NgramSession(self.config, tree or self.tree, prompt.token_ids.tolist())


class _NgramSession:
    def __init__(self, config: NgramConfig, tree: TreeConfig, history: list[int]) -> None:
        self.config = config
        self.tree = tree
        self.history = history  # every token in the target KV, in order

    def commit(self, token_ids: torch.Tensor, features: torch.Tensor) -> None:
        self.history.extend(token_ids.tolist())

    def _continuations(self, seq: list[int], depth: int) -> list[list[int]]:
        cfg = self.config
        n_total = len(seq)
        for n in range(min(cfg.max_ngram, n_total - 1), cfg.min_ngram - 1, -1):
            tail = seq[-n:]
            found: list[list[int]] = []
            # scan backwards (most recent first); the match must end before the tail itself
            for end in range(n_total - 1, n - 1, -1):
                if seq[end - n : end] == tail:
                    cont = seq[end : end + depth]
                    if cont:
                        found.append(cont)
                        if len(found) >= cfg.max_matches:
                            break
            if found:
                return found
        return []

    def propose(self, root: int, max_depth: int) -> DraftTree:
        depth = min(self.tree.depth, max_depth)
        if depth <= 0:
            return DraftTree.root_only(root)
        conts = self._continuations(self.history + [root], depth)
        tokens, parents = [root], [-1]
        child_of: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
        branches = 0
        for cont in conts:
            node = 0
            new_branch = (0, cont[0]) not in child_of
            if new_branch and branches >= self.tree.top_k:
                continue
            branches += new_branch
            for tok in cont:
                key = (node, tok)
                if key not in child_of:
                    if len(tokens) - 1 >= self.tree.total_tokens:
                        break
                    child_of[key] = len(tokens)
                    tokens.append(tok)
                    parents.append(node)
                node = child_of[key]
        return DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))
