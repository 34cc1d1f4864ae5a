"""Benchmarks: every speed figure vlmspec reports comes from here (`vlmspec bench ...`).

`harness` (bench run), `verify_cost`, `kernel` and `ablation` (bench ablate) take typed options
(dataclasses) and return reports; their command-line options live in `vlmspec/cli/bench.py`."""
