"""Self-speculation (Kangaroo, DEL): the target's own first E decoder layers draft; no separate drafter.

Each step copies the target's committed KV entries of layers < E into a shallow cache (nothing is recomputed) and
runs the root, then each drafted token, through layers < E, the final norm and the LM head
(`vlmspec.target.early_exit.ExitView`). The tree: a chain of top-1 tokens with each level's next `top_k - 1`
candidates as leaf siblings, at most `total_tokens` nodes, verified as deterministic choices (outputs stay the
target's). Exit layer: fixed (`exit_layer=E`, Kangaroo without its adapter) or per request and step among `exits`
(DEL): each keeps a decayed count of drafted and accepted levels (Beta prior `prior_accept`) and its seconds per
level t_E, and the session drafts with the E of the most expected tokens per second at the controller's `depth`:

    tokens(E) = 1 + sum_{k=1..depth} a_E^k       seconds(E) = step + depth * t_E

with `step` estimated from the per-layer time t_E / E times the target's layers, plus its LM head.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from vlmspec.draft.base import DraftSession, PromptContext, TreeConfig
from vlmspec.errors import ConfigError
from vlmspec.stats import posterior_acceptance
from vlmspec.target.early_exit import ExitView
from vlmspec.tree import DraftTree


@dataclass(frozen=True)
class SelfSpecConfig:
    exit_layer: int | None = None  # fixed E; None: DEL's dynamic choice among `exits`
    exits: tuple[int, ...] = ()  # candidates (empty: 1/6, 1/4, 1/3 and 1/2 of the target's layers)
    draft_vocab: int | None = None  # draft over the first K token ids only (byte-level BPE: the earliest merges); None: all
    prior_accept: float = 0.6  # prior mean of an exit's per-level acceptance
    prior_weight: float = 2.0  # its strength in pseudo-levels
    decay: float = 0.9  # per observed step: older observations count this much less


def expected_tokens_per_second(accept: float, seconds_per_level: float, exit_layer: int, depth: int, num_layers: int) -> float:
    """A chain of `depth` levels drafted through `exit_layer` of `num_layers` layers: expected emitted
    tokens over the step's seconds (a target step estimated from the measured per-layer time)."""
    tokens = 1.0 + sum(accept**k for k in range(1, depth + 1))
    step = seconds_per_level / exit_layer * num_layers
    return tokens / (step + depth * seconds_per_level)


def best_exit(accept: dict[int, float], seconds_per_level: dict[int, float], depth: int, num_layers: int) -> int:
    """DEL's choice: the exit with the best expected tokens per second; one never measured (0 s) first,
    the shallowest of equals."""
    unmeasured = [e for e in accept if seconds_per_level[e] <= 0]
    if unmeasured:
        return min(unmeasured)
    return max(accept, key=lambda e: (expected_tokens_per_second(accept[e], seconds_per_level[e], e, depth, num_layers), -e))


def default_exits(num_layers: int) -> tuple[int, ...]:
    return tuple(sorted({max(1, min(num_layers - 1, round(num_layers * f))) for f in (1 / 6, 1 / 4, 1 / 3, 1 / 2)}))


class SelfSpecDrafter:
    name = "self"
    needs_visual = False

    def __init__(self, target, tree: TreeConfig | None = None, config: SelfSpecConfig | None = None) -> None:
        self.view = ExitView(target)
        self.tree = tree or TreeConfig()
        self.config = config = config or SelfSpecConfig()
        exits = (config.exit_layer,) if config.exit_layer is not None else (config.exits or default_exits(self.view.num_layers))
        for e in exits:
            self.view.check_exit(e)
        self.exits = tuple(exits)
        vocab = self.view.head.weight.shape[0]
        if config.draft_vocab is not None and not 1 <= config.draft_vocab <= vocab:
            raise ConfigError(f"draft vocabulary must be in [1, {vocab}] tokens, got {config.draft_vocab}")
        # [K] target ids the head drafts over (None: all); the LM head's rows for them, copied once
        self.rows = None if config.draft_vocab is None or config.draft_vocab == vocab else torch.arange(config.draft_vocab)
        self.head = self.view.head_weights(self.rows)  # (weight [K or V, H], bias)
        self.name = "self" + (f":{config.exit_layer}" if config.exit_layer is not None else "") + (
            f" (vocab {config.draft_vocab})" if self.rows is not None else "")

    def start(self, prompt: PromptContext, tree: TreeConfig | None = None) -> DraftSession:
        if prompt.kv is None:
            raise ConfigError("self-speculation needs the target's KV cache in the prompt context (the engine passes it)")
        return _SelfSession(self, tree or self.tree, prompt)


@dataclass
class _ExitStats:
    drafted: float = 0.0  # decayed levels that were drafted and reached (up to the first rejection)
    accepted: float = 0.0  # of them, accepted
    seconds_per_level: float = 0.0  # measured (0: not yet)


@dataclass
class _SelfSession:
    drafter: SelfSpecDrafter
    tree: TreeConfig
    prompt: PromptContext
    seq_len: int = field(init=False)  # tokens in the target's KV cache
    stats: dict[int, _ExitStats] = field(init=False)
    last: tuple[int, int] | None = None  # (exit, chain depth) of the pending proposal
    chosen: list[int] = field(default_factory=list)  # the exit of every drafted step, in order

    def __post_init__(self) -> None:
        self.seq_len = int(self.prompt.token_ids.numel())
        self.stats = {e: _ExitStats() for e in self.drafter.exits}

    # ---------------------------------------------------------------- DEL's choice
    def accept_rate(self, e: int) -> float:
        c, s = self.drafter.config, self.stats[e]
        return posterior_acceptance(s.accepted, s.drafted, c.prior_accept, c.prior_weight)

    def choose_exit(self, depth: int) -> int:
        exits = self.drafter.exits
        if len(exits) == 1:
            return exits[0]
        return best_exit({e: self.accept_rate(e) for e in exits}, {e: self.stats[e].seconds_per_level for e in exits},
                         depth, self.drafter.view.num_layers)

    # ---------------------------------------------------------------- the session protocol
    def propose(self, root: int, max_depth: int) -> DraftTree:
        depth = min(self.tree.depth, max_depth)
        if depth <= 0:
            self.last = None
            return DraftTree.root_only(root)
        e = self.choose_exit(depth)
        view, (w, b) = self.drafter.view, self.drafter.head
        t0 = time.perf_counter()
        cache = view.shallow_cache(self.prompt.kv(e), e)
        k = max(1, min(self.tree.top_k, self.tree.total_tokens))
        tokens, parents = [root], [-1]
        node, tok, levels = 0, root, 0
        while levels < depth and len(tokens) - 1 < self.tree.total_tokens:
            logits = torch.nn.functional.linear(view.run(tok, self.seq_len + levels, cache, e), w, b)  # [V]
            top = torch.topk(logits, min(k, logits.shape[0])).indices
            top = (top if self.drafter.rows is None else self.drafter.rows[top]).tolist()  # -> target ids
            chain = len(tokens)
            for cand in top[: self.tree.total_tokens - (len(tokens) - 1)]:  # the top-1 goes on, the rest are leaves
                tokens.append(cand)
                parents.append(node)
            node, tok, levels = chain, top[0], levels + 1
        st = self.stats[e]
        dt = (time.perf_counter() - t0) / levels
        st.seconds_per_level = dt if st.seconds_per_level <= 0 else 0.8 * st.seconds_per_level + 0.2 * dt
        self.last = (e, levels)
        self.chosen.append(e)
        return DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))

    def commit(self, token_ids: torch.Tensor, features: torch.Tensor) -> None:
        self.seq_len += int(token_ids.numel())
        if self.last is None:
            return
        e, levels = self.last
        accepted = int(token_ids.numel()) - 1
        c, st = self.drafter.config, self.stats[e]
        st.drafted = st.drafted * c.decay + min(levels, accepted + 1)  # levels reached: up to the first rejection
        st.accepted = st.accepted * c.decay + accepted
        self.last = None


__all__ = ["SelfSpecConfig", "SelfSpecDrafter", "best_exit", "default_exits", "expected_tokens_per_second"]
