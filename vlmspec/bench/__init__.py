"""Benchmarks of the product: every speed figure vlmspec reports for itself comes from here (`vlmspec bench ...`).

`harness` (bench run), `verify_cost`, `kernel` and `server` (bench server) take typed options or
arguments and return reports; their command-line options live in `vlmspec/cli/bench.py`. Every
bench that times ways against each other on the same prompts does it through `runner.run_ways`
(interleaved, order rotated per prompt, ratios paired). The research suites (ablations, adaptive
speculation, the stop head, tree shapes) are the lab's: `recipes/bench/`, `python -m recipes`."""
