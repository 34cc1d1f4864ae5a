"""EAGLE-style draft head with a dynamic EAGLE-2 tree.

The head reads pairs (target feature at position i, token at position i+1):

    x_i  = fc(concat(norm(embed(token_{i+1})), norm(feature_i)))     # [*, 2H] -> [*, H]
    h_i  = LlamaDecoderLayer(x_i)                                   # one HF decoder layer, own KV cache
    p(token_{i+2}) = softmax(lm_head(h_i))                          # the target's frozen LM head

h_i is trained to predict the target's feature at position i+1, so drafting feeds it back.
Training runs `EagleHead.forward` (the HF layer as it is); drafting runs `EagleHead.decode`, the
same layer in fewer ops over weights packed once for the CPU's matrix units, held to
`forward` proposal for proposal by the tests.
Embedding and LM head are the target's own modules, shared and frozen; only fc, the norms and
the decoder layer are the head's weights.

EAGLE-3 (`Eagle3Head`, config arch "eagle3") reads the hidden states of three target layers
(low, middle, high) fused by fc, and has its own LM head over the draft vocabulary; the target
hands it those layers' states (`EagleDrafter.feature_layers`) from the same forwards.

A drafter checkpoint is a Hugging Face artefact: `config.json` written by `EagleConfig`
(a `PretrainedConfig`, model_type "vlmspec_eagle", registered with `AutoConfig`) plus
`model.safetensors` with the head's weights. It loads from a folder or a hub id ("org/name");
the first format (config.json with "drafter": "eagle") still loads and is converted in memory.

On CUDA, a proposal grows the whole tree on the device and reads it back with ONE
device->host transfer (not one per node); a batch's rows grow stacked and come back in one
transfer together (`grow`).

SpecDec++ (`acceptance_head`): a small head beside it predicts, for each of a node's top-k
children, the probability that the target accepts that child given that the node was accepted.
A proposal stops deepening the tree once no frontier node's predicted path acceptance (the
product along its path) reaches `stop_threshold`; with the acceptance head off, or threshold 0,
the tree is EAGLE-2's. Only the tree's shape changes, so verification stays lossless. (That
check reads one number per level back from the device.)

The modules (each imports only those above it in this list):

    config   EagleConfig, the checkpoint's files (either format), folder / hub id resolution
    vocab    the trimmed draft vocabulary (d2t) tools
    head     EagleHead (training forward, packed decode), Eagle3Head (EAGLE-3 on the same), AcceptanceHead
    grow     the tree growth of a batch of rows, stacked on the device, and its one read back
    session  EagleDrafter (random_init, save / load / from_pretrained) and _EagleSession (one request's state)

Every name is re-exported here: import from `vlmspec.draft.eagle`.
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
