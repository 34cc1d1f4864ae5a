"""`--drafter suffix`: SuffixDecoding (Oliaro et al., NeurIPS 2025), drafting from past answers and the request itself.

    store = SuffixStore(max_tokens=200_000)          # the composition root's: one per model (vlmspec.factory)
    drafter = SuffixDrafter(tree, SuffixConfig(), store)     # store None: no cross-request memory
    session = drafter.start(prompt)                  # prompt.tenant: the one pool it reads and joins (None: shared)
    tree = session.propose(root, max_depth)          # a frequency tree, verified as any draft tree
    session.finish(emitted)                          # the engine, when the request leaves: the answer's last tokens

Each step matches the longest suffix of the context (prompt + answer so far + root) in the request's own index and its
tenant's pool (`vlmspec.draft.suffix_index`); a match's tree keeps the best `total_tokens` nodes within `depth` by
empirical probability (the product of the path's child frequencies), at most `spec_factor` x the match length, and the
tree of higher expected accepted length (its nodes' probabilities summed) is proposed. An answer joins its pool as it
is written (after its prompt's `prompt_tail`), so a repeat sent while its original decodes drafts from it.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from vlmspec.draft.base import DraftSession, PromptContext, TreeConfig
from vlmspec.draft.suffix_index import DraftLimits, IndexConfig, SuffixIndex, SuffixStore, Written, suffix_tree
from vlmspec.tree import DraftTree


def suffix_tree_config(device: str | torch.device = "cpu") -> TreeConfig:
    """The suffix drafter's default tree: deep and narrow, as a repeated answer is drafted whole.
    CPU: 24 nodes verify in about 1.7 plain steps on the default model (bf16,
    docs/measured/drafter-default/verify_cost_bf16.json); GPU: vLLM's suffix default depth, 64 nodes."""
    if torch.device(device).type == "cuda":
        return TreeConfig(depth=24, top_k=8, total_tokens=64)
    return TreeConfig(depth=24, top_k=4, total_tokens=24)


@dataclass(frozen=True)
class SuffixConfig:
    """The suffix drafter's knobs (the store's budget is the store's own)."""

    limits: DraftLimits = field(default_factory=DraftLimits)  # min probability of a node, speculation length per match length
    index: IndexConfig = field(default_factory=IndexConfig)  # the request's own index
    local: bool = True  # draft from the request's own prompt and answer too
    prompt_tail: int = 16  # prompt tokens kept before each answer in the store (0: the answer alone)
    fingerprint: bool = True  # a pseudo-token naming the whole prompt (ids, images) heads each stored answer

    def __post_init__(self) -> None:
        if self.prompt_tail < 0:
            raise ValueError(f"prompt_tail must be >= 0, got {self.prompt_tail}")


@dataclass
class SuffixCounters:
    """Plain counters over every request of a drafter (the service's metrics read them)."""

    proposals: int = 0  # steps that asked for a draft (max depth > 0)
    hits: int = 0  # of those, the steps that drafted at least one token
    global_hits: int = 0  # hits whose tree came from the cross-request store
    drafted_tokens: int = 0  # nodes proposed (roots excluded)
    accepted_tokens: int = 0  # of those, accepted by the target

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class SuffixDrafter:
    """Model-free: drafts from the suffix indexes (module docstring). `store` is shared by every
    request of the drafter, passed in by whoever builds it (None: each request drafts from its own
    prompt and answer only)."""

    name = "suffix"
    needs_visual = False

    def __init__(self, tree: TreeConfig | None = None, config: SuffixConfig | None = None, store: SuffixStore | None = None) -> None:
        self.tree = tree or suffix_tree_config()
        self.config = config or SuffixConfig()
        self.store = store
        self.counters = SuffixCounters()

    @property
    def index_tokens(self) -> int:
        """Tokens held in the cross-request store (0 without one)."""
        return 0 if self.store is None else self.store.tokens

    def metrics(self) -> dict[str, Any]:
        """The counters, the store's size and its own counters, as plain numbers."""
        out: dict[str, Any] = {**self.counters.as_dict(), "index_tokens": self.index_tokens}
        if self.store is not None:
            out.update({f"store_{k}": v for k, v in asdict(self.store.stats).items()}, store_tenants=len(self.store.tenants()))
        return out

    def observe(self, tokens: list[int], tenant: str | None = None) -> None:
        """Keep an answer produced elsewhere (another engine, a log) for later requests of `tenant`."""
        if self.store is not None:
            self.store.add(list(tokens), tenant)

    def start(self, prompt: PromptContext, tree: TreeConfig | None = None) -> DraftSession:
        return _SuffixSession(self, tree or self.tree, prompt)


class _SuffixSession:
    """One request: its own index over prompt + answer, its tenant, the last proposal's size.

    Its pool context is [fingerprint] + the prompt's tail + the answer so far: what its answer is
    stored after (`written`, extended at each commit; its own drafts never read it), so the same
    request's earlier answer matches back over the whole context, and another request's (another
    image, the same question) falls short of it by the fingerprint at least. `sure` says the last proposal's pool match covered the whole context
    (at most the index's `max_match` tokens): the same prompt, answered the same way so far."""

    def __init__(self, drafter: SuffixDrafter, tree: TreeConfig, prompt: PromptContext) -> None:
        self.drafter, self.tree, self.config = drafter, tree, drafter.config
        self.tenant, self.remember = prompt.tenant, prompt.remember
        ids = prompt.token_ids.tolist()
        self.local = SuffixIndex(self.config.index) if self.config.local else None
        if self.local is not None:
            self.local.add(ids)
        store = drafter.store
        tail = ids[len(ids) - self.config.prompt_tail :] if self.config.prompt_tail else []
        self.head = ([prompt_fingerprint(prompt)] if store is not None and self.config.fingerprint else []) + tail
        self.pooled = list(self.head)  # the pool context: head + the answer so far (its last tokens)
        self.keep = store is not None and self.remember  # its answer joins the pool (until evicted)
        self.written: Written | None = None  # its document there, opened at the first commit
        self.answered = 0  # answer tokens written
        self.window = max(self.config.index.max_match, store.index_config.max_match if store is not None else 0)
        self.drafted = 0  # drafted nodes of the last proposal
        self.pooled_best = self.sure = False  # it came from the pool; that match covered the whole context

    def propose(self, root: int, max_depth: int) -> DraftTree:
        """The likelier of the request's own tree and its tenant's pool's (`tree.path_probs` summed)."""
        depth = min(self.tree.depth, max_depth)
        self.drafted, self.sure = 0, False
        if depth <= 0:
            return DraftTree.root_only(root)
        counters, limits, budget, top_k = self.drafter.counters, self.config.limits, self.tree.total_tokens, self.tree.top_k
        counters.proposals += 1
        best, pooled_best = DraftTree.root_only(root), False
        if self.local is not None:
            best = suffix_tree(self.local, self.local.docs[0][-self.window :] + [root], depth, budget, limits, top_k)[0]
        store = self.drafter.store
        if store is not None:
            context = self.pooled[-self.window :] + [root]
            pooled, length = store.tree(context, self.tenant, depth, budget, limits, top_k, own=self.written)
            if pooled.size > 1 and (best.size == 1 or pooled.expected_accepted() > best.expected_accepted()):
                best, pooled_best = pooled, True
                self.sure = length >= min(len(context), store.index_config.max_match)
        self.drafted, self.pooled_best = best.size - 1, pooled_best
        if self.drafted:
            counters.hits += 1
            counters.global_hits += pooled_best
            counters.drafted_tokens += self.drafted
        return best

    def discard(self) -> None:
        """The last proposal was not verified (the hybrid proposed the head's tree): uncount it."""
        if self.drafted:
            counters = self.drafter.counters
            counters.hits -= 1
            counters.global_hits -= self.pooled_best
            counters.drafted_tokens -= self.drafted
            self.drafted = 0

    def commit(self, token_ids: torch.Tensor, features: torch.Tensor) -> None:
        """token_ids [k]: the root and the accepted tokens (features unused)."""
        tokens = token_ids.tolist()
        if self.drafted:
            self.drafter.counters.accepted_tokens += len(tokens) - 1
            self.drafted = 0
        if self.local is not None:
            self.local.extend(0, tokens)
        self._write(tokens)
        self.pooled.extend(tokens)
        if len(self.pooled) > 4 * self.window:
            del self.pooled[: -self.window]  # only the last tokens are ever matched

    def finish(self, tokens: list[int]) -> None:
        """`tokens`: every token the request emitted; those never committed (the last step's bonus
        token) are written after the rest."""
        self._write(list(tokens)[self.answered :])

    def _write(self, tokens: list[int]) -> None:
        """Append to the request's document in its pool, opened (after its head) by the first
        tokens; once it is evicted, nothing more."""
        store = self.drafter.store
        if not (self.keep and tokens and store is not None):
            return
        if self.written is None:
            self.written = store.open(self.head + tokens, self.tenant)
        elif not store.extend(self.written, tokens):
            self.written = None
        self.keep = self.written is not None
        self.answered += len(tokens)


def prompt_fingerprint(prompt: PromptContext, samples: int = 1 << 16) -> int:
    """A pseudo-token naming the whole prompt: a hash of its token ids and of every input tensor
    (pixels, grids; at most `samples` evenly spaced elements of each), negative so it is never a
    token the target emits (nothing is ever drafted from it: it only starts stored answers)."""
    h = hashlib.blake2b(digest_size=7)
    h.update(prompt.token_ids.cpu().numpy().tobytes())
    for key in sorted(prompt.inputs):
        value = prompt.inputs[key]
        if isinstance(value, torch.Tensor) and key not in ("input_ids", "attention_mask"):
            flat = value.detach().reshape(-1)
            flat = flat[:: max(1, flat.numel() // samples)].cpu().contiguous()
            h.update(key.encode() + flat.view(torch.uint8).numpy().tobytes())
    return -1 - int.from_bytes(h.digest(), "big")


__all__ = ["SuffixConfig", "SuffixCounters", "SuffixDrafter", "prompt_fingerprint", "suffix_tree_config"]
