"""Synthetic data for training / evaluating tiny VLMs (see :mod:`vlmspec.data.toyworld`)."""

from .toyworld import (
    CELL_NAMES,
    CHART_LABELS,
    COLOR_NAMES,
    COLORS,
    IMAGE_SIZE,
    SHAPES,
    SIZES,
    SPLITS,
    TASK_MIX,
    TASKS,
    WORDS,
    Sample,
    description_coverage,
    export_split,
    extract_mentions,
    font_source,
    iter_split,
    load_jsonl,
    make_sample,
    render_scene,
    score,
    to_record,
)
from .processor import (
    CHAT_TEMPLATE,
    PATCH_SIZE,
    SPECIAL_TOKENS,
    build_processor,
    corpus_for_tokenizer,
    llava_config_kwargs,
    train_tokenizer,
)

__all__ = [
    "CELL_NAMES", "CHART_LABELS", "COLOR_NAMES", "COLORS", "IMAGE_SIZE", "SHAPES", "SIZES", "SPLITS",
    "TASK_MIX", "TASKS", "WORDS", "Sample", "description_coverage", "export_split", "extract_mentions",
    "font_source", "iter_split", "load_jsonl", "make_sample", "render_scene", "score", "to_record",
    "CHAT_TEMPLATE", "PATCH_SIZE", "SPECIAL_TOKENS", "build_processor", "corpus_for_tokenizer",
    "llava_config_kwargs", "train_tokenizer",
]
