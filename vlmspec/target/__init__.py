"""The target VLM: the adapter (prefill / tree forward / commit), its loader and its attention choice."""

from vlmspec.errors import ContextLengthError, TargetLoadError
from vlmspec.target.attention import ATTENTION_MODES, set_attention
from vlmspec.target.loading import hub_reachable, load_target
from vlmspec.target.model import ForwardOut, Target, TargetState
from vlmspec.target.sdpa import decoding_sdpa

__all__ = ["ATTENTION_MODES", "ContextLengthError", "ForwardOut", "Target", "TargetLoadError", "TargetState", "hub_reachable",
           "decoding_sdpa", "load_target", "set_attention"]
