"""Kernels: attention backends the target can run its tree-verify forwards on (a Triton tree kernel),
and linear layers over weights prepacked for oneDNN (the drafter's levels on a CPU)."""
