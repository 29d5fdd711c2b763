"""The channel mixer of each block: SwiGLU (LLaMA, fla's GatedMLP) or a GELU MLP."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .plan import Mlp

Tensor = torch.Tensor


def mlp_hidden_size(kind: Mlp, d_model: int, ratio: float) -> int:
    """Hidden width. SwiGLU has three matrices instead of two, so it takes 2/3 of the
    width (as LLaMA and fla do) to cost what a GELU MLP of the same ratio costs."""
    if kind == "swiglu":
        return max(1, int(ratio * d_model * 2 / 3))
    return max(1, int(ratio * d_model))


class MLP(nn.Module):
    def __init__(self, kind: Mlp, d_model: int, ratio: float):
        super().__init__()
        if kind not in ("swiglu", "gelu"):
            raise ValueError(f"MLP kind must be 'swiglu' or 'gelu', got {kind!r}")
        hidden = mlp_hidden_size(kind, d_model, ratio)
        self.kind = kind
        self.up_proj = nn.Linear(d_model, hidden, bias=False)
        self.gate_proj = nn.Linear(d_model, hidden, bias=False) if kind == "swiglu" else None
        self.down_proj = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        if self.gate_proj is not None:
            h = F.silu(self.gate_proj(x)) * self.up_proj(x)
        else:
            h = F.gelu(self.up_proj(x))
        return self.down_proj(h)
