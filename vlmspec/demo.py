"""`make serve` until the HTTP service exists (issue #7): plain and speculative decoding side by
side on the bundled model and a bundled sample image (a tiny random LLaVA when no bundled model
is there), in the terminal."""

from __future__ import annotations

import sys

from PIL import Image

from vlmspec import assets
from vlmspec.draft import NgramDrafter, NoDrafter, load_drafter
from vlmspec.engine import GenerationConfig, SpecEngine
from vlmspec.target import Target


def _setup() -> tuple[Target, list, Image.Image, str]:
    path = assets.bundled_target()
    if path is None:
        from vlmspec.testing.tiny import build_tiny, tiny_image

        print("No bundled model found: running on a tiny RANDOM LLaVA (its words are noise; the decoding is real).\n")
        model, processor = build_tiny("llava")
        return Target(model, processor, name="tiny-random-llava"), [NoDrafter(), NgramDrafter()], tiny_image(0), "describe the image"
    target = Target.load(path)
    drafters = [NoDrafter(), NgramDrafter()]
    if assets.bundled_drafter() is not None:
        drafters.append(load_drafter(str(assets.bundled_drafter()), target))
    image = Image.open(assets.SAMPLE_IMAGES / "toyworld_scene.png").convert("RGB")
    return target, drafters, image, "Describe the picture in detail."


def main() -> int:
    print("vlmspec demo (the HTTP service, issue #7, is not built yet)")
    target, drafters, image, prompt = _setup()
    print(f"target: {target.name}\nprompt: {prompt}\n")
    inputs = target.encode(prompt, [image])
    config = GenerationConfig(max_new_tokens=160)
    results = {}
    for drafter in drafters:
        results[drafter.name] = r = SpecEngine(target, drafter).generate(inputs, config)
        if drafter.name == "none":
            print(f"answer: {r.text}\n")
        print(
            f"{drafter.name:>6}: {len(r.token_ids)} tokens, {r.num_target_forwards} target forwards, "
            f"mean accepted length {r.mean_accepted_length:.2f}, {r.tokens_per_s:.0f} tok/s"
        )
    same = all(r.token_ids == results["none"].token_ids for r in results.values())
    print(f"\nevery drafter's output identical to plain decoding: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
