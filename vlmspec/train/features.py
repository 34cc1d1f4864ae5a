"""The offline feature cache (`vlmspec features`; `vlmspec train --data CACHE` reads it): what a
plain EAGLE-1 or EAGLE-3 head learns from, computed once per conversation by one target forward and
stored on disk, so training runs many epochs without the target.

Per conversation (token t of its T tokens):
    ids [T] int32, answer [T] bool (the labels), feats [T, H'] bf16 (the last hidden state, or
    EAGLE-3's layers concatenated), and at every row whose next token is an answer token (`teach`)
    the teacher's top-k logits, top_ids / top_logits [M, k] int32 / fp16 (renormalised by the loss;
    k = 64 keeps ~all of the mass of a 135M model's answers).

A shard is one safetensors file of `shard_size` conversations end to end (`offsets`, `teach_offsets`
[n+1]), read memory-mapped. `manifest.json` names the corpus, the target (folder digest), the layers,
k and each shard's sha256: a resumed build keeps those shards; training checks each before reading it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save

from vlmspec.data.corpus import atomic_write, folder_digest, read_format_manifest, sha256_file
from vlmspec.target import Target
from vlmspec.train.data import DataError, encode_conversations, load_jsonl
from vlmspec.train.distill_losses import teacher

FORMAT = "vlmspec-features/1"
MANIFEST = "manifest.json"


class FeatureCacheError(DataError):
    """A feature cache that cannot be used as it is; the message names the file and what to do."""


def shard_name(index: int) -> str:
    return f"features-{index:05d}.safetensors"


def is_feature_cache(path: str | Path) -> bool:
    manifest = Path(path) / MANIFEST
    if not manifest.is_file():
        return False
    try:
        return json.loads(manifest.read_text()).get("format") == FORMAT
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        return False


def model_record(target: Target, model: str) -> dict[str, Any]:
    """What names the target a cache was computed with (a folder's digest; a hub id as given)."""
    return {"id": model, "digest": folder_digest(model) if Path(model).is_dir() else "", "dtype": str(target.dtype).replace("torch.", "")}


@dataclass(frozen=True)
class FeatureSpec:
    """What a cache holds: the features a head reads and how much of the teacher's distribution."""

    layers: tuple[int, ...] | None  # None: the last hidden state (EAGLE-1); EAGLE-3: the layers it reads
    top_k: int = 64

    def to_dict(self) -> dict[str, Any]:
        return {"layers": None if self.layers is None else list(self.layers), "top_k": self.top_k}


def _encode_shard(target: Target, convs: list, spec: FeatureSpec, batch_size: int) -> dict[str, torch.Tensor]:
    """One shard's tensors (see the module docstring) from its conversations, `batch_size` per forward."""
    ids, answer, feats, top_ids, top_logits = [], [], [], [], []
    offsets, teach_offsets = [0], [0]
    for i in range(0, len(convs), batch_size):
        batch = encode_conversations(target.processor, convs[i : i + batch_size])
        labels = batch["labels"]
        batch = {k: v.to(target.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        with torch.no_grad():
            f, logits, _ = teacher(target, batch, layers=spec.layers)  # [B, T, H'], [B, T, V]
        for b, length in enumerate(batch["attention_mask"].sum(1).tolist()):  # right-padded
            ans = labels[b, :length] != -100  # [L]
            teach = torch.zeros_like(ans)
            teach[:-1] = ans[1:]  # row t's logits predict token t + 1
            top = logits[b, :length][teach.to(logits.device)].float().topk(min(spec.top_k, logits.shape[-1]), dim=-1)
            ids.append(batch["input_ids"][b, :length].to("cpu", torch.int32))
            answer.append(ans)
            feats.append(f[b, :length].to("cpu", torch.bfloat16))
            top_ids.append(top.indices.to("cpu", torch.int32))
            top_logits.append(top.values.to("cpu", torch.float16))
            offsets.append(offsets[-1] + length)
            teach_offsets.append(teach_offsets[-1] + int(teach.sum()))
    return {"ids": torch.cat(ids), "answer": torch.cat(answer).to(torch.uint8), "feats": torch.cat(feats),
            "top_ids": torch.cat(top_ids), "top_logits": torch.cat(top_logits),
            "offsets": torch.tensor(offsets, dtype=torch.int64), "teach_offsets": torch.tensor(teach_offsets, dtype=torch.int64)}


def build_features(target: Target, model: str, data: str | Path, out: str | Path, spec: FeatureSpec, shard_size: int = 128,
                   batch_size: int = 4, limit: int | None = None, progress: bool = True) -> dict[str, Any]:
    """Compute the cache of `data` (a LLaVA-style JSONL or a `vlmspec data` corpus folder) for
    `target` into `out`; resumable (the manifest's shards are kept when the corpus, target, layers
    and k are the ones it names). Returns the manifest."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    convs, problems = load_jsonl(data)
    convs = convs[:limit] if limit is not None else convs
    if not convs:
        raise FeatureCacheError(f"{data}: no conversations to compute features for")
    source = {"data": str(data), "conversations": len(convs), "skipped_lines": len(problems)}
    head = {"format": FORMAT, "source": source, "model": model_record(target, model), **spec.to_dict(), "shard_size": shard_size}
    manifest = {**head, "shards": []}
    old = read_manifest(out)
    if old is not None:
        if {k: old.get(k) for k in head} != head:
            diff = [k for k in head if old.get(k) != head[k]]
            raise FeatureCacheError(f"{out / MANIFEST}: a cache of other settings ({', '.join(diff)} differ); "
                                    "give another --out, or move this one aside")
        manifest = old
    done = len(manifest["shards"])
    shards = (len(convs) + shard_size - 1) // shard_size
    bar = _bar(shards, done, progress)
    for k in range(done, shards):
        part = convs[k * shard_size : (k + 1) * shard_size]
        tensors = _encode_shard(target, part, spec, batch_size)
        atomic_write(out / shard_name(k), save(tensors))
        manifest["shards"].append({"file": shard_name(k), "samples": len(part), "tokens": int(tensors["offsets"][-1]),
                                   "teach_rows": int(tensors["teach_offsets"][-1]), "sha256": sha256_file(out / shard_name(k))})
        atomic_write(out / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return manifest


def _bar(total: int, done: int, progress: bool) -> Any:
    if not progress:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=done, desc="vlmspec features", unit="shard", dynamic_ncols=True)


def read_manifest(folder: Path) -> dict[str, Any] | None:
    return read_format_manifest(folder / MANIFEST, FORMAT, FeatureCacheError, "build it again")


@dataclass
class CachedSample:
    """One conversation of the cache (views into its memory-mapped shard)."""

    ids: torch.Tensor  # [T] long
    answer: torch.Tensor  # [T] bool
    feats: torch.Tensor  # [T, H'] bf16
    top_ids: torch.Tensor  # [M, k] long: the teacher's top-k at the rows whose next token is an answer token
    top_logits: torch.Tensor  # [M, k]


class FeatureCache:
    """A built cache, every shard checked against the manifest when opened (FeatureCacheError naming
    each corrupt one; none of them is read)."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        manifest = read_manifest(self.folder)
        if manifest is None:
            raise FeatureCacheError(f"{self.folder}: no {MANIFEST} (build it with `vlmspec features --out {self.folder}`)")
        self.manifest = manifest
        bad = []
        for entry in manifest["shards"]:
            path = self.folder / entry["file"]
            if not path.is_file():
                bad.append(f"{path}: missing")
            elif sha256_file(path) != entry["sha256"]:
                bad.append(f"{path}: sha256 is not the manifest's (changed or truncated)")
        if bad:
            raise FeatureCacheError(f"{len(bad)} corrupt feature shard(s), not used: " + "; ".join(bad)
                                    + f" (move them aside and rerun `vlmspec features --out {self.folder}` with the same options)")
        if not manifest["shards"]:
            raise FeatureCacheError(f"{self.folder}: no shard built yet")
        self.layers = None if manifest["layers"] is None else tuple(manifest["layers"])
        self._files = [safe_open(str(self.folder / e["file"]), framework="pt") for e in manifest["shards"]]
        self._index = [(s, j) for s, e in enumerate(manifest["shards"]) for j in range(e["samples"])]
        self._offsets = [(f.get_tensor("offsets").tolist(), f.get_tensor("teach_offsets").tolist()) for f in self._files]

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, i: int) -> CachedSample:
        s, j = self._index[i]
        f, (offsets, teach) = self._files[s], self._offsets[s]
        a, b, c, d = offsets[j], offsets[j + 1], teach[j], teach[j + 1]
        return CachedSample(f.get_slice("ids")[a:b].long(), f.get_slice("answer")[a:b].bool(), f.get_slice("feats")[a:b],
                            f.get_slice("top_ids")[c:d].long(), f.get_slice("top_logits")[c:d])

    def answer_counts(self, n: int, vocab_size: int) -> torch.Tensor:
        """[V] how often each token is an answer token in the first `n` conversations (the trimmed draft vocabulary's counts)."""
        counts = torch.zeros(vocab_size, dtype=torch.long)
        for i in range(min(n, len(self))):
            s = self[i]
            counts += torch.bincount(s.ids[s.answer], minlength=vocab_size)[:vocab_size]
        return counts

    def batches(self, batch_size: int, seed: int, start_step: int) -> Iterator[list[CachedSample]]:
        """Batches of `batch_size` samples from step `start_step` on, epoch after epoch, each epoch
        in its own seeded order (a pure function of seed and step: a resumed run continues exactly)."""
        per_epoch = len(self) // batch_size
        if per_epoch == 0:
            raise FeatureCacheError(f"{self.folder}: {len(self)} conversations, fewer than one batch of {batch_size}")
        step = start_step
        while True:
            epoch, k = divmod(step, per_epoch)
            order = torch.randperm(len(self), generator=torch.Generator().manual_seed(seed * 1000 + epoch)).tolist()
            yield [self[i] for i in order[k * batch_size : (k + 1) * batch_size]]
            step += 1


def collate(samples: list[CachedSample], vocab_size: int, dtype: torch.dtype = torch.float32,
            device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """A batch as the online teacher gives it: input_ids / labels [B, T] (right-padded, -100 outside
    answers), feats [B, T, H'] float32 and logits [B, T, V] (the cached top k at the teach rows, the
    rest at the dtype's lowest value: outside the top k the teacher's probability is 0)."""
    T = max(len(s.ids) for s in samples)
    B, H = len(samples), samples[0].feats.shape[-1]
    ids = torch.zeros(B, T, dtype=torch.long)
    labels = torch.full((B, T), -100, dtype=torch.long)
    feats = torch.zeros(B, T, H, dtype=torch.float32)
    logits = torch.full((B, T, vocab_size), torch.finfo(dtype).min, dtype=dtype)
    for b, s in enumerate(samples):
        L = len(s.ids)
        ids[b, :L] = s.ids
        labels[b, :L] = torch.where(s.answer, s.ids, -100)
        feats[b, :L] = s.feats.float()
        teach = torch.zeros(L, dtype=torch.bool)
        teach[:-1] = s.answer[1:]
        rows = logits[b, :L][teach]  # [M, V] (a copy: written back below)
        rows.scatter_(-1, s.top_ids, s.top_logits.to(dtype))
        logits[b, :L][teach] = rows
    return {"input_ids": ids.to(device), "labels": labels.to(device), "feats": feats.to(device), "logits": logits.to(device)}


__all__ = ["FORMAT", "CachedSample", "FeatureCache", "FeatureCacheError", "FeatureSpec", "build_features", "collate", "is_feature_cache"]
