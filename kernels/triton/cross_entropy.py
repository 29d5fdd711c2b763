"""Cross-entropy of a chunk of logits, its gradient written over the logits in place.

One program per row. When the row fits one block (`ONE_BLOCK`: a vocabulary of up to
`block_v` columns, the usual case) it is read once into registers: its maximum, the sum of
exponentials and the log-sum-exp, then each logit `x_j` is overwritten with
`scale * (softmax(x)_j - [j == target])`, the gradient of the row's loss, from the
exponentials already formed: one read and one write of the row, one `exp` per logit.
Otherwise a first pass over the vocabulary in blocks keeps the running maximum and the sum
of exponentials (the online log-sum-exp) and a second reads the row again to write the
gradient. (The blocked form on every row, 4,096 columns and 8 warps, took 2.10 ms of the
166M DeltaNet step on the H200 for 16,384 rows of 32,000 bfloat16 logits, 1.5 TB/s, where
fla's fused loss took 1.00; `benchmarks/results/models.json`, commit 72256b2.) The
logits arrive in the compute dtype (bfloat16 under autocast) and only one chunk of rows
exists at a time (`kernels/linear_ce.py`), so no float32 copy of the whole vocabulary's
logits is ever made; the arithmetic is float32 in registers (float64 for float64 logits).

Rows whose target is `ignore_index` get loss 0 and a zero gradient; a target outside
`[0, V)` (the caller did not check, `kernels/linear_ce.py`) gets a NaN loss and gradient
row, and nothing is read past the row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kinds import accumulation
from .launch import CROSS_ENTROPY_LAUNCH, CrossEntropyLaunch

Tensor = torch.Tensor


@triton.jit(do_not_specialize=["V", "ignore_index"])
def softmax_ce_grad_kernel(
    logits, stride_row, targets, loss, V, ignore_index, scale_ptr,
    BLOCK_V: tl.constexpr, ONE_BLOCK: tl.constexpr, ACC: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * stride_row
    target = tl.load(targets + row).to(tl.int64)
    cols = tl.arange(0, BLOCK_V)
    ignored = target == ignore_index
    outside = (target != ignore_index) & ((target < 0) | (target >= V))
    # a tensor: a float64 scale stays float64
    row_scale = tl.where(ignored, 0.0, tl.where(outside, float("nan"), tl.load(scale_ptr)))
    if ONE_BLOCK:
        _one_block_row(base, cols, target, ignored, outside, row_scale, loss + row, V, ACC)
    else:
        _blocked_row(base, cols, target, ignored, outside, row_scale, loss + row, V, BLOCK_V, ACC)


@triton.jit
def _one_block_row(base, cols, target, ignored, outside, row_scale, p_loss, V, ACC: tl.constexpr):
    """The whole row in registers: one read, one write, one `exp` a logit."""
    valid = cols < V
    x = tl.load(base + cols, mask=valid, other=float("-inf")).to(ACC)
    m = tl.max(x, 0)  # at least one logit is finite
    e = tl.exp(x - m)  # 0 past V
    s = tl.sum(e, 0)
    x_target = tl.sum(tl.where(cols == target, x, 0.0), 0)
    tl.store(p_loss, tl.where(ignored, 0.0, tl.where(outside, float("nan"), m + tl.log(s) - x_target)))
    grad = e / s - tl.where(cols == target, 1.0, 0.0)
    tl.store(base + cols, (grad * row_scale).to(base.dtype.element_ty), mask=valid)


@triton.jit
def _blocked_row(base, cols, target, ignored, outside, row_scale, p_loss, V, BLOCK_V: tl.constexpr,
                 ACC: tl.constexpr):
    """A row wider than one block: two passes over it."""
    # Pass 1: log-sum-exp online. The first block holds at least one finite logit, so the
    # running maximum is finite after it and exp(m_old - m_new) never sees inf - inf.
    m = tl.full((), float("-inf"), ACC)
    s = tl.full((), 0.0, ACC)
    for start in range(0, V, BLOCK_V):
        offs = start + cols
        x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(ACC)
        m_new = tl.maximum(m, tl.max(x, 0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m = m_new
    lse = m + tl.log(s)

    safe_target = tl.where(ignored | outside, 0, target)
    x_target = tl.load(base + safe_target).to(ACC)
    tl.store(p_loss, tl.where(ignored, 0.0, tl.where(outside, float("nan"), lse - x_target)))

    # Pass 2: the gradient over the logits, in place.
    for start in range(0, V, BLOCK_V):
        offs = start + cols
        valid = offs < V
        x = tl.load(base + offs, mask=valid, other=0.0).to(ACC)
        grad = tl.exp(x - lse) - tl.where(offs == target, 1.0, 0.0)
        tl.store(base + offs, (grad * row_scale).to(base.dtype.element_ty), mask=valid)


def softmax_ce_grad_triton(
    logits: Tensor, targets: Tensor, *, ignore_index: int, scale: float | Tensor,
    launch: CrossEntropyLaunch = CROSS_ENTROPY_LAUNCH,
) -> Tensor:
    """Loss per row `[N]` (float32, float64 for float64 logits); `logits` `[N, V]` (unit stride along V) now hold
    `scale * d loss_row / d logits`. Same contract as `kernels.linear_ce.softmax_ce_grad_`."""
    N, V = logits.shape
    acc = torch.promote_types(logits.dtype, torch.float32)
    loss = torch.empty(N, device=logits.device, dtype=acc)
    if N == 0:
        return loss
    block_v = min(launch.block_v, triton.next_power_of_2(V))
    softmax_ce_grad_kernel[(N,)](
        logits, logits.stride(0), targets, loss, V, ignore_index,
        torch.as_tensor(scale, device=logits.device, dtype=acc),
        BLOCK_V=block_v, ONE_BLOCK=V <= block_v, ACC=accumulation(acc)[1],
        num_warps=launch.num_warps if V <= block_v else launch.blocked_num_warps,
    )
    return loss
