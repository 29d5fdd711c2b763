"""The short causal depthwise convolution of the mixer's streams, with its SiLU and the
optional per-head L2 normalisation, for whole sequences, packed documents and carried tails.

`y[t, c] = normalize(silu(sum_j w[c, j] * x[t - (W-1) + j, c]))`: inputs before a
sequence's first token come from its carried tail (the last W-1 inputs of the previous
piece, for decoding) or are zero, and with `cu_seqlens` (token offsets of the documents
packed in one row, B = 1) a token never reads another document's inputs.
`normalize` divides each group of `head_dim` channels by `max(|.|, eps)` (F.normalize);
`head_dim=0` skips it.

`short_conv_ref` is the definition in plain torch (the CPU path; autograd saves what it
saves); on CUDA `short_conv` runs `kernels/triton/short_conv.py`, whose backward
recomputes the pre-activation instead of saving it. `conv_tails` gives the tail each
sequence carries on. `stream_step` is one token of decoding for all of a mixer's streams
side by side, the tail shifted in place (`stream_step_ref` its definition; one launch of
`triton/decode.py` on CUDA).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .fused import resolve_fused_backend
from .packed import check_offsets, per_offsets_tensor

Tensor = torch.Tensor


def sequence_index(cu_seqlens: Tensor | None, batch: int, T: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Per token (`[T]`, long): the start of its sequence and the sequence's index (the row
    of its tail). Without `cu_seqlens` every row of the batch is one sequence from 0."""
    if cu_seqlens is None:
        return torch.zeros(T, dtype=torch.long, device=device), torch.zeros(T, dtype=torch.long, device=device)
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    docs = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths, output_size=T)
    return cu_seqlens.long()[docs], docs


@per_offsets_tensor
def packed_sequence_index(cu_seqlens: Tensor, T: int) -> tuple[Tensor, Tensor]:
    """`sequence_index` of a packed row as the Triton kernels read it (int32), formed once
    per `cu_seqlens` tensor (`kernels/packed.py`): a mixer's streams (q, k, v) in every
    layer share one packed batch, and each formation is a few small launches on a step
    that is partly bound by the host."""
    start, doc = sequence_index(cu_seqlens, 1, T, cu_seqlens.device)
    return start.to(torch.int32), doc.to(torch.int32)


def _shifted(x: Tensor, tail: Tensor | None, start: Tensor, doc: Tensor, shift: int) -> Tensor:
    """Packed `x` `[1, T, C]`: `x[:, t - shift]` within each document, its tail (or zero)
    before its start."""
    T = x.shape[1]
    src = torch.arange(T, device=x.device) - shift
    inseq = src >= start
    out = x[:, src.clamp(min=0)] * inseq[None, :, None]
    if tail is not None:
        W1 = tail.shape[1]
        ti = (W1 + src - start).clamp(0, W1 - 1)
        out = out + tail[doc, ti][None] * (~inseq)[None, :, None]
    return out


def short_conv_ref(x: Tensor, weight: Tensor, *, tail: Tensor | None = None, cu_seqlens: Tensor | None = None,
                   activation: bool = True, head_dim: int = 0, eps: float = 1e-6) -> Tensor:
    """`x` `[B, T, C]`, `weight` `[C, W]` (or `[C, 1, W]`), `tail` `[B or N, W-1, C]`; float32
    arithmetic (float64 for float64 inputs), output in `x`'s dtype."""
    acc = torch.promote_types(x.dtype, torch.float32)
    w = weight.reshape(weight.shape[0], -1).to(acc)
    W = w.shape[1]
    xa = x.to(acc)
    ta = None if tail is None or W == 1 else tail.to(acc)
    if cu_seqlens is None:
        # One sequence per row: torch's depthwise conv over the tail (or zeros) and x.
        pad = ta if ta is not None else xa.new_zeros(xa.shape[0], W - 1, xa.shape[2])
        padded = torch.cat([pad, xa], dim=1).transpose(1, 2)
        z = F.conv1d(padded, w[:, None, :], groups=w.shape[0]).transpose(1, 2)
    else:
        # Packed documents: each tap reads its own document's inputs, or its tail.
        start, doc = sequence_index(cu_seqlens, x.shape[0], x.shape[1], x.device)
        z = sum(_shifted(xa, ta, start, doc, W - 1 - j) * w[:, j] for j in range(W))
    y = F.silu(z) if activation else z
    if head_dim:
        y = F.normalize(y.unflatten(-1, (-1, head_dim)), dim=-1, eps=eps).flatten(-2)
    return y.to(x.dtype)


def conv_tails(x: Tensor, tail: Tensor | None, cu_seqlens: Tensor | None, kernel_size: int) -> Tensor:
    """The last W-1 inputs of each sequence, tail included: `[B or N, W-1, C]`."""
    B, T, C = x.shape
    W1 = kernel_size - 1
    if cu_seqlens is None:
        start = torch.zeros(B, dtype=torch.long, device=x.device)
        end = torch.full((B,), T, dtype=torch.long, device=x.device)
        rows = torch.arange(B, device=x.device)
    else:
        start, end = cu_seqlens[:-1].long(), cu_seqlens[1:].long()
        rows = torch.zeros(start.numel(), dtype=torch.long, device=x.device)
    pos = end[:, None] - W1 + torch.arange(W1, device=x.device)  # [S, W-1]
    inseq = pos >= start[:, None]
    out = x[rows[:, None], pos.clamp(0, max(T - 1, 0))] if T else x.new_zeros(rows.numel(), W1, C)
    out = out * inseq[..., None]
    if tail is not None:
        ti = (W1 + pos - start[:, None]).clamp(0, W1 - 1)
        out = out + tail.to(x.dtype)[torch.arange(tail.shape[0], device=x.device)[:, None], ti] * (~inseq)[..., None]
    return out


def _head_tokens(x: Tensor, cu_seqlens: Tensor | None, count: int) -> tuple[Tensor, Tensor]:
    """The first `count` positions of each sequence as a batch `[S, count, C]` (zeros past
    a short sequence's end), and their flat token indices (for gathering `dy`)."""
    B, T, C = x.shape
    if cu_seqlens is None:
        idx = torch.arange(min(count, T), device=x.device)
        return x[:, idx], idx
    start, end = cu_seqlens[:-1].long(), cu_seqlens[1:].long()
    pos = start[:, None] + torch.arange(count, device=x.device)
    valid = pos < end[:, None]
    flat = pos.clamp(max=max(T - 1, 0))
    return x[0, flat] * valid[..., None], torch.where(valid, flat, -1)


class _ShortConvTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, tail: Tensor | None, cu_seqlens: Tensor | None,
                activation: bool, head_dim: int, eps: float) -> Tensor:
        from .triton.short_conv import short_conv_forward_triton

        x3 = x.contiguous()
        w2 = weight.reshape(weight.shape[0], -1).contiguous()
        tail_c = None if tail is None else tail.to(x.dtype).contiguous()
        starts = docs = None
        if cu_seqlens is not None:
            starts, docs = packed_sequence_index(cu_seqlens, x.shape[1])
        y = short_conv_forward_triton(x3, w2, tail_c, starts, docs, activation=activation, head=head_dim, eps=eps)
        ctx.save_for_backward(x3, w2, tail_c, starts, docs, tail, cu_seqlens)
        ctx.settings = (activation, head_dim, eps, weight.shape, weight.dtype)
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        from .triton.short_conv import short_conv_backward_triton

        x3, w2, tail_c, starts, docs, tail, cu_seqlens = ctx.saved_tensors
        activation, head_dim, eps, w_shape, w_dtype = ctx.settings
        dx, dw = short_conv_backward_triton(x3, w2, tail_c, starts, docs, dy.contiguous(),
                                            activation=activation, head=head_dim, eps=eps)
        dtail = None
        if ctx.needs_input_grad[2]:
            dtail = _tail_grad(x3, w2, tail, cu_seqlens, dy, activation, head_dim, eps)
        return dx, dw.reshape(w_shape).to(w_dtype), dtail, None, None, None, None


def _tail_grad(x: Tensor, w: Tensor, tail: Tensor, cu_seqlens: Tensor | None, dy: Tensor,
               activation: bool, head_dim: int, eps: float) -> Tensor:
    """The carried tail reaches only the first W-1 outputs of its sequence: differentiate
    the definition on those few positions (decoding with gradients; never in training)."""
    count = w.shape[1] - 1
    heads, idx = _head_tokens(x, cu_seqlens, count)
    if cu_seqlens is None:
        dy_heads = dy[:, idx]
    else:
        dy_heads = dy[0, idx.clamp(min=0)] * (idx >= 0)[..., None]
    with torch.enable_grad():
        leaf = tail.detach().requires_grad_(True)
        y = short_conv_ref(heads.detach(), w.detach(), tail=leaf, activation=activation, head_dim=head_dim, eps=eps)
        (grad,) = torch.autograd.grad(y, leaf, dy_heads.to(y.dtype))
    return grad


def short_conv(x: Tensor, weight: Tensor, *, tail: Tensor | None = None, cu_seqlens: Tensor | None = None,
               activation: bool = True, head_dim: int = 0, eps: float = 1e-6, backend: str = "auto") -> Tensor:
    """`normalize(silu(causal depthwise conv(x)))` `[B, T, C]` in `x`'s dtype; differentiable
    in `x`, `weight` and `tail`. `weight` `[C, W]` or `[C, 1, W]`; `tail` `[B, W-1, C]`, or
    `[N, W-1, C]` with `cu_seqlens` (N documents, B = 1); `head_dim` > 0 L2-normalises
    each group of that many channels."""
    if x.dim() != 3:
        raise ValueError(f"short_conv: x must be [B, T, C], got {tuple(x.shape)}")
    B, T, C = x.shape
    if weight.shape[0] != C or weight.numel() % C:
        raise ValueError(f"short_conv: weight must be [C, W] with C = {C}, got {tuple(weight.shape)}")
    W = weight.numel() // C
    rows = B
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"short_conv: with cu_seqlens the batch must be 1 (packed), got B={B}")
        check_offsets(cu_seqlens, T, "short_conv")
        rows = cu_seqlens.numel() - 1
    if tail is not None and tuple(tail.shape) != (rows, W - 1, C):
        raise ValueError(f"short_conv: tail must be [{rows}, {W - 1}, {C}], got {tuple(tail.shape)}")
    if head_dim and C % head_dim:
        raise ValueError(f"short_conv: head_dim {head_dim} must divide the {C} channels")
    if W == 1 and tail is not None:
        tail = None  # nothing to carry
    if resolve_fused_backend(backend, x.device) == "triton":
        return _ShortConvTriton.apply(x, weight, tail, cu_seqlens, activation, head_dim, eps)
    return short_conv_ref(x, weight, tail=tail, cu_seqlens=cu_seqlens, activation=activation, head_dim=head_dim, eps=eps)


# A stream of `stream_step`: its width in channels and the head size of its L2 norm (0: none).
Stream = tuple[int, int]


def stream_step_ref(x: Tensor, weight: Tensor | None, tail: Tensor | None, streams: tuple[Stream, ...], *,
                    eps: float = 1e-6) -> Tensor:
    """One token of `short_conv_ref` with the SiLU for every stream side by side: `x`
    `[B, 1, C]` after the carried `tail` `[B, W-1, C]`, which is shifted in place to end
    with `x` (no conv when both are None), then each stream's L2 norm. Float32 arithmetic
    (float64 for float64 inputs), output in `x`'s dtype."""
    acc = torch.promote_types(x.dtype, torch.float32)
    z = x.to(acc)
    if weight is not None:
        window = torch.cat([tail.to(acc), z], dim=1)  # inputs t-W+1 .. t: [B, W, C]
        z = (window * weight.to(acc).t()[None]).sum(1, keepdim=True)
        tail.copy_(window[:, 1:])
    pieces = []
    for part, (_, head) in zip(F.silu(z).split([width for width, _ in streams], dim=-1), streams):
        pieces.append(F.normalize(part.unflatten(-1, (-1, head)), dim=-1, eps=eps).flatten(-2) if head else part)
    return torch.cat(pieces, dim=-1).to(x.dtype)


def stream_step(x: Tensor, weight: Tensor | None, tail: Tensor | None, streams: tuple[Stream, ...], *,
                eps: float = 1e-6, backend: str = "auto") -> Tensor:
    """The decoding step of a mixer's streams: one token `x` `[B, 1, C]` of the streams
    side by side (q, k, v, ... as `streams` lists them, `(width, head_dim)` each, at most
    4; rows may be column slices of a wider output), each `short_conv(..., activation=True,
    head_dim=head_dim)` of the token continuing `tail` `[B, W-1, C]` with `weight`
    `[C, W]` (the streams' conv weights stacked), or with neither only SiLU and norm. The
    tail is shifted in place, so a captured CUDA graph replays the step on the same
    buffer. Returns `[B, 1, C]` (contiguous), no autograd. On CUDA one Triton launch
    (`triton/decode.py`)."""
    if x.dim() != 3 or x.shape[1] != 1 or x.stride(-1) != 1:
        raise ValueError(f"stream_step: x must be [B, 1, C] (one token) with unit channel stride, got "
                         f"{tuple(x.shape)} strides {x.stride()}")
    B, _, C = x.shape
    if not 1 <= len(streams) <= 4 or sum(w for w, _ in streams) != C or any(
            w < 1 or h < 0 or (h and w % h) for w, h in streams):
        raise ValueError(f"stream_step: streams must be 1-4 (width, head_dim) pairs whose widths sum to {C} and whose "
                         f"head_dim (0: no norm) divides the width, got {streams}")
    if (weight is None) != (tail is None):
        raise ValueError("stream_step: give the conv's weight and tail together, or neither")
    if weight is not None:
        W = weight.shape[-1]
        if tuple(weight.shape) != (C, W):
            raise ValueError(f"stream_step: weight must be [C, W] with C = {C}, got {tuple(weight.shape)}")
        if tuple(tail.shape) != (B, W - 1, C) or not tail.is_contiguous():
            raise ValueError(f"stream_step: tail must be a contiguous [{B}, {W - 1}, {C}] tensor, got "
                             f"{tuple(tail.shape)}")
    with torch.no_grad():
        if resolve_fused_backend(backend, x.device) == "triton":
            from .triton.decode import stream_step_triton

            return stream_step_triton(x, None if weight is None else weight.contiguous(), tail, tuple(streams), eps)
        return stream_step_ref(x, weight, tail, tuple(streams), eps=eps)
