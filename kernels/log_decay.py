"""The decay gates' log decay, `g = -exp(A_log) * f(proj + bias)`, saving only its inputs.

Three forms (`kinds.DecayForm`):

- `mamba2`: `f = softplus`. Mamba2's parameterisation, as Gated DeltaNet's scalar gate and
  KDA's channel gate use it in flash-linear-attention: `A_log` a learned per-head rate,
  `bias` the learned `dt_bias`; `g` is unbounded below.
- `rwkv7`: `f = sigmoid`. RWKV-7's decay `w = exp(-e^{-1/2} sigmoid(.))`: with the fixed
  `A_log = -1/2` a token decays by at most `e^{-1/2} = 0.61` nats, so a 64-token chunk by
  at most 39 nats, within the chunk kernel's factorization bound (`triton/decay.py`).
- `gla`: `f(z) = softplus(-z)`, so `g = exp(A_log) logsigmoid(z)`: GLA's
  `logsigmoid(.) / 16` with the fixed `A_log = -ln 16`. Unbounded below, but at
  initialisation (bias 0) about 0.04 nats a token.

`g` is formed in float32 (float64 for float64 inputs): the chunk kernel sums log decays
over a chunk, and bfloat16's 8-bit mantissa would put errors of about 1% into every decay.
Its float32 intermediates (the biased logits, their softplus or sigmoid) are recomputed in
the backward rather than saved: for a channel gate at 16k tokens and 1,024 channels they
would be 128 MB a layer.

On CUDA (`backend="auto"`) the forward and the backward are one kernel each
(`kernels/triton/log_decay.py`); in plain torch, the definition and what runs on the CPU,
they are about five and ten float32 elementwise kernels, each a pass over `[tokens,
channels]`. The backward's sums over tokens (the gradients of `A_log` and `bias`) come
from per-block partial sums.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .fused import resolve_fused_backend
from .kinds import DecayForm

Tensor = torch.Tensor


def log_decay_ref(A_log: Tensor, proj: Tensor, bias: Tensor,
                  form: DecayForm = DecayForm.MAMBA2) -> tuple[Tensor, Tensor, Tensor]:
    """`(g, exp(A_log), proj + bias)` in at least float32."""
    dtype = torch.promote_types(proj.dtype, torch.float32)
    z = proj.to(dtype) + bias.to(dtype)
    rate = torch.exp(A_log.to(dtype))
    f = {DecayForm.MAMBA2: F.softplus, DecayForm.RWKV7: torch.sigmoid, DecayForm.GLA: lambda x: F.softplus(-x)}[form](z)
    return -rate * f, rate, z


def _log_decay_backward_ref(A_log: Tensor, proj: Tensor, bias: Tensor, dg: Tensor,
                            form: DecayForm) -> tuple[Tensor, Tensor, Tensor]:
    g, rate, z = log_decay_ref(A_log, proj, bias, form)
    dg = dg.to(g.dtype)
    s = torch.sigmoid(z)
    # d softplus(z) / dz = sigmoid(z); d sigmoid(z) / dz = sigmoid(z) (1 - sigmoid(z));
    # d softplus(-z) / dz = -sigmoid(-z) = sigmoid(z) - 1
    slope = {DecayForm.MAMBA2: s, DecayForm.RWKV7: s * (1 - s), DecayForm.GLA: s - 1}[form]
    d_logits = -rate * slope * dg
    d_A = (g * dg).sum_to_size(A_log.shape)  # d(-exp(A) f) / dA = -exp(A) f = g
    return d_A, d_logits, d_logits.sum_to_size(bias.shape)


class _LogDecay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, A_log: Tensor, proj: Tensor, bias: Tensor, form: DecayForm, triton: bool) -> Tensor:
        ctx.save_for_backward(A_log, proj, bias)
        ctx.form, ctx.triton = form, triton
        if triton:
            from .triton.log_decay import log_decay_forward_triton

            return log_decay_forward_triton(A_log, proj.contiguous(), bias, form)
        return log_decay_ref(A_log, proj, bias, form)[0]

    @staticmethod
    def backward(ctx, dg: Tensor):
        A_log, proj, bias = ctx.saved_tensors
        if ctx.triton:
            from .triton.log_decay import log_decay_backward_triton

            d_A, d_proj, d_bias = log_decay_backward_triton(A_log, proj.contiguous(), bias, dg.contiguous(), ctx.form)
        else:
            d_A, d_proj, d_bias = _log_decay_backward_ref(A_log, proj, bias, dg, ctx.form)
        return d_A.to(A_log.dtype), d_proj.to(proj.dtype), d_bias.to(bias.dtype), None, None


def gate_log_decay(A_log: Tensor, proj: Tensor, bias: Tensor, *, form: str | DecayForm = "mamba2",
                   backend: str = "auto") -> Tensor:
    """`-exp(A_log) * f(proj + bias)` in at least float32, `f` softplus (`form="mamba2"`),
    sigmoid (`"rwkv7"`) or `softplus(-z)` (`"gla"`). `bias` has the trailing shape of `proj` (`[H]` for a scalar gate,
    `[H, K]` for a channel gate), and `A_log` broadcasts to it (`[H]`, or `[H, 1]` for a
    channel gate)."""
    decay_form = DecayForm.named(form) if isinstance(form, str) else DecayForm(form)
    trailing = tuple(bias.shape)
    a_fits = A_log.dim() <= len(trailing) and all(a in (1, t) for a, t in zip(reversed(A_log.shape), reversed(trailing)))
    if tuple(proj.shape[proj.dim() - len(trailing):]) != trailing or not a_fits:
        raise ValueError(f"gate_log_decay: proj {tuple(proj.shape)} must end in bias's shape {trailing}, "
                         f"and A_log {tuple(A_log.shape)} must broadcast to it")
    triton = resolve_fused_backend(backend, proj.device) == "triton"
    return _LogDecay.apply(A_log, proj, bias, decay_form, triton)
