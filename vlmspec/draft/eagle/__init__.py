"""EAGLE-style draft head with a dynamic EAGLE-2 tree (docs/drafters.md, docs/eagle3.md).

The head reads pairs (target feature at position i, token at position i+1):

    x_i  = fc(concat(norm(embed(token_{i+1})), norm(feature_i)))     # [*, 2H] -> [*, H]
    h_i  = LlamaDecoderLayer(x_i)                                   # one HF decoder layer, own KV cache
    p(token_{i+2}) = softmax(lm_head(h_i))                          # the target's frozen LM head

h_i is trained to predict the target's feature at position i+1, so drafting feeds it back. EAGLE-3 (`Eagle3Head`) fuses
three target layers and has its own LM head over a trimmed vocabulary; SpecDec++'s `AcceptanceHead` stops deepening a
tree whose predicted path acceptance falls under `stop_threshold` (lossless: it only shapes the tree). A checkpoint:
`config.json` (`EagleConfig`) + `model.safetensors`. Modules, each importing only those before it: config, vocab, head,
grow (batched trees, on the device), session (EagleDrafter, _EagleSession); import from `vlmspec.draft.eagle`.
"""

from __future__ import annotations

from vlmspec.errors import DrafterLoadError
from vlmspec.draft.eagle.config import (CONFIG_NAME, LEGACY_KEY, MODEL_TYPE, WEIGHTS_NAME, EagleConfig, default_feature_layers, logger,
                                        looks_like_hub_id)
from vlmspec.draft.eagle.vocab import check_draft_vocab, draft_vocabulary, t2d_map
from vlmspec.draft.eagle.head import AcceptanceHead, Eagle3Head, EagleHead, _rms_norm, build_head, draft_entropy, question_embedding
from vlmspec.draft.eagle.session import EagleDrafter, _EagleSession

__all__ = [
    "CONFIG_NAME", "LEGACY_KEY", "MODEL_TYPE", "WEIGHTS_NAME",
    "AcceptanceHead", "DrafterLoadError", "Eagle3Head", "EagleConfig", "EagleDrafter", "EagleHead", "build_head",
    "check_draft_vocab", "default_feature_layers", "draft_entropy", "draft_vocabulary", "looks_like_hub_id", "question_embedding", "t2d_map",
]
