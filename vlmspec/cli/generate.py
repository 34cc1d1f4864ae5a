"""`vlmspec generate`: one prompt (with images) -> the streamed text, or one JSON record.

    engine = factory.build_engine(spec)            # target + drafter
    inputs = encode_prompt(engine.target, prompt, images)
    stream_text(engine, inputs, config, stop)      # or generate_text(...) for --json
"""

from __future__ import annotations

import argparse
import json
import sys

from vlmspec.cli.options import UsageError, add_engine_args, engine_spec, float_in, non_negative_int, positive_int


def register(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser("generate", help="answer one prompt (with images) and print the text or a JSON record")
    g.add_argument("--image", action="append", default=[], help="image file (repeat for several images)")
    g.add_argument("--prompt", required=True, help="the user's text")
    add_engine_args(g)
    g.add_argument("--max-new-tokens", type=positive_int("--max-new-tokens"), default=128, help='at most this many new tokens')
    g.add_argument("--temperature", type=float_in("--temperature", 0.0, 100.0), default=0.0, help='sampling temperature (0 = greedy)')
    g.add_argument("--top-p", type=float_in("--top-p", 0.0, 1.0, low_open=True), default=1.0, help='nucleus sampling: keep the smallest set of tokens with this much probability')
    g.add_argument("--top-k", type=non_negative_int("--top-k"), default=0, help='sample among the k most likely tokens (0 = all)')
    g.add_argument("--seed", type=int, default=None, help='random seed for sampling (default: unseeded)')
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of the text")
    g.set_defaults(func=run)


def load_image(path: str):
    """An image file through vlmspec.inputs (with its limits); its errors as the CLI's one line."""
    from vlmspec.errors import InputError
    from vlmspec.inputs import load_image_file

    try:
        return load_image_file(path, param=path)
    except InputError as exc:
        if exc.code == "image_not_found":
            raise UsageError(f"image not found: {path}") from None
        if exc.code == "invalid_image":
            raise UsageError(f"not a readable image: {path} ({exc.message})") from None
        raise UsageError(f"{path}: {exc.message}") from None


def run(args: argparse.Namespace) -> int:
    from vlmspec import factory
    from vlmspec.policy.control import depth_summary
    from vlmspec.engine import GenerationConfig
    from vlmspec.inputs import encode_prompt
    from vlmspec.sampling import SamplingParams
    from vlmspec.text import generate_text, stream_text

    spec = engine_spec(args)
    factory.resolve_drafter(spec.drafter, factory.resolve_model(spec.model, spec.drafter))  # a bad model / drafter choice fails before loading
    images = [load_image(p) for p in args.image]  # so does a bad image file
    engine = factory.build_engine(spec)
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, sampling=sampling, seed=args.seed)
    inputs = encode_prompt(engine.target, args.prompt, images)
    stop = tuple(args.stop)
    if args.json:
        record = generate_text(engine, inputs, config, stop).to_dict()
        record["drafter"] = engine.drafter.name
        print(json.dumps(record))
        return 0
    gen = stream_text(engine, inputs, config, stop)
    for event in gen:
        sys.stdout.write(event.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    assert gen.completion is not None
    result = gen.completion.result
    print(
        f"[{len(result.token_ids)} tokens in {result.elapsed_s:.2f}s, {result.tokens_per_s:.1f} tok/s, "
        f"{result.num_target_forwards} target forwards, mean accepted length {result.mean_accepted_length:.2f}"
        + (f", policy {result.policy}: depths chosen {depth_summary(result.depths)}"
           if result.depths and engine.drafter.tree is not None else "") + "]",
        file=sys.stderr,
    )
    return 0
