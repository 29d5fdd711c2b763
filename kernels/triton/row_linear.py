"""The decoding step's matrix-vector products, with the norm or SwiGLU in front fused in.

At batch 1 each linear map of a decoding step reads its weight once and does two flops
per weight element, so its floor is the weight's bytes over the memory bandwidth. cuBLAS's
kernels for these shapes reached 0.3-2.2 TB/s on the H200 (the 2 MB `o_proj` took 6.7 us,
the 5.6 MB `down_proj` a split-K kernel and its reduction), a third of the decoding step.
Here a program owns `block_n` outputs of one row: it streams their `[block_n, K]` slice
of the weight in `[block_n, block_k]` tiles, each multiplied into a float32 tile of
partial sums that is reduced once at the end.

The input row is formed in front of the product, tile by tile beside the weight's, by
every program from the row itself (a few KB, cached after the first program reads it),
and rounded to the activations' dtype as the unfused path's output is (`PRE`):

    PRE_NONE    the row as it is
    PRE_NORM    the pre-norm's residual step `rms_norm(x + h) * w`: the product reads
                `(x + h) * w` and its sums are scaled by the row's `1 / rms` at the end;
                `x + h` (the residual stream after it) written out by the first program
    HEAD_NORM   the mixer's output norm: `rms_norm` of each head's `HEAD` channels (a
                tile holds whole heads) times `w`, times `act(gate)` (`ACT`: SiLU,
                sigmoid or none)
    SWIGLU      `silu(gate) * up` of the joined `[gate | up]` row (`K` = the hidden width)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kinds import accumulation
from .launch import ROW_LINEAR_LAUNCH, RowLinearLaunch, overlapped
from .rms_norm import ACTIVATIONS, gate_activation

Tensor = torch.Tensor

PRE_NONE = tl.constexpr(0)
PRE_NORM = tl.constexpr(1)
HEAD_NORM = tl.constexpr(2)
SWIGLU = tl.constexpr(3)
PROLOGUES = {"none": 0, "norm": 1, "head_norm": 2, "swiglu": 3}


@triton.jit
def _input_tile(row, h, residual, gate, nw, b, i_n, kk, ok, K, gate_stride, eps,
                PRE: tl.constexpr, ADD: tl.constexpr, ACT: tl.constexpr, HEAD: tl.constexpr,
                BLOCK_K: tl.constexpr, OUT: tl.constexpr, ACC: tl.constexpr):
    """Columns `kk` of row `b`'s input to the product, rounded to the activations' dtype
    `OUT` as the unfused path hands it over, and (the pre-norm) their squares."""
    sq = tl.zeros([BLOCK_K], dtype=ACC)
    if PRE == PRE_NORM:
        r = tl.load(row + kk, mask=ok, other=0.0).to(ACC)
        if ADD:  # the residual stream `x + h`, rounded as the unfused pre-norm stores it
            r = (r + tl.load(h + b * K + kk, mask=ok, other=0.0).to(ACC)).to(residual.dtype.element_ty)
            if i_n == 0:
                tl.store(residual + b * K + kk, r, mask=ok)
            r = r.to(ACC)
        sq = r * r
        y = r * tl.load(nw + kk, mask=ok, other=0.0).to(ACC)
    elif PRE == HEAD_NORM:  # the tile holds whole heads: each its own mean square
        xv = tl.reshape(tl.load(row + kk, mask=ok, other=0.0).to(ACC), (BLOCK_K // HEAD, HEAD))
        xv = xv / tl.sqrt(tl.sum(xv * xv, 1) / HEAD + eps)[:, None]
        y = tl.reshape(xv, (BLOCK_K,)) * tl.load(nw + kk % HEAD, mask=ok, other=0.0).to(ACC)
        if ACT != 0:
            y = y * gate_activation(tl.load(gate + b * gate_stride + kk, mask=ok, other=0.0).to(ACC), ACT)
    elif PRE == SWIGLU:
        g = tl.load(row + kk, mask=ok, other=0.0).to(ACC)
        y = g * tl.sigmoid(g) * tl.load(row + K + kk, mask=ok, other=0.0).to(ACC)
    else:
        y = tl.load(row + kk, mask=ok, other=0.0).to(ACC)
    return y.to(OUT).to(ACC), sq


@triton.jit
def row_linear_kernel(
    x, h, residual, gate, nw, w, bias, out, N, K, x_stride, gate_stride, eps,
    PRE: tl.constexpr, ADD: tl.constexpr, ACT: tl.constexpr, HEAD: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, OVERLAP: tl.constexpr, ACC: tl.constexpr,
):
    i_n, b = tl.program_id(0), tl.program_id(1).to(tl.int64)
    nn = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = nn < N
    row = x + b * x_stride
    w_rows = w + nn[:, None].to(tl.int64) * K
    # The first weight tile is loaded before anything the kernels before this one write:
    # with OVERLAP (programmatic dependent launch) it streams in while they finish.
    kk = tl.arange(0, BLOCK_K)
    ok = kk < K
    wt = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & ok[None, :], other=0.0)
    if OVERLAP:
        tl.extra.cuda.gdc_wait()  # the kernel before has finished and its writes are visible
        tl.extra.cuda.gdc_launch_dependents()
    y, sq = _input_tile(row, h, residual, gate, nw, b, i_n, kk, ok, K, gate_stride, eps, PRE, ADD, ACT, HEAD, BLOCK_K,
                        out.dtype.element_ty, ACC)
    acc = wt.to(ACC) * y[None, :]
    # One pass over the rest: the pre-norm's 1 / rms is one number per row, so it scales
    # the finished sums instead of the input.
    for k0 in range(BLOCK_K, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        ok = kk < K
        wt = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & ok[None, :], other=0.0)
        y, sq_k = _input_tile(row, h, residual, gate, nw, b, i_n, kk, ok, K, gate_stride, eps, PRE, ADD, ACT, HEAD,
                              BLOCK_K, out.dtype.element_ty, ACC)
        acc += wt.to(ACC) * y[None, :]
        sq += sq_k
    o = tl.sum(acc, 1)
    if PRE == PRE_NORM:
        o = o / tl.sqrt(tl.sum(sq, 0) / K + eps)
    if HAS_BIAS:
        o += tl.load(bias + nn, mask=n_ok, other=0.0).to(ACC)
    tl.store(out + b * N + nn, o.to(out.dtype.element_ty), mask=n_ok)


def row_linear_triton(x: Tensor, weight: Tensor, bias: Tensor | None, *, prologue: str = "none",
                      pending: Tensor | None = None, norm_weight: Tensor | None = None, eps: float = 1e-6,
                      gate: Tensor | None = None, activation: str = "none", head: int = 0,
                      launch: RowLinearLaunch | None = None, weight_settled: bool = True) -> tuple[Tensor, Tensor | None]:
    """`kernels.row_linear` on one launch (arguments checked there): `x` `[B, K]` (`[B, 2K]`
    for SwiGLU) with contiguous rows, `weight` `[N, K]` contiguous; `pending`, `gate`
    `[B, K]` rows. Returns `[B, N]` in `x`'s dtype, and the residual `x + pending` for
    the pre-norm. Launched overlapped (`launch.overlapped`), the kernel reads its first
    weight tile before waiting for the kernel before it: `weight_settled=False` (a weight
    that kernel may have written, such as a copy made just now) launches it plainly."""
    B, N, K = x.shape[0], weight.shape[0], weight.shape[1]
    out = torch.empty(B, N, device=x.device, dtype=x.dtype)
    residual = torch.empty(B, K, device=x.device, dtype=torch.promote_types(x.dtype, pending.dtype)) \
        if pending is not None else None
    if B == 0:
        return out, residual
    launch = launch or ROW_LINEAR_LAUNCH[prologue]
    overlap = weight_settled and overlapped(x.device)
    # a head-norm tile holds whole heads
    block_k = head * max(1, launch.block_k // head) if prologue == "head_norm" else launch.block_k
    acc = accumulation(weight.dtype if weight.dtype == torch.float64 else x.dtype)[1]
    grid = (triton.cdiv(N, launch.block_n), B)
    row_linear_kernel[grid](
        x, x if pending is None else pending, x if residual is None else residual, x if gate is None else gate,
        x if norm_weight is None else norm_weight, weight, x if bias is None else bias, out, N, K, x.stride(0),
        0 if gate is None else gate.stride(0), float(eps),
        PRE=PROLOGUES[prologue], ADD=pending is not None, ACT=ACTIVATIONS[activation], HEAD=max(head, 1),
        HAS_BIAS=bias is not None, BLOCK_N=launch.block_n, BLOCK_K=block_k, OVERLAP=overlap, ACC=acc,
        num_warps=launch.num_warps, num_stages=launch.num_stages, **({"launch_pdl": True} if overlap else {}),
    )
    return out, residual
