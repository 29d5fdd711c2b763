"""A low-rank linear map `W_up act(W_down x)`: KDA's gates and RWKV-7's per-channel vectors.

Per-channel quantities (a decay per key channel, an output gate per value channel, an
erase strength per key channel) would cost `d_model * H * K` parameters with a full
projection; KDA and RWKV-7 route them through a rank-r bottleneck instead. `act` is the
identity (KDA) or tanh (RWKV-7's decay LoRA).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn as nn

Tensor = torch.Tensor

Inner = Literal["none", "tanh"]


class LowRankLinear(nn.Module):
    def __init__(self, in_features: int, rank: int, out_features: int, *, bias: bool, inner: Inner = "none"):
        super().__init__()
        if inner not in ("none", "tanh"):
            raise ValueError(f"LowRankLinear: inner must be 'none' or 'tanh', got {inner!r}")
        self.inner = inner
        self.down = nn.Linear(in_features, rank, bias=False)
        self.up = nn.Linear(rank, out_features, bias=bias)
        if bias:
            nn.init.zeros_(self.up.bias)

    def activate(self, down: Tensor) -> Tensor:
        """The map between the two stages, on the rank-r output of `down`."""
        return torch.tanh(down) if self.inner == "tanh" else down

    def forward(self, x: Tensor) -> Tensor:
        return self.up(self.activate(self.down(x)))
