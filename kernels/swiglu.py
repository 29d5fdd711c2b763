"""SwiGLU's down projection, `(silu(gate) * up) @ weight^T`, saving only `gate` and `up`.

The product, which the matmul would otherwise keep for its backward, and the SiLU are
recomputed in the backward (as flash-linear-attention's fused SwiGLU-linear does): two
`[tokens, hidden]` tensors less per block. The matmuls run in `compute_dtype` (autocast's,
recorded at the forward, since the backward runs outside autocast); the elementwise part
in float32 (float64 for float64 inputs). On CUDA (`backend="auto"`) the elementwise
forward and backward are one kernel each (`kernels/triton/swiglu.py`); `"torch"` is the
definition, and what runs on the CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .fused import compute_dtype, resolve_fused_backend, weight_grad

Tensor = torch.Tensor


def swiglu_ref(gate: Tensor, up: Tensor, out_dtype: torch.dtype) -> Tensor:
    """`silu(gate) * up` in float32 (float64 for float64 inputs), written in `out_dtype`."""
    acc = torch.promote_types(out_dtype, torch.float32)
    return (F.silu(gate.to(acc)) * up.to(acc)).to(out_dtype)


def _swiglu_backward_ref(gate: Tensor, up: Tensor, dh: Tensor, out_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    acc = torch.promote_types(gate.dtype, torch.float32)
    g, u, d = gate.to(acc), up.to(acc), dh.to(acc)
    s = torch.sigmoid(g)
    d_gate = d * u * s * (1 + g * (1 - s))
    d_up = d * g * s
    return d_gate.to(gate.dtype), d_up.to(up.dtype), swiglu_ref(gate, up, out_dtype)


class _SwiGLUDown(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: Tensor, up: Tensor, weight: Tensor, cdtype: torch.dtype, triton: bool) -> Tensor:
        ctx.save_for_backward(gate, up, weight)
        ctx.cdtype, ctx.triton = cdtype, triton
        if triton:
            from .triton.swiglu import swiglu_forward_triton

            product = swiglu_forward_triton(gate.contiguous(), up.contiguous(), cdtype)
        else:
            product = swiglu_ref(gate, up, cdtype)
        return F.linear(product, weight.to(cdtype))

    @staticmethod
    def backward(ctx, dy: Tensor):
        gate, up, weight = ctx.saved_tensors
        cdtype = ctx.cdtype
        dy = dy.to(cdtype)
        dh = dy @ weight.to(cdtype)
        if ctx.triton:
            from .triton.swiglu import swiglu_backward_triton

            d_gate, d_up, product = swiglu_backward_triton(gate.contiguous(), up.contiguous(), dh.contiguous(), cdtype)
        else:
            d_gate, d_up, product = _swiglu_backward_ref(gate, up, dh, cdtype)
        d_weight = weight_grad(dy.flatten(0, -2), product.flatten(0, -2), weight.dtype)
        return d_gate, d_up, d_weight, None, None


def swiglu_linear(gate: Tensor, up: Tensor, weight: Tensor, *, backend: str = "auto") -> Tensor:
    """`gate`, `up` `[..., hidden]`, `weight` `[out, hidden]` -> `[..., out]`, in autocast's
    dtype when it is on (else the inputs'); differentiable in all three."""
    if gate.shape != up.shape or weight.shape[-1] != gate.shape[-1]:
        raise ValueError(f"swiglu_linear: gate {tuple(gate.shape)} and up {tuple(up.shape)} must match and end in "
                         f"weight's {weight.shape[-1]} columns (weight {tuple(weight.shape)})")
    triton = resolve_fused_backend(backend, gate.device) == "triton"
    return _SwiGLUDown.apply(gate, up, weight, compute_dtype(gate), triton)


def swiglu_joined(gate_up: Tensor, *, backend: str = "auto") -> Tensor:
    """`silu(gate) * up` of `gate_up` `[..., 2 * hidden]`, the two projections' outputs
    side by side (gate first; the decoding step's joined GEMV), in its dtype; no autograd.
    On CUDA one launch that reads the halves in place."""
    if gate_up.shape[-1] % 2 or gate_up.stride(-1) != 1:
        raise ValueError(f"swiglu_joined: gate_up must end in an even, contiguous 2 * hidden columns, got "
                         f"{tuple(gate_up.shape)} strides {gate_up.stride()}")
    with torch.no_grad():
        if resolve_fused_backend(backend, gate_up.device) == "triton":
            from .triton.swiglu import swiglu_joined_triton

            return swiglu_joined_triton(gate_up.reshape(-1, gate_up.shape[-1])).reshape(
                *gate_up.shape[:-1], gate_up.shape[-1] // 2)
        gate, up = gate_up.chunk(2, dim=-1)
        return swiglu_ref(gate, up, gate_up.dtype)
