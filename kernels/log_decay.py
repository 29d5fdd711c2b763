"""The decay gates' log decay, `g = -exp(A_log) * softplus(proj + dt_bias)`, saving only
its inputs.

Gated DeltaNet's scalar gate and KDA's channel gate follow Mamba2's parameterisation (as
in flash-linear-attention). `g` is formed in float32 (float64 for float64 inputs): the
chunk kernel sums log decays over a chunk, and bfloat16's 8-bit mantissa would put errors
of about 1% into every decay. Its float32 intermediates (the biased logits, their
softplus) are recomputed in the backward rather than saved: for a channel gate at 16k
tokens and 1,024 channels they would be 128 MB a layer.

On CUDA (`backend="auto"`) the forward and the backward are one kernel each
(`kernels/triton/log_decay.py`); in plain torch, the definition and what runs on the CPU,
they are about five and ten float32 elementwise kernels, each a pass over `[tokens,
channels]`. The backward's sums over tokens (the gradients of `A_log` and `dt_bias`) come
from per-block partial sums.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .fused import resolve_fused_backend

Tensor = torch.Tensor


def log_decay_ref(A_log: Tensor, proj: Tensor, dt_bias: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """`(g, exp(A_log), proj + dt_bias)` in at least float32."""
    dtype = torch.promote_types(proj.dtype, torch.float32)
    z = proj.to(dtype) + dt_bias.to(dtype)
    rate = torch.exp(A_log.to(dtype))
    return -rate * F.softplus(z), rate, z


def _log_decay_backward_ref(A_log: Tensor, proj: Tensor, dt_bias: Tensor, dg: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    g, rate, z = log_decay_ref(A_log, proj, dt_bias)
    dg = dg.to(g.dtype)
    d_logits = -rate * torch.sigmoid(z) * dg  # d softplus(z) / dz = sigmoid(z)
    d_A = (g * dg).sum_to_size(A_log.shape)  # d(-exp(A) s) / dA = -exp(A) s = g
    return d_A, d_logits, d_logits.sum_to_size(dt_bias.shape)


class _LogDecay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, A_log: Tensor, proj: Tensor, dt_bias: Tensor, triton: bool) -> Tensor:
        ctx.save_for_backward(A_log, proj, dt_bias)
        ctx.triton = triton
        if triton:
            from .triton.log_decay import log_decay_forward_triton

            return log_decay_forward_triton(A_log, proj.contiguous(), dt_bias)
        return log_decay_ref(A_log, proj, dt_bias)[0]

    @staticmethod
    def backward(ctx, dg: Tensor):
        A_log, proj, dt_bias = ctx.saved_tensors
        if ctx.triton:
            from .triton.log_decay import log_decay_backward_triton

            d_A, d_proj, d_bias = log_decay_backward_triton(A_log, proj.contiguous(), dt_bias, dg.contiguous())
        else:
            d_A, d_proj, d_bias = _log_decay_backward_ref(A_log, proj, dt_bias, dg)
        return d_A.to(A_log.dtype), d_proj.to(proj.dtype), d_bias.to(dt_bias.dtype), None


def mamba_log_decay(A_log: Tensor, proj: Tensor, dt_bias: Tensor, *, backend: str = "auto") -> Tensor:
    """`-exp(A_log) * softplus(proj + dt_bias)` in at least float32. `dt_bias` has the
    trailing shape of `proj` (`[H]` for a scalar gate, `[H, K]` for a channel gate), and
    `A_log` broadcasts to it (`[H]`, or `[H, 1]` for a channel gate)."""
    trailing = tuple(dt_bias.shape)
    a_fits = A_log.dim() <= len(trailing) and all(a in (1, t) for a, t in zip(reversed(A_log.shape), reversed(trailing)))
    if tuple(proj.shape[proj.dim() - len(trailing):]) != trailing or not a_fits:
        raise ValueError(f"mamba_log_decay: proj {tuple(proj.shape)} must end in dt_bias's shape {trailing}, "
                         f"and A_log {tuple(A_log.shape)} must broadcast to it")
    triton = resolve_fused_backend(backend, proj.device) == "triton"
    return _LogDecay.apply(A_log, proj, dt_bias, triton)
