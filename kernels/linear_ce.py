"""Linear cross-entropy without the logits: `mean CE(hidden @ weight^T, targets)` and its
gradients, one chunk of tokens at a time.

A language model's head maps `N` hidden rows `[N, d]` to `N x V` logits; at N = 16,384
tokens and V = 32,000 words those are 524M numbers, 2 GB in float32 and as much again for
their gradient. Here the logits exist one chunk of rows at a time, in the compute dtype
(bfloat16 under autocast): each chunk's logits are made, turned in place into their
gradient (`softmax - one_hot`, scaled for the mean), and multiplied straight into the
gradients of the hidden rows and of the weight, all during the forward. The backward
only scales the two saved gradients by the incoming one, so nothing of size `N x V`
outlives a chunk. The design follows Liger-Kernel's fused linear cross-entropy.

- `softmax_ce_grad_` is the per-chunk step in plain torch (the definition, and the CPU
  path); `kernels/triton/cross_entropy.py` is the same step as one Triton kernel.
- `linear_cross_entropy(hidden, weight, targets, ...)` is the public entry: autograd
  through `hidden` and `weight`; `backend="auto"` is the Triton step on CUDA, torch elsewhere.

Host reads. The mean's denominator (the scored rows) and the check of the targets need
their values on the host: one read, which on CUDA waits for everything queued before it.
In the middle of a training step that is the whole forward, so the host starts queueing
the backward only when the device has run dry, and every stretch of the backward whose
kernels are shorter than their launches then leaves the device idle. A caller that knows
the count (`scored_rows`, as HuggingFace's `num_items_in_batch`) checks the targets where
a read costs nothing: `LanguageModel.forward` does, at the start of the step
(`blocks/loss.py:checked_scored_labels`). Without that read the step marks a target outside
the vocabulary with a NaN loss (and NaN gradients), never a read past the row.
"""

from __future__ import annotations

import torch

from .fused import compute_dtype, resolve_fused_backend

Tensor = torch.Tensor

IGNORE_INDEX = -100  # PyTorch's and HuggingFace's convention for unscored positions
# Rows per chunk. Each chunk adds its weight gradient into one float32 `[V, d]` buffer, a
# read and a write of 8 V d bytes, against 6 rows V d FLOPs of the chunk's three matmuls:
# at an H100's ~650 TFLOP/s and ~3 TB/s those round trips cost ~270 / rows of the
# matmuls' time (26% at 1,024 rows: 2.55 ms of weight-gradient matmuls in a 166M-model
# step, whose FLOPs alone take ~1.65 ms). So a chunk's logits may take up to
# `LOGITS_CHUNK_BYTES` (4,096 rows at V = 32,000 in bfloat16: ~7% overhead), or as much as
# the hidden rows [N, d] if that is more (Liger-Kernel's rule), and never fewer rows than
# MIN_CHUNK_ROWS. Measured on an H100 (16,384 rows, d = 1,024, V = 32,000, bfloat16
# autocast, float32 weight; forward + backward): 8.99 ms at 1,024 rows, 7.14 ms at 4,096;
# the head's transient memory 347 -> 721 MiB (about two chunks of logits), against a
# step's ~6 GB peak at that model's size.
LOGITS_CHUNK_BYTES = 256 << 20
MIN_CHUNK_ROWS = 256


def softmax_ce_grad_(logits: Tensor, targets: Tensor, *, ignore_index: int = IGNORE_INDEX,
                     scale: float | Tensor = 1.0) -> Tensor:
    """Loss of each row `[N]`, and `logits` `[N, V]` overwritten with
    `scale * (softmax(logits) - one_hot(targets))` (zero rows where `targets == ignore_index`;
    a NaN loss and gradient row where a target is outside `[0, V)`). `scale`: a number, or a
    one-element tensor on the logits' device (one for every chunk of a call).

    Float32 arithmetic (float64 for float64 logits) on one chunk of rows at a time (the
    caller chunks); the loss comes back in that dtype.
    """
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    scored = targets != ignore_index
    outside = scored & ((targets < 0) | (targets >= x.shape[-1]))
    safe = torch.where(scored & ~outside, targets, torch.zeros_like(targets))
    lse = torch.logsumexp(x, dim=-1)
    loss = torch.where(scored, lse - x.gather(1, safe[:, None]).squeeze(1), torch.zeros_like(lse))
    loss = torch.where(outside, torch.full_like(loss, float("nan")), loss)
    grad = torch.exp(x - lse[:, None])
    grad.scatter_add_(1, safe[:, None], -torch.ones_like(lse)[:, None])
    row_scale = torch.where(outside, float("nan"), scored.to(x.dtype)) * torch.as_tensor(scale, dtype=x.dtype, device=x.device)
    grad.mul_(row_scale[:, None])
    logits.copy_(grad)
    return loss


def _softmax_ce_grad(backend: str):
    if backend == "triton":
        from .triton.cross_entropy import softmax_ce_grad_triton

        return softmax_ce_grad_triton
    return softmax_ce_grad_


def chunk_rows_for(n_rows: int, d: int, vocab: int, element_bytes: int = 2) -> int:
    """Rows per chunk (a power of two, at most `n_rows`): logits `[rows, V]` of
    `element_bytes` each within `LOGITS_CHUNK_BYTES`, or about the size of the hidden rows
    `[N, d]` where that is larger, and at least `MIN_CHUNK_ROWS` rows."""
    budget = LOGITS_CHUNK_BYTES // (vocab * element_bytes)
    by_budget = 1 << (budget.bit_length() - 1) if budget else 0  # a power of two within the budget
    by_input = 1 << (-(-n_rows * d // vocab) - 1).bit_length()
    return max(1, min(n_rows, max(MIN_CHUNK_ROWS, by_budget, by_input)))


def _accumulate_product(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """`acc += a @ b` with `acc` in float32 and `a`, `b` in half precision. On CUDA the
    matmul adds into `acc` itself (`out_dtype`); elsewhere the product is rounded to the
    half dtype first and added by a second kernel, which on the H200 cost 1.9 ms per
    166M-model step over 16 row chunks, a separate read and write of the whole buffer."""
    if acc.is_cuda and acc.dtype == torch.float32 and a.dtype in (torch.bfloat16, torch.float16):
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc += a @ b


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, ignore_index: int, chunk_rows: int,
                backend: str, cdtype: torch.dtype, grad_enabled: bool, scored_rows: int | Tensor) -> Tensor:
        N, d = hidden.shape
        V = weight.shape[0]
        # Under no_grad (evaluation) only the loss is formed: no gradient matmuls.
        need_h, need_w = grad_enabled and ctx.needs_input_grad[0], grad_enabled and ctx.needs_input_grad[1]
        acc = torch.promote_types(cdtype, torch.float32)
        # no scored row: loss 0 and zero gradients. One tensor for every chunk's step; a
        # count on the device stays there (a captured CUDA graph reads it at each replay).
        if isinstance(scored_rows, Tensor):
            scale = 1.0 / scored_rows.to(device=hidden.device, dtype=acc).clamp(min=1)
        else:
            scale = torch.full((), 1.0 / max(scored_rows, 1), device=hidden.device, dtype=acc)
        step = _softmax_ce_grad(backend)
        h = hidden.to(cdtype)
        w = weight.to(cdtype)
        loss_rows = torch.empty(N, device=hidden.device, dtype=acc)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(V, d, device=weight.device, dtype=acc) if need_w else None
        with torch.autocast(hidden.device.type, enabled=False):
            for lo in range(0, N, chunk_rows):
                hi = min(N, lo + chunk_rows)
                logits = h[lo:hi] @ w.T  # [rows, V] in the compute dtype: the only logits there are
                loss_rows[lo:hi] = step(logits, targets[lo:hi], ignore_index=ignore_index, scale=scale)  # logits := their gradient
                if grad_h is not None:
                    grad_h[lo:hi] = logits @ w
                if grad_w is not None:
                    _accumulate_product(grad_w, logits.T, h[lo:hi])
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        return loss_rows.sum() * scale

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        grad_h, grad_w = ctx.saved_tensors
        dh = None if grad_h is None else grad_h * grad_loss.to(grad_h.dtype)
        dw = None if grad_w is None else (grad_w * grad_loss).to(ctx.weight_dtype)
        return dh, dw, None, None, None, None, None, None, None


def checked_scored_targets(targets: Tensor, vocab: int, ignore_index: int, what: str) -> int:
    """How many of `targets` are scored (not `ignore_index`), after checking that each of
    those is a row of the vocabulary `[0, vocab)`: one host read."""
    scored_mask = targets != ignore_index
    outside_mask = scored_mask & ((targets < 0) | (targets >= vocab))
    outside, scored = torch.stack([outside_mask.sum(), scored_mask.sum()]).tolist()
    if outside:
        raise outside_vocabulary(what, targets, outside_mask, vocab, f" that are not ignore_index={ignore_index}")
    return scored


def outside_vocabulary(what: str, values: Tensor, outside_mask: Tensor, vocab: int, besides: str = "") -> ValueError:
    """The error for `values` with entries outside `[0, vocab)` (`outside_mask`): how many, and
    where the first one is and what it holds (read only on this path)."""
    first = tuple(int(i) for i in outside_mask.nonzero()[0])
    return ValueError(f"{what}: {int(outside_mask.sum())} outside [0, {vocab}){besides}; the first, at "
                      f"[{', '.join(map(str, first))}], is {int(values[first])}")


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    ignore_index: int = IGNORE_INDEX,
    chunk_rows: int | None = None,
    backend: str = "auto",
    scored_rows: int | Tensor | None = None,
) -> Tensor:
    """Mean cross-entropy of `hidden @ weight^T` against `targets` over the rows whose target
    is not `ignore_index`; a float32 scalar (float64 for float64 inputs), differentiable in `hidden` and `weight`.

    `hidden` `[..., d]`, `weight` `[V, d]`, `targets` `[...]` (int). Under autocast the
    matmuls run in its dtype; gradients come back in each input's own dtype. The loss is 0
    (with zero gradients) when no row is scored.

    `scored_rows`: the mean's denominator when the caller has counted the scored targets and
    checked them (`checked_scored_targets`), or a larger count they are part of (the scored
    targets of every micro-batch of an accumulated step: transformers' `num_items_in_batch`);
    then nothing is read on the host here (module docstring), and a target outside the
    vocabulary makes the loss NaN. It may be a 0-dim integer tensor on `hidden`'s device, which
    is read only there (`archspec.graphed_step` writes each batch's count into one before
    replaying its captured step). Without it, the targets are counted and checked here (one
    host read; a `ValueError` says which is bad).
    """
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"linear_cross_entropy: hidden {tuple(hidden.shape)} must be targets' shape {tuple(targets.shape)} + [d]")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"linear_cross_entropy: weight must be [V, d] with d = {hidden.shape[-1]}, got {tuple(weight.shape)}")
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise ValueError(f"linear_cross_entropy: targets must be integer, got {targets.dtype}")
    name = resolve_fused_backend(backend, hidden.device)
    cdtype = compute_dtype(hidden)
    hidden2 = hidden.reshape(-1, hidden.shape[-1])
    flat = targets.reshape(-1).contiguous()
    rows = chunk_rows or chunk_rows_for(hidden2.shape[0], weight.shape[1], weight.shape[0], cdtype.itemsize)
    if rows < 1:
        raise ValueError(f"linear_cross_entropy: chunk_rows must be >= 1, got {rows}")
    if scored_rows is None:
        scored_rows = checked_scored_targets(targets, weight.shape[0], ignore_index, "linear_cross_entropy: targets")
    elif isinstance(scored_rows, Tensor):
        if scored_rows.dim() != 0 or scored_rows.dtype.is_floating_point or scored_rows.device != hidden.device:
            raise ValueError(f"linear_cross_entropy: a scored_rows tensor must be a 0-dim integer on {hidden.device}, got "
                             f"shape {tuple(scored_rows.shape)}, {scored_rows.dtype} on {scored_rows.device}")
    elif scored_rows < 0:
        raise ValueError(f"linear_cross_entropy: scored_rows must be >= 0, got {scored_rows}")
    return _LinearCrossEntropy.apply(hidden2, weight, flat, ignore_index, rows, name, cdtype, torch.is_grad_enabled(),
                                     scored_rows)
