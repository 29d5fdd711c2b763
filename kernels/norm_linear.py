"""A mixer's read-out: the per-head output norm and the projection that reads it,
`linear(rms_norm(x [, gate]).flatten(-2), W)`, keeping the norm's inputs, not its output,
for the backward.

Apart, the norm keeps `x` and the gate (it needs them for its own backward) and the
projection keeps the normalised rows: a third `[tokens, H V]` tensor a layer, 2 H V bytes
a token in bfloat16 (4 KB a token and layer for Gated DeltaNet's values twice as wide, a
third of the read-out's share). Fused, the backward forms the normalised rows again from
what the norm kept (one more norm kernel, reading `x` and the gate) and projects with
them, as flash-linear-attention's norm-and-linear layers do.

A gate that is the cheap output of a projection whose input is kept anyway (Gated DeltaNet's
and GLA's `g_proj(x)`, KDA's low-rank second stage) may come with its `Recompute` recipe
(`gate_recompute`): the fused read-out then keeps the recipe's tensors, not the gate, and
forms the gate again in its backward (one `[tokens, d] x [d, H V]` product), 2 H V bytes a
token and layer less (4 KB for Gated DeltaNet's values twice as wide).

`rms_norm_linear_ref` is the definition (the two calls apart, what the CPU runs);
`backend="auto"` takes the fused function on CUDA, `"triton"` forces it (the interpreter
runs it in the tests).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .fused import compute_dtype, resolve_fused_backend
from .recompute import Recompute
from .rms_norm import GATE_ACTIVATIONS, rms_norm

Tensor = torch.Tensor


def rms_norm_linear_ref(x: Tensor, norm_weight: Tensor, linear_weight: Tensor, gate: Tensor | None = None, *,
                        eps: float = 1e-6, activation: str = "none", backend: str = "torch") -> Tensor:
    """The norm (`rms_norm` on `backend`) and then `F.linear`, as two calls."""
    y = rms_norm(x, norm_weight, gate, eps=eps, activation=activation, out_dtype=compute_dtype(x), backend=backend)
    return F.linear(y.flatten(-2), linear_weight)


class _RMSNormLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, norm_weight: Tensor, gate: Tensor | None, linear_weight: Tensor, eps: float,
                activation: str, gate_recompute: Recompute | None):
        from .triton.rms_norm import rms_norm_forward_triton

        shape, D = x.shape, x.shape[-1]
        x2 = x.reshape(-1, D).contiguous()
        g2 = None if gate is None else gate.reshape(-1, D).contiguous()
        y, rstd, _ = rms_norm_forward_triton(x2, norm_weight.contiguous(), g2, eps, activation, linear_weight.dtype)
        out = y.view(-1, shape[-2] * D) @ linear_weight.t()
        # with a recipe, the gate's own inputs are kept (the projection before it keeps
        # them anyway), and what the node holds of the recipe has no tensor in it
        ctx.gate_recipe = None if gate_recompute is None else gate_recompute.without_tensors()
        ctx.gate_dtype = None if gate is None else g2.dtype
        kept_gate = [] if gate_recompute is None else gate_recompute.tensors()
        ctx.save_for_backward(x2, norm_weight, g2 if gate_recompute is None else None, rstd, linear_weight, *kept_gate)
        ctx.shape, ctx.eps, ctx.activation = shape, eps, activation
        return out.view(*shape[:-2], linear_weight.shape[0])

    @staticmethod
    def backward(ctx, d_out: Tensor):
        from .triton.rms_norm import rms_norm_backward_triton, rms_norm_forward_triton

        x2, norm_weight, g2, rstd, linear_weight, *kept_gate = ctx.saved_tensors
        shape, D = ctx.shape, ctx.shape[-1]
        if ctx.gate_recipe is not None:
            g2 = _gate_again(ctx.gate_recipe, kept_gate, x2.shape, ctx.gate_dtype)
        # the normalised rows again, from what the norm kept for its own backward
        y, _, _ = rms_norm_forward_triton(x2, norm_weight.contiguous(), g2, ctx.eps, ctx.activation,
                                          linear_weight.dtype)
        rows = d_out.reshape(-1, linear_weight.shape[0]).to(linear_weight.dtype)
        d_linear = rows.t() @ y.view(-1, shape[-2] * D)
        dy = (rows @ linear_weight).view(-1, D)
        dx, dgate, dw, _ = rms_norm_backward_triton(x2, norm_weight.contiguous(), g2, rstd, dy.contiguous(),
                                                    ctx.activation)
        return (dx.reshape(shape), dw.to(norm_weight.dtype), None if dgate is None else dgate.reshape(shape),
                d_linear, None, None, None)


def _gate_again(recipe: Recompute, tensors: list[Tensor], rows_shape: torch.Size, dtype: torch.dtype) -> Tensor:
    """The gate formed again by its recipe, as the kernel reads it: `[tokens, D]` rows. A
    recipe that forms something of another size or dtype is an error, not a silent misread."""
    gate = recipe.run(tensors)
    if gate.numel() != rows_shape.numel() or gate.dtype != dtype:
        raise RuntimeError(f"rms_norm_linear: the recompute of the gate gave {tuple(gate.shape)} {gate.dtype}, "
                           f"the gate was {rows_shape.numel()} elements of {dtype}")
    return gate.reshape(rows_shape).contiguous()


def rms_norm_linear(x: Tensor, norm_weight: Tensor, linear_weight: Tensor, gate: Tensor | None = None, *,
                    eps: float = 1e-6, activation: str = "none", backend: str = "auto",
                    gate_recompute: Recompute | None = None) -> Tensor:
    """`x` `[..., H, D]` normalised over D (`norm_weight` `[D]`, `gate` like `x` unless
    `activation="none"`), its rows of H D projected by `linear_weight` `[out, H D]`
    -> `[..., out]`, in autocast's dtype under autocast (else `x`'s); differentiable in
    all four. `gate_recompute`: how to form `gate` again (`kernels.Recompute`; its result,
    reshaped to `x`'s shape, must equal `gate`), so that the fused path keeps its tensors
    instead of the gate; the torch path keeps what autograd keeps and ignores it."""
    if activation not in GATE_ACTIVATIONS:
        raise ValueError(f"rms_norm_linear: activation must be one of {GATE_ACTIVATIONS}, got {activation!r}")
    if x.dim() < 2 or norm_weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm_linear: x must be [..., H, D] and norm_weight [D], got {tuple(x.shape)} "
                         f"and {tuple(norm_weight.shape)}")
    if linear_weight.dim() != 2 or linear_weight.shape[1] != x.shape[-2] * x.shape[-1]:
        raise ValueError(f"rms_norm_linear: linear_weight must be [out, {x.shape[-2] * x.shape[-1]}], "
                         f"got {tuple(linear_weight.shape)}")
    if (activation == "none") != (gate is None):
        raise ValueError(f"rms_norm_linear: activation {activation!r} {'takes no' if gate is not None else 'needs a'} gate")
    if gate is not None and gate.shape != x.shape:
        raise ValueError(f"rms_norm_linear: gate must have x's shape {tuple(x.shape)}, got {tuple(gate.shape)}")
    if gate_recompute is not None and not isinstance(gate_recompute, Recompute):
        raise ValueError(f"rms_norm_linear: gate_recompute must be a kernels.Recompute, got {type(gate_recompute).__name__}")
    if gate_recompute is not None and gate is None:
        raise ValueError("rms_norm_linear: gate_recompute forms a gate again, but no gate was passed")
    if resolve_fused_backend(backend, x.device) != "triton":
        return rms_norm_linear_ref(x, norm_weight, linear_weight, gate, eps=eps, activation=activation, backend=backend)
    # The projection runs in the dtype autocast would give it; the cast of the weight is
    # autograd's (its gradient returns in the weight's own dtype).
    weight = linear_weight.to(compute_dtype(x))
    with torch.autocast(x.device.type, enabled=False):
        return _RMSNormLinear.apply(x, norm_weight, gate, weight, eps, activation, gate_recompute)
