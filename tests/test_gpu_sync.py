"""Host syncs per engine step on CUDA (issue #18, item 6), counted, not guessed.

`torch.cuda.set_sync_debug_mode("warn")` makes every synchronizing CUDA call warn ("called a
synchronizing CUDA operation"): a blocking copy in either direction (`.to(cuda)` from pageable
host memory, `.cpu()`, `.tolist()`, `.item()`, `int(t)` of a device tensor), `nonzero`, a stream
sync. Pinned, non-blocking host->device copies do not sync and do not warn. The warnings are
recorded with the filter at "always", so repeats from one line are all counted.

The bound per verify step, from reading the code (tiny llava: 2 decoder layers):
    draft    1   `EagleDrafter.propose_batch`: the whole tree in one device->host read (any depth)
    verify   3   `Target.forward_tree`: ancestor mask, token ids, position ids to the device
             1   `verify_greedy` argmax / `verify_sampling` probabilities to the host
    commit   L   `KVCache.commit`: the kept indices to the device, once per target layer
             1   engine: the accepted path's indices to the features' device
+ SLACK for what the Hugging Face forward may do on its own. The drafter's commit moves its
tokens with a pinned, non-blocking copy (no sync). The first algorithm synced ~1,200 times per
proposal with these tree settings (depth 7, top-k 10, 60 tokens).
"""
import warnings

import pytest
import torch

from vlmspec.draft.base import TreeConfig
from vlmspec.draft.eagle import EagleDrafter
from vlmspec.engine import GenerationConfig, SpecEngine
from vlmspec.inputs import encode_prompt
from vlmspec.sampling import SamplingParams
from vlmspec.target import Target
from testing.tiny import build_tiny, tiny_image

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SYNC_WARNING = "called a synchronizing CUDA operation"
PROPOSE_SYNCS = 1
VERIFY_SYNCS = 3 + 1
ENGINE_SYNCS = 1
SLACK = 2


class SyncCounter:
    """Counts synchronizing CUDA calls while active (process-global mode: one test at a time)."""

    def __enter__(self) -> "SyncCounter":
        self._catch = warnings.catch_warnings(record=True)
        self._records = self._catch.__enter__()
        warnings.simplefilter("always")
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        torch.cuda.set_sync_debug_mode("default")
        self._catch.__exit__(*exc)

    @property
    def count(self) -> int:
        return sum(SYNC_WARNING in str(w.message) for w in self._records)


@pytest.fixture(scope="module")
def cuda_target():
    model, processor = build_tiny("llava", seed=0)  # a fresh model: the CPU one in conftest is shared
    return Target(model.to("cuda"), processor, name="tiny-llava-cuda")


def _count_propose(monkeypatch, counter: SyncCounter) -> list[int]:
    """Wrap the drafter's batched proposal (what the engine calls each step) to record the syncs inside each call."""
    per_call: list[int] = []
    real = EagleDrafter.propose_batch

    def propose_batch(self, sessions, roots, max_depths, chains=None):
        before = counter.count
        trees = real(self, sessions, roots, max_depths, chains)
        per_call.append(counter.count - before)
        return trees

    monkeypatch.setattr(EagleDrafter, "propose_batch", propose_batch)
    return per_call


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_host_syncs_per_step_are_bounded(cuda_target, monkeypatch, temperature):
    target = cuda_target
    tree = TreeConfig.for_device("cuda")
    assert (tree.depth, tree.top_k, tree.total_tokens) == (7, 10, 60)
    drafter = EagleDrafter.random_init(target, tree, seed=0)  # a random head always drafts a full tree
    inputs = encode_prompt(target, "describe the image in detail", [tiny_image(0)])
    # seed=None: with a seed the engine's first token samples CUDA probabilities with a CPU generator
    config = GenerationConfig(max_new_tokens=32, ignore_eos=True, sampling=SamplingParams(temperature=temperature),
                              sync_timings=False)
    engine = SpecEngine(target, drafter)
    engine.generate(inputs, config)  # warm-up: kernels, caching allocators (pinned pool included)
    n_layers = int(target.text_config.num_hidden_layers)
    bound = PROPOSE_SYNCS + VERIFY_SYNCS + n_layers + ENGINE_SYNCS + SLACK
    with SyncCounter() as counter:
        per_propose = _count_propose(monkeypatch, counter)
        steps = iter(engine.stream(inputs, config))
        next(steps)  # prefill and the first token: not a verify step
        per_step, drafted, last = [], 0, counter.count
        for event in steps:
            per_step.append(counter.count - last)
            drafted, last = drafted + event.num_drafted, counter.count
    print(f"\nT={temperature}: host syncs per verify step {per_step} (bound {bound}); per proposal {per_propose}")
    assert per_step and per_propose and drafted > 0
    assert max(per_propose) <= PROPOSE_SYNCS, per_propose
    assert max(per_step) <= bound, per_step
