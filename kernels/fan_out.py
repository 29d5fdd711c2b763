"""Several linear maps of one input, `[x @ W_i^T for each W_i]`, whose input gradient is
summed inside the backward's matmuls.

A mixer projects its normalised input to q, k, v and beta, SwiGLU to its gate and up.
Apart, autograd sums the input's gradient from each projection with an elementwise add
that reads two `[tokens, d_model]` tensors and writes one (on the H200, 32 such adds took
0.76 ms of the 166M DeltaNet step), and autocast's weight casts return each weight's
gradient as a bfloat16 product cast to float32 afterwards (another kernel a weight). Here
one backward accumulates every `dY_i W_i` into one buffer with `addmm_`, whose epilogue
reads the running sum, and forms each weight's gradient in the weight's own dtype inside
its matmul where CUDA offers it (`torch.mm(..., out_dtype=)`; summed in float32 either
way, it skips the rounding to bfloat16 too). In the 166M DeltaNet step on the H200
(`benchmarks/models.py`'s profile at T=2048) the adds went: the device time of the
anatomy's `other` kernels fell from 2.90 to 1.69 ms, while its matmuls' rose from 19.28
to 19.53 ms.

The forward is what autocast gives `F.linear`: the products in autocast's dtype (else the
input's), one cast of each weight a call. The backward runs when the gradients of all the
outputs are there, so the maps joined are those whose gradients arrive together (a
mixer's streams and beta, SwiGLU's gate and up; not an output gate read after the
recurrence, whose gradient would wait through it). `backend="torch"` is `F.linear` per
weight (the definition, and the CPU path); `"auto"` joins them on CUDA, `"triton"` forces
the joined function (the tests run it on the CPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .fused import compute_dtype, resolve_fused_backend, weight_grad

Tensor = torch.Tensor


class _FanOut(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, cdtype: torch.dtype, *weights: Tensor) -> tuple[Tensor, ...]:
        ctx.set_materialize_grads(False)  # an output nobody read sends no gradient: skip its matmuls
        rows = x.reshape(-1, x.shape[-1]).to(cdtype)
        cast = [w.to(cdtype) for w in weights]
        ctx.save_for_backward(rows, *cast)
        ctx.x_shape, ctx.x_dtype, ctx.weight_dtypes = x.shape, x.dtype, [w.dtype for w in weights]
        return tuple((rows @ w.t()).view(*x.shape[:-1], w.shape[0]) for w in cast)

    @staticmethod
    def backward(ctx, *d_outs: Tensor | None):
        rows, *cast = ctx.saved_tensors
        dx = None
        d_weights: list[Tensor | None] = []
        for i, (d_out, w) in enumerate(zip(d_outs, cast)):
            if d_out is None:
                d_weights.append(None)
                continue
            d_rows = d_out.reshape(-1, w.shape[0]).to(w.dtype)
            if ctx.needs_input_grad[0]:
                if dx is None:
                    dx = d_rows @ w
                else:
                    dx.addmm_(d_rows, w)  # summed in the matmul: no add kernel, no second buffer
            d_weights.append(weight_grad(d_rows, rows, ctx.weight_dtypes[i]) if ctx.needs_input_grad[2 + i] else None)
        if dx is not None:
            dx = dx.view(ctx.x_shape).to(ctx.x_dtype)
        return (dx, None, *d_weights)


def fan_out_linear(x: Tensor, weights: list[Tensor], *, backend: str = "auto") -> tuple[Tensor, ...]:
    """`x` `[..., in]`, `weights` `[out_i, in]` each -> `(x @ W_i^T `[..., out_i]`, ...)`, in
    autocast's dtype when it is on (else `x`'s); differentiable in `x` and every weight."""
    if not weights or any(w.dim() != 2 or w.shape[1] != x.shape[-1] for w in weights):
        raise ValueError(f"fan_out_linear: weights must be one or more [out, {x.shape[-1]}] matrices, got "
                         f"{[tuple(w.shape) for w in weights]}")
    if resolve_fused_backend(backend, x.device) != "triton":
        return tuple(F.linear(x, w) for w in weights)
    cdtype = compute_dtype(x)
    with torch.autocast(x.device.type, enabled=False):
        return _FanOut.apply(x, cdtype, *weights)
