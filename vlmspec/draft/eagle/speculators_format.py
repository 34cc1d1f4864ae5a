"""The `speculators` file format of an EAGLE-3 drafter (vLLM reads it; the `speculators` package trains and writes it):
read into an `Eagle3Head`'s config and weights, checked against the target field by field, and written from one.

config.json (`speculators_model_type: "eagle3"`, `transformer_layer_config`, `draft_vocab_size`,
`eagle_aux_hidden_state_layer_ids`: [2, n // 2, n - 3] when absent, `speculators_config`) + model.safetensors:

    fc.weight [H, mH]      layers.0.self_attn.{q,k,v}_proj.weight [*, 2H], o_proj, mlp.{gate,up,down}_proj
    layers.0.{input_layernorm, post_attention_layernorm, hidden_norm}.weight [H]
    norm.weight [H]        lm_head.weight [K, H]       embed_tokens.weight [V, H] (the target's)
    d2t [K] long OFFSETS: target id = draft index + d2t[draft index]     t2d [V] bool (both absent when K = V)

vlmspec keeps d2t as target ids and converts both ways; `norm_before_residual` is read as
speculators does (false when absent; vLLM: true) and always written.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from vlmspec.errors import DrafterLoadError
from vlmspec.target import Target
from vlmspec.draft.eagle.config import CONFIG_NAME, WEIGHTS_NAME, EagleConfig, _rope_theta, target_depth
from vlmspec.draft.eagle.head import EagleHead

KEY = "speculators_model_type"
FORMAT_VERSION = "0.9.0"  # the `speculators` release whose format this writes (and the interop test runs)

# vlmspec Eagle3Head state-dict name -> speculators' name (d2t, t2d and embed_tokens are converted apart)
_NAMES = {
    "fc.weight": "fc.weight",
    "hidden_norm.weight": "layers.0.hidden_norm.weight",
    "norm.weight": "norm.weight",
    "lm.weight": "lm_head.weight",
    **{f"layer.{part}.weight": f"layers.0.{part}.weight" for part in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm")},
}
# settings of the format this head does not run: each must be off
_UNSUPPORTED_FLAGS = ("norm_before_fc", "fc_norm", "norm_output")


def is_speculators(raw: dict[str, Any]) -> bool:
    return KEY in raw


def _refuse(path: Path, problems: list[str]) -> None:
    if problems:
        raise DrafterLoadError(f"{path}: this speculators drafter does not fit this target or this head ("
                               + "; ".join(problems) + ")")


def config_from_speculators(raw: dict[str, Any], target: Target, path: Path) -> EagleConfig:
    """A speculators config.json -> the `EagleConfig` of an eagle3 head for `target`. DrafterLoadError
    naming each field that does not fit: the algorithm, the layer's kind and shape, the target's
    vocabulary and hidden size, layer ids beyond the target's depth, rope settings."""
    problems = []
    if raw.get(KEY) != "eagle3":
        _refuse(path, [f"{KEY}: {raw.get(KEY)!r}; vlmspec reads 'eagle3' drafters"])
    tl = raw.get("transformer_layer_config")
    if not isinstance(tl, dict):
        _refuse(path, ["transformer_layer_config: missing or not a JSON object"])
    kind = tl.get("model_type", "qwen3")  # speculators' default layer config is Qwen3's
    if kind != "llama":
        problems.append(f"transformer_layer_config.model_type: {kind!r}; vlmspec runs a Llama decoder layer ('llama')")
    if tl.get("num_hidden_layers", 1) != 1:
        problems.append(f"transformer_layer_config.num_hidden_layers: {tl.get('num_hidden_layers')}; vlmspec runs one decoder layer")
    for name in ("attention_bias", "mlp_bias"):
        if tl.get(name):
            problems.append(f"transformer_layer_config.{name}: true; vlmspec's head has no biases")
    if tl.get("hidden_act", "silu") != "silu":
        problems.append(f"transformer_layer_config.hidden_act: {tl.get('hidden_act')!r}; vlmspec's head uses silu")
    for name in _UNSUPPORTED_FLAGS:
        if raw.get(name):
            problems.append(f"{name}: true; vlmspec's head does not run it")
    hidden, vocab = tl.get("hidden_size"), tl.get("vocab_size")
    if hidden != target.hidden_size:
        problems.append(f"transformer_layer_config.hidden_size: {hidden} != the target's {target.hidden_size}")
    th = raw.get("target_hidden_size")
    if th is not None and th != target.hidden_size:
        problems.append(f"target_hidden_size: {th} != the target's {target.hidden_size}")
    if vocab != target.vocab_size:
        problems.append(f"transformer_layer_config.vocab_size: {vocab} != the target's vocabulary of {target.vocab_size}")
    k = raw.get("draft_vocab_size")
    if not isinstance(k, int) or isinstance(k, bool) or not 0 < k <= (vocab or 0):
        problems.append(f"draft_vocab_size: {k!r}, not in 1..transformer_layer_config.vocab_size")
    depth = target_depth(target)
    ids = raw.get("eagle_aux_hidden_state_layer_ids") or [2, depth // 2, depth - 3]
    if len(ids) < 2 or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        problems.append(f"eagle_aux_hidden_state_layer_ids: {ids}; vlmspec's head reads two or more layer ids")
    elif min(ids) < 0 or max(ids) >= depth:
        problems.append(f"eagle_aux_hidden_state_layer_ids: {ids} reach beyond this target's {depth} layers (ids 0..{depth - 1})")
    rope = tl.get("rope_parameters") or tl.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        problems.append(f"transformer_layer_config.rope_parameters.rope_type: {rope_type!r}; vlmspec's head runs 'default' RoPE")
    theta = float(rope.get("rope_theta", tl.get("rope_theta", 10000.0)))
    if theta != _rope_theta(target.text_config):
        problems.append(f"transformer_layer_config.rope_theta: {theta:g} != the target's {_rope_theta(target.text_config):g}")
    _refuse(path, problems)
    heads = int(tl["num_attention_heads"])
    return EagleConfig(
        hidden_size=int(hidden), vocab_size=int(vocab), num_attention_heads=heads,
        num_key_value_heads=int(tl.get("num_key_value_heads") or heads), head_dim=int(tl.get("head_dim") or hidden // heads),
        intermediate_size=int(tl["intermediate_size"]), max_position_embeddings=target.max_positions,  # the head's positions are the target's
        rope_theta=theta, rms_norm_eps=float(tl.get("rms_norm_eps", 1e-6)),
        target_model_type=str(getattr(target.model.config, "model_type", "")),
        draft_vocab_size=0 if k == vocab else int(k), arch="eagle3", feature_layers=list(ids),
        norm_before_residual=bool(raw.get("norm_before_residual", False)),
    )


def weights_from_speculators(state: dict[str, torch.Tensor], config: EagleConfig, target: Target, path: Path) -> dict[str, torch.Tensor]:
    """speculators' tensors -> an `Eagle3Head` state dict (d2t offsets -> ids). DrafterLoadError on a
    missing or unexpected tensor, a d2t / t2d that is not a draft vocabulary of this target, or an
    `embed_tokens.weight` that is not the target's embedding (the head shares the target's)."""
    state = {k: v for k, v in state.items() if not k.startswith("verifier_")}  # verifier copies, never read (speculators' own rule)
    out = {ours: state.pop(theirs) for ours, theirs in _NAMES.items() if theirs in state}
    missing = sorted(theirs for ours, theirs in _NAMES.items() if ours not in out)
    embed = state.pop("embed_tokens.weight", None)
    d2t, t2d = state.pop("d2t", None), state.pop("t2d", None)
    if missing or state:
        raise DrafterLoadError(f"{path}: not the tensors of a speculators EAGLE-3 drafter (missing {missing[:5]}, unexpected {sorted(state)[:5]})")
    if embed is not None:
        own = target.input_embeddings().weight.detach().to("cpu", torch.float32)
        if embed.shape != own.shape or not torch.allclose(embed.float(), own, rtol=1e-2, atol=1e-2):
            raise DrafterLoadError(f"{path}: embed_tokens.weight is not this target's input embedding (vlmspec's head reads the "
                                   "target's own): the drafter was made for another target")
    k = config.draft_vocab_size
    if k:
        if d2t is None or t2d is None:
            raise DrafterLoadError(f"{path}: draft_vocab_size {k} < the vocabulary, but d2t / t2d are missing")
        if d2t.shape != (k,) or t2d.shape != (config.vocab_size,):
            raise DrafterLoadError(f"{path}: d2t {tuple(d2t.shape)} / t2d {tuple(t2d.shape)} do not match draft_vocab_size {k} "
                                   f"and the vocabulary of {config.vocab_size}")
        ids = torch.arange(k) + d2t.long()  # offsets -> target ids
        if int(ids.min()) < 0 or int(ids.max()) >= config.vocab_size or ids.unique().numel() != k:
            raise DrafterLoadError(f"{path}: d2t (offsets: target id = draft index + d2t[index]) does not give {k} distinct ids of this vocabulary")
        if not bool(t2d.bool()[ids].all()) or int(t2d.bool().sum()) != k:
            raise DrafterLoadError(f"{path}: t2d does not mark the {k} target ids d2t gives")
        out["d2t"] = ids
    elif d2t is not None and (d2t.numel() != config.vocab_size or bool(d2t.any())):
        raise DrafterLoadError(f"{path}: d2t maps the full vocabulary to other ids; vlmspec reads that as no draft vocabulary only when it is all zeros")
    return out


def to_speculators(head: EagleHead, out: str | Path, verifier: str, verifier_architectures: list[str],
                   speculative_tokens: int = 5) -> Path:
    """Write `head` (an eagle3 head) in the speculators format to folder `out`, naming its verifier.
    ValueError, saying why, for a head the format cannot hold exactly."""
    cfg = head.config
    if cfg.arch != "eagle3":
        raise ValueError(eagle1_refusal(head))
    if head.accept is not None:
        raise ValueError("this drafter has an acceptance head (SpecDec++), which the speculators format cannot hold: "
                         "export a drafter trained without --acceptance-head")
    layer = cfg.llama_config()
    tl = {k: v for k, v in layer.to_dict().items() if k not in ("_attn_implementation", "transformers_version", "architectures",
                                                                "dtype", "torch_dtype")}
    tl.update(model_type="llama", num_hidden_layers=1, head_dim=cfg.head_dim, rope_theta=cfg.rope_theta,
              rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta})
    k = cfg.draft_vocab_size or cfg.vocab_size
    config = {
        "architectures": ["Eagle3Speculator"],
        KEY: "eagle3",
        "speculators_version": FORMAT_VERSION,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens),
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)},
        },
        "transformer_layer_config": tl,
        "draft_vocab_size": k,
        "target_hidden_size": cfg.hidden_size,
        "norm_before_residual": bool(cfg.norm_before_residual),
        "eagle_aux_hidden_state_layer_ids": list(cfg.feature_layers),
        "norm_before_fc": False, "fc_norm": False, "norm_output": False, "embed_requires_grad": False,
        "dtype": str(next(head.parameters()).dtype).removeprefix("torch."),
    }
    state = head.head_state_dict()
    tensors = {theirs: state[ours] for ours, theirs in _NAMES.items()}
    tensors["embed_tokens.weight"] = head.embed.weight.detach().to(tensors["fc.weight"]).contiguous()
    if cfg.draft_vocab_size:
        ids = state["d2t"].cpu()
        tensors["d2t"] = (ids - torch.arange(k)).contiguous()  # offsets
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        tensors["t2d"] = t2d
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    save_file({n: t.detach().cpu().contiguous() for n, t in tensors.items()}, str(folder / WEIGHTS_NAME), metadata={"format": "pt"})
    return folder


def eagle1_refusal(head: EagleHead) -> str:
    """Why an EAGLE-1 head does not export to vLLM's EAGLE-1 layout exactly (that layout: fc over
    [embedding, hidden state] with no norms before it, no norm on its layer's input, no final norm,
    the target's full LM head, no draft vocabulary)."""
    why = ["it normalises the embedding and the feature before fc (embed_norm, feat_norm), which vLLM's EAGLE-1 layout has no place for",
           "its decoder layer normalises its input (input_layernorm), which vLLM's EAGLE-1 layer skips on layer 0"]
    if head.trimmed:
        why.append(f"it drafts over a trimmed vocabulary of {head.config.draft_vocab_size} tokens (d2t), which that layout cannot hold")
    if head.visual is not None:
        why.append("it is a VLM-aware variant (extra.visual)")
    return ("an EAGLE-1 drafter does not export exactly: " + "; ".join(why)
            + ". Train an EAGLE-3 drafter (vlmspec train --arch eagle3) and export that.")
