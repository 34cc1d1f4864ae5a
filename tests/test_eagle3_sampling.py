"""Sampling losslessness end to end with an EAGLE-3 drafter that gets accepted: the engine's sampled
tokens (prefill token, then a verify step over an EAGLE-3 tree) follow the target's own
distribution, computed exactly by full recomputation; a verifier that is not lossless fails the
same check (negative control).

A random tiny model is almost impossible to draft (its next token depends on the whole context in
no learnable way), so a head trained on it is nearly never accepted and a test on it would prove
nothing. The target here is a tiny LLaVA turned into a near-bigram model: the attention and MLP
outputs scaled down, so the last hidden state is mostly the current token's embedding, and the LM
head scaled up. A few EAGLE-3 training steps on its own answers learn enough of it to be accepted
on a good share of the steps, and its distributions at T=1 still spread over several tokens."""
import math
from collections import Counter

import pytest
import torch

from test_eagle3 import TREE
from vlmspec.policy.control import FixedPolicy
from vlmspec.draft.eagle import EagleDrafter
from vlmspec.engine import GenerationConfig, SpecEngine
from vlmspec.inputs import encode_prompt
from vlmspec.sampling import SamplingParams, logits_to_probs
from vlmspec.target import Target
from testing.tiny import build_tiny, tiny_image
from vlmspec.train.distill import DistillConfig, train_drafter
from vlmspec.tree import DraftTree
from vlmspec.verify import acceptance
from vlmspec.verify.acceptance import Verdict

PARAMS = SamplingParams(temperature=1.0)
N = 400  # sampled generations per check
BINS = 12  # the most probable (t1, t2, t3) triples, each a bin, and one bin for the rest


def _bigram_target() -> Target:
    model, processor = build_tiny("llava", seed=7)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(40.0)
        for name, p in model.named_parameters():
            if "language_model" in name and name.endswith(("o_proj.weight", "down_proj.weight")):
                p.mul_(0.05)
    return Target(model, processor, name="tiny-llava-bigram")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    target = _bigram_target()
    out = tmp_path_factory.mktemp("eagle3-sampling")
    cfg = DistillConfig(steps=16, batch_size=4, lr=1e-2, w_ce=1.0, warmup=2, eval_every=10**6, eval_n=1, ckpt_every=10**6,
                        arch="eagle3", regenerate=True, regen_max_tokens=24)
    train_drafter(target, "toyworld", out, cfg, progress=False)
    drafter = EagleDrafter.load(out / "drafter", target, TREE)
    assert drafter.head.config.arch == "eagle3"
    inputs = encode_prompt(target, "describe the image in detail", [tiny_image(0)])
    return SpecEngine(target, drafter), inputs


def _next_probs(target: Target, inputs: dict, tail: list[int]) -> torch.Tensor:
    """[V]: the target's shaped distribution after the prompt and `tail`, by full recomputation."""
    ids = torch.cat([inputs["input_ids"], torch.tensor([tail], dtype=inputs["input_ids"].dtype)], 1)
    fixed = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    with torch.no_grad():
        logits = target.model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False, **fixed).logits
    return logits_to_probs(logits[0, -1], PARAMS)


def _exact_triples(target: Target, inputs: dict) -> dict[tuple[int, int, int], float]:
    """The BINS most probable first three tokens and their exact probabilities."""
    triples: dict[tuple[int, int, int], float] = {}
    p1 = _next_probs(target, inputs, [])
    for a in p1.topk(5).indices.tolist():
        p2 = _next_probs(target, inputs, [a])
        for b in p2.topk(4).indices.tolist():
            p3 = _next_probs(target, inputs, [a, b])
            for c in p3.topk(3).indices.tolist():
                triples[(a, b, c)] = float(p1[a] * p2[b] * p3[c])
    return dict(sorted(triples.items(), key=lambda kv: -kv[1])[:BINS])


def _sampled(engine: SpecEngine, inputs: dict, seeds: range) -> tuple[Counter, int, int]:
    """(counts of the first three tokens, accepted drafted tokens, verify steps) over one request per seed."""
    configs = [GenerationConfig(max_new_tokens=3, sampling=PARAMS, seed=s, ignore_eos=True, policy=FixedPolicy()) for s in seeds]
    results = engine.generate_many([(inputs, c) for c in configs], slots=16)
    counts = Counter(tuple(r.token_ids) for r in results)
    return counts, sum(r.stats.num_accepted_tokens for r in results), sum(r.stats.num_drafts for r in results)


def _tv_on_bins(counts: Counter, exact: dict) -> float:
    n = sum(counts.values())
    seen = [counts.get(t, 0) / n for t in exact]
    truth = list(exact.values())
    rest = (1 - sum(seen), 1 - sum(truth))
    return 0.5 * (sum(abs(s - p) for s, p in zip(seen, truth)) + abs(rest[0] - rest[1]))


def _tv_bound(n: int, k: int = BINS + 1, delta: float = 1e-6) -> float:
    """P(TV(empirical of n draws over k bins, truth) >= eps) <= 2^k exp(-2 n eps^2) (Bretagnolle-Huber-Carol)."""
    return math.sqrt((k * math.log(2) + math.log(1 / delta)) / (2 * n))


def _accept_first_child(tree: DraftTree, target_probs: torch.Tensor, generator: torch.Generator | None) -> Verdict:
    """NEGATIVE CONTROL: follows the first child at every node, then samples the bonus. Not lossless."""
    children, node, path = tree.children(), 0, [0]
    while children[node]:
        node = children[node][0]
        path.append(node)
    return Verdict(path, int(torch.multinomial(target_probs[node].float(), 1, generator=generator)), True)


def test_eagle3_sampling_follows_the_target_with_accepted_drafts_and_a_negative_control(setup, monkeypatch):
    engine, inputs = setup
    exact = _exact_triples(engine.target, inputs)
    assert 0.3 < sum(exact.values()) < 0.95 and max(exact.values()) < 0.5  # spread over the bins, and beyond them
    counts, accepted, steps = _sampled(engine, inputs, range(N))
    assert accepted >= N // 8, (accepted, steps)  # the drafts do get accepted (125 of 675 verify steps when written)
    tv = _tv_on_bins(counts, exact)
    assert tv < _tv_bound(N), (tv, _tv_bound(N))
    # the same measurement catches a verifier that keeps the drafter's first choice
    monkeypatch.setattr(acceptance, "verify_sampling", _accept_first_child)
    bad, _, _ = _sampled(engine, inputs, range(N))
    assert _tv_on_bins(bad, exact) > _tv_bound(N), _tv_on_bins(bad, exact)
