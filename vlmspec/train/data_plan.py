"""What each sample of a `vlmspec data` corpus is, before the target answers it: its source, its
user turns (or the start of one the target writes itself), its images, its sampling and seed.

A shard's plan is a pure function of the config and the shard's index, so a resumed run plans the
same samples: shard k holds the global samples k * shard_size ..., each source's count in a shard
follows the shares within one sample (`sources_of`), the order within the shard is shuffled by (seed, k),
and each sample's draws come from its own generator seeded by (seed, global index). Sources that
walk a list (photographs, ToyWorld seeds, a user JSONL) take the next items after those the
shards before used.

    SOURCES = ("text", "followup", "photo", "toyworld", "jsonl")
    cfg = DataConfig(samples=20000, shares={"text": .4, "followup": .2, "photo": .25, "toyworld": .15})
    specs = plan_shard(cfg, k, Resources(photos, jsonl_convs))     # [SampleSpec]
"""

from __future__ import annotations

import io
import random
from dataclasses import asdict, dataclass, field
from typing import Any

from PIL import Image

from vlmspec.data import toyworld
from vlmspec.data.heldout import Conversation
from vlmspec.data.photos import Photo, augment
from vlmspec.data.prompts import TOPICS, followup_turns, is_heldout, photo_question, text_prompt
from vlmspec.errors import ConfigError
from vlmspec.sampling import SamplingParams
from vlmspec.train.magpie import magpie_start

SOURCES = ("text", "followup", "photo", "toyworld", "jsonl")
TOYWORLD_OFFSET = 7 * 10**8  # the data engine's block of ToyWorld's train split (`vlmspec train` reads from 5 * 10**8)


@dataclass(frozen=True)
class DataConfig:
    """What `vlmspec data` writes. Shares are relative weights of the sources (normalised)."""

    samples: int = 1000
    shard_size: int = 64
    seed: int = 0
    shares: dict[str, float] = field(default_factory=lambda: {"text": 0.4, "followup": 0.2, "photo": 0.25, "toyworld": 0.15})
    jsonl: str = ""  # a LLaVA-style JSONL file: the "jsonl" source's prompts (its answers are regenerated)
    sampled_share: float = 0.3  # samples answered with sampling (the rest greedy, T = 0)
    temperature: float = 1.0
    top_p: float = 0.95
    max_new_tokens: int = 192
    followup_turns: tuple[int, int] = (1, 2)  # later user turns of a follow-up dialogue: between these (2-3 turn dialogues)
    photo_followup_share: float = 0.3  # follow-up dialogues that start from a photograph
    magpie_tokens: int = 48  # length limit of a user turn the target writes (Magpie)
    magpie_attempts: int = 3  # tries at a usable user turn before a templated instruction is used
    magpie_topic_share: float = 0.5  # Magpie turns led in by a topic
    slots: int = 8  # rows decoded together (the batched engine's slots); does not change any answer

    def __post_init__(self) -> None:
        unknown = set(self.shares) - set(SOURCES)
        if unknown:
            raise ConfigError(f"unknown data source(s) {sorted(unknown)}: the sources are {', '.join(SOURCES)}")
        if any(v < 0 for v in self.shares.values()) or sum(self.shares.values()) <= 0:
            raise ConfigError(f"source shares must be >= 0 with a positive sum, got {self.shares}")
        if self.shares.get("jsonl", 0) > 0 and not self.jsonl:
            raise ConfigError("a jsonl share needs the JSONL file: pass --jsonl FILE, or set its share to 0")
        if self.samples < 1 or self.shard_size < 1 or self.max_new_tokens < 1 or self.slots < 1 or self.magpie_attempts < 1:
            raise ConfigError("samples, shard size, max new tokens, slots and Magpie attempts must all be >= 1")
        if not 0 <= self.sampled_share <= 1 or not 0 <= self.photo_followup_share <= 1 or not 0 <= self.magpie_topic_share <= 1:
            raise ConfigError("--sampled-share and the other shares of a source must be in [0, 1]")
        lo, hi = self.followup_turns
        if not 1 <= lo <= hi:
            raise ConfigError(f"follow-up turns must be 1 <= min <= max, got {self.followup_turns}")
        SamplingParams(self.temperature, 0, self.top_p)  # ValueError with the bound it broke

    @property
    def shards(self) -> int:
        return -(-self.samples // self.shard_size)

    def shard_samples(self, k: int) -> int:
        return min(self.shard_size, self.samples - k * self.shard_size)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["followup_turns"] = list(self.followup_turns)
        return d

    def plan_key(self) -> dict[str, Any]:
        """What decides the content of shard k (not the sample count, which only decides how many
        shards there are, nor the slots): a resumed run must match it."""
        d = self.to_json()
        d.pop("samples")
        d.pop("slots")
        return d


@dataclass
class SampleSpec:
    """One sample before the target answers it."""

    index: int  # global sample index
    source: str
    turns: list[str | None]  # user turns; None: the target writes it (Magpie), `fallback` if it cannot
    sampling: SamplingParams
    seed: int
    images: list[Image.Image] = field(default_factory=list)  # as the corpus' files decode (a JPEG's losses included)
    files: list[bytes] = field(default_factory=list)  # the images' file bytes, written beside the shard as they are
    image_ext: str = "png"
    info: dict[str, Any] = field(default_factory=dict)  # what the record's meta says about it (topic, kind, photo, ...)
    magpie_start: str = ""  # the start of the user turn the target writes
    fallback: str = ""


def encoded(image: Image.Image, ext: str) -> tuple[bytes, Image.Image]:
    """(the image's file bytes, the RGB image they decode to): the target answers the image a
    training run will read back, not the one before JPEG's losses."""
    buf = io.BytesIO()
    image.convert("RGB").save(buf, format="JPEG" if ext == "jpg" else "PNG", **({"quality": 90} if ext == "jpg" else {}))
    data = buf.getvalue()
    with Image.open(io.BytesIO(data)) as im:
        return data, im.convert("RGB")


def _set_images(spec: SampleSpec, images: list[Image.Image], ext: str) -> None:
    spec.image_ext = ext
    pairs = [encoded(im, ext) for im in images]
    spec.files, spec.images = [d for d, _ in pairs], [im for _, im in pairs]


@dataclass
class Resources:
    photos: list[Photo] = field(default_factory=list)
    jsonl: list[Conversation] = field(default_factory=list)  # held-out prompts already left out


def sources_of(cfg: DataConfig, end: int) -> list[str]:
    """The source of each of the first `end` samples: a smooth weighted round robin over the shares,
    so every prefix (every shard, the first shards of a run) holds each source within one sample of
    its share, and a longer run only appends."""
    weights = {s: cfg.shares.get(s, 0.0) for s in SOURCES if cfg.shares.get(s, 0.0) > 0}
    total = sum(weights.values())
    current = dict.fromkeys(weights, 0.0)
    out = []
    for _ in range(end):
        for s, w in weights.items():
            current[s] += w
        pick = max(current, key=lambda s: (current[s], -SOURCES.index(s)))
        current[pick] -= total
        out.append(pick)
    return out


def _sampling(cfg: DataConfig, rng: random.Random) -> SamplingParams:
    sampled = rng.random() < cfg.sampled_share
    return SamplingParams(cfg.temperature, 0, cfg.top_p) if sampled and cfg.temperature > 0 else SamplingParams()


def plan_shard(cfg: DataConfig, k: int, res: Resources) -> list[SampleSpec]:
    """The samples of shard `k`, in the order they are written."""
    size = cfg.shard_samples(k)
    if size <= 0:
        raise ValueError(f"shard {k} is past the last shard ({cfg.shards} of them)")
    start = k * cfg.shard_size
    every = sources_of(cfg, start + size)
    sources = every[start:]
    random.Random(f"order:{cfg.seed}:{k}").shuffle(sources)
    used = {s: every[:start].count(s) for s in SOURCES}  # items each source took in the shards before this one
    specs = []
    for j, source in enumerate(sources):
        g = k * cfg.shard_size + j
        rng = random.Random(f"sample:{cfg.seed}:{g}")
        spec = SampleSpec(g, source, [], _sampling(cfg, rng), (cfg.seed * 1_000_003 + g) % 2**31)
        _PLANNERS[source](cfg, spec, rng, used[source], res)
        used[source] += 1
        specs.append(spec)
    return specs


def _text(cfg: DataConfig, spec: SampleSpec, rng: random.Random, n: int, res: Resources) -> None:
    start, opener, topic = magpie_start(rng, TOPICS, cfg.magpie_topic_share)
    spec.turns = [None]
    spec.magpie_start = start
    spec.fallback = text_prompt(rng, topic)[1]
    spec.info = {"opener": opener, "topic": topic}


def _photo_image(spec: SampleSpec, rng: random.Random, n: int, res: Resources) -> None:
    if not res.photos:
        raise ConfigError("photo samples need photographs and none of the catalogue's is installed: "
                          "pip install 'vlmspec[data]', or set the photo shares to 0 (--photo 0)")
    photo = res.photos[n % len(res.photos)]
    image, params = augment(photo.image(), rng)
    _set_images(spec, [image], "jpg")
    spec.info.update(photo=photo.name, augment=params)


def _followup(cfg: DataConfig, spec: SampleSpec, rng: random.Random, n: int, res: Resources) -> None:
    extra = rng.randint(*cfg.followup_turns)
    if res.photos and rng.random() < cfg.photo_followup_share:
        kind, first = photo_question(rng)
        _photo_image(spec, rng, n, res)
        spec.turns = [first, *followup_turns(rng, None, extra, photo=True)]
        spec.info.update(kind=kind)
    else:
        topic, first = text_prompt(rng)
        spec.turns = [first, *followup_turns(rng, topic, extra)]
        spec.info.update(topic=topic)


def _photo(cfg: DataConfig, spec: SampleSpec, rng: random.Random, n: int, res: Resources) -> None:
    kind, question = photo_question(rng)
    _photo_image(spec, rng, n, res)
    spec.turns = [question]
    spec.info.update(kind=kind)


def _toyworld(cfg: DataConfig, spec: SampleSpec, rng: random.Random, n: int, res: Resources) -> None:
    generator = toyworld()
    seed = generator.SPLITS["train"][0] + TOYWORLD_OFFSET + cfg.seed * 10**7 + n
    sample = generator.make_sample(seed)
    spec.turns = [sample.prompt]
    _set_images(spec, [sample.image] if sample.image is not None else [], "png")
    spec.info = {"toyworld_seed": seed, "task": sample.task}


def _jsonl(cfg: DataConfig, spec: SampleSpec, rng: random.Random, n: int, res: Resources) -> None:
    if not res.jsonl:
        raise ConfigError(f"the jsonl source has no usable conversation in {cfg.jsonl}")
    conv = res.jsonl[n % len(res.jsonl)]
    spec.turns = [conv.prompt, *(q for q, _ in conv.followups)]
    _set_images(spec, list(conv.images), "png")
    spec.info = {"jsonl_line": n % len(res.jsonl), "task": conv.task}


_PLANNERS = {"text": _text, "followup": _followup, "photo": _photo, "toyworld": _toyworld, "jsonl": _jsonl}


def usable_jsonl(convs: list[Conversation]) -> tuple[list[Conversation], int]:
    """(the conversations none of whose user turns is held out, how many were left out)."""
    kept = [c for c in convs if not any(is_heldout(q) for q in [c.prompt, *(q for q, _ in c.followups)])]
    return kept, len(convs) - len(kept)


__all__ = ["SOURCES", "DataConfig", "Resources", "SampleSpec", "plan_shard", "sources_of", "usable_jsonl"]
