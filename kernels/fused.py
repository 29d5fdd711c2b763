"""The fused pieces of a training step beside the recurrence, and how each picks its path.

- `linear_ce.linear_cross_entropy`: the LM head and its cross-entropy without the logits.
- `rms_norm.rms_norm`: RMSNorm with an optional SiLU or sigmoid output gate.
- `norm_linear.rms_norm_linear`: a mixer's output norm and `o_proj`, the normalised rows
  formed again in the backward instead of kept.
- `short_conv.short_conv`: the causal depthwise convolution with its SiLU (and the
  per-head L2 normalisation of the streams that need unit keys), packed documents and
  carried tails.
- `swiglu.swiglu_linear`: SwiGLU's down projection, the product recomputed in the backward.
- `log_decay.gate_log_decay`: the decay gates' `-exp(A_log) * f(proj + bias)`, `f` softplus or sigmoid.
- `fan_out.fan_out_linear`: several projections of one input, their input gradients
  summed inside the backward's matmuls (cuBLAS, not Triton: `"triton"` selects it too).

Each has a plain torch path (the definition, and what runs on the CPU) and a Triton path
in `kernels/triton/`; `backend="auto"` takes Triton on CUDA tensors and torch elsewhere,
`"torch"` and `"triton"` force one (the tests run the Triton path under the interpreter).
"""

from __future__ import annotations

import torch

from .api import resolve_backend

Tensor = torch.Tensor

FUSED_BACKENDS = ("torch", "triton", "auto")


def resolve_fused_backend(backend: str, device: torch.device) -> str:
    """`auto`: the Triton kernel on CUDA tensors, plain torch elsewhere."""
    return resolve_backend(backend, device, FUSED_BACKENDS)


def compute_dtype(t: Tensor) -> torch.dtype:
    """The dtype a matmul on `t` runs in: autocast's when it is on for `t`'s device, else `t`'s."""
    if torch.is_autocast_enabled(t.device.type):
        return torch.get_autocast_dtype(t.device.type)
    return t.dtype


# Inputs whose product CUDA can write in float32 directly (`torch.mm(..., out_dtype=)`).
_LOW_PRECISION = (torch.bfloat16, torch.float16)


def weight_grad(rows: Tensor, x: Tensor, dtype: torch.dtype) -> Tensor:
    """`rows^T @ x` `[out, in]` in `dtype`: the float32 gradient of a float32 weight whose
    matmuls ran in bfloat16 comes out of the matmul itself on CUDA (`fan_out_linear`,
    `swiglu_linear`)."""
    if rows.is_cuda and dtype == torch.float32 and rows.dtype in _LOW_PRECISION:
        return torch.mm(rows.t(), x, out_dtype=torch.float32)
    return (rows.t() @ x).to(dtype)


def linear_as(x: Tensor, weight: Tensor, bias: Tensor | None = None, *, dtype: torch.dtype) -> Tensor:
    """`F.linear` with every operand in `dtype`, as autocast runs a projection (it casts
    the input, the weight and the bias alike): a recipe (`kernels.Recompute`) that forms a
    projection's output again in a backward, where autocast is off, gets the forward's
    values bit for bit."""
    with torch.autocast(x.device.type, enabled=False):
        return torch.nn.functional.linear(x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))

