"""The short causal depthwise convolution with its SiLU (and, optionally, the per-head L2
normalisation that unit keys need), forward and backward, recomputing the pre-activation.

`z[t, c] = sum_j w[c, j] * x[t - (W-1) + j, c]`, reading the sequence's carried tail (or
zeros) before its first token and never across a document boundary of a packed batch;
`y = normalize(silu(z))`. The backward recomputes `z` (and the norm) from `x` instead of
saving it, in two passes: the first forms `dz` at each tile of positions (into a float32
`[B, T, C]` buffer) and the weight's gradient there; the second reads `dz` back for
`dx[t] = sum_i w[c, W-1-i] * dz[t+i]`. (One pass that recomputed `dz` at the `W-1`
positions after its tile loaded x W*W + 2W times a tile; on the H200 it took 7x the
forward's time. One pass whose programs own `block_t - (W-1)` positions and gather the
W-1 after them from their own tile (commit 13686c9) moved 6 bytes a channel and token
against these two passes' 14, yet in the 166M DeltaNet step on the H200 it took 0.222 ms
a call (8 warps) against 0.155 for the two passes, and its 8 warps slowed the forward
from 0.034 to 0.050 ms.) The weight's gradient is summed per program into a float32
`[programs, C, W]` buffer; the tail's (only when decoding with gradients) is left to the
caller (`kernels/short_conv.py`).

Layout: `x`, `y` `[B, T, C]` contiguous; with `cu_seqlens` B is 1 and `starts[t]` /
`docs[t]` give each token's document start and index. With normalisation a program's
channels are one head (`HEAD` consecutive channels), so the norm is a row sum in registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kinds import accumulation
from .launch import SHORT_CONV_LAUNCH, ShortConvLaunch

Tensor = torch.Tensor


@triton.jit
def _tap(x, tail, b, tt, cc, tok_ok, ch_ok, start, doc, T, C, j: tl.constexpr, W: tl.constexpr, HAS_TAIL: tl.constexpr,
         ACC: tl.constexpr):
    """Tap j's input at positions `tt`: `x[tt - (W-1) + j]` within the sequence, the
    carried tail before its start (zeros without one)."""
    src = tt - (W - 1) + j
    inseq = src >= start
    m = (tok_ok & inseq)[:, None] & ch_ok[None, :]
    xj = tl.load(x + (b * T + src).to(tl.int64)[:, None] * C + cc[None, :], mask=m, other=0.0).to(ACC)
    if HAS_TAIL:
        ti = (W - 1) + src - start
        mt = (tok_ok & (src < start))[:, None] & ch_ok[None, :]
        xj += tl.load(tail + (doc * (W - 1) + ti).to(tl.int64)[:, None] * C + cc[None, :], mask=mt, other=0.0).to(ACC)
    return xj


@triton.jit
def _conv_at(x, w, tail, b, tt, cc, tok_ok, ch_ok, start, doc, T, C,
             W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, HAS_TAIL: tl.constexpr, ACC: tl.constexpr):
    acc = tl.zeros([BT, BC], dtype=ACC)
    for j in tl.static_range(W):
        xj = _tap(x, tail, b, tt, cc, tok_ok, ch_ok, start, doc, T, C, j, W, HAS_TAIL, ACC)
        wj = tl.load(w + cc * W + j, mask=ch_ok, other=0.0).to(ACC)
        acc += xj * wj[None, :]
    return acc


@triton.jit
def _dz_at(x, w, tail, dy, b, tt, cc, tok_ok, ch_ok, start, doc, T, C, eps,
           W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, ACT: tl.constexpr, NORM: tl.constexpr,
           HAS_TAIL: tl.constexpr, ACC: tl.constexpr):
    """`dL/dz` at positions `tt` (zero where `tok_ok` is false), recomputing z."""
    z = _conv_at(x, w, tail, b, tt, cc, tok_ok, ch_ok, start, doc, T, C, W, BT, BC, HAS_TAIL, ACC)
    m = tok_ok[:, None] & ch_ok[None, :]
    g = tl.load(dy + (b * T + tt).to(tl.int64)[:, None] * C + cc[None, :], mask=m, other=0.0).to(ACC)
    if ACT:
        s = tl.sigmoid(z)
        u = z * s
        dact = s * (1.0 + z * (1.0 - s))
    else:
        u = z
        dact = 1.0
    if NORM:
        # y = u / max(|u|, eps): du = (dy - y (y . dy)) / |u|, or dy / eps where clamped.
        n = tl.sqrt(tl.sum(u * u, 1))
        denom = tl.maximum(n, eps)
        yv = u / denom[:, None]
        proj = tl.where(n > eps, tl.sum(yv * g, 1), 0.0)
        g = (g - yv * proj[:, None]) / denom[:, None]
    return g * dact


@triton.jit
def _tile(i_t, i_c, b, starts, docs, T, C,
          BT: tl.constexpr, BC: tl.constexpr, HEAD: tl.constexpr, NORM: tl.constexpr, VARLEN: tl.constexpr):
    tt = i_t * BT + tl.arange(0, BT)
    tok_ok = tt < T
    if NORM:
        cc = i_c * HEAD + tl.arange(0, BC)
        ch_ok = tl.arange(0, BC) < HEAD
    else:
        cc = i_c * BC + tl.arange(0, BC)
        ch_ok = cc < C
    if VARLEN:
        start = tl.load(starts + tt, mask=tok_ok, other=0)
        doc = tl.load(docs + tt, mask=tok_ok, other=0)
    else:
        start = tl.zeros([BT], dtype=tl.int32)
        doc = tl.zeros([BT], dtype=tl.int32) + b
    return tt, tok_ok, cc, ch_ok, start, doc


@triton.jit(do_not_specialize=["T"])
def short_conv_forward_kernel(
    x, w, tail, starts, docs, y, T, C, eps,
    W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, HEAD: tl.constexpr,
    ACT: tl.constexpr, NORM: tl.constexpr, HAS_TAIL: tl.constexpr, VARLEN: tl.constexpr, ACC: tl.constexpr,
):
    i_t, i_c, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    tt, tok_ok, cc, ch_ok, start, doc = _tile(i_t, i_c, b, starts, docs, T, C, BT, BC, HEAD, NORM, VARLEN)
    u = _conv_at(x, w, tail, b, tt, cc, tok_ok, ch_ok, start, doc, T, C, W, BT, BC, HAS_TAIL, ACC)
    if ACT:
        u = u * tl.sigmoid(u)
    if NORM:
        u = u / tl.maximum(tl.sqrt(tl.sum(u * u, 1)), eps)[:, None]
    m = tok_ok[:, None] & ch_ok[None, :]
    tl.store(y + (b * T + tt).to(tl.int64)[:, None] * C + cc[None, :], u.to(y.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["T"])
def short_conv_dz_kernel(
    x, w, tail, starts, docs, dy, dz, dw_partial, T, C, eps,
    W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, HEAD: tl.constexpr,
    ACT: tl.constexpr, NORM: tl.constexpr, HAS_TAIL: tl.constexpr, VARLEN: tl.constexpr, ACC: tl.constexpr,
):
    """`dz` at this tile (z recomputed from x) into a float32 buffer, and the weight's
    gradient summed over the tile: tap j meets `dz[t] * input[t - (W-1) + j]`."""
    i_t, i_c, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    tt, tok_ok, cc, ch_ok, start, doc = _tile(i_t, i_c, b, starts, docs, T, C, BT, BC, HEAD, NORM, VARLEN)
    g = _dz_at(x, w, tail, dy, b, tt, cc, tok_ok, ch_ok, start, doc, T, C, eps, W, BT, BC, ACT, NORM, HAS_TAIL, ACC)
    m = tok_ok[:, None] & ch_ok[None, :]
    tl.store(dz + (b * T + tt).to(tl.int64)[:, None] * C + cc[None, :], g, mask=m)
    part = ((b * tl.num_programs(0) + i_t) * C + cc) * W
    for j in tl.static_range(W):
        xj = _tap(x, tail, b, tt, cc, tok_ok, ch_ok, start, doc, T, C, j, W, HAS_TAIL, ACC)
        tl.store(dw_partial + part + j, tl.sum(g * xj, 0), mask=ch_ok)


@triton.jit(do_not_specialize=["T"])
def short_conv_dx_kernel(
    w, starts, dz, dx, T, C,
    W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, VARLEN: tl.constexpr, ACC: tl.constexpr,
):
    """`dx[t] = sum_i w[W-1-i] * dz[t+i]` over the positions `t+i` of x's own sequence."""
    i_t, i_c, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    tt = i_t * BT + tl.arange(0, BT)
    cc = i_c * BC + tl.arange(0, BC)
    tok_ok, ch_ok = tt < T, cc < C
    if VARLEN:
        start = tl.load(starts + tt, mask=tok_ok, other=0)
    acc = tl.zeros([BT, BC], dtype=ACC)
    for i in tl.static_range(W):
        t2 = tt + i
        ok2 = tok_ok & (t2 < T)
        if VARLEN:
            ok2 = ok2 & (tl.load(starts + t2, mask=ok2, other=-1) == start)
        d = tl.load(dz + (b * T + t2).to(tl.int64)[:, None] * C + cc[None, :], mask=ok2[:, None] & ch_ok[None, :],
                    other=0.0).to(ACC)
        acc += d * tl.load(w + cc * W + (W - 1 - i), mask=ch_ok, other=0.0).to(ACC)[None, :]
    m = tok_ok[:, None] & ch_ok[None, :]
    tl.store(dx + (b * T + tt).to(tl.int64)[:, None] * C + cc[None, :], acc.to(dx.dtype.element_ty), mask=m)


def _grid_shape(T: int, C: int, B: int, head: int, block_t: int, launch: ShortConvLaunch) -> tuple[tuple[int, int, int], int]:
    if head:
        return (triton.cdiv(T, block_t), C // head, B), triton.next_power_of_2(head)
    block_c = min(launch.block_c, triton.next_power_of_2(C))
    return (triton.cdiv(T, block_t), triton.cdiv(C, block_c), B), block_c


def short_conv_forward_triton(
    x: Tensor, w: Tensor, tail: Tensor | None, starts: Tensor | None, docs: Tensor | None, *,
    activation: bool, head: int, eps: float, launch: ShortConvLaunch = SHORT_CONV_LAUNCH,
) -> Tensor:
    """`x` `[B, T, C]`, `w` `[C, W]`, `tail` `[B or N, W-1, C]` or None, `starts`/`docs`
    `[T]` int32 (packed) or None; `head` > 0 normalises each group of `head` channels."""
    B, T, C = x.shape
    W = w.shape[1]
    y = torch.empty_like(x)
    if T == 0:
        return y
    grid, block_c = _grid_shape(T, C, B, head, launch.block_t, launch)
    short_conv_forward_kernel[grid](
        x, w, x if tail is None else tail, x if starts is None else starts, x if docs is None else docs, y, T, C, float(eps),
        W=W, BT=launch.block_t, BC=block_c, HEAD=max(head, 1), ACT=activation, NORM=head > 0,
        HAS_TAIL=tail is not None, VARLEN=starts is not None, ACC=accumulation(x.dtype)[1], num_warps=launch.num_warps,
    )
    return y


def short_conv_backward_triton(
    x: Tensor, w: Tensor, tail: Tensor | None, starts: Tensor | None, docs: Tensor | None, dy: Tensor, *,
    activation: bool, head: int, eps: float, launch: ShortConvLaunch = SHORT_CONV_LAUNCH,
) -> tuple[Tensor, Tensor]:
    """(`dx` like `x`, `dw` `[C, W]` in the accumulation dtype); the tail's gradient is not formed here."""
    B, T, C = x.shape
    W = w.shape[1]
    dx = torch.empty_like(x)
    if T == 0:
        return dx, torch.zeros(C, W, device=x.device, dtype=accumulation(x.dtype)[0])
    grid, block_c = _grid_shape(T, C, B, head, launch.block_t, launch)
    acc, acc_tl = accumulation(x.dtype)
    dz = torch.empty(B, T, C, device=x.device, dtype=acc)
    dw_partial = torch.empty(B * grid[0], C, W, device=x.device, dtype=acc)
    short_conv_dz_kernel[grid](
        x, w, x if tail is None else tail, x if starts is None else starts, x if docs is None else docs, dy, dz, dw_partial,
        T, C, float(eps),
        W=W, BT=launch.block_t, BC=block_c, HEAD=max(head, 1), ACT=activation, NORM=head > 0,
        HAS_TAIL=tail is not None, VARLEN=starts is not None, ACC=acc_tl, num_warps=launch.num_warps,
    )
    dx_grid, dx_block_c = _grid_shape(T, C, B, 0, launch.block_t, launch)
    short_conv_dx_kernel[dx_grid](
        w, x if starts is None else starts, dz, dx, T, C,
        W=W, BT=launch.block_t, BC=dx_block_c, VARLEN=starts is not None, ACC=acc_tl, num_warps=launch.num_warps,
    )
    return dx, dw_partial.sum(0)
