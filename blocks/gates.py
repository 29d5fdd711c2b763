"""The decay gates, in log space: `g <= 0`, the state is multiplied by `exp(g)` per token.

Both follow Mamba2's parameterisation (as Gated DeltaNet and KDA do in
flash-linear-attention): `g = -exp(A_log) * softplus(a(x) + dt_bias)`. `A_log` is a
per-head log decay rate and `dt_bias` a learned offset of the data-dependent step, so a
head decays fast or slowly from initialisation on, and `g` is never positive.

- `ScalarGate` (Gated DeltaNet): one value per token and head, `g` `[B, T, H]`.
- `ChannelGate` (KDA): one value per key channel, `g` `[B, T, H, K]`, through a low-rank
  projection of rank V (`head_v_dim` in KDA) to keep the parameter count small.

`g` itself is `kernels.mamba_log_decay` (float32, one Triton kernel each way on CUDA);
`fused_backend` picks its path and is set by `LanguageModel.set_backend`.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from archspec.kernels import mamba_log_decay

from .lowrank import LowRankLinear

Tensor = torch.Tensor


def inverse_softplus(y: Tensor) -> Tensor:
    """x with softplus(x) = y, for y > 0 (used to initialise dt_bias)."""
    return y + torch.log(-torch.expm1(-y))


class ScalarGate(nn.Module):
    """Mamba2-style per-head decay; initialisation as Mamba2 / Gated DeltaNet."""

    def __init__(self, d_model: int, heads: int, dt_min: float = 1e-3, dt_max: float = 0.1):
        super().__init__()
        self.a_proj = nn.Linear(d_model, heads, bias=False)
        # A ~ U(0, 16) and dt log-uniform in [dt_min, dt_max]: a spread of time scales
        # across heads, from nearly no decay to fast forgetting.
        self.A_log = nn.Parameter(torch.log(torch.empty(heads).uniform_(0, 16)))
        dt = torch.exp(torch.rand(heads) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        self.dt_bias = nn.Parameter(inverse_softplus(dt.clamp(min=1e-4)))
        self.fused_backend = "auto"

    def forward(self, x: Tensor) -> Tensor:
        """`x` `[B, T, d_model]` -> `g` `[B, T, H]`."""
        return mamba_log_decay(self.A_log, self.a_proj(x), self.dt_bias, backend=self.fused_backend)


class ChannelGate(nn.Module):
    """KDA's per-channel decay through a low-rank projection; initialisation as KDA."""

    def __init__(self, d_model: int, heads: int, head_dim: int, rank: int):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.f_proj = LowRankLinear(d_model, rank, heads * head_dim, bias=False)
        self.A_log = nn.Parameter(torch.log(torch.empty(heads).uniform_(1, 16)))
        self.dt_bias = nn.Parameter(torch.zeros(heads * head_dim))
        self.fused_backend = "auto"

    def forward(self, x: Tensor) -> Tensor:
        """`x` `[B, T, d_model]` -> `g` `[B, T, H, K]`."""
        proj = self.f_proj(x).unflatten(-1, (self.heads, self.head_dim))
        return mamba_log_decay(self.A_log[:, None], proj, self.dt_bias.view(self.heads, self.head_dim),
                               backend=self.fused_backend)
