"""Tokens/s of `SpecEngine.generate` (batch 1) on held-out prompts, for comparing two checkouts.

    PYTHONPATH=<checkout> .venv/bin/python scripts/engine_speed.py --dtype bfloat16 -n 8 --rounds 3

Runs the default model and its shipped drafter (goodput policy, the product's defaults) on n held-out
prompts (ToyWorld scenes, photographs and text, in turn), 64 new tokens each, after one warm-up
round; prints one line of JSON per round: total tokens / total seconds, and the tokens per verify
forward (accepted length tau, bonus included) over the round. Uses only APIs that exist
in both the batched engine and the engine before it.
"""
import argparse
import json
import time

import torch

from vlmspec.data.heldout import adversarial, heldout
from vlmspec.engine import GenerationConfig
from vlmspec.factory import EngineSpec, build_engine
from vlmspec.inputs import encode_prompt

parser = argparse.ArgumentParser()
parser.add_argument("--dtype", default="bfloat16")
parser.add_argument("-n", type=int, default=8)
parser.add_argument("--rounds", type=int, default=3)
parser.add_argument("--max-new-tokens", type=int, default=64)
args = parser.parse_args()
engine = build_engine(EngineSpec(dtype=args.dtype, device="cpu"))
sets = [heldout("bench", args.n, split="test"), adversarial("photo_unknown", args.n), adversarial("unseen_text", args.n)]
convs = [sets[i % 3][i // 3] for i in range(args.n)]
prompts = [encode_prompt(engine.target, c.prompt, c.images) for c in convs]
config = GenerationConfig(max_new_tokens=args.max_new_tokens, ignore_eos=True)
for r in range(args.rounds + 1):
    tokens, emitted, forwards, t0 = 0, 0, 0, time.perf_counter()
    for inputs in prompts:
        result = engine.generate(inputs, config)
        tokens += len(result.token_ids)
        emitted += result.stats.num_accepted_tokens + result.stats.num_drafts  # accepted + one target token per verify
        forwards += result.stats.num_drafts
    if r:  # round 0 warms up
        print(json.dumps({"round": r, "tokens_per_s": round(tokens / (time.perf_counter() - t0), 2),
                          "tau": round(emitted / max(forwards, 1), 3), "torch_threads": torch.get_num_threads()}))
