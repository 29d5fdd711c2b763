"""RMSNorm over the last axis with an optional output gate: `x * rstd(x) * w * act(gate)`.

`act` is `none` (plain RMSNorm: the blocks' pre-norms, DeltaNet's read-out), `silu` (Gated
DeltaNet's read-out) or `sigmoid` (KDA's), as flash-linear-attention's `FusedRMSNormGated`.
`rms_norm_ref` is the definition in float32 torch (the CPU path); on CUDA
`rms_norm(..., backend="auto")` runs `kernels/triton/rms_norm.py`, one kernel forward and
one backward that recomputes the normalised rows instead of saving them.

The output dtype is the caller's (`out_dtype`): under bfloat16 autocast the norm writes
bfloat16 rows for the projection that reads them, so the float32 residual stream is read
once and no float32 copy of the normalised rows is kept for the backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .fused import resolve_fused_backend

Tensor = torch.Tensor

GATE_ACTIVATIONS = ("none", "silu", "sigmoid")


def rms_norm_ref(x: Tensor, weight: Tensor, gate: Tensor | None = None, *, eps: float = 1e-6,
                 activation: str = "none", out_dtype: torch.dtype | None = None) -> Tensor:
    """The definition, in float32 (float64 for float64 inputs)."""
    acc = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(acc)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.to(acc)
    if activation == "silu":
        y = y * F.silu(gate.to(acc))
    elif activation == "sigmoid":
        y = y * torch.sigmoid(gate.to(acc))
    return y.to(out_dtype or x.dtype)


class _RMSNormTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, gate: Tensor | None, eps: float, activation: str, out_dtype: torch.dtype):
        from .triton.rms_norm import rms_norm_forward_triton

        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).contiguous()
        g2 = None if gate is None else gate.reshape(-1, shape[-1]).contiguous()
        y, rstd = rms_norm_forward_triton(x2, weight.contiguous(), g2, eps, activation, out_dtype)
        ctx.save_for_backward(x2, weight, g2, rstd)
        ctx.activation, ctx.shape = activation, shape
        return y.reshape(shape)

    @staticmethod
    def backward(ctx, dy: Tensor):
        from .triton.rms_norm import rms_norm_backward_triton

        x2, weight, g2, rstd = ctx.saved_tensors
        dx, dgate, dw = rms_norm_backward_triton(
            x2, weight.contiguous(), g2, rstd, dy.reshape(x2.shape).contiguous(), ctx.activation
        )
        shape = ctx.shape
        return dx.reshape(shape), dw.to(weight.dtype), None if dgate is None else dgate.reshape(shape), None, None, None


def rms_norm(x: Tensor, weight: Tensor, gate: Tensor | None = None, *, eps: float = 1e-6, activation: str = "none",
             out_dtype: torch.dtype | None = None, backend: str = "auto") -> Tensor:
    """`x` `[..., D]`, `weight` `[D]`, `gate` like `x` (needed unless `activation="none"`).

    Returns `[..., D]` in `out_dtype` (default `x.dtype`); differentiable in all three.
    """
    if activation not in GATE_ACTIVATIONS:
        raise ValueError(f"rms_norm: activation must be one of {GATE_ACTIVATIONS}, got {activation!r}")
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm: weight must be [{x.shape[-1]}], got {tuple(weight.shape)}")
    if (activation == "none") != (gate is None):
        raise ValueError(f"rms_norm: activation {activation!r} {'takes no' if gate is not None else 'needs a'} gate")
    if gate is not None and gate.shape != x.shape:
        raise ValueError(f"rms_norm: gate must have x's shape {tuple(x.shape)}, got {tuple(gate.shape)}")
    out_dtype = out_dtype or x.dtype
    if resolve_fused_backend(backend, x.device) == "triton":
        return _RMSNormTriton.apply(x, weight, gate, eps, activation, out_dtype)
    return rms_norm_ref(x, weight, gate, eps=eps, activation=activation, out_dtype=out_dtype)
