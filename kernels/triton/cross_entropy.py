"""Cross-entropy of a chunk of logits, its gradient written over the logits in place.

One program per row: a first pass over the vocabulary in blocks keeps the running maximum
and the sum of exponentials (the online log-sum-exp), a second pass overwrites each logit
`x_j` with `scale * (softmax(x)_j - [j == target])`, the gradient of the row's loss. The
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


# `V` is specialized as every integer argument is by default (divisible by 16 or not): only
# when the mask `offs < V` is known to hold for runs of 16 columns do the loads and stores
# become 16-byte vectors. Left unspecialized, every logit was a 2-byte access of its own
# (`ld.global.b16`, 8x the memory instructions), which bound the kernel by issue, not by
# bandwidth: 2.08 ms a 166M-model step on both the H100 and the H200, where fla's
# bandwidth-bound pass read 1.25 and 0.99 ms.
@triton.jit(do_not_specialize=["ignore_index"])
def softmax_ce_grad_kernel(
    logits, stride_row, targets, loss, V, ignore_index, scale_ptr,
    BLOCK_V: tl.constexpr, ACC: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * stride_row
    target = tl.load(targets + row).to(tl.int64)
    cols = tl.arange(0, BLOCK_V)

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

    ignored = target == ignore_index
    outside = (target != ignore_index) & ((target < 0) | (target >= V))
    safe_target = tl.where(ignored | outside, 0, target)
    x_target = tl.load(base + safe_target).to(ACC)
    tl.store(loss + row, tl.where(ignored, 0.0, tl.where(outside, float("nan"), lse - x_target)))

    # Pass 2: the gradient over the logits, in place.
    # a tensor: a float64 scale stays float64
    row_scale = tl.where(ignored, 0.0, tl.where(outside, float("nan"), tl.load(scale_ptr)))
    for start in range(0, V, BLOCK_V):
        offs = start + cols
        valid = offs < V
        x = tl.load(base + offs, mask=valid, other=0.0).to(ACC)
        grad = tl.exp(x - lse) - tl.where(offs == target, 1.0, 0.0)
        tl.store(base + offs, (grad * row_scale).to(logits.dtype.element_ty), mask=valid)


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
        BLOCK_V=block_v, ACC=accumulation(acc)[1], num_warps=launch.num_warps,
    )
    return loss
