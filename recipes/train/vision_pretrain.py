"""Stage 0 of `python -m recipes train-target` (and the probes of `train-align`): supervised pre-training of the vision tower + projector.

Real VLMs start from a pre-trained image encoder (CLIP, SigLIP); trained from scratch together
with the decoder, our small tower never became informative within the CPU budget (measured in
issue #3: held-out loss with shuffled images equal to the loss with the real ones after 40k
samples). ToyWorld knows what every image contains, so the tower is pre-trained directly on that:
probe heads on the *projected* image tokens (the embeddings the decoder will read) predict

  * per image token (one token per 32 px cell): the object in that cell (none, or shape x colour)
    and its size; the word on the sign in that token's row (none if no sign there);
  * per chart (all tokens flattened): each bar slot's label, colour and value.

The heads are thrown away afterwards; only the tower and projector keep what they learned. During
SFT the same loss can be kept on (`SFTConfig.aux_weight`) so the tokens stay informative.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from torch import nn

import toyworld

N_CELLS = toyworld.GRID * toyworld.GRID
N_OBJ = 1 + len(toyworld.SHAPES) * len(toyworld.COLOR_NAMES)  # 0 = empty cell
N_SIZE = 1 + len(toyworld.SIZES)
N_WORD = 1 + len(toyworld.WORDS)
MAX_BARS = 4
N_LABEL = 1 + len(toyworld.CHART_LABELS)
N_COLOR = 1 + len(toyworld.COLOR_NAMES)
N_VALUE = 10  # 0 = no bar in this slot, else the value 1..9


@dataclass
class SceneLabels:
    """Targets for one batch. Shapes: obj/size/word [B, 9]; bar_* [B, MAX_BARS]; is_chart [B]."""

    obj: torch.Tensor
    size: torch.Tensor
    word: torch.Tensor
    bar_label: torch.Tensor
    bar_color: torch.Tensor
    bar_value: torch.Tensor
    is_chart: torch.Tensor


def scene_labels(scenes: list[dict]) -> SceneLabels:
    """ToyWorld scene metas (``Sample.meta["scene"]``) -> per-cell and per-bar class targets."""
    b = len(scenes)
    obj = torch.zeros(b, N_CELLS, dtype=torch.long)
    size = torch.zeros(b, N_CELLS, dtype=torch.long)
    word = torch.zeros(b, N_CELLS, dtype=torch.long)
    bl = torch.zeros(b, MAX_BARS, dtype=torch.long)
    bc = torch.zeros(b, MAX_BARS, dtype=torch.long)
    bv = torch.zeros(b, MAX_BARS, dtype=torch.long)
    is_chart = torch.zeros(b, dtype=torch.bool)
    n_col = len(toyworld.COLOR_NAMES)
    for i, sc in enumerate(scenes):
        if sc["kind"] == "chart":
            is_chart[i] = True
            for j, bar in enumerate(sc["bars"]):
                bl[i, j] = 1 + toyworld.CHART_LABELS.index(bar["label"])
                bc[i, j] = 1 + toyworld.COLOR_NAMES.index(bar["color"])
                bv[i, j] = bar["value"]
            continue
        for o in sc["objects"]:
            cell = o["row"] * toyworld.GRID + o["col"]
            obj[i, cell] = 1 + toyworld.SHAPES.index(o["shape"]) * n_col + toyworld.COLOR_NAMES.index(o["color"])
            size[i, cell] = 1 + toyworld.SIZES.index(o["size"])
        sign = sc.get("sign")
        if sign:
            r = sign["row"]
            word[i, r * toyworld.GRID : (r + 1) * toyworld.GRID] = 1 + toyworld.WORDS.index(sign["word"])
    return SceneLabels(obj, size, word, bl, bc, bv, is_chart)


def pool_cells(tokens: torch.Tensor) -> torch.Tensor:
    """Image tokens [B, g*g, H] (a g x g map, g a multiple of 3) -> their averages over ToyWorld's
    3x3 cells, [B, 9, H]."""
    b, n, h = tokens.shape
    g, cells = int(round(n ** 0.5)), toyworld.GRID
    assert g * g == n and g % cells == 0, f"{n} image tokens do not pool onto a {cells}x{cells} grid"
    pooled = nn.functional.avg_pool2d(tokens.transpose(1, 2).reshape(b, h, g, g), g // cells)  # [B, H, 3, 3]
    return pooled.flatten(2).transpose(1, 2)


def token_cells(n: int) -> torch.Tensor:
    """For a g x g token map (n = g*g, g a multiple of 3): each token's ToyWorld cell, [n] (row-major)."""
    g, cells = int(round(n ** 0.5)), toyworld.GRID
    assert g * g == n and g % cells == 0, f"{n} image tokens do not map onto a {cells}x{cells} grid"
    rows = torch.arange(g) // (g // cells)
    return (rows[:, None] * cells + rows[None, :]).flatten()


class SceneProbe(nn.Module):
    """Linear probes over projected image tokens, one per ToyWorld cell [B, 9, H] (training only,
    never exported): each cell's object, size and sign word; the chart head reads all nine."""

    def __init__(self, hidden: int):
        super().__init__()
        self.obj = nn.Linear(hidden, N_OBJ)
        self.size = nn.Linear(hidden, N_SIZE)
        self.word = nn.Linear(hidden, N_WORD)
        self.bars = nn.Linear(hidden * N_CELLS, MAX_BARS * (N_LABEL + N_COLOR + N_VALUE))

    def forward(self, feats: torch.Tensor, y: SceneLabels) -> tuple[torch.Tensor, dict[str, float]]:
        """feats: [B, 9, H]. Returns (loss, accuracies)."""
        ce = nn.functional.cross_entropy
        assert feats.shape[1] == N_CELLS, f"the scene probe reads one token per cell, got {feats.shape[1]} (pool_cells)"
        objects = ~y.is_chart
        losses, acc = [], {}
        if objects.any():
            f = feats[objects]
            for name, head, tgt in (("obj", self.obj, y.obj), ("size", self.size, y.size), ("word", self.word, y.word)):
                t = tgt[objects]  # [b, 9]
                logits = head(f)  # [b, 9, C]
                losses.append(ce(logits.flatten(0, 1), t.flatten()))
                acc[name] = float((logits.argmax(-1) == t).float().mean())
        if y.is_chart.any():
            logits = self.bars(feats[y.is_chart].flatten(1)).view(-1, MAX_BARS, N_LABEL + N_COLOR + N_VALUE)
            parts = logits.split((N_LABEL, N_COLOR, N_VALUE), dim=-1)
            for name, lg, tgt in zip(("bar_label", "bar_color", "bar_value"), parts, (y.bar_label, y.bar_color, y.bar_value)):
                t = tgt[y.is_chart]
                losses.append(ce(lg.flatten(0, 1), t.flatten()))
                acc[name] = float((lg.argmax(-1) == t).float().mean())
        return torch.stack(losses).mean(), acc


# the word groups of `WordProbe`: (name, words, read per token (True) or per cell pooled (False),
# the text before the word as answers write it: " red star", 'The sign says "SHIP".')
WORD_GROUPS = (
    ("row", toyworld.ROWS, True, " "),
    ("col", toyworld.COLS, True, " "),
    ("color", toyworld.COLOR_NAMES, False, " "),
    ("shape", toyworld.SHAPES, False, " "),
    ("size", toyworld.SIZES, False, " "),
)
SIGN_GROUP = ("sign", toyworld.WORDS, False, "")  # the sign's word in the cells of its row
POOLED = ("color", "shape", "size", "sign")  # the cell groups, in the order of `WordProbe.none`


def word_vectors(embeddings: torch.Tensor, tokenizer, words: tuple[str, ...], prefix: str = " ") -> torch.Tensor:
    """The language model's input embedding of each word as answers write it (after `prefix`: a
    space inside a sentence, nothing after a quote; a word of several pieces averaged), [len(words), H]."""
    rows = []
    for w in words:
        ids = tokenizer(prefix + w, add_special_tokens=False)["input_ids"]
        assert ids, f"the tokenizer gives no tokens for {w!r}"
        rows.append(embeddings[ids].float().mean(0))
    return torch.stack(rows)


class WordProbe(nn.Module):
    """Probes whose class vectors are the language model's own (frozen) word embeddings (training
    only). Every image token is asked for its row word (top / middle / bottom) and column word
    (left / center / right); every cell (its tokens pooled) for its object's colour, shape and size
    word, or none (a learned vector). Logits are ``scale * x . E[word] + bias``: the only way to win
    is to move the tokens along the directions in which the language model already tells "red"
    from "blue" and "top" from "bottom", so it reads the image tokens partly as the words it knows
    (a learned linear head can be satisfied by any direction). The sign's word too, in the cells
    of its row, against the embeddings of the word as the answer quotes it."""

    def __init__(self, vectors: dict[str, torch.Tensor]):
        """vectors: group name -> [C, H] word embeddings, for each group of `WORD_GROUPS` and `SIGN_GROUP`."""
        super().__init__()
        self.groups = WORD_GROUPS + (SIGN_GROUP,)
        hidden = next(iter(vectors.values())).shape[1]
        for name, words, per_token, _ in self.groups:
            assert vectors[name].shape == (len(words), hidden), f"{name}: {tuple(vectors[name].shape)}"
            self.register_buffer(f"w_{name}", vectors[name].float().clone(), persistent=False)
            self.register_parameter(f"b_{name}", nn.Parameter(torch.zeros(len(words) + (0 if per_token else 1))))
        self.none = nn.Parameter(torch.zeros(len(POOLED), hidden))  # the "none" class of each cell group
        rms = float(torch.cat([vectors[name] for name, *_ in self.groups]).pow(2).mean().sqrt())  # of the groups read
        self.scale = nn.Parameter(torch.tensor(1.0 / (rms * rms * hidden) ** 0.5))  # logits of order 1 at the start

    def classes(self, name: str) -> torch.Tensor:
        """[C, H] (per-token groups) or [1 + C, H] with the none vector first (cell groups)."""
        w = getattr(self, f"w_{name}")
        if name not in POOLED:
            return w
        return torch.cat([self.none[POOLED.index(name)][None], w])

    def forward(self, tokens: torch.Tensor, y: SceneLabels) -> tuple[torch.Tensor, dict[str, float]]:
        """tokens: the projector's [B, g*g, H] (object scenes and charts alike; charts count as
        empty cells). Returns (mean cross-entropy over the groups, accuracies by group)."""
        cells = token_cells(tokens.shape[1])  # [g*g]
        n_col = len(toyworld.COLOR_NAMES)
        obj = y.obj  # [B, 9], 0 for empty cells and charts (`scene_labels`)
        targets = {
            "row": (cells // toyworld.GRID).expand(tokens.shape[0], -1),  # [B, g*g]
            "col": (cells % toyworld.GRID).expand(tokens.shape[0], -1),
            "color": torch.where(obj > 0, (obj - 1) % n_col + 1, 0),  # [B, 9], 0 = none
            "shape": torch.where(obj > 0, (obj - 1) // n_col + 1, 0),
            "size": torch.where(obj > 0, y.size, 0),
            "sign": y.word,  # [B, 9], 0 = no sign in the cell's row
        }
        pooled = pool_cells(tokens)  # [B, 9, H]
        losses, acc = [], {}
        for name, _, per_token, _ in self.groups:
            x = tokens if per_token else pooled
            logits = self.scale * (x @ self.classes(name).T) + getattr(self, f"b_{name}")  # [B, N, C]
            t = targets[name]
            losses.append(nn.functional.cross_entropy(logits.flatten(0, 1), t.flatten()))
            acc[f"w_{name}"] = float((logits.argmax(-1) == t).float().mean())
        return torch.stack(losses).mean(), acc

    @torch.no_grad()
    def rescale(self, factor: float) -> None:
        """The tokens were multiplied by `factor`: keep every logit (the none vectors are in the
        tokens' space, so the one scale covers them)."""
        self.scale.div_(factor)


def image_tokens(model: nn.Module, pixel_values: torch.Tensor) -> torch.Tensor:
    """pixel_values [B, 3, H, W] -> the projected image tokens the decoder reads, [B, n_img, hidden]."""
    return model.model.get_image_features(pixel_values=pixel_values).pooler_output


def pretrain_scenes(seed: int, n: int, chart_frac: float = 0.25, sign_frac: float = 0.4) -> list[dict]:
    """`n` random ToyWorld scenes (objects with or without a sign, or charts) from one seed."""
    rng = random.Random(seed)
    return [toyworld.random_scene(rng, chart_frac, sign_frac) for _ in range(n)]


def pretrain_batch(step: int, batch_size: int, seed: int, processor) -> tuple[torch.Tensor, SceneLabels]:
    """Batch `step` of stage 0: a pure function of the step (train-split seed range)."""
    base = toyworld.SPLITS["train"][0] + 9 * 10**8 + seed * 10**6  # a train-range block of its own
    scenes = pretrain_scenes(base + step, batch_size)
    images = [toyworld.render_scene(sc) for sc in scenes]
    pixels = processor.image_processor(images, return_tensors="pt")["pixel_values"]
    return pixels, scene_labels(scenes)
