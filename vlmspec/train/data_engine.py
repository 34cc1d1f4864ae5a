"""`vlmspec data`: a drafter-training corpus whose answers the target writes itself, through the
batched engine (plain rows, `cfg.slots` at once), resumable shard by shard.

    for each shard k not yet complete (vlmspec.train.data_plan.plan_shard: a pure function of the config and k):
        every sample's rows through one Batch (`run_samples`), each row joining as soon as a slot is free:
          a Magpie sample: the target writes its user turn (sampled, its own seed; retried, then templated)
          then each user turn in order: the dialogue so far through the chat template -> one row -> the answer
          (a follow-up turn is asked after a cut answer too, as a user would; `meta.ended` says which were cut)
        images saved under images/k/, the shard written atomically, the manifest rewritten (vlmspec.data.corpus)

Each row carries its own sampling parameters and seed (`GenerationConfig.seed`) and its tokens do not
depend on the rest of its batch: a shard is the same alone, resumed, or with other slots. A shard listed
in the manifest with its sha256 intact is kept; one that fails the check is reported and written again.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from vlmspec.data import corpus
from vlmspec.data.prompts import prompt_key
from vlmspec.engine import GenerationConfig, GenerationResult, SpecEngine
from vlmspec.errors import ConfigError
from vlmspec.inputs import encode_messages, model_inputs, user_turn
from vlmspec.sampling import SamplingParams
from vlmspec.text import decode
from vlmspec.train.data import messages
from vlmspec.train.data_plan import DataConfig, Resources, SampleSpec, plan_shard
from vlmspec.train.magpie import usable_instruction, user_turn_opening

MAGPIE_SAMPLING = SamplingParams(1.0, 0, 0.95)  # Magpie's user turns: temperature 1, nucleus 0.95


@dataclass
class Turn:
    answer: str
    ended: bool  # the answer ended with the end-of-turn token
    prompt_tokens: int
    answer_tokens: int


@dataclass
class _Sample:
    spec: SampleSpec
    turns: list[str | None] = field(default_factory=list)  # the user turns as sent (None: not written yet)
    done: list[Turn] = field(default_factory=list)
    prompt_origin: str = "given"  # given | magpie | template
    attempts: int = 0  # Magpie tries so far

    def next_row(self) -> tuple[str, int] | None:
        """("prompt", attempt) while the target still writes the first user turn, then ("answer", t)
        for the next turn to answer; None when the dialogue is over (every turn answered, or an empty answer)."""
        if self.turns and self.turns[0] is None:
            return "prompt", self.attempts
        t = len(self.done)
        if t >= len(self.turns) or (t and not self.done[-1].answer.strip()):
            return None
        return "answer", t


@dataclass
class RunStats:
    samples: int = 0
    rows: int = 0
    answer_tokens: int = 0
    prompt_tokens: int = 0
    written_tokens: int = 0  # tokens of the user turns the target wrote (Magpie rows)
    failed: int = 0  # rows whose prefill raised (their sample ends there)
    seconds: float = 0.0


def _answer_text(tokenizer: Any, result: GenerationResult) -> Turn:
    ended = result.finish_reason == "stop"
    text = decode(tokenizer, result.token_ids)
    text = text.strip() if ended else text.rstrip("\ufffd").lstrip()  # a cut answer keeps its last space
    return Turn(text, ended, result.prompt_tokens, len(result.token_ids))


def _prompt_row(engine: SpecEngine, cfg: DataConfig, s: _Sample, opening: str) -> tuple[dict[str, torch.Tensor], GenerationConfig]:
    """The chat template's opening of a user turn + the sample's start: the target writes the rest (Magpie)."""
    enc = engine.target.tokenizer(opening + s.spec.magpie_start, return_tensors="pt", add_special_tokens=False)
    inputs = model_inputs(engine.target, {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})
    return inputs, GenerationConfig(cfg.magpie_tokens, MAGPIE_SAMPLING, seed=s.spec.seed * 7 + s.attempts)


def _answer_row(engine: SpecEngine, cfg: DataConfig, s: _Sample, t: int) -> tuple[dict[str, torch.Tensor], GenerationConfig]:
    """The dialogue up to user turn t as model inputs, and this row's generation config."""
    n_images = len(s.spec.images)
    if t == 0:
        msgs = user_turn(s.turns[0], n_images)
    else:
        prior = [(q, d.answer) for q, d in zip(s.turns[1:t], s.done[1:t])]
        msgs = messages(s.turns[0], n_images, s.done[0].answer, prior) + user_turn(s.turns[t], 0)
    inputs = encode_messages(engine.target, msgs, s.spec.images)
    return inputs, GenerationConfig(cfg.max_new_tokens, s.spec.sampling, seed=s.spec.seed + 1000 * t)


def _took_prompt(cfg: DataConfig, s: _Sample, text: str, ended: bool, seen: set[str]) -> None:
    """A written user turn kept (ended, usable, not one of the shard's given turns), else tried again;
    after `magpie_attempts` tries the sample's templated instruction."""
    s.attempts += 1
    if ended and usable_instruction(text, seen):
        s.turns[0], s.prompt_origin = text, "magpie"
    elif s.attempts >= cfg.magpie_attempts:
        s.turns[0], s.prompt_origin = s.spec.fallback, "template"


class Progress:
    """The run's progress bar (tqdm, on stderr): samples done of the total, rate and ETA, and the
    answer tokens per second of this run; no bar when progress is off."""

    def __init__(self, total: int, initial: int, show: bool) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, initial=initial, unit="sample", desc="vlmspec data", dynamic_ncols=True, file=sys.stderr,
                        smoothing=0.1) if show else None
        self.tokens, self.t0 = 0, time.perf_counter()

    def tick(self, tokens: int, sample_done: bool) -> None:
        self.tokens += tokens
        if self.bar is not None and sample_done:
            self.bar.set_postfix_str(f"{self.tokens / max(time.perf_counter() - self.t0, 1e-9):.0f} tok/s", refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _row_failed(s: _Sample, failure: Exception, prompt_tokens: int, stats: RunStats, progress: Progress | None) -> None:
    """A row the engine failed for alone: its sample ends there (an empty turn; `record` keeps the
    turns before it, or drops the sample), said on stderr and counted, and the run goes on."""
    stats.failed += 1
    print(f"vlmspec data: sample {s.spec.index} ({s.spec.source}) left at turn {len(s.done)}: "
          f"{failure.__class__.__name__}: {failure}", file=sys.stderr)
    if s.turns[0] is None:
        s.turns[0] = s.spec.fallback
    s.done.append(Turn("", False, prompt_tokens, 0))
    stats.samples += 1
    if progress is not None:
        progress.tick(0, True)


def run_samples(engine: SpecEngine, cfg: DataConfig, samples: list[_Sample], stats: RunStats, progress: Progress | None = None) -> None:
    """Every row of every sample through ONE `Batch` of `cfg.slots`: a row joins as soon as a slot is
    free, and a sample's next row (its answer after its written prompt, its next follow-up turn)
    joins as soon as the row before it finished, so no round waits for the slowest row of another.
    Each row's tokens depend on its own inputs, sampling and seed only, not on when it ran."""
    tokenizer = engine.target.tokenizer
    opening = user_turn_opening(tokenizer) if getattr(tokenizer, "chat_template", None) else None
    seen = {prompt_key(q) for s in samples for q in s.spec.turns if q}
    for s in samples:
        if s.turns and s.turns[0] is None and (opening is None or cfg.magpie_attempts == 0):
            s.turns[0], s.prompt_origin = s.spec.fallback, "template"
    batch = engine.batch(cfg.slots)
    queue = deque(samples)  # samples whose next row may be submitted
    running: dict[int, tuple[_Sample, str, Any]] = {}
    while queue or not batch.idle:
        while queue and len(batch.waiting) + len(batch.requests) < cfg.slots:  # inputs built only for rows a free slot waits for
            s = queue.popleft()
            nxt = s.next_row()
            if nxt is None:
                continue
            kind, t = nxt
            inputs, config = _prompt_row(engine, cfg, s, opening) if kind == "prompt" else _answer_row(engine, cfg, s, t)
            ticket = batch.submit(inputs, config)
            running[id(ticket)] = (s, kind, ticket)
        batch.step()
        for key, (s, kind, ticket) in list(running.items()):
            failure = ticket.error if ticket.error is not None else (
                ticket.request.failure.error if ticket.request is not None and ticket.request.failure is not None else None)
            if failure is not None:  # its prefill or a step failed for it alone (e.g. a prompt over the context)
                del running[key]
                _row_failed(s, failure, ticket.prompt_tokens, stats, progress)
                continue
            if ticket.result is None:
                continue
            del running[key]
            r = ticket.result
            stats.rows += 1
            if kind == "prompt":
                stats.written_tokens += len(r.token_ids)
                _took_prompt(cfg, s, (s.spec.magpie_start + decode(tokenizer, r.token_ids)).strip(), r.finish_reason == "stop", seen)
            else:
                s.done.append(_answer_text(tokenizer, r))
                stats.answer_tokens += len(r.token_ids)
                stats.prompt_tokens += r.prompt_tokens
            over = s.next_row() is None
            stats.samples += over
            if progress is not None:
                progress.tick(len(r.token_ids) if kind == "answer" else 0, over)
            if not over:
                queue.appendleft(s)  # a started dialogue goes on first: its shard finishes sooner


def _save_image(folder: Path, rel: str, data: bytes) -> str:
    path = folder / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return corpus.sha256_bytes(data)


def record(folder: Path, k: int, j: int, s: _Sample) -> dict[str, Any] | None:
    """The sample as one JSONL line (None: its first answer is empty); its images saved beside."""
    turns = [(q, d) for q, d in zip(s.turns, s.done) if d.answer.strip()]
    if not turns or not s.done[0].answer.strip():
        return None
    rels, shas = [], []
    for m, data in enumerate(s.spec.files):
        rel = f"{corpus.image_folder(k)}/{j:04d}-{m}.{s.spec.image_ext}"
        shas.append(_save_image(folder, rel, data))
        rels.append(rel)
    convs = []
    for t, (q, d) in enumerate(turns):
        convs.append({"from": "human", "value": ("<image>\n" * len(rels) if t == 0 else "") + q})
        convs.append({"from": "gpt", "value": d.answer})
    sp = s.spec.sampling
    meta = {"sampling": {"temperature": sp.temperature, "top_p": sp.top_p}, "seed": s.spec.seed, "prompt_origin": s.prompt_origin,
            "ended": [d.ended for _, d in turns], "prompt_tokens": [d.prompt_tokens for _, d in turns],
            "answer_tokens": [d.answer_tokens for _, d in turns], "image_sha256": shas, **s.spec.info}
    return {"id": f"{s.spec.index:07d}", "source": s.spec.source, "task": s.spec.source, "images": rels, "conversations": convs,
            "open_end": not turns[-1][1].ended, "meta": meta}


def generate_shard(engine: SpecEngine, cfg: DataConfig, folder: Path, k: int, res: Resources,
                   progress: Progress | None = None) -> dict[str, Any]:
    """Shard k planned, answered, written; returns its manifest entry."""
    t0 = time.perf_counter()
    stats = RunStats()
    samples = [_Sample(spec, list(spec.turns)) for spec in plan_shard(cfg, k, res)]
    run_samples(engine, cfg, samples, stats, progress)
    records = [r for j, s in enumerate(samples) if (r := record(folder, k, j, s)) is not None]
    entry = corpus.write_shard(folder, k, records)
    by_source: dict[str, int] = {}
    for r in records:
        by_source[r["source"]] = by_source.get(r["source"], 0) + 1
    entry.update(planned=len(samples), dropped_empty=len(samples) - len(records), by_source=by_source, rows=stats.rows,
                 answer_tokens=stats.answer_tokens, prompt_tokens=stats.prompt_tokens, written_tokens=stats.written_tokens,
                 failed_rows=stats.failed, seconds=round(time.perf_counter() - t0, 3))
    return entry


@dataclass
class CorpusRun:
    """What a call of `generate_corpus` did."""

    folder: Path
    kept: int = 0  # shards found complete and kept
    written: int = 0  # shards generated by this call
    rewritten: list[str] = field(default_factory=list)  # "PATH: why" of shards that failed their check and were generated again
    samples: int = 0  # samples generated by this call
    answer_tokens: int = 0
    seconds: float = 0.0

    @property
    def samples_per_min(self) -> float:
        return 60 * self.samples / self.seconds if self.seconds else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.answer_tokens / self.seconds if self.seconds else 0.0


def _start_manifest(folder: Path, cfg: DataConfig, model: dict[str, Any], photos: list[dict[str, Any]]) -> dict[str, Any]:
    """The folder's manifest checked against this run's plan (same plan, model and photographs), or a new one."""
    manifest = corpus.read_manifest(folder)
    new = {"format": corpus.FORMAT, "config": cfg.to_json(), "model": model, "photos": photos, "shards": [], "totals": {}}
    if manifest is None:
        return new
    old_key = {k: v for k, v in manifest["config"].items() if k not in ("samples", "slots")}
    for what, old, now in (("options", old_key, cfg.plan_key()), ("model", manifest["model"], model), ("photographs", manifest["photos"], photos)):
        if old != now:
            differ = sorted(k for k in set(old) | set(now) if old.get(k) != now.get(k)) if isinstance(old, dict) else [f"{old} vs now {now}"]
            raise ConfigError(f"{folder} holds a corpus made with other {what} ({', '.join(map(str, differ))} differ; see its "
                              f"{corpus.MANIFEST}): pass the same options to resume it, or give another --out")
    return {**new, "shards": manifest["shards"]}


def _totals(shards: list[dict[str, Any]]) -> dict[str, Any]:
    by_source: dict[str, int] = {}
    for e in shards:
        for s, n in e["by_source"].items():
            by_source[s] = by_source.get(s, 0) + n
    keys = ("lines", "planned", "dropped_empty", "rows", "answer_tokens", "prompt_tokens", "written_tokens", "failed_rows", "seconds")
    return {"shards": len(shards), **{k: round(sum(e.get(k, 0) for e in shards), 3) for k in keys}, "by_source": by_source}


def _write_manifest(folder: Path, manifest: dict[str, Any], shards: dict[int, dict[str, Any]]) -> None:
    listed = [shards[k] for k in sorted(shards)]
    corpus.write_manifest(folder, {**manifest, "shards": listed, "totals": _totals(listed)})


def _kept_shards(folder: Path, cfg: DataConfig, manifest: dict[str, Any], run: "CorpusRun") -> tuple[dict[int, Any], dict[int, Any]]:
    """(the manifest's shards this run keeps: complete, intact, planned as now; those past this run's
    end, left as they are). A shard that fails its check is reported (stderr, `run.rewritten`) and not kept."""
    kept: dict[int, dict[str, Any]] = {}
    beyond: dict[int, dict[str, Any]] = {}
    for entry in manifest["shards"]:
        k = int(entry["file"][len("shard-"):-len(".jsonl")])
        if k >= cfg.shards:
            beyond[k] = entry
            continue
        if entry.get("planned") != cfg.shard_samples(k):
            continue  # a last shard that is now longer: generated again
        problem = corpus.shard_problem(folder, entry)
        if problem is None:
            kept[k] = entry
        else:
            run.rewritten.append(f"{folder / entry['file']}: {problem}")
            print(f"vlmspec data: {folder / entry['file']} is corrupt ({problem}); generating it again", file=sys.stderr)
    return kept, beyond


def generate_corpus(engine: SpecEngine, cfg: DataConfig, out: str | Path, res: Resources, model: dict[str, Any],
                    progress: bool = True, on_shard: Callable[[int], None] | None = None) -> CorpusRun:
    """Every shard of `cfg` in `out` that is not already there intact (see the module's docstring).
    `model`: what the manifest says of the target (id, digest, dtype); `on_shard(k)` after shard k is committed."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    manifest = _start_manifest(folder, cfg, model, [p.record() for p in res.photos])
    run = CorpusRun(folder)
    kept, beyond = _kept_shards(folder, cfg, manifest, run)
    run.kept = len(kept)
    done_before = sum(cfg.shard_samples(k) for k in kept)
    bar = Progress(cfg.samples, done_before, progress)
    t0 = time.perf_counter()
    try:
        for k in range(cfg.shards):
            if k in kept:
                continue
            entry = generate_shard(engine, cfg, folder, k, res, bar)
            kept[k] = entry
            run.written += 1
            run.samples += entry["planned"]
            run.answer_tokens += entry["answer_tokens"]
            _write_manifest(folder, manifest, {**beyond, **kept})
            if on_shard is not None:
                on_shard(k)
    finally:
        bar.close()
        run.seconds = time.perf_counter() - t0
    _write_manifest(folder, manifest, {**beyond, **kept})
    return run


__all__ = ["CorpusRun", "RunStats", "generate_corpus", "generate_shard", "run_samples"]
