"""`make serve` until the service and the bundled model exist: one speculative generation on a
tiny randomly initialised LLaVA built in process, plain and speculative side by side."""

from __future__ import annotations

import sys

from vlmspec.draft import NgramDrafter, NoDrafter
from vlmspec.engine import GenerationConfig, SpecEngine
from vlmspec.target import Target
from vlmspec.testing.tiny import build_tiny, tiny_image


def main() -> int:
    print("vlmspec demo: the HTTP service (issue #7) and the bundled model (issue #3) are not built yet.")
    print("Running the engine on a tiny RANDOM LLaVA (its words are noise; the decoding is real).\n")
    model, processor = build_tiny("llava")
    target = Target(model, processor, name="tiny-random-llava")
    inputs = target.encode("describe the image", [tiny_image(0)])
    config = GenerationConfig(max_new_tokens=64, ignore_eos=True)
    results = {}
    for drafter in (NoDrafter(), NgramDrafter()):
        results[drafter.name] = r = SpecEngine(target, drafter).generate(inputs, config)
        print(
            f"{drafter.name:>6}: {len(r.token_ids)} tokens, {r.num_target_forwards} target forwards, "
            f"mean accepted length {r.mean_accepted_length:.2f}, {r.tokens_per_s:.0f} tok/s"
        )
    same = results["none"].token_ids == results["ngram"].token_ids
    print(f"\nspeculative output identical to plain decoding: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
