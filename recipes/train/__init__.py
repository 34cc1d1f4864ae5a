"""Trainers of the bundled targets' parts (not of drafters: those are the product's `vlmspec.train`)."""
