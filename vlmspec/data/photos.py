"""Real photographs for training data, taken from pip packages that ship them, and their seeded
augmentation (crop, flip, scale, colour).

The held-out photographs stay out: the sample photographs of scikit-image, matplotlib, scikit-learn
and scipy (`assets/images/` ships five of them; the evaluation sets read those) are in no catalogue
entry, and `heldout_photo_hashes` lets a caller refuse any image whose bytes are one of
`assets/images/`'s files. `CATALOGUE` names each photograph by package, path inside it and sha256:
a file whose bytes differ (another release) is not used. A package that is not installed
contributes nothing (`available_photos` says which). Licences: the packages' own (docs/data.md).

    photos, missing = available_photos()          # [Photo], ["imgaug (pip install ...)", ...]
    image, params = augment(photo.image(), random.Random(7))   # a new RGB image, the ops applied
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import random
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageEnhance, ImageOps

from vlmspec.assets import SAMPLE_IMAGES


@dataclass(frozen=True)
class PhotoSource:
    package: str  # the distribution and its import name
    path: str  # inside the installed package's folder
    sha256: str  # of the file's bytes
    licence: str  # the package's licence (no separate one is stated for the image)
    what: str
    install: str  # how to get it


_GRADIO = "pip install 'vlmspec[data]' (gradio ships these; it is also in the serve extra)"
_MAHOTAS = "pip install 'vlmspec[data]'"
_IMGAUG = "pip install --no-deps imgaug==0.4.0 (its dependencies are not needed to read the file)"
CATALOGUE = (
    PhotoSource("gradio", "media_assets/images/cheetah.jpg", "29b0090f5ec471dad0264abc20ecc3c80a0133a63a03d11df920e39a093fe6c8",
                "Apache-2.0", "a cheetah running across a plain", _GRADIO),
    PhotoSource("gradio", "media_assets/images/cheetah1.jpg", "35550bfbba996e59c242af00f6a14a9c0d055dfbc52ad069a1a4e8c1c39ca095",
                "Apache-2.0", "a cheetah's face", _GRADIO),
    PhotoSource("gradio", "test_data/cheetah2.jpg", "6882e714aa43d60a429f704a5ddd3af4b3708f89701b3bcc9626121349853795",
                "Apache-2.0", "a cheetah cub on a white background", _GRADIO),
    PhotoSource("gradio", "media_assets/images/lion.jpg", "4c45ece00075f152cb2e6cfd5f1dfd7dc8e83042264685b4f470026240eff3ef",
                "Apache-2.0", "a lion lying on a rock", _GRADIO),
    PhotoSource("gradio", "media_assets/images/tower.jpg", "f57f96f7a71f89739d27ae8ffc09f73cd2f17415d16c94d42dcb0d571f4eb0ee",
                "Apache-2.0", "the Eiffel Tower lit at dusk", _GRADIO),
    PhotoSource("mahotas", "demos/data/luispedro.jpg", "27e7af47501a4e9a06e4d8bd8b834bd773fe7b187baef2f47e120c663524bed1",
                "MIT", "a portrait of mahotas' author", _MAHOTAS),
    PhotoSource("imgaug", "quokka.jpg", "bf1059d0f925e7d0c712cadf07a04ba4cfc98957d7be65d3a7d8ae0c464cd76e",
                "MIT", "a quokka on a path", _IMGAUG),
)


@dataclass(frozen=True)
class Photo:
    source: PhotoSource
    file: Path
    version: str  # the installed package's version

    @property
    def name(self) -> str:
        return f"{self.source.package}/{self.source.path}"

    def image(self) -> Image.Image:
        with Image.open(self.file) as im:
            return im.convert("RGB")

    def record(self) -> dict[str, str]:
        """What a manifest says about it."""
        return {"package": self.source.package, "version": self.version, "file": self.source.path, "sha256": self.source.sha256,
                "licence": self.source.licence, "what": self.source.what}


def _package_dir(package: str) -> Path | None:
    """The installed package's folder, found without importing it (None: not installed)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def available_photos(catalogue: tuple[PhotoSource, ...] = CATALOGUE) -> tuple[list[Photo], list[str]]:
    """(the catalogue's photographs found installed with their listed bytes, a line per one left out and why)."""
    found, missing = [], []
    held = heldout_photo_hashes()
    for src in catalogue:
        folder = _package_dir(src.package)
        if folder is None:
            missing.append(f"{src.package}/{src.path}: {src.package} is not installed ({src.install})")
            continue
        file = folder / src.path
        if not file.is_file():
            missing.append(f"{src.package}/{src.path}: not in the installed {src.package}")
        elif sha256_file(file) != src.sha256:
            missing.append(f"{src.package}/{src.path}: its bytes differ from the catalogue's (another release of {src.package})")
        elif src.sha256 in held:
            missing.append(f"{src.package}/{src.path}: a held-out photograph")
        else:
            found.append(Photo(src, file, importlib.metadata.version(src.package)))
    return found, missing


def heldout_photo_hashes(folder: Path = SAMPLE_IMAGES) -> frozenset[str]:
    """sha256 of every image file in `assets/images/` (the evaluation's photographs and renders)."""
    return frozenset(sha256_file(p) for p in sorted(folder.glob("*")) if p.suffix.lower() in (".jpg", ".jpeg", ".png"))


def augment(image: Image.Image, rng: random.Random, max_side: int = 384) -> tuple[Image.Image, dict]:
    """A seeded variant of `image`: a crop keeping 55-100% of each side, a mirror half the time, a
    scale to 45-100% of at most `max_side` px on the long side, brightness / contrast / saturation
    each times 0.7-1.3. Returns (RGB image, the parameters drawn)."""
    w, h = image.size
    fw, fh = rng.uniform(0.55, 1.0), rng.uniform(0.55, 1.0)
    cw, ch = max(16, round(w * fw)), max(16, round(h * fh))
    x0, y0 = rng.randint(0, w - cw), rng.randint(0, h - ch)
    out = image.crop((x0, y0, x0 + cw, y0 + ch))
    flip = rng.random() < 0.5
    if flip:
        out = ImageOps.mirror(out)
    scale = rng.uniform(0.45, 1.0) * min(1.0, max_side / max(cw, ch))
    size = (max(16, round(cw * scale)), max(16, round(ch * scale)))
    out = out.resize(size, Image.Resampling.BICUBIC)
    jitter = {k: round(rng.uniform(0.7, 1.3), 3) for k in ("brightness", "contrast", "saturation")}
    out = ImageEnhance.Brightness(out).enhance(jitter["brightness"])
    out = ImageEnhance.Contrast(out).enhance(jitter["contrast"])
    out = ImageEnhance.Color(out).enhance(jitter["saturation"])
    params = {"crop": [x0, y0, cw, ch], "flip": flip, "size": list(size), **jitter}
    return out.convert("RGB"), params


__all__ = ["CATALOGUE", "Photo", "PhotoSource", "augment", "available_photos", "heldout_photo_hashes", "sha256_file"]
