"""Timings of the CPU kernels the product chose between, to see for oneself on any machine:
`python -m recipes kernels onednn | attention | packing --model DIR | packed-linear`
(docs/batching.md and docs/serving.md quote their output). They are the lab's, apart from the
product modules whose choices they time (vlmspec/runtime/onednn.py, vlmspec/target/attention.py,
vlmspec/target/packing.py, vlmspec/kernels/packed_linear.py)."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from transformers import AutoModelForImageTextToText, DynamicCache
from transformers.integrations import sdpa_attention

from vlmspec.kernels.packed_linear import PACKED_DTYPES, PackedLinear
from vlmspec.cache.kv_cache import cache_kwarg
from vlmspec.runtime.memory import rss_bytes
from vlmspec.runtime.onednn import bound_shape_caches, new_shapes_growth
from vlmspec.stats import median_ms
from vlmspec.target.attention import gqa_sdpa_forward, packs
from vlmspec.target.packing import pack_exact_linears


def time_onednn() -> None:
    """Prints the growth over 400 new row counts with the settings in effect (run it with and
    without the environment variables set: `ONEDNN_PRIMITIVE_CACHE_CAPACITY=1024
    LRU_CACHE_CAPACITY=1024 python -m recipes kernels onednn` is oneDNN's default)."""
    settings = bound_shape_caches()
    start = time.perf_counter()
    grown = new_shapes_growth(range(5, 405))
    print(f"{settings}: resident memory +{grown:.0f} MiB over 400 new row counts ({time.perf_counter() - start:.1f} s)")


def time_attention() -> None:
    """Times one layer's attention at the default model's heads (9 query, 3 key / value, 64 wide) and
    batched steps' shapes: transformers' SDPA path, SDPA over the grouped heads read in place, and
    `gqa_sdpa_forward` (which packs the query heads where `packs` says), with whether the last two agree."""
    from types import SimpleNamespace

    sdpa_attention_forward = sdpa_attention.sdpa_attention_forward

    def grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).transpose(1, 2).contiguous()

    module = SimpleNamespace(num_key_value_groups=3, is_causal=True, training=False)
    for dtype in (torch.bfloat16, torch.float32):
        print(f"{dtype}, {torch.get_num_threads()} threads: median us per layer: transformers' SDPA, grouped heads in place, gqa_sdpa_forward")
        for rows, n, cached in ((1, 16, 200), (1, 4, 200), (2, 3, 210), (4, 2, 210), (8, 1, 210), (8, 2, 210), (8, 4, 210), (16, 3, 220)):
            q = torch.randn(rows, n, 9, 64).to(dtype).transpose(1, 2)  # the layout the models hand over
            k, v = torch.randn(rows, 3, cached + n, 64).to(dtype), torch.randn(rows, 3, cached + n, 64).to(dtype)
            mask = torch.zeros(rows, 1, n, cached + n, dtype=dtype)
            mask[..., cached:] = torch.finfo(dtype).min * (1 - torch.eye(n, dtype=dtype))
            calls = (lambda: sdpa_attention_forward(module, q, k, v, mask), lambda: grouped(q, k, v, mask),
                     lambda: gqa_sdpa_forward(module, q, k, v, mask))
            with torch.no_grad():
                same = torch.equal(grouped(q, k, v, mask), gqa_sdpa_forward(module, q, k, v, mask)[0])
                us = [1e3 * median_ms(q.device, call, repeats=200, warmup=10) for call in calls]
            how = "packed" if packs(q, k, mask) else "grouped"
            print(f"  {rows:2d} rows x {n:2d} queries over {cached + n:3d} entries: {us[0]:7.1f} {us[1]:7.1f} {us[2]:7.1f}  {how:7s} (equal: {same})")


def time_packing(model_dir: str, rounds: int) -> None:
    """A target's one-token step over a 200-token cache at 1 and 8 rows, bf16, with F.linear and
    with its exact packed layers, taking turns: ms per step, and whether the logits are equal."""
    bound_shape_caches()  # as the composition root does
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    plain = {(p, n): c for p in model.modules() for n, c in p.named_children() if type(c) is torch.nn.Linear}
    copies = sum(c.weight.numel() * c.weight.element_size() for c in plain.values()) / 2**20
    before, probe = rss_bytes(), time.perf_counter()
    found = pack_exact_linears(model)
    probe = time.perf_counter() - probe
    packed = {(p, n): getattr(p, n) for p, n in plain}
    print(f"probed in {probe:.1f} s; resident memory +{(rss_bytes() - before) / 2**20:.0f} MiB (the packed copies of "
          f"{len(plain)} layers' weights are {copies:.0f} MiB, the rest the primitives the probe built); rows packed per shape {found}")
    g = torch.Generator().manual_seed(0)
    for rows in (1, 8):
        ids = torch.randint(0, model.config.get_text_config().vocab_size, (rows, 201), generator=g)
        times: dict[str, list[float]] = {"F.linear": [], "packed": []}
        logits: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            cache = DynamicCache()
            model.get_decoder()(input_ids=ids[:, :200], use_cache=True, **cache_kwarg(model.get_decoder(), cache))

            def step() -> torch.Tensor:  # the 201st token's logits; `cache.crop(-1)` takes its entry out again
                return model(input_ids=ids[:, 200:], **cache_kwarg(model, cache)).logits

            for _ in range(rounds):
                for way, layers in (("F.linear", plain), ("packed", packed)):
                    for (p, n), layer in layers.items():
                        setattr(p, n, layer)
                    logits[way] = step()
                    cache.crop(-1)
                    times[way].append(median_ms(torch.device("cpu"), step, repeats=10, warmup=3, after=lambda: cache.crop(-1)))
        print(f"{rows} row(s), a one-token step, ms per round: " + "; ".join(f"{w} {', '.join(f'{t:.1f}' for t in ts)}" for w, ts in times.items())
              + f"; logits equal to the bit: {torch.equal(logits['F.linear'], logits['packed'])}")


def time_packed_linear() -> None:
    """Times F.linear against the packed weight at a drafter's shapes (this machine's threads)."""
    for dtype in PACKED_DTYPES:
        print(f"{dtype}, {torch.get_num_threads()} threads: median us per call, F.linear vs packed (largest difference)")
        # the default model's drafter (hidden 576, 9 + 2 x 3 heads of 64, MLP 1536, K = 4,096)
        for name, n, k in (("q|k|v", 960, 576), ("gate|up", 3072, 576), ("down", 576, 1536), ("cut LM head", 4096, 576)):
            w = torch.randn(n, k).to(dtype)
            packed = PackedLinear(w)
            for rows in (1, 4, 17):
                x = torch.randn(rows, k).to(dtype)
                diff = float((F.linear(x, w).float() - packed(x).float()).abs().max())
                print(f"  {name:11s} [{rows:2d}, {k}] x [{k}, {n}]: {_us(lambda: F.linear(x, w)):7.1f} vs "
                      f"{_us(lambda: packed(x)):7.1f}  ({diff:.1e})")


def _us(call) -> float:
    return 1e3 * median_ms(torch.device("cpu"), call, repeats=300, warmup=20)
