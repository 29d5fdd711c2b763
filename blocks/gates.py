"""The decay gates, in log space: `g <= 0`, the state is multiplied by `exp(g)` per token.

Both follow Mamba2's parameterisation (as Gated DeltaNet and KDA do in
flash-linear-attention): `g = -exp(A_log) * softplus(a(x) + dt_bias)`. `A_log` is a
per-head log decay rate and `dt_bias` a learned offset of the data-dependent step, so a
head decays fast or slowly from initialisation on, and `g` is never positive.

- `ScalarGate` (Gated DeltaNet): one value per token and head, `g` `[B, T, H]`.
- `ChannelGate` (KDA): one value per key channel, `g` `[B, T, H, K]`, through a low-rank
  projection of rank V (`head_v_dim` in KDA) to keep the parameter count small.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .lowrank import LowRankLinear

Tensor = torch.Tensor


class _MambaLogDecay(torch.autograd.Function):
    """`-exp(A_log) * softplus(proj + dt_bias)` saving only its inputs: the float32
    intermediates (the biased logits, their softplus) are recomputed in the backward. For a
    channel gate at B*T = 16k tokens and H*K = 1024 channels they would be 128 MB a layer."""

    @staticmethod
    def forward(ctx, A_log: Tensor, proj: Tensor, dt_bias: Tensor) -> Tensor:
        ctx.save_for_backward(A_log, proj, dt_bias)
        return _decay(A_log, proj, dt_bias)[0]

    @staticmethod
    def backward(ctx, dg: Tensor):
        A_log, proj, dt_bias = ctx.saved_tensors
        g, rate, z = _decay(A_log, proj, dt_bias)
        dg = dg.to(g.dtype)
        d_logits = -rate * torch.sigmoid(z) * dg  # d softplus(z) / dz = sigmoid(z)
        d_A = (g * dg).sum_to_size(A_log.shape).to(A_log.dtype)  # d(-exp(A) s) / dA = -exp(A) s = g
        return d_A, d_logits.to(proj.dtype), d_logits.sum_to_size(dt_bias.shape).to(dt_bias.dtype)


def _decay(A_log: Tensor, proj: Tensor, dt_bias: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    dtype = torch.promote_types(proj.dtype, torch.float32)
    z = proj.to(dtype) + dt_bias.to(dtype)
    rate = torch.exp(A_log.to(dtype))
    return -rate * F.softplus(z), rate, z


def mamba_log_decay(A_log: Tensor, proj: Tensor, dt_bias: Tensor) -> Tensor:
    """`-exp(A_log) * softplus(proj + dt_bias)`; `A_log` and `dt_bias` broadcast over the
    last axes of `proj`.

    Computed in at least float32 (as fla does): the kernel sums log-gates over a chunk,
    and bfloat16's 8-bit mantissa would put errors of ~1% into every decay.
    """
    return _MambaLogDecay.apply(A_log, proj, dt_bias)


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

    def forward(self, x: Tensor) -> Tensor:
        """`x` `[B, T, d_model]` -> `g` `[B, T, H]`."""
        return mamba_log_decay(self.A_log, self.a_proj(x), self.dt_bias)


class ChannelGate(nn.Module):
    """KDA's per-channel decay through a low-rank projection; initialisation as KDA."""

    def __init__(self, d_model: int, heads: int, head_dim: int, rank: int):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.f_proj = LowRankLinear(d_model, rank, heads * head_dim, bias=False)
        self.A_log = nn.Parameter(torch.log(torch.empty(heads).uniform_(1, 16)))
        self.dt_bias = nn.Parameter(torch.zeros(heads * head_dim))

    def forward(self, x: Tensor) -> Tensor:
        """`x` `[B, T, d_model]` -> `g` `[B, T, H, K]`."""
        proj = self.f_proj(x).unflatten(-1, (self.heads, self.head_dim))
        return mamba_log_decay(self.A_log[:, None], proj, self.dt_bias.view(self.heads, self.head_dim))
