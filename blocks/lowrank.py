"""A low-rank linear map `W_up (W_down x)`: KDA's gates and RWKV-7's per-channel vectors.

Per-channel quantities (a decay per key channel, an output gate per value channel, an
erase strength per key channel) would cost `d_model * H * K` parameters with a full
projection; KDA and RWKV-7 route them through a rank-r bottleneck instead.
"""

from __future__ import annotations

import torch
import torch.nn as nn

Tensor = torch.Tensor


class LowRankLinear(nn.Module):
    def __init__(self, in_features: int, rank: int, out_features: int, *, bias: bool):
        super().__init__()
        self.down = nn.Linear(in_features, rank, bias=False)
        self.up = nn.Linear(rank, out_features, bias=bias)
        if bias:
            nn.init.zeros_(self.up.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.up(self.down(x))
