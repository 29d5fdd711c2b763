"""SwiGLU's elementwise part, `silu(gate) * up`, forward and backward, in float32 registers.

The MLP's down projection reads the product; its backward needs the product again (for
the weight's gradient) and `d gate`, `d up` from the product's gradient `dh`. Both are one
pass over `[tokens, hidden]` here: the forward reads gate and up and writes the product;
the backward reads gate, up and dh and writes `d gate`, `d up` and the product, recomputed
rather than saved. In plain torch the same backward is about ten float32 elementwise
kernels and casts, each a full pass over the tensor.

`d silu(g) / dg = s (1 + g (1 - s))` with `s = sigmoid(g)`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kinds import accumulation
from .launch import SWIGLU_LAUNCH, SwiGLULaunch

Tensor = torch.Tensor


@triton.jit
def swiglu_forward_kernel(gate, up, product, N, hidden, row_stride, BLOCK: tl.constexpr, JOINED: tl.constexpr,
                          ACC: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    src = offs
    if JOINED:  # the two halves of one joined row: rows of `hidden` every `row_stride` elements
        src = (offs // hidden) * row_stride + offs % hidden
    g = tl.load(gate + src, mask=mask, other=0.0).to(ACC)
    u = tl.load(up + src, mask=mask, other=0.0).to(ACC)
    tl.store(product + offs, (g * tl.sigmoid(g) * u).to(product.dtype.element_ty), mask=mask)


@triton.jit
def swiglu_backward_kernel(gate, up, dh, d_gate, d_up, product, N, BLOCK: tl.constexpr, ACC: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    g = tl.load(gate + offs, mask=mask, other=0.0).to(ACC)
    u = tl.load(up + offs, mask=mask, other=0.0).to(ACC)
    d = tl.load(dh + offs, mask=mask, other=0.0).to(ACC)
    s = tl.sigmoid(g)
    silu = g * s
    tl.store(d_gate + offs, (d * u * s * (1.0 + g * (1.0 - s))).to(d_gate.dtype.element_ty), mask=mask)
    tl.store(d_up + offs, (d * silu).to(d_up.dtype.element_ty), mask=mask)
    tl.store(product + offs, (silu * u).to(product.dtype.element_ty), mask=mask)


def swiglu_forward_triton(gate: Tensor, up: Tensor, out_dtype: torch.dtype,
                          launch: SwiGLULaunch = SWIGLU_LAUNCH) -> Tensor:
    """`silu(gate) * up` in `out_dtype`; `gate`, `up` contiguous, of one shape."""
    hidden = gate.shape[-1]
    return _swiglu_forward(gate, up, gate.shape, hidden, out_dtype, launch)


def swiglu_joined_triton(gate_up: Tensor, launch: SwiGLULaunch = SWIGLU_LAUNCH) -> Tensor:
    """`silu(gate) * up` of `gate_up` `[..., 2 * hidden]` (gate first, contiguous rows), in
    its dtype: the halves read in place."""
    hidden = gate_up.shape[-1] // 2
    return _swiglu_forward(gate_up, gate_up[..., hidden:], (*gate_up.shape[:-1], hidden), 2 * hidden, gate_up.dtype,
                           launch)


def _swiglu_forward(gate: Tensor, up: Tensor, shape: tuple, row_stride: int, out_dtype: torch.dtype,
                    launch: SwiGLULaunch) -> Tensor:
    product = torch.empty(shape, device=gate.device, dtype=out_dtype)
    N, hidden = product.numel(), shape[-1]
    if N:
        swiglu_forward_kernel[(triton.cdiv(N, launch.block),)](
            gate, up, product, N, hidden, row_stride, BLOCK=launch.block, JOINED=row_stride != hidden,
            ACC=accumulation(gate.dtype)[1], num_warps=launch.num_warps)
    return product


def swiglu_backward_triton(gate: Tensor, up: Tensor, dh: Tensor, out_dtype: torch.dtype,
                           launch: SwiGLULaunch = SWIGLU_LAUNCH) -> tuple[Tensor, Tensor, Tensor]:
    """(`d gate` like gate, `d up` like up, the product in `out_dtype`) from the product's
    gradient `dh`; all contiguous, of one shape."""
    d_gate, d_up = torch.empty_like(gate), torch.empty_like(up)
    product = torch.empty(gate.shape, device=gate.device, dtype=out_dtype)
    N = gate.numel()
    if N:
        swiglu_backward_kernel[(triton.cdiv(N, launch.block),)](
            gate, up, dh, d_gate, d_up, product, N, BLOCK=launch.block, ACC=accumulation(gate.dtype)[1],
            num_warps=launch.num_warps)
    return d_gate, d_up, product
