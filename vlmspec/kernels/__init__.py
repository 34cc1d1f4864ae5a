"""Attention backends the target can run its tree-verify forwards on (a Triton tree kernel)."""
