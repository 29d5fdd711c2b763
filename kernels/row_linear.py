"""The decoding step's linear maps: a token's rows through a weight, with what the step
runs in front of the product (a norm, SwiGLU) fused into it.

`row_linear(x, weight, bias=None, *, before=None, backend="auto") -> (out, residual)`,
`x` `[B, 1, K]` (a token per row; rows may be column slices of a wider output), `before`:

- None: `x @ weight^T (+ bias)`;
- `PreNorm(weight, eps, pending)`: a pre-norm block's residual step; `x` is the residual
  stream, the product reads `rms_norm(x + pending) * weight` and `residual` is `x +
  pending` (`x` itself without `pending`), as `add_rms_norm` gives them;
- `HeadNorm(weight, eps, gate, activation)`: the mixer's output norm, `x` `[B, 1, H*V]`
  normalised per head of `V = len(weight)` channels, times `act(gate)` (`rms_norm`);
- `SWIGLU`: `x` `[B, 1, 2 * hidden]` is `[gate | up]`, the product reads `silu(gate) * up`.

On CUDA with at most `ROW_LINEAR_MAX_ROWS` rows this is one Triton launch
(`triton/row_linear.py`); otherwise it is the definition: the fused norm or SwiGLU
kernel, then `F.linear` (cuBLAS, which reads the weight once for all the rows). No
autograd: decoding is inference. On sm_90 the launch overlaps the kernel before it and
reads its first weight tile before waiting for it: pass a weight that kernel did not
write (a model's weights; a non-contiguous weight is copied and then read after the wait).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .fused import compute_dtype, resolve_fused_backend
from .rms_norm import GATE_ACTIVATIONS, add_rms_norm, rms_norm
from .swiglu import swiglu_joined

Tensor = torch.Tensor


@dataclass(frozen=True)
class PreNorm:
    """`rms_norm(x + pending) * weight` in front of the product."""

    weight: Tensor
    eps: float
    pending: Tensor | None = None


@dataclass(frozen=True)
class HeadNorm:
    """`rms_norm` per head of `len(weight)` channels, times `activation(gate)`."""

    weight: Tensor
    eps: float
    gate: Tensor | None = None
    activation: str = "none"


class _SwiGLU:
    def __repr__(self) -> str:
        return "SWIGLU"


SWIGLU = _SwiGLU()  # `silu(gate) * up` of the joined `[gate | up]` row in front of the product

Before = PreNorm | HeadNorm | _SwiGLU | None


def _input_width(x: Tensor, before: Before) -> int:
    return x.shape[-1] // 2 if before is SWIGLU else x.shape[-1]


def _check(x: Tensor, weight: Tensor, bias: Tensor | None, before: Before) -> None:
    problems = []
    if x.dim() != 3 or x.shape[1] != 1 or x.stride(-1) != 1:
        problems.append(f"x must be [B, 1, K] (a token per row) with unit column stride, got {tuple(x.shape)}")
    elif weight.dim() != 2 or weight.shape[1] != _input_width(x, before):
        problems.append(f"weight must be [N, {_input_width(x, before)}], got {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != weight.shape[:1]:
        problems.append(f"bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
    if before is SWIGLU and x.shape[-1] % 2:
        problems.append(f"SWIGLU needs an even [gate | up] width, got {x.shape[-1]}")
    if isinstance(before, PreNorm):
        if tuple(before.weight.shape) != (x.shape[-1],):
            problems.append(f"PreNorm's weight must be [{x.shape[-1]}], got {tuple(before.weight.shape)}")
        if before.pending is not None and before.pending.shape != x.shape:
            problems.append(f"PreNorm's pending must have x's shape {tuple(x.shape)}, got {tuple(before.pending.shape)}")
    if isinstance(before, HeadNorm):
        V = before.weight.numel()
        if before.weight.dim() != 1 or x.shape[-1] % V:
            problems.append(f"HeadNorm's weight must be [V] with V dividing {x.shape[-1]}, got {tuple(before.weight.shape)}")
        if before.gate is not None and before.gate.shape != x.shape:
            problems.append(f"HeadNorm's gate must have x's shape {tuple(x.shape)}, got {tuple(before.gate.shape)}")
        if before.activation not in GATE_ACTIVATIONS or (before.activation == "none") != (before.gate is None):
            problems.append(f"HeadNorm's activation must be one of {GATE_ACTIVATIONS}, 'none' exactly without a gate, "
                            f"got {before.activation!r}")
    if problems:
        raise ValueError("row_linear: " + "; ".join(problems))


def _on_triton(x: Tensor, before: Before, backend: str) -> bool:
    from .triton.launch import ROW_LINEAR_MAX_ROWS

    if resolve_fused_backend(backend, x.device) != "triton" or x.shape[0] > ROW_LINEAR_MAX_ROWS:
        return False
    if isinstance(before, HeadNorm):  # one tile per head: a power of two
        V = before.weight.numel()
        return V & (V - 1) == 0
    return True


def _rows(t: Tensor | None) -> Tensor | None:
    """`t` `[B, 1, C]` as `[B, C]` rows, each contiguous (a column slice stays in place)."""
    if t is None:
        return None
    t = t[:, 0]
    return t if t.stride(-1) == 1 else t.contiguous()


def row_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, *, before: Before = None,
               backend: str = "auto") -> tuple[Tensor, Tensor | None]:
    """`(out [B, 1, N], residual)`: see the module. `residual` is None unless `before` is a
    `PreNorm`."""
    _check(x, weight, bias, before)
    with torch.no_grad():
        if _on_triton(x, before, backend):
            from .triton.row_linear import row_linear_triton

            options: dict = {}
            if isinstance(before, PreNorm):
                pending = None if before.pending is None else _rows(before.pending).contiguous()
                options = dict(prologue="norm", pending=pending, norm_weight=before.weight, eps=before.eps)
            elif isinstance(before, HeadNorm):
                options = dict(prologue="head_norm", norm_weight=before.weight, eps=before.eps, gate=_rows(before.gate),
                               activation=before.activation, head=before.weight.numel())
            elif before is SWIGLU:
                options = dict(prologue="swiglu")
            rows_of_weight = weight.contiguous()
            # a copy made just now is the kernel right before: not to be read ahead of the wait
            out, residual = row_linear_triton(_rows(x), rows_of_weight, bias, **options,
                                              weight_settled=rows_of_weight is weight)
            if isinstance(before, PreNorm) and residual is None:
                residual = x
            return out[:, None], None if residual is None else residual.reshape(x.shape)
        return _unfused(x, weight, bias, before, backend)


def _unfused(x: Tensor, weight: Tensor, bias: Tensor | None, before: Before,
             backend: str) -> tuple[Tensor, Tensor | None]:
    """The definition: the fused norm or SwiGLU kernel, then the product."""
    residual = None
    if isinstance(before, PreNorm):
        y, residual = add_rms_norm(x, before.pending, before.weight, eps=before.eps, out_dtype=compute_dtype(x),
                                   backend=backend)
    elif isinstance(before, HeadNorm):
        V = before.weight.numel()
        heads = (lambda t: None if t is None else t.unflatten(-1, (-1, V)))
        y = rms_norm(heads(x), before.weight, heads(before.gate), eps=before.eps, activation=before.activation,
                     out_dtype=compute_dtype(x), backend=backend).flatten(-2)
    elif before is SWIGLU:
        y = swiglu_joined(x, backend=backend)
    else:
        y = x
    return F.linear(y, weight, bias), residual
