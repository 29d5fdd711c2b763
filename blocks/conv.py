"""Short causal depthwise convolution over time, with the tail it needs for decoding.

The three backbones (DeltaNet, Gated DeltaNet, KDA in flash-linear-attention) run q, k and
v through a kernel-size-4 depthwise causal conv before the recurrence. A causal conv of
kernel size W at position t reads inputs t-W+1..t, so to continue a sequence in pieces the
layer only has to remember the last W-1 inputs: that tail is its decoding state.
"""

from __future__ import annotations

import torch
import torch.nn as nn

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
        # causal padding is done by hand so that a carried tail can stand in for zeros.
        self.conv = nn.Conv1d(channels, channels, kernel_size, groups=channels, bias=False)

    def empty_tail(self, batch_size: int, device: torch.device, dtype: torch.dtype) -> Tensor:
        """The tail of a sequence that has not started: W-1 zero inputs."""
        return torch.zeros(batch_size, self.kernel_size - 1, self.channels, device=device, dtype=dtype)

    def forward(self, x: Tensor, tail: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Return (conv(x) [B, T, C], new tail [B, W-1, C]); `tail` continues a sequence."""
        if tail is None:
            tail = self.empty_tail(x.shape[0], x.device, x.dtype)
        padded = torch.cat([tail.to(x.dtype), x], dim=1)  # [B, W-1+T, C]
        y = self.conv(padded.transpose(1, 2)).transpose(1, 2)
        return y, padded[:, padded.shape[1] - (self.kernel_size - 1) :]

