"""The channel mixer of each block: SwiGLU (LLaMA, fla's GatedMLP) or a GELU MLP.

SwiGLU's `down(silu(gate) * up)` is `kernels.swiglu_linear`: it saves only `gate` and `up`
for its backward and recomputes the product (fused into one kernel each way on CUDA); its
gate and up projections are one `kernels.fan_out_linear`, whose backward sums the input's
two gradients inside its matmuls.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from archspec.kernels.fan_out import fan_out_linear
from archspec.kernels.row_linear import SWIGLU, PreNorm, row_linear
from archspec.kernels.swiglu import swiglu_linear

from .hooks import fusable
from .joined import JoinedWeights
from .plan import Mlp

Tensor = torch.Tensor


# Hidden widths are rounded up to a multiple of this (LLaMA's `multiple_of` does the same,
# at 256): 16-byte rows in bfloat16, which cuBLAS needs for its Hopper matmuls. At
# d_model 1024, SwiGLU's 2/3 * 4096 = 2730 took Ampere kernels with 2-element alignment on
# the H200, about 240 TFLOP/s; the MLP's nine matmuls were a third of the training step.
HIDDEN_MULTIPLE = 8


def mlp_hidden_size(kind: Mlp, d_model: int, ratio: float) -> int:
    """Hidden width. SwiGLU has three matrices instead of two, so it takes 2/3 of the
    width (as LLaMA and fla do) to cost what a GELU MLP of the same ratio costs; rounded
    up to a multiple of `HIDDEN_MULTIPLE`."""
    width = ratio * d_model * (2 / 3 if kind == "swiglu" else 1)
    return max(1, -(-int(width) // HIDDEN_MULTIPLE)) * HIDDEN_MULTIPLE


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
        self.fused_backend = "auto"  # SwiGLU's elementwise path; `LanguageModel.set_backend` sets it
        # the decoding step reads gate and up as one matrix (`joined.py`)
        self._step_inputs = JoinedWeights([self.gate_proj, self.up_proj]) if self.gate_proj is not None else None

    def forward(self, x: Tensor) -> Tensor:
        if self.gate_proj is not None:
            if fusable(self.gate_proj) and fusable(self.up_proj):  # one backward sums x's two gradients
                gate, up = fan_out_linear(x, [self.gate_proj.weight, self.up_proj.weight], backend=self.fused_backend)
            else:
                gate, up = self.gate_proj(x), self.up_proj(x)
            return swiglu_linear(gate, up, self.down_proj.weight, backend=self.fused_backend)
        return self.down_proj(F.gelu(self.up_proj(x)))

    def step(self, x: Tensor, *, pre_norm: PreNorm | None = None) -> tuple[Tensor, Tensor]:
        """`forward` of one decoding token `[B, 1, d_model]`, and the residual: with
        `pre_norm` (the block's norm) `x` is the residual stream, the MLP reads
        `rms_norm(x + pending)` and the residual is `x + pending` (else `x`). SwiGLU's gate
        and up are one product (`joined.py`), and `down_proj` reads `silu(gate) * up`
        fused in front (`kernels.row_linear`)."""
        if self._step_inputs is None:
            h, residual = row_linear(x, self.up_proj.weight, before=pre_norm, backend=self.fused_backend)
            y = self.down_proj(F.gelu(h))
        else:
            gate_up, residual = row_linear(x, self._step_inputs.current()[0], before=pre_norm,
                                           backend=self.fused_backend)
            y, _ = row_linear(gate_up, self.down_proj.weight, before=SWIGLU, backend=self.fused_backend)
        return y, x if residual is None else residual
