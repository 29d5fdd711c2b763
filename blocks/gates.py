"""The decay gates, in log space: `g <= 0`, the state is multiplied by `exp(g)` per token.

A gate's log decay is `g = -exp(A_log) * f(z)` of its projection `z` (bias included),
in one of three forms (the plan's `decay`, `DECAY_FORMS`):

- `mamba2` (the default): `f = softplus`, `A_log` a learned per-head rate, the bias the
  learned `dt_bias`: Mamba2's parameterisation, as Gated DeltaNet and KDA use it in
  flash-linear-attention. `g` is unbounded below. Initialised as Mamba2 (`mamba2_dt_bias`:
  `softplus(dt_bias) = dt` log-uniform in [0.001, 0.1], per head for the scalar gate and per
  key channel for KDA's, as flash-linear-attention 0.6's `KimiDeltaAttention` and
  transformers' Kimi Linear do), with `A` uniform in [0, 16] (Gated DeltaNet) or [1, 16]
  (KDA), a token decays by `A dt`, about 0.001 to 1.6 nats.
- `rwkv7`: `f = sigmoid` with the fixed `A_log = -1/2`, RWKV-7's decay
  `w = exp(-e^{-1/2} sigmoid(w0 + tanh(x W1) W2))`: at most 0.61 nats a token, so a 64-token
  chunk decays by at most 39 nats and the chunk kernel always takes its fastest path
  (`kernels/triton/decay.py`). `w0` starts at RWKV-7's per-channel decay speeds.
- `gla`: `f(z) = softplus(-z)` with the fixed `A_log = -ln 16`, GLA's
  `logsigmoid(W2 W1 x + b) / 16`; the bias starts at 0 (about 0.04 nats a token).

- `ScalarGate` (Gated DeltaNet): one value per token and head, `g` `[B, T, H]`.
- `ChannelGate` (KDA): one value per key channel, `g` `[B, T, H, K]`, through a low-rank
  projection (rank V, `head_v_dim` in KDA, with RWKV-7's tanh inside for the rwkv7 form) to
  keep the parameter count small.

`g` itself is `kernels.gate_log_decay` (float32, one Triton kernel each way on CUDA);
`fused_backend` picks its path and is set by `LanguageModel.set_backend`. `decay_params`
is what the decoding step forms the same `g` from; `forward(x, recipe=True)` hands the
recurrence how to form `g` again in its backward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from archspec.kernels import Recompute, gate_log_decay

from .lowrank import Inner, LowRankLinear
from .plan import DecayForm

Tensor = torch.Tensor


@dataclass(frozen=True)
class DecayFormSetting:
    """What a decay form fixes in a gate."""

    log_rate: float | None  # the constant A_log; None: a learned rate per head
    bias: str  # the bias parameter's name (as its source names it)
    inner: Inner  # the activation inside a channel gate's low-rank map


DECAY_FORMS: dict[str, DecayFormSetting] = {
    "mamba2": DecayFormSetting(log_rate=None, bias="dt_bias", inner="none"),
    "rwkv7": DecayFormSetting(log_rate=-0.5, bias="w0", inner="tanh"),  # -e^{-1/2} sigmoid(.)
    "gla": DecayFormSetting(log_rate=-math.log(16), bias="gk_bias", inner="none"),  # logsigmoid(.) / 16
}


def inverse_softplus(y: Tensor) -> Tensor:
    """x with softplus(x) = y, for y > 0 (used to initialise dt_bias)."""
    return y + torch.log(-torch.expm1(-y))


# Mamba2's initialisation: time steps log-uniform between these (never below the floor),
# and the rate `A = exp(A_log)` uniform per head in [0, 16] for a scalar gate (Gated
# DeltaNet) and in [1, 16] for a channel gate (KDA), as flash-linear-attention has them.
DT_MIN, DT_MAX, DT_FLOOR = 1e-3, 0.1, 1e-4
SCALAR_RATE_INIT = (0.0, 16.0)
CHANNEL_RATE_INIT = (1.0, 16.0)


def mamba2_dt_bias(count: int, dt_min: float = DT_MIN, dt_max: float = DT_MAX,
                   generator: torch.Generator | None = None) -> Tensor:
    """Mamba2's initial `dt_bias` for `count` rates: `softplus(dt_bias) = dt`, `dt`
    log-uniform in `[dt_min, dt_max]` (at least `DT_FLOOR`): a spread of time scales, from
    nearly no decay to fast forgetting."""
    u = torch.rand(count, generator=generator)
    dt = torch.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
    return inverse_softplus(dt.clamp(min=DT_FLOOR))


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
        setting = DECAY_FORMS[self.form]
        self.rates = rates
        if setting.log_rate is None:
            self.A_log = nn.Parameter(torch.zeros(rates))
        start = rwkv7_decay_bias(biases, depth) if self.form == "rwkv7" else torch.zeros(biases)
        self.register_parameter(setting.bias, nn.Parameter(start))

    def log_rate(self) -> Tensor:
        """`A_log` `[H]`: the learned parameter (mamba2), or the form's constant (RWKV-7 and
        GLA learn no rate), made in the bias's arithmetic (float64 for a float64 model) and
        never cast with the model's weights, so that GLA's 1/16 stays exact."""
        constant = DECAY_FORMS[self.form].log_rate
        if constant is None:
            return self.A_log
        bias = self.bias
        return torch.full((self.rates,), constant, device=bias.device, dtype=torch.promote_types(bias.dtype, torch.float32))

    @property
    def bias(self) -> Tensor:
        """The bias inside `f`: `dt_bias` (mamba2), `w0` (rwkv7) or `gk_bias` (gla)."""
        return getattr(self, DECAY_FORMS[self.form].bias)

    def decay_params(self) -> tuple[Tensor, Tensor]:
        """`(A_log [H], bias)` as `kernels.decode_step`'s `decay` takes them."""
        return self.log_rate(), self.bias

    def forward(self, x: Tensor, recipe: bool = False) -> Tensor | tuple[Tensor, Recompute]:
        """`x` `[B, T, d_model]` -> `g` `[B, T, H]` (scalar) or `[B, T, H, K]` (channel);
        with `recipe`, also its `kernels.Recompute`: the log decay formed again from the
        projection, which `gate_log_decay` keeps anyway (the recurrence then keeps neither
        `g` nor its float32 chunk sums)."""
        A_log, proj, bias = self._decay_inputs(x)
        again = Recompute(gate_log_decay, (A_log, proj, bias), dict(form=self.form, backend=self.fused_backend))
        g = again.fn(*again.args, **again.kwargs)
        return (g, again) if recipe else g

    def _decay_inputs(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """`(A_log, proj, bias)` shaped as `gate_log_decay` takes them."""
        raise NotImplementedError


class ScalarGate(_Gate):
    """One decay per token and head; mamba2's initialisation as Mamba2 / Gated DeltaNet."""

    def __init__(self, d_model: int, heads: int, dt_min: float = DT_MIN, dt_max: float = DT_MAX,
                 form: DecayForm = "mamba2", depth: float = 0.5):
        super().__init__(form)
        self.a_proj = nn.Linear(d_model, heads, bias=False)
        self._add_decay_parameters(heads, heads, depth)
        if form == "mamba2":
            # A per head, and Mamba2's dt per head
            with torch.no_grad():
                self.A_log.copy_(torch.log(torch.empty(heads).uniform_(*SCALAR_RATE_INIT)))
                self.dt_bias.copy_(mamba2_dt_bias(heads, dt_min, dt_max))

    def _decay_inputs(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return self.log_rate(), self.a_proj(x), self.bias


class ChannelGate(_Gate):
    """KDA's per-channel decay through a low-rank projection; mamba2's initialisation as
    KDA, rwkv7's as RWKV-7 (with its LoRA's tanh), gla's as GLA."""

    def __init__(self, d_model: int, heads: int, head_dim: int, rank: int, form: DecayForm = "mamba2",
                 depth: float = 0.5):
        super().__init__(form)
        self.heads, self.head_dim = heads, head_dim
        self.f_proj = LowRankLinear(d_model, rank, heads * head_dim, bias=False, inner=DECAY_FORMS[form].inner)
        self._add_decay_parameters(heads, heads * head_dim, depth)
        if form == "mamba2":
            # A per head, and Mamba2's dt per key channel (KDA's)
            with torch.no_grad():
                self.A_log.copy_(torch.log(torch.empty(heads).uniform_(*CHANNEL_RATE_INIT)))
                self.dt_bias.copy_(mamba2_dt_bias(heads * head_dim))

    def _decay_inputs(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        proj = self.f_proj(x).unflatten(-1, (self.heads, self.head_dim))
        return self.log_rate()[:, None], proj, self.bias.view(self.heads, self.head_dim)
