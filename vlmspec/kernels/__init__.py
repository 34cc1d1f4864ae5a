"""Kernels: attention backends the target can run its tree-verify forwards on (a Triton tree kernel),
and linear layers over weights prepacked for the CPU's bf16 matrix units (the drafter's levels)."""
