"""Short causal depthwise convolution over time, with the tail it needs for decoding.

The three backbones (DeltaNet, Gated DeltaNet, KDA in flash-linear-attention) run q, k and
v through a kernel-size-4 depthwise causal conv and a SiLU before the recurrence. A causal
conv of kernel size W at position t reads inputs t-W+1..t, so to continue a sequence in
pieces the layer only has to remember the last W-1 inputs: that tail is its decoding state.
With packed documents (`cu_seqlens`) each document starts from its own tail (or zeros)
and carries its own on: no token reads another document's inputs.

The conv, its SiLU and (for the streams that need unit keys) the per-head L2 norm run as
one `archspec.kernels.short_conv` call: one Triton kernel each way on CUDA, whose backward
recomputes the pre-activation instead of saving it; plain torch elsewhere. `recipe` hands
the recurrence that call, so that the conv's output is formed again in the recurrence's
backward rather than kept beside the conv's input.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from archspec.kernels import Recompute, conv_tails, short_conv

Tensor = torch.Tensor


class ShortConv(nn.Module):
    """Causal depthwise conv on `[B, T, C]` activations; no bias (as in fla's layers)."""

    def __init__(self, channels: int, kernel_size: int):
        super().__init__()
        if kernel_size < 1:
            raise ValueError(f"kernel_size must be >= 1, got {kernel_size}")
        self.channels = channels
        self.kernel_size = kernel_size
        # nn.Conv1d holds the weight [C, 1, W] with PyTorch's default initialisation; the
        # causal padding is done by the kernel so that a carried tail can stand in for zeros.
        self.conv = nn.Conv1d(channels, channels, kernel_size, groups=channels, bias=False)
        self.fused_backend = "auto"

    def empty_tail(self, batch_size: int, device: torch.device, dtype: torch.dtype) -> Tensor:
        """The tail of a sequence that has not started: W-1 zero inputs."""
        return torch.zeros(batch_size, self.kernel_size - 1, self.channels, device=device, dtype=dtype)

    def forward(
        self, x: Tensor, tail: Tensor | None = None, *, cu_seqlens: Tensor | None = None,
        activation: bool = False, head_dim: int = 0, norm_eps: float = 1e-6, return_tail: bool = True,
    ) -> tuple[Tensor, Tensor | None]:
        """`(y [B, T, C], new tail)`: `y = normalize(act(conv(x)))` with `act` SiLU when
        `activation`, `normalize` (to unit L2 norm, `norm_eps` below) per group of `head_dim`
        channels when it is > 0. `tail`
        (`[B, W-1, C]`, or `[N, W-1, C]` with `cu_seqlens`) continues each sequence; the new
        tail has the same layout, or is None when `return_tail` is False."""
        recipe = self.recipe(x, tail, cu_seqlens=cu_seqlens, activation=activation, head_dim=head_dim,
                             norm_eps=norm_eps)
        y = recipe.fn(*recipe.args, **recipe.kwargs)
        new_tail = conv_tails(x, recipe.kwargs["tail"], cu_seqlens, self.kernel_size) if return_tail else None
        return y, new_tail

    def recipe(self, x: Tensor, tail: Tensor | None = None, *, cu_seqlens: Tensor | None = None,
               activation: bool = False, head_dim: int = 0, norm_eps: float = 1e-6,
               shape: tuple[int, ...] | None = None) -> Recompute:
        """`forward`'s output as a `kernels.Recompute` (the one call `forward` makes), so a
        kernel that reads the output can form it again in its backward from `x`, which
        the conv's own backward keeps, instead of keeping it too; `shape` reshapes it as
        the kernel takes it."""
        return Recompute(short_conv, (x, self.conv.weight),
                         dict(tail=None if tail is None else tail.to(x.dtype), cu_seqlens=cu_seqlens,
                              activation=activation, head_dim=head_dim, eps=norm_eps, backend=self.fused_backend),
                         shape)
