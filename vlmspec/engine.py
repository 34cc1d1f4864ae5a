"""The speculative decoding loop: draft a tree, verify it in one target forward, commit, repeat.

    prefill -> first token (root)
    loop:  tree    = session.propose(root)           # drafter
           out     = target.forward_tree(tree)       # ONE target forward over all N nodes
           verdict = verify(tree, out.logits)        # accepted path + recovered/bonus token
           target.commit(path); session.commit(...)  # keep the accepted KV entries
           emit accepted tokens + next token; root = next token

With the `none` drafter every tree is the root alone and this is plain autoregressive decoding,
which is the oracle every other drafter is tested against.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from vlmspec.draft.base import Drafter, PromptContext
from vlmspec.sampling import SamplingParams, next_token
from vlmspec.target import ContextLengthError, Target
from vlmspec.verify.acceptance import verify


@dataclass
class GenerationConfig:
    max_new_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        self.stop = tuple(s for s in self.stop if s)


@dataclass
class StepEvent:
    """What one target forward pass produced."""

    token_ids: list[int]  # tokens emitted to the user by this pass (after stop truncation)
    num_drafted: int  # drafted nodes in the tree (root excluded)
    num_accepted: int  # accepted drafted tokens (tau of this pass = num_accepted + 1)
    text: str = ""  # the new text since the previous event (stop strings cut off)


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS or a stop string) | "length" (max tokens or context)
    prompt_tokens: int
    num_target_forwards: int  # prefill + verify forwards
    num_drafted: int
    num_accepted: int
    mean_accepted_length: float  # tokens per verify forward, bonus included (1.0 for plain decoding)
    depth_reached: list[int]  # [d-1]: verify passes whose tree had a drafted node at depth d
    depth_accepted: list[int]  # [d-1]: verify passes that accepted a token at depth d
    elapsed_s: float
    timings: dict[str, float]  # seconds: prefill, draft, verify, commit, other

    @property
    def acceptance_by_position(self) -> list[float]:
        """P(the drafted token at depth d is accepted | the tree reached depth d), d = 1, 2, ..."""
        return [h / r for h, r in zip(self.depth_accepted, self.depth_reached)]

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "num_target_forwards": self.num_target_forwards,
            "num_drafted": self.num_drafted,
            "num_accepted": self.num_accepted,
            "mean_accepted_length": self.mean_accepted_length,
            "acceptance_by_position": self.acceptance_by_position,
            "elapsed_s": self.elapsed_s,
            "tokens_per_s": self.tokens_per_s,
            "timings": self.timings,
        }


class _Clock:
    def __init__(self) -> None:
        self.t: dict[str, float] = {"prefill": 0.0, "draft": 0.0, "verify": 0.0, "commit": 0.0, "other": 0.0}
        self._last = time.perf_counter()

    def lap(self, key: str) -> None:
        now = time.perf_counter()
        self.t[key] += now - self._last
        self._last = now


class Generation:
    """An iterable of StepEvents; `result` is set once iteration ends (or the consumer stops)."""

    def __init__(self, it: Iterator[StepEvent]) -> None:
        self._it = it
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[StepEvent]:
        return self._it


class SpecEngine:
    def __init__(self, target: Target, drafter: Drafter) -> None:
        self.target = target
        self.drafter = drafter

    def generate(self, inputs: dict[str, torch.Tensor], config: GenerationConfig) -> GenerationResult:
        gen = self.stream(inputs, config)
        for _ in gen:
            pass
        assert gen.result is not None
        return gen.result

    def stream(self, inputs: dict[str, torch.Tensor], config: GenerationConfig) -> Generation:
        gen = Generation(iter(()))
        gen._it = self._run(inputs, config, gen)
        return gen

    def _run(self, inputs: dict[str, torch.Tensor], config: GenerationConfig, gen: Generation) -> Iterator[StepEvent]:
        target, params = self.target, config.sampling
        rng = torch.Generator().manual_seed(config.seed) if config.seed is not None else None
        eos = set() if config.ignore_eos else target.eos_token_ids
        t_start = time.perf_counter()
        clock = _Clock()

        state, out = target.prefill(inputs, visual=getattr(self.drafter, "needs_visual", False))
        prompt_len = state.seq_len
        clock.lap("prefill")
        session = self.drafter.start(
            PromptContext(inputs["input_ids"][0].cpu(), out.features, inputs, out.image_mask, out.image_embeds, out.attention)
        )
        clock.lap("draft")

        emitted: list[int] = []
        text_sent = full_text = ""
        finish = "length"
        forwards, drafted, accepted = 1, 0, 0
        reached: list[int] = []  # reached[d-1]: passes whose tree had a drafted node at depth d
        hits: list[int] = []  # hits[d-1]: passes that accepted a token at depth d

        hold_back = max((len(s) for s in config.stop), default=1) - 1

        def emit(new: list[int], n_drafted: int, n_acc: int) -> tuple[StepEvent, bool]:
            """Append tokens, apply EOS / stop strings / max tokens -> (event, finished)."""
            nonlocal finish, text_sent, full_text
            stop_now = False
            keep: list[int] = []
            for tok in new:
                keep.append(tok)
                if tok in eos:
                    finish, stop_now = "stop", True
                    break
                if len(emitted) + len(keep) >= config.max_new_tokens:
                    stop_now = True
                    break
            emitted.extend(keep)
            text = target.decode(emitted)
            if config.stop:
                cut = min((i for i in (text.find(s) for s in config.stop) if i >= 0), default=-1)
                if cut >= 0:
                    text, finish, stop_now = text[:cut], "stop", True
            full_text = visible = text
            if not stop_now:
                # hold back a half-decoded character and what could be the start of a stop string
                visible = visible.rstrip("\ufffd")
                visible = visible[: max(len(text_sent), len(visible) - hold_back)]
            delta = visible[len(text_sent) :] if visible.startswith(text_sent) else ""
            text_sent = visible if visible.startswith(text_sent) else text_sent
            return StepEvent(keep, n_drafted, n_acc, delta), stop_now

        root = next_token(out.logits[0], params, rng)
        event, done = emit([root], 0, 0)
        clock.lap("other")
        yield event
        while not done:
            remaining = config.max_new_tokens - len(emitted)
            room = target.max_positions - state.seq_len - 1  # deepest node position must stay in context
            if room < 0:
                finish = "length"
                break
            max_depth = min(remaining - 1, room)
            tree = session.propose(root, max_depth).truncate_depth(max_depth)
            clock.lap("draft")
            out = target.forward_tree(state, tree)
            verdict = verify(tree, out.logits, params, rng)
            clock.lap("verify")
            target.commit(state, verdict.path)
            path = torch.tensor(verdict.path, dtype=torch.long)
            clock.lap("commit")
            session.commit(tree.tokens[path], out.features[path.to(out.features.device)])
            clock.lap("draft")

            forwards += 1
            n_drafted = tree.size - 1
            drafted += n_drafted
            accepted += verdict.num_accepted
            max_d = int(tree.depth.max())
            for d in range(1, max_d + 1):
                if d > len(reached):
                    reached.append(0)
                    hits.append(0)
                reached[d - 1] += 1
                hits[d - 1] += d <= verdict.num_accepted
            new = tree.tokens[path[1:]].tolist() + [verdict.next_token]
            root = verdict.next_token
            event, done = emit(new, n_drafted, verdict.num_accepted)
            clock.lap("other")
            yield event
            if done:
                break
            if state.seq_len >= target.max_positions:
                finish = "length"
                break

        if full_text != text_sent and full_text.startswith(text_sent):  # flush what was held back
            yield StepEvent([], 0, 0, full_text[len(text_sent) :])
        elapsed = time.perf_counter() - t_start
        verify_forwards = forwards - 1
        gen.result = GenerationResult(
            token_ids=emitted,
            text=full_text,
            finish_reason=finish,
            prompt_tokens=prompt_len,
            num_target_forwards=forwards,
            num_drafted=drafted,
            num_accepted=accepted,
            mean_accepted_length=(accepted + verify_forwards) / verify_forwards if verify_forwards else 1.0,
            depth_reached=reached,
            depth_accepted=hits,
            elapsed_s=elapsed,
            timings=dict(clock.t),
        )


__all__ = ["SpecEngine", "GenerationConfig", "GenerationResult", "StepEvent", "Generation", "ContextLengthError"]
