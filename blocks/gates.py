"""The decay gates, in log space: `g <= 0`, the state is multiplied by `exp(g)` per token.

A gate's log decay is `g = -exp(A_log) * f(z)` of its projection `z` (bias included),
in one of two forms (the plan's `decay`):

- `mamba2` (the default): `f = softplus`, `A_log` a learned per-head rate, the bias the
  learned `dt_bias`: Mamba2's parameterisation, as Gated DeltaNet and KDA use it in
  flash-linear-attention. `g` is unbounded below; at initialisation (`A` in [1, 16] for
  KDA) a token decays by several nats.
- `rwkv7`: `f = sigmoid` with the fixed `A_log = -1/2`, RWKV-7's decay
  `w = exp(-e^{-1/2} sigmoid(w0 + tanh(x W1) W2))`: at most 0.61 nats a token, so a 64-token
  chunk decays by at most 39 nats and the chunk kernel always takes its fastest path
  (`kernels/triton/decay.py`). `w0` starts at RWKV-7's per-channel decay speeds.

- `ScalarGate` (Gated DeltaNet): one value per token and head, `g` `[B, T, H]`.
- `ChannelGate` (KDA): one value per key channel, `g` `[B, T, H, K]`, through a low-rank
  projection (rank V, `head_v_dim` in KDA, with RWKV-7's tanh inside for the rwkv7 form) to
  keep the parameter count small.

`g` itself is `kernels.gate_log_decay` (float32, one Triton kernel each way on CUDA);
`fused_backend` picks its path and is set by `LanguageModel.set_backend`. `decay_params`
is what the decoding step forms the same `g` from.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from archspec.kernels import gate_log_decay

from .lowrank import LowRankLinear
from .plan import DecayForm

Tensor = torch.Tensor

# RWKV-7's fixed rate: its log decay is -e^{-1/2} sigmoid(.), A_log = -1/2.
RWKV7_LOG_RATE = -0.5


def inverse_softplus(y: Tensor) -> Tensor:
    """x with softplus(x) = y, for y > 0 (used to initialise dt_bias)."""
    return y + torch.log(-torch.expm1(-y))


def rwkv7_decay_bias(channels: int, depth: float) -> Tensor:
    """RWKV-7's initial `w0` over `channels` (slowest first): decay speeds from -7 to -2
    with an exponent that grows with the layer's `depth` (0 bottom, 1 top), plus 1/2
    (Peng et al. 2025, the reference model's time-mix initialisation, as fla's RWKV-7 sets
    it). A token then decays by 0.001-0.11 nats."""
    position = torch.arange(channels, dtype=torch.float64) / max(channels - 1, 1)
    speed = -7 + 5 * position ** (0.85 + math.sqrt(depth))
    return (speed + 0.5).float()


class _Gate(nn.Module):
    """What both gates share: the form, its rate, the bias and the kernel call."""

    def __init__(self, form: DecayForm):
        super().__init__()
        self.form = form
        self.fused_backend = "auto"

    def _add_decay_parameters(self, rates: int, biases: int, depth: float) -> None:
        """The rate and the bias, registered after the projection: a mamba2 gate's state
        dict and random draws keep the order of a gate that has only that form."""
        if self.form == "mamba2":
            self.A_log = nn.Parameter(torch.zeros(rates))
            self.dt_bias = nn.Parameter(torch.zeros(biases))
        else:
            # A constant, not a parameter (RWKV-7 learns no rate), and not in the state dict.
            self.register_buffer("A_log", torch.full((rates,), RWKV7_LOG_RATE), persistent=False)
            self.w0 = nn.Parameter(rwkv7_decay_bias(biases, depth))

    @property
    def bias(self) -> Tensor:
        """The bias inside `f`: `dt_bias` (mamba2) or `w0` (rwkv7)."""
        return self.dt_bias if self.form == "mamba2" else self.w0

    def decay_params(self) -> tuple[Tensor, Tensor]:
        """`(A_log [H], bias)` as `kernels.decode_step`'s `decay` takes them."""
        return self.A_log, self.bias

    def _log_decay(self, A_log: Tensor, proj: Tensor, bias: Tensor) -> Tensor:
        return gate_log_decay(A_log, proj, bias, form=self.form, backend=self.fused_backend)


class ScalarGate(_Gate):
    """One decay per token and head; mamba2's initialisation as Mamba2 / Gated DeltaNet."""

    def __init__(self, d_model: int, heads: int, dt_min: float = 1e-3, dt_max: float = 0.1,
                 form: DecayForm = "mamba2", depth: float = 0.5):
        super().__init__(form)
        self.a_proj = nn.Linear(d_model, heads, bias=False)
        self._add_decay_parameters(heads, heads, depth)
        if form == "mamba2":
            # A ~ U(0, 16) and dt log-uniform in [dt_min, dt_max]: a spread of time scales
            # across heads, from nearly no decay to fast forgetting.
            with torch.no_grad():
                self.A_log.copy_(torch.log(torch.empty(heads).uniform_(0, 16)))
                dt = torch.exp(torch.rand(heads) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
                self.dt_bias.copy_(inverse_softplus(dt.clamp(min=1e-4)))

    def forward(self, x: Tensor) -> Tensor:
        """`x` `[B, T, d_model]` -> `g` `[B, T, H]`."""
        return self._log_decay(self.A_log, self.a_proj(x), self.bias)


class ChannelGate(_Gate):
    """KDA's per-channel decay through a low-rank projection; mamba2's initialisation as
    KDA, rwkv7's as RWKV-7 (with its LoRA's tanh)."""

    def __init__(self, d_model: int, heads: int, head_dim: int, rank: int, form: DecayForm = "mamba2",
                 depth: float = 0.5):
        super().__init__(form)
        self.heads, self.head_dim = heads, head_dim
        self.f_proj = LowRankLinear(d_model, rank, heads * head_dim, bias=False,
                                    inner="tanh" if form == "rwkv7" else "none")
        self._add_decay_parameters(heads, heads * head_dim, depth)
        if form == "mamba2":
            with torch.no_grad():
                self.A_log.copy_(torch.log(torch.empty(heads).uniform_(1, 16)))  # dt_bias stays 0

    def forward(self, x: Tensor) -> Tensor:
        """`x` `[B, T, d_model]` -> `g` `[B, T, H, K]`."""
        proj = self.f_proj(x).unflatten(-1, (self.heads, self.head_dim))
        return self._log_decay(self.A_log[:, None], proj, self.bias.view(self.heads, self.head_dim))
