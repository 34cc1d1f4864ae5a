"""Test-only drafters: the two extremes every speculative engine must survive."""
import torch

from vlmspec.draft.base import PromptContext
from vlmspec.tree import DraftTree


class OracleDrafter:
    """Proposes the target's own greedy continuation (known in advance), with a wrong sibling in
    front of every right token, so the verifier has to pick the matching child."""

    name = "oracle"
    needs_visual = False
    tree = None

    def __init__(self, continuation: list[int], depth: int, vocab: int, decoys: bool = True):
        self.continuation, self.depth, self.vocab, self.decoys = continuation, depth, vocab, decoys

    def start(self, prompt: PromptContext, tree=None):
        return _OracleSession(self, prompt.token_ids.numel())


class _OracleSession:
    def __init__(self, d: OracleDrafter, prompt_len: int):
        self.d, self.committed, self.prompt_len = d, prompt_len, prompt_len

    def commit(self, token_ids, features):
        assert features.shape[0] == token_ids.shape[0]
        self.committed += token_ids.numel()

    def propose(self, root: int, max_depth: int) -> DraftTree:
        g = self.committed - self.prompt_len  # index of the root in the generated text
        want = self.d.continuation[g + 1 : g + 1 + min(self.d.depth, max_depth)]
        tokens, parents, node = [root], [-1], 0
        for tok in want:
            if self.d.decoys:
                tokens.append((tok + 1) % self.d.vocab)
                parents.append(node)
            tokens.append(tok)
            parents.append(node)
            node = len(tokens) - 1
        return DraftTree(torch.tensor(tokens), torch.tensor(parents))
