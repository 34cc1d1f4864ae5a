"""Benchmarks: every speed figure vlmspec reports comes from here (`vlmspec bench ...`)."""
