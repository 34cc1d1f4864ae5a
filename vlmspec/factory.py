"""The composition root: what to run (an `EngineSpec`) -> a target, a drafter and an engine, built nowhere else.

    spec = EngineSpec(model=None, drafter="auto", device=None, dtype="auto")   # the defaults
    engine = build_engine(spec)                  # SpecEngine(target, drafter)
    target = load(spec)                          # the target alone (training, evaluation)

Resolution: no model -> the target a drafter folder records (`trained_for`), else the aligned real target when built
(`vlmspec build-target`), else the committed toy ("toy"); drafter "auto" -> the EAGLE drafter shipped for that model
("eagle" names it), else n-gram; device None -> CUDA if there; dtype "auto" -> bfloat16 on CUDA, float32 on CPU;
policy "goodput" -> the cost model measured at build (`vlmspec.policy.cost.measured_costs`, cached per model, drafter,
device, dtype) unless nothing drafts. oneDNN's caches are bounded first (`vlmspec.runtime.onednn`); a bad choice
raises `ConfigError` saying what to pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from vlmspec import assets
from vlmspec.policy.control import POLICIES, CostModel, Speculation
from vlmspec.policy.cost import measured_costs
from vlmspec.draft import (HYBRID_SUFFIX, PlainDrafter, SuffixStore, TreeConfig, canonical_drafter, check_drafter_name, default_tree,
                           load_drafter, recorded_target)
from vlmspec.draft.base import Drafter
from vlmspec.engine import SpecEngine
from vlmspec.engine.prompt_cache import PromptCache
from vlmspec.errors import ConfigError
from vlmspec.runtime.onednn import bound_shape_caches
from vlmspec.target import Target, load_target

DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BUNDLED_DRAFTER_NAME = "eagle"


@dataclass(frozen=True)
class EngineSpec:
    model: str | None = None  # a folder, a hub id or "toy"; None = the default (see resolve_model)
    drafter: str = "auto"  # auto | plain | ngram | eagle | a drafter folder or hub id ("none": plain, the old spelling)
    device: str | None = None  # cpu | cuda | cuda:N; None = CUDA when available
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    attention: str = "auto"  # auto | triton | sdpa | eager
    tree_depth: int | None = None  # None: the drafter's measured default for the device, else the device's (TreeConfig.for_device)
    tree_topk: int | None = None
    tree_tokens: int | None = None
    policy: str = "goodput"  # the default speculation policy of the engine's requests (goodput | fixed)
    max_batch: int = 1  # requests decoded together at most (the service's batch): the goodput cost model is measured up to it
    packed_weights: bool = True  # CPU: the target's decode steps over linear weights packed for oneDNN where exact (bf16)
    suffix_memory: int = 200_000  # `suffix` / hybrid drafters: tokens of earlier answers kept across requests, all tenants (0: none)
    prompt_cache_mb: int = 0  # MiB of prefills of prompts seen before, served instead of a new prefill (0: none; PromptCache)

    def __post_init__(self) -> None:
        object.__setattr__(self, "drafter", canonical_drafter(self.drafter))


# the prompt the cost model is measured on at build (step times hardly depend on the prompt)


def resolve_device(device: str | None) -> str:
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ConfigError(f"--device must be cpu or cuda, got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for but no CUDA device is available")
    return device


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    chosen = DTYPES[dtype]
    if chosen is None:
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return chosen


def cpu_has_bf16_units(cpuinfo: str | None = None) -> bool | None:
    """Whether this CPU does bf16 matrix arithmetic in hardware (AVX512-BF16 or AMX-BF16 in
    /proc/cpuinfo's flags); None where that cannot be read (not Linux)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), None)
    if flags is None:
        return None
    return "avx512_bf16" in flags or "amx_bf16" in flags


def bf16_cpu_warning(device: str, bf16: bool, cpuinfo: str | None = None) -> str | None:
    """One line for a user who asked for bf16 on a CPU that emulates it (measured on an AVX2 host:
    a forward about 8x slower than fp32, an alignment step under autocast about 20x), else None."""
    if not bf16 or not device.startswith("cpu") or cpu_has_bf16_units(cpuinfo) is not False:
        return None
    return ("warning: this CPU has no bf16 units (no avx512_bf16 / amx_bf16 flag): bf16 is emulated and runs many times "
            "slower than float32 here; use float32 (drop --autocast, or --dtype float32)")


def resolve_model(model: str | None, drafter: str | None = None) -> str:
    """None -> the target `drafter` records it was trained for (`model_of_drafter`), else the aligned
    real target when it is built, else the committed toy; 'toy' -> the toy; anything else as given."""
    if model is None and drafter is not None:
        model = model_of_drafter(drafter)
    if model == assets.TOY_NAME or (model is None and assets.default_target() is None):
        if assets.bundled_target() is None:
            raise ConfigError(f"the toy model is missing ({assets.BUNDLED_TARGET}): pass --model DIR|HUB_ID")
        return str(assets.BUNDLED_TARGET)
    if model:
        return model
    return str(assets.default_target())


def model_of_drafter(drafter: str) -> str | None:
    """The --model a drafter folder records it was trained for (`vlmspec train` writes it; a
    speculators drafter names its verifier), as found on this machine; None when it records none.
    ConfigError when that model is not here, saying what to pass."""
    record = recorded_target(drafter)
    if record is None:
        return None
    model = assets.recorded_model(record["model"], record.get("path") or "")
    if model is None:
        where = f" (at {record['path']})" if record.get("path") else ""
        build = " (`make setup` builds it)" if record["model"] in assets.KNOWN_MODELS else ""
        raise ConfigError(f"drafter {drafter} was trained for {record['model']}{where}, which is not on this machine{build}: "
                          "pass --model with that model's folder or hub id")
    return model


def resolve_drafter(drafter: str, model: str) -> str:
    """'auto' and 'eagle' -> the EAGLE drafter shipped for `model` (the toy's, the default
    model's: `assets.shipped_drafter`); 'auto' -> n-gram for any other model."""
    check_drafter_name(drafter)  # an unknown name is said before any model is loaded
    if drafter in ("hybrid", BUNDLED_DRAFTER_NAME + HYBRID_SUFFIX):  # the shipped EAGLE drafter beside the suffix drafter
        return resolve_drafter(BUNDLED_DRAFTER_NAME, model) + HYBRID_SUFFIX
    if drafter not in ("auto", BUNDLED_DRAFTER_NAME):
        return drafter
    shipped = assets.shipped_drafter(model)
    if shipped is not None:
        return str(shipped)
    if drafter == "auto":
        return "ngram"
    raise ConfigError(f"--drafter {BUNDLED_DRAFTER_NAME} names a shipped EAGLE drafter, and none is shipped for {model} "
                      f"(there is one for --model {assets.TOY_NAME} and for the default model {assets.DEFAULT_TARGET_NAME}); "
                      "pass a drafter folder trained for this model (vlmspec train), or ngram / plain")


def tree_config(spec: EngineSpec, device: str, drafter: str | None = None) -> TreeConfig:
    """The draft tree: the spec's knobs over the drafter's measured default for this device (its
    config's `tree_defaults`; `drafter` is a resolved drafter name), else the device's default."""
    base = (default_tree(drafter, device) if drafter else None) or TreeConfig.for_device(device)
    return TreeConfig(depth=spec.tree_depth or base.depth, top_k=spec.tree_topk or base.top_k,
                      total_tokens=spec.tree_tokens or base.total_tokens)


def load(spec: EngineSpec) -> Target:
    """The target of `spec` (TargetLoadError when it cannot be loaded)."""
    device = resolve_device(spec.device)
    return load_target(resolve_model(spec.model, spec.drafter), device=device, dtype=resolve_dtype(spec.dtype, device), attention=spec.attention,
                       packed_weights=spec.packed_weights)


def drafter_for(spec: EngineSpec, target: Target, store: SuffixStore | None = None) -> Drafter:
    """The drafter of `spec` for an already loaded target (DrafterLoadError / ConfigError). A drafter
    that learns from traffic (`suffix`, `X+suffix`) gets `store`, else a new one of
    `spec.suffix_memory` tokens (none when that is 0): one per engine, so one per model served."""
    name = resolve_drafter(spec.drafter, target.name)
    if store is None and spec.suffix_memory > 0 and (name == "suffix" or name.endswith(HYBRID_SUFFIX)):
        store = SuffixStore(spec.suffix_memory)
    return load_drafter(name, target, tree_config(spec, str(target.device), name), store=store)


def build_engine(spec: EngineSpec) -> SpecEngine:
    if spec.policy not in POLICIES:
        raise ConfigError(f"--policy must be one of {', '.join(POLICIES)}, got {spec.policy!r}")
    if spec.max_batch < 1:
        raise ConfigError(f"--max-batch must be at least 1, got {spec.max_batch}")
    bound_shape_caches()  # before the drafter packs its weights: oneDNN reads it at its first primitive
    target = load(spec)
    engine = with_policy(SpecEngine(target, drafter_for(spec, target)), spec.policy, max_batch=spec.max_batch)
    if spec.prompt_cache_mb < 0:
        raise ConfigError(f"--prompt-cache must be at least 0 MiB, got {spec.prompt_cache_mb}")
    if spec.prompt_cache_mb:  # after the cost model's measurement, which must run its prefills
        engine = SpecEngine(engine.target, engine.drafter, engine.speculation, PromptCache(spec.prompt_cache_mb << 20))
    return engine


def batch_sizes(max_batch: int) -> tuple[int, ...]:
    """The batch sizes the batched cost model is measured at: powers of two below `max_batch`, and it."""
    return tuple(sorted({b for b in (2, 4, 8, 16, 32, 64) if b < max_batch} | {max_batch})) if max_batch > 1 else ()


def with_policy(engine: SpecEngine, policy: str, cost: CostModel | None = None, max_batch: int = 1) -> SpecEngine:
    """`engine` whose requests default to `policy`; goodput gets `cost`, measured here (or read from
    the cost cache) when not given, per batch size up to `max_batch` too (nothing is measured for a
    drafter that never drafts: its requests run plain steps anyway)."""
    batch_cost = None
    if policy == "goodput" and cost is None and not isinstance(engine.drafter, PlainDrafter):
        cost, batch_cost = measured_costs(engine, batch_sizes(max_batch))
    return SpecEngine(engine.target, engine.drafter, Speculation(policy, cost, batch_cost), engine.prompt_cache)


def plain_engine(engine: SpecEngine) -> SpecEngine:
    """Plain decoding through the same engine code over the same target (the oracle, the baseline)."""
    return SpecEngine(engine.target, PlainDrafter())
