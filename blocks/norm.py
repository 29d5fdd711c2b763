"""The RMS norms of the LM: the blocks' pre-norms and the mixers' (gated) output norms.

Gated DeltaNet reads out `RMSNorm(o) * SiLU(W_g x)` and KDA `RMSNorm(o) * sigmoid(...)`
(flash-linear-attention's `FusedRMSNormGated`); DeltaNet uses a plain RMSNorm. The output
norm is per head: it acts on the last dimension V of `[B, T, H, V]`.

Both run `archspec.kernels.rms_norm`: one Triton kernel forward and one backward on CUDA
(the gate fused in, the normalised rows recomputed rather than saved), plain torch
elsewhere. Under autocast they write the autocast dtype, which the projection after them
reads anyway. `fused_backend` (`auto`, `torch`, `triton`) is set by
`LanguageModel.set_backend`.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn as nn

from archspec.kernels import Recompute, add_rms_norm, rms_norm, rms_norm_linear
from archspec.kernels.fused import compute_dtype
from archspec.kernels.row_linear import PreNorm

from .hooks import fusable

Tensor = torch.Tensor

GateActivation = Literal["silu", "sigmoid"]


class RMSNorm(nn.RMSNorm):
    """`nn.RMSNorm` (same parameter, same state-dict key) on the fused kernel."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__(dim, eps=eps)
        self.fused_backend = "auto"

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, eps=self.eps, out_dtype=compute_dtype(x), backend=self.fused_backend)

    def add(self, x: Tensor, h: Tensor | None) -> tuple[Tensor, Tensor]:
        """A pre-norm's residual step: `(self(x + h), x + h)` (`h` None: `(self(x), x)`),
        the addition fused into the norm's kernels on CUDA."""
        return add_rms_norm(x, h, self.weight, eps=self.eps, out_dtype=compute_dtype(x), backend=self.fused_backend)

    def project(self, x: Tensor, linear: nn.Linear) -> Tensor:
        """`linear(self(x).flatten(-2))` for per-head rows `x` `[..., H, D]`: a mixer's
        read-out, the normalised rows not kept for the backward (`kernels.rms_norm_linear`)."""
        if not fusable(linear):
            return linear(self(x).flatten(-2))
        return rms_norm_linear(x, self.weight, linear.weight, eps=self.eps, backend=self.fused_backend)

    def pending(self, h: Tensor | None) -> PreNorm:
        """This norm of `x + h`, left for the decoding step's next product to apply in front
        of it (`kernels.row_linear`), where `x` is the residual stream it is given."""
        return PreNorm(self.weight, self.eps, h)


class GatedRMSNorm(nn.Module):
    """`RMSNorm(x) * act(gate)` with a learned per-feature weight (`norm.weight`)."""

    def __init__(self, dim: int, activation: GateActivation, eps: float = 1e-6):
        super().__init__()
        if activation not in ("silu", "sigmoid"):
            raise ValueError(f"activation must be 'silu' or 'sigmoid', got {activation!r}")
        self.norm = nn.RMSNorm(dim, eps=eps)
        self.activation = activation
        self.fused_backend = "auto"

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        return rms_norm(x, self.norm.weight, gate, eps=self.norm.eps, activation=self.activation,
                        out_dtype=compute_dtype(x), backend=self.fused_backend)

    def project(self, x: Tensor, gate: Tensor, linear: nn.Linear, gate_recompute: Recompute | None = None) -> Tensor:
        """`linear(self(x, gate).flatten(-2))` for per-head rows `x` `[..., H, D]`: a
        mixer's read-out, the normalised rows not kept for the backward
        (`kernels.rms_norm_linear`), nor the gate where `gate_recompute` forms it again."""
        if not fusable(linear):
            return linear(self(x, gate).flatten(-2))
        return rms_norm_linear(x, self.norm.weight, linear.weight, gate, eps=self.norm.eps,
                               activation=self.activation, backend=self.fused_backend, gate_recompute=gate_recompute)
