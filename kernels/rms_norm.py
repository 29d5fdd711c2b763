"""RMSNorm over the last axis with an optional output gate: `x * rstd(x) * w * act(gate)`.

`act` is `none` (plain RMSNorm: the blocks' pre-norms, DeltaNet's read-out), `silu` (Gated
DeltaNet's read-out) or `sigmoid` (KDA's), as flash-linear-attention's `FusedRMSNormGated`.
`rms_norm_ref` is the definition in float32 torch (the CPU path); on CUDA
`rms_norm(..., backend="auto")` runs `kernels/triton/rms_norm.py`, one kernel forward and
one backward that recomputes the normalised rows instead of saving them.

`add_rms_norm` is a pre-norm block's residual step, `(RMSNorm(x + h), x + h)`, the
addition fused into the same kernels (forward and backward) on CUDA.

The output dtype is the caller's (`out_dtype`): under bfloat16 autocast the norm writes
bfloat16 rows for the projection that reads them, so the float32 residual stream is read
once and no float32 copy of the normalised rows is kept for the backward.

A pre-norm's CUDA path (`add_rms_norm`, and `rms_norm(..., keep_output=True)`) keeps its
output, not its input, for the backward (`keeps_output`): the rows come back as `y / w`.
The projection after a pre-norm keeps `y` anyway, so a pre-norm costs its backward one
float a row instead of the float32 residual stream (4 bytes a feature, twice a block).
Elsewhere (attention's q/k norms, whose output the next op does not keep) that would save
nothing and cost precision, so `rms_norm` keeps its input by default. The weight's
magnitude is floored at 1e-12 for it (`triton/rms_norm.py`), within float32's rounding of
the definition. The backward then reads rows rounded to bfloat16: on random rows (1024 x
1024, against float64) the weight's gradient is within 3.3e-3 (a linear layer's weight
gradient under bfloat16 autocast: 2.4e-3) and the stream's within 1.9e-4 (6e-8 from the
float32 rows).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .fused import resolve_fused_backend

Tensor = torch.Tensor

GATE_ACTIVATIONS = ("none", "silu", "sigmoid")

# Output dtypes with float32's exponent range: `x * rstd * w` keeps every row value that
# matters as a normal number, so the backward can read the rows back from the output.
# float16 (smallest normal 6e-5) would flush small values, so its norms keep their input.
OUTPUT_KEEPING_DTYPES = (torch.bfloat16, torch.float32, torch.float64)


def keeps_output(activation: str, out_dtype: torch.dtype) -> bool:
    """Whether a norm asked to keep its output can: ungated, in a dtype with float32's range."""
    return activation == "none" and out_dtype in OUTPUT_KEEPING_DTYPES


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
    def forward(ctx, x: Tensor, weight: Tensor, gate: Tensor | None, eps: float, activation: str, out_dtype: torch.dtype,
                keep_output: bool):
        from .triton.rms_norm import rms_norm_forward_triton

        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).contiguous()
        g2 = None if gate is None else gate.reshape(-1, shape[-1]).contiguous()
        from_output = keep_output and keeps_output(activation, out_dtype)
        y, rstd, _ = rms_norm_forward_triton(x2, weight.contiguous(), g2, eps, activation, out_dtype,
                                             floor_weight=from_output)
        ctx.save_for_backward(y if from_output else x2, weight, g2, rstd)
        ctx.activation, ctx.shape, ctx.from_output, ctx.x_dtype = activation, shape, from_output, x.dtype
        return y.reshape(shape)

    @staticmethod
    def backward(ctx, dy: Tensor):
        from .triton.rms_norm import rms_norm_backward_triton

        rows, weight, g2, rstd = ctx.saved_tensors
        dx, dgate, dw, _ = rms_norm_backward_triton(
            rows, weight.contiguous(), g2, rstd, dy.reshape(rows.shape).contiguous(), ctx.activation,
            from_output=ctx.from_output, x_dtype=ctx.x_dtype,
        )
        shape = ctx.shape
        return dx.reshape(shape), dw.to(weight.dtype), None if dgate is None else dgate.reshape(shape), None, None, None, None


def rms_norm(x: Tensor, weight: Tensor, gate: Tensor | None = None, *, eps: float = 1e-6, activation: str = "none",
             out_dtype: torch.dtype | None = None, backend: str = "auto", keep_output: bool = False) -> Tensor:
    """`x` `[..., D]`, `weight` `[D]`, `gate` like `x` (needed unless `activation="none"`).

    Returns `[..., D]` in `out_dtype` (default `x.dtype`); differentiable in all three.
    `keep_output`: a pre-norm, whose output the next op keeps anyway: the CUDA path keeps
    that output for its backward instead of `x` where it can (module docstring).
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
        return _RMSNormTriton.apply(x, weight, gate, eps, activation, out_dtype, keep_output)
    return rms_norm_ref(x, weight, gate, eps=eps, activation=activation, out_dtype=out_dtype)


class _AddRMSNormTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, h: Tensor, weight: Tensor, eps: float, out_dtype: torch.dtype):
        from .triton.rms_norm import rms_norm_forward_triton

        shape = x.shape
        residual_dtype = torch.promote_types(x.dtype, h.dtype)
        from_output = keeps_output("none", out_dtype)
        y, rstd, r = rms_norm_forward_triton(x.reshape(-1, shape[-1]).contiguous(), weight.contiguous(), None, eps,
                                             "none", out_dtype, h=h.reshape(-1, shape[-1]).contiguous(),
                                             residual_dtype=residual_dtype, floor_weight=from_output)
        ctx.save_for_backward(y if from_output else r, weight, rstd)
        ctx.shape, ctx.x_dtype, ctx.h_dtype, ctx.residual_dtype = shape, x.dtype, h.dtype, residual_dtype
        ctx.from_output = from_output
        return y.reshape(shape), r.reshape(shape)

    @staticmethod
    def backward(ctx, dy: Tensor | None, d_residual: Tensor | None):
        from .triton.rms_norm import rms_norm_backward_triton

        rows, weight, rstd = ctx.saved_tensors
        if dy is None:
            dy = torch.zeros(rows.shape, device=rows.device, dtype=rows.dtype)
        dr = None if d_residual is None else d_residual.reshape(rows.shape).to(ctx.residual_dtype).contiguous()
        dx, _, dw, dh = rms_norm_backward_triton(rows, weight.contiguous(), None, rstd,
                                                 dy.reshape(rows.shape).contiguous(), "none", d_residual=dr,
                                                 h_dtype=ctx.h_dtype, from_output=ctx.from_output,
                                                 x_dtype=ctx.residual_dtype)
        shape = ctx.shape
        return dx.to(ctx.x_dtype).reshape(shape), dh.reshape(shape), dw.to(weight.dtype), None, None


def add_rms_norm(x: Tensor, h: Tensor | None, weight: Tensor, *, eps: float = 1e-6,
                 out_dtype: torch.dtype | None = None, backend: str = "auto") -> tuple[Tensor, Tensor]:
    """A pre-norm block's residual step: `(rms_norm(x + h), x + h)`, or `(rms_norm(x), x)`
    without `h`. `x + h` takes torch's promoted dtype (float32 for a float32 stream and a
    bfloat16 `h`); `y` is in `out_dtype` (default that dtype). On CUDA the addition is fused
    into the norm, forward and backward."""
    if h is None:
        return rms_norm(x, weight, eps=eps, out_dtype=out_dtype, backend=backend, keep_output=True), x
    if h.shape != x.shape:
        raise ValueError(f"add_rms_norm: h must have x's shape {tuple(x.shape)}, got {tuple(h.shape)}")
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"add_rms_norm: weight must be [{x.shape[-1]}], got {tuple(weight.shape)}")
    residual_dtype = torch.promote_types(x.dtype, h.dtype)
    out_dtype = out_dtype or residual_dtype
    if resolve_fused_backend(backend, x.device) == "triton":
        return _AddRMSNormTriton.apply(x, h, weight, eps, out_dtype)
    r = x + h
    return rms_norm_ref(r, weight, eps=eps, out_dtype=out_dtype), r
