"""Low-rank adapters (LoRA) on a model's linear layers, attached with forward hooks: no forked
modelling file and no replaced modules. While training, each adapted linear returns
`x W^T + b + (x A^T) B^T * scale` (two thin matmuls, and no gradient for W is ever formed); for
shipping, the trained pairs are merged into W once (`vlmspec.target.assemble.apply_trained`).

    adapters = add_lora(model.model.language_model, rank=16, alpha=32)   # B = 0: no change yet
    ...train adapters.parameters()...
    adapters.tensors()            # {"<linear>.lora_A": [r, in], "<linear>.lora_B": [out, r] * scale}
    adapters.remove()             # the hooks come off; the model is the base again
"""

from __future__ import annotations

import math

import torch
from torch import nn

# the projections of a Llama-style decoder layer
LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraAdapters(nn.Module):
    """The A [r, in] / B [out, r] pairs of one module's linears, keyed by the linear's name."""

    def __init__(self, module: nn.Module, rank: int, alpha: float, targets: tuple[str, ...] = LLAMA_TARGETS, seed: int = 0):
        super().__init__()
        assert rank > 0 and alpha > 0
        self.scale = alpha / rank
        self.names: list[str] = []
        self.A, self.B = nn.ParameterDict(), nn.ParameterDict()
        self._hooks = []
        g = torch.Generator().manual_seed(seed)
        for name, sub in module.named_modules():
            if isinstance(sub, nn.Linear) and name.rsplit(".", 1)[-1] in targets:
                key = self._key(name)
                out_f, in_f = sub.weight.shape
                bound = 1 / math.sqrt(in_f)
                self.A[key] = nn.Parameter(((torch.rand(rank, in_f, generator=g) * 2 - 1) * bound).to(sub.weight.device))
                self.B[key] = nn.Parameter(torch.zeros(out_f, rank, device=sub.weight.device))
                self._hooks.append(sub.register_forward_hook(self._hook(key)))
                self.names.append(name)
        if not self.names:
            raise ValueError(f"no linear layer named one of {targets} in {type(module).__name__}")

    @staticmethod
    def _key(name: str) -> str:
        """A linear's qualified name as a ParameterDict key (no dots allowed there)."""
        return name.replace(".", "__")

    def _hook(self, key: str):
        def hook(_module: nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
            x = args[0]
            return output + ((x @ self.A[key].to(x.dtype).T) @ self.B[key].to(x.dtype).T) * self.scale
        return hook

    def tensors(self) -> dict[str, torch.Tensor]:
        """{'<linear>.lora_A': [r, in], '<linear>.lora_B': [out, r]} with the scale folded into B,
        so that merging is W + B @ A."""
        out = {}
        for name in self.names:
            key = self._key(name)
            out[f"{name}.lora_A"] = self.A[key].detach().float().clone()
            out[f"{name}.lora_B"] = (self.B[key].detach().float() * self.scale).clone()
        return out

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Inverse of `tensors` (resume); the names must match exactly."""
        expected = {f"{n}.lora_{ab}" for n in self.names for ab in "AB"}
        if set(tensors) != expected:
            missing, extra = sorted(expected - set(tensors))[:3], sorted(set(tensors) - expected)[:3]
            raise ValueError(f"LoRA tensors do not match the adapters (missing {missing}, unexpected {extra})")
        with torch.no_grad():
            for name in self.names:
                key = self._key(name)
                self.A[key].copy_(tensors[f"{name}.lora_A"])
                self.B[key].copy_(tensors[f"{name}.lora_B"] / self.scale)

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def add_lora(module: nn.Module, rank: int, alpha: float, targets: tuple[str, ...] = LLAMA_TARGETS, seed: int = 0) -> LoraAdapters:
    return LoraAdapters(module, rank, alpha, targets, seed)


__all__ = ["LLAMA_TARGETS", "LoraAdapters", "add_lora"]
