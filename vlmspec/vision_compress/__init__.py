"""VLM-aware drafting inputs: visual compressors and a gate (SpecVLM), decoupled visual rows
(MSD) and a global image feature (ViSpec), plus the hooks that capture what they read."""

from vlmspec.vision_compress.adaptor import PromptRows, VisualAdaptor, VisualConfig, image_spans
from vlmspec.vision_compress.compressors import FIXED, Gate, build, keep_count, token_grid

__all__ = ["FIXED", "Gate", "PromptRows", "VisualAdaptor", "VisualConfig", "build", "image_spans", "keep_count", "token_grid"]
