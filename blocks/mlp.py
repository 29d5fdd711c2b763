"""The channel mixer of each block: SwiGLU (LLaMA, fla's GatedMLP) or a GELU MLP.

SwiGLU's `down(silu(gate) * up)` saves only `gate` and `up` for its backward (as fla's
fused SwiGLU-linear does): the product, which the down projection would otherwise keep,
and the SiLU are recomputed, two `[tokens, hidden]` tensors less per block.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from archspec.kernels.fused import compute_dtype

from .plan import Mlp

Tensor = torch.Tensor


def mlp_hidden_size(kind: Mlp, d_model: int, ratio: float) -> int:
    """Hidden width. SwiGLU has three matrices instead of two, so it takes 2/3 of the
    width (as LLaMA and fla do) to cost what a GELU MLP of the same ratio costs."""
    if kind == "swiglu":
        return max(1, int(ratio * d_model * 2 / 3))
    return max(1, int(ratio * d_model))


class _SwiGLUDown(torch.autograd.Function):
    """`(silu(gate) * up) @ weight^T`, the matmuls in `cdtype` (autocast's, recorded at the
    forward: the backward runs outside autocast)."""

    @staticmethod
    def forward(ctx, gate: Tensor, up: Tensor, weight: Tensor, cdtype: torch.dtype) -> Tensor:
        ctx.save_for_backward(gate, up, weight)
        ctx.cdtype = cdtype
        return F.linear(_product(gate, up, cdtype), weight.to(cdtype))

    @staticmethod
    def backward(ctx, dy: Tensor):
        gate, up, weight = ctx.saved_tensors
        cdtype = ctx.cdtype
        dy = dy.to(cdtype)
        d_weight = (dy.flatten(0, -2).T @ _product(gate, up, cdtype).flatten(0, -2)).to(weight.dtype)
        dh = (dy @ weight.to(cdtype)).float()
        g, u = gate.float(), up.float()
        s = torch.sigmoid(g)
        d_gate = dh * u * s * (1 + g * (1 - s))
        d_up = dh * g * s
        return d_gate.to(gate.dtype), d_up.to(up.dtype), d_weight, None


def _product(gate: Tensor, up: Tensor, dtype: torch.dtype) -> Tensor:
    acc = torch.promote_types(dtype, torch.float32)
    return (F.silu(gate.to(acc)) * up.to(acc)).to(dtype)


class MLP(nn.Module):
    def __init__(self, kind: Mlp, d_model: int, ratio: float):
        super().__init__()
        if kind not in ("swiglu", "gelu"):
            raise ValueError(f"MLP kind must be 'swiglu' or 'gelu', got {kind!r}")
        hidden = mlp_hidden_size(kind, d_model, ratio)
        self.kind = kind
        self.up_proj = nn.Linear(d_model, hidden, bias=False)
        self.gate_proj = nn.Linear(d_model, hidden, bias=False) if kind == "swiglu" else None
        self.down_proj = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        if self.gate_proj is not None:
            gate, up = self.gate_proj(x), self.up_proj(x)
            return _SwiGLUDown.apply(gate, up, self.down_proj.weight, compute_dtype(gate))
        return self.down_proj(F.gelu(self.up_proj(x)))
