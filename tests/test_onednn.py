"""oneDNN's per-shape caches are bounded where the composition root builds an engine (vlmspec.runtime.onednn):
products at many new row counts keep far less memory than with oneDNN's default capacities."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from vlmspec.runtime.onednn import SHAPE_CACHES, bound_shape_caches

GROWTH = "from vlmspec.runtime.onednn import bound_shape_caches, new_shapes_growth; bound_shape_caches(); print(new_shapes_growth(range(5, 405)))"


def test_bound_shape_caches_sets_what_the_environment_leaves_unset(monkeypatch):
    for name in SHAPE_CACHES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "7")  # a user's setting wins
    got = bound_shape_caches()
    assert got == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(SHAPE_CACHES["ONEDNN_PRIMITIVE_CACHE_CAPACITY"]), "LRU_CACHE_CAPACITY": "7"}
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == got["ONEDNN_PRIMITIVE_CACHE_CAPACITY"]


def test_the_composition_root_bounds_them_before_it_builds(monkeypatch):
    from vlmspec import factory

    for name in SHAPE_CACHES:
        monkeypatch.delenv(name, raising=False)
    seen = {}

    def load(spec):  # the first thing build_engine loads: what the environment says by then
        seen.update({name: os.environ.get(name) for name in SHAPE_CACHES})
        raise RuntimeError("stop here")

    monkeypatch.setattr(factory, "load", load)
    with pytest.raises(RuntimeError, match="stop here"):
        factory.build_engine(factory.EngineSpec(model="toy", policy="fixed"))
    assert seen == {name: str(capacity) for name, capacity in SHAPE_CACHES.items()}


def _growth_mib(env: dict[str, str]) -> float:
    """Resident MiB the drafter's packed products take on over 400 new row counts, in a fresh process
    (the capacities are read at the process's first oneDNN primitive)."""
    clean = {k: v for k, v in os.environ.items() if k not in SHAPE_CACHES}
    out = subprocess.run([sys.executable, "-c", GROWTH], env={**clean, **env}, capture_output=True, text=True, timeout=300, check=True)
    return float(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux") or not torch.backends.mkldnn.is_available(),
                    reason="reads /proc/self/statm; needs torch's oneDNN")
@pytest.mark.slow  # a memory figure over 64 new shapes (30 s): `make test-all`
def test_bounded_caches_keep_far_less_memory_over_new_shapes():
    bounded = _growth_mib({})
    default = _growth_mib({name: "1024" for name in SHAPE_CACHES})  # negative control: oneDNN's own capacities
    assert default > 200, f"with the default capacities 2,000 new shapes should leave hundreds of MiB, got {default:.0f}"
    assert bounded < 0.5 * default, (bounded, default)
