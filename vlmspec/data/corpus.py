"""A training corpus on disk: sharded LLaVA-style JSONL plus `manifest.json`, written so that a
kill loses at most the shard in progress, and read back only once checked.

    OUT/manifest.json           {"format", "config", "model", "photos", "shards": [{"file", "lines", "sha256", ...}], "totals"}
    OUT/shard-00000.jsonl       one conversation a line: {"images": [paths relative to OUT], "conversations": [...], ...}
    OUT/images/00000/...        the images of shard 0 (PNG / JPEG)

A shard is written to `shard-NNNNN.jsonl.tmp`, flushed to disk and renamed (atomic on POSIX);
the manifest is rewritten the same way after each shard, so it only ever lists complete shards.
`verify` checks every listed shard against its sha256 and line count and that each line is a
conversation (and, with images=True, every image against the sha256 its record carries);
`checked_shards` is what a reader calls: it raises `CorpusError` naming each bad shard's path,
so a corrupt shard is never used silently.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vlmspec.errors import VlmspecError

MANIFEST = "manifest.json"
FORMAT = "vlmspec-corpus/1"


class CorpusError(VlmspecError, ValueError):
    """A corpus folder that cannot be used as it is; the message names the file and what to do."""


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.jsonl"


def image_folder(index: int) -> str:
    """The folder of shard `index`'s images, relative to the corpus folder."""
    return f"images/{index:05d}"


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    """A file's sha256, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_shard(folder: Path, index: int, records: list[dict[str, Any]]) -> dict[str, Any]:
    """Write shard `index` atomically; returns its manifest entry (file, lines, sha256, bytes)."""
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()
    atomic_write(folder / shard_name(index), data)
    return {"file": shard_name(index), "lines": len(records), "sha256": sha256_bytes(data), "bytes": len(data)}


def read_manifest(folder: Path) -> dict[str, Any] | None:
    """The folder's manifest, None when there is none yet (CorpusError when it cannot be read)."""
    return read_format_manifest(folder / MANIFEST, FORMAT, CorpusError, "generate again")


def read_format_manifest(path: Path, fmt: str, error: type[Exception], redo: str) -> dict[str, Any] | None:
    """A JSON manifest of format `fmt` with a list of shards at `path`, None when there is none yet;
    `error` naming the file (and `redo`: what to do instead) when it cannot be read as one."""
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise error(f"{path}: not valid JSON ({exc}); move the folder aside and {redo}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != fmt or not isinstance(manifest.get("shards"), list):
        raise error(f"{path}: not a {fmt} manifest (its 'format' is {manifest.get('format') if isinstance(manifest, dict) else None!r})")
    return manifest


def write_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    atomic_write(folder / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())


def shard_problem(folder: Path, entry: dict[str, Any], images: bool = False) -> str | None:
    """Why the shard of manifest `entry` cannot be used (None: it can): missing, its sha256 or line
    count not the manifest's, a line that is not a conversation, (images=True) an image missing or changed."""
    path = folder / entry["file"]
    if not path.is_file():
        return "missing"
    data = path.read_bytes()
    if sha256_bytes(data) != entry["sha256"]:
        return f"sha256 {sha256_bytes(data)[:12]}... is not the manifest's {entry['sha256'][:12]}... (changed or truncated)"
    lines = data.decode().splitlines()
    if len(lines) != entry["lines"]:
        return f"{len(lines)} lines, the manifest says {entry['lines']}"
    for n, line in enumerate(lines, 1):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            return f"line {n} is not JSON ({exc})"
        if not isinstance(rec, dict) or not isinstance(rec.get("conversations"), list):
            return f"line {n} has no 'conversations' list"
        if images:
            for rel, digest in zip(rec.get("images") or [], (rec.get("meta") or {}).get("image_sha256") or []):
                file = folder / rel
                if not file.is_file() or sha256_bytes(file.read_bytes()) != digest:
                    return f"line {n}: image {rel} is missing or changed"
    return None


@dataclass
class Verification:
    folder: Path
    good: list[str] = field(default_factory=list)  # shard files that passed
    bad: list[str] = field(default_factory=list)  # "PATH: why"
    stray: list[str] = field(default_factory=list)  # shard or temp files the manifest does not list (a shard in progress)
    lines: int = 0

    @property
    def ok(self) -> bool:
        return not self.bad

    def summary(self) -> str:
        head = f"{self.folder}: {len(self.good)} good shards ({self.lines} conversations), {len(self.bad)} bad"
        extra = [f"  bad: {b}" for b in self.bad] + [f"  not in the manifest (ignored): {s}" for s in self.stray]
        return "\n".join([head, *extra])


def verify(folder: str | Path, images: bool = False) -> Verification:
    """Every shard the manifest lists, checked (`shard_problem`); files it does not list are reported as stray."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    if manifest is None:
        raise CorpusError(f"{folder}: no {MANIFEST} (not a corpus written by `vlmspec data`, or none of its shards completed yet)")
    report = Verification(folder)
    listed = set()
    for entry in manifest["shards"]:
        listed.add(entry["file"])
        problem = shard_problem(folder, entry, images)
        if problem is None:
            report.good.append(entry["file"])
            report.lines += entry["lines"]
        else:
            report.bad.append(f"{folder / entry['file']}: {problem}")
    for p in sorted(folder.glob("shard-*")):
        if p.name not in listed:
            report.stray.append(str(p))
    return report


def checked_shards(folder: str | Path) -> list[Path]:
    """The corpus' shard files, every one checked; CorpusError naming each bad one's path otherwise."""
    report = verify(folder)
    if not report.ok:
        raise CorpusError(f"{len(report.bad)} corrupt shard(s), not used: " + "; ".join(report.bad)
                          + f" (rerun `vlmspec data --out {report.folder}` with the options in its manifest: it writes them again)")
    return [Path(folder) / f for f in report.good]


def folder_digest(folder: str | Path) -> str:
    """sha256 over the sorted (name, sha256) of a model folder's files (what names the model a corpus was written by)."""
    h = hashlib.sha256()
    for p in sorted(Path(folder).iterdir()):
        if p.is_file():
            h.update(f"{p.name}\0{sha256_file(p)}\n".encode())
    return h.hexdigest()


__all__ = ["FORMAT", "folder_digest", "MANIFEST", "CorpusError", "Verification", "checked_shards", "image_folder", "read_manifest", "shard_name",
           "shard_problem", "sha256_bytes", "sha256_file", "atomic_write", "read_format_manifest", "verify", "write_manifest", "write_shard"]
