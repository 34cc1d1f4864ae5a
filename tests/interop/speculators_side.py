"""The `speculators` side of tests/test_speculators_interop.py, run by that test in the
speculators environment (scripts/speculators-env.sh: its own transformers pin), never imported by
vlmspec. Two commands:

    logits DRAFTER INPUTS OUT   load DRAFTER with speculators' own Eagle3DraftModel.from_pretrained,
                                run its draft forward (one step) on INPUTS' hidden_states [1, n, mH],
                                input_ids [1, n], position_ids [1, n] in fp32; write its logits
                                [n, K] and the target ids of the draft vocabulary (index + d2t) to OUT
    make VERIFIER OUT K SEED    a random EAGLE-3 drafter for the verifier folder, made by speculators
                                itself (a draft vocabulary of K ids, layers [0, 1]), saved to OUT
"""

import sys

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig


def logits(drafter: str, inputs: str, out: str) -> None:
    config = Eagle3SpeculatorConfig.from_pretrained(drafter)
    config.transformer_layer_config._attn_implementation = "sdpa"  # its dense-mask path (flex attention wants a GPU compile)
    model = Eagle3DraftModel.from_pretrained(drafter, config=config).float().eval()
    x = load_file(inputs)
    seen = {}
    model.lm_head.register_forward_hook(lambda mod, args, result: seen.__setitem__("logits", result))
    n = x["input_ids"].shape[1]
    with torch.no_grad():
        model(hidden_states=x["hidden_states"].float(), input_ids=x["input_ids"], document_ids=torch.zeros(1, n, dtype=torch.long),
              position_ids=x["position_ids"], ttt_steps=1)
    k = model.config.draft_vocab_size
    ids = torch.arange(k) + model.d2t if model.d2t is not None else torch.arange(k)
    save_file({"logits": seen["logits"][0].float().contiguous(), "target_ids": ids.long().contiguous()}, out)


def make(verifier: str, out: str, k: int, seed: int) -> None:
    torch.manual_seed(seed)
    vcfg = AutoConfig.from_pretrained(verifier)
    text = getattr(vcfg, "text_config", vcfg)
    layer = text.__class__(**{**text.to_dict(), "num_hidden_layers": 1})
    layer._attn_implementation = "sdpa"
    vocab = text.vocab_size
    ids = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[:k].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=k, norm_before_residual=True, eagle_aux_hidden_state_layer_ids=[0, 1],
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)], default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=verifier, architectures=list(vcfg.architectures or []))),
    )
    model = Eagle3DraftModel(config=config)
    model.load_vocab_mappings(t2d, ids - torch.arange(k))  # d2t: offsets
    model.load_verifier_weights()
    with torch.no_grad():  # weights away from their initial values (norms at 1), so that each one is exercised
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
    model.save_pretrained(out)


if __name__ == "__main__":
    cmd, *args = sys.argv[1:]
    if cmd == "logits":
        logits(*args)
    elif cmd == "make":
        make(args[0], args[1], int(args[2]), int(args[3]))
    else:
        raise SystemExit(f"unknown command {cmd!r}")
