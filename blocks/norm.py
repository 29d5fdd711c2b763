"""The gated output norm of GDN and KDA (plain RMSNorm is torch's `nn.RMSNorm`).

Gated DeltaNet reads out `RMSNorm(o) * SiLU(W_g x)` and KDA `RMSNorm(o) * sigmoid(...)`
(flash-linear-attention's `FusedRMSNormGated`); DeltaNet uses a plain RMSNorm. The norm is
per head: it acts on the last dimension V of `[B, T, H, V]`.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F

Tensor = torch.Tensor

GateActivation = Literal["silu", "sigmoid"]


class GatedRMSNorm(nn.Module):
    """`RMSNorm(x) * act(gate)` with a learned per-feature weight."""

    def __init__(self, dim: int, activation: GateActivation, eps: float = 1e-6):
        super().__init__()
        if activation not in ("silu", "sigmoid"):
            raise ValueError(f"activation must be 'silu' or 'sigmoid', got {activation!r}")
        self.norm = nn.RMSNorm(dim, eps=eps)
        self.activation = activation

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        act = F.silu(gate) if self.activation == "silu" else torch.sigmoid(gate)
        return self.norm(x) * act
