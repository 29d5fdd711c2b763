"""RMSNorm with an optional output gate, `y = x * rstd * w * act(gate)`, forward and backward.

Gated DeltaNet reads out `RMSNorm(o) * SiLU(g)`, KDA `RMSNorm(o) * sigmoid(g)`, and every
block's pre-norm is the ungated case. One program normalises a block of rows (each row is
one head's features, or the model width); the backward recomputes `x * rstd` and the
gate's activation from `x`, the gate and the saved `rstd` (one float per row) instead of
saving the normalised rows, and sums the weight's gradient per program (a `[programs, D]`
float32 buffer that the host reduces).

The ungated norm can instead keep its output for the backward (`FROM_OUTPUT`), as apex's
memory-efficient norms do: `x * rstd = y / w`. The projection after the norm keeps `y`
anyway, so the norm's input (under autocast the float32 residual stream, 4 bytes a
feature) need not be kept at all. For that the forward floors the weight's magnitude at
`WEIGHT_FLOOR` (`FLOOR_W`), so that `y = 0` never hides a row's value; the weight's
gradient is the floored weight's.

A block's pre-norm also takes the residual stream's addition (`ADD`): it reads `x` and the
sub-block output `h`, writes `x + h` (the stream, float32 under autocast) and its
normalised rows; the backward adds the stream's own gradient to the norm's and writes it
again in `h`'s dtype, as flash-linear-attention's fused add-and-norm does. Unfused, that
is a float32 add forward, and an add and a cast backward, each a pass over the stream.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kinds import accumulation
from .launch import RMS_NORM_LAUNCH, RMSNormLaunch

Tensor = torch.Tensor

# The gate's activation, as a compile-time constant of the kernels.
ACT_NONE = tl.constexpr(0)
ACT_SILU = tl.constexpr(1)
ACT_SIGMOID = tl.constexpr(2)
ACTIVATIONS = {"none": ACT_NONE.value, "silu": ACT_SILU.value, "sigmoid": ACT_SIGMOID.value}

# A weight entry nearer zero than this acts as +-WEIGHT_FLOOR in a norm that keeps its
# output. It moves an output by at most WEIGHT_FLOOR * |x * rstd| <= 1e-12 * sqrt(D), far
# below float32's rounding, and keeps `x * rstd * w` a normal bfloat16 or float32 number
# (whose exponent reaches 1e-38) wherever |x * rstd| > 1e-26, so `y / w` gives it back.
WEIGHT_FLOOR = tl.constexpr(1e-12)


@triton.jit
def gate_activation(gate, ACT: tl.constexpr):
    if ACT == ACT_SILU:
        return gate * tl.sigmoid(gate)
    elif ACT == ACT_SIGMOID:
        return tl.sigmoid(gate)
    else:
        return gate


@triton.jit
def floored(w):
    """`w` with its magnitude at least WEIGHT_FLOOR (a zero counts as positive)."""
    return tl.where(w < 0, tl.minimum(w, -WEIGHT_FLOOR), tl.maximum(w, WEIGHT_FLOOR))


@triton.jit(do_not_specialize=["M"])
def rms_norm_forward_kernel(
    x, h, residual, gate, w, y, rstd, M, eps,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_ROWS: tl.constexpr, ACT: tl.constexpr, ADD: tl.constexpr,
    FLOOR_W: tl.constexpr, ACC: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < M) & (cols[None, :] < D)
    offs = rows[:, None].to(tl.int64) * D + cols[None, :]
    xr = tl.load(x + offs, mask=mask, other=0.0).to(ACC)
    if ADD:  # the residual stream's sum `x + h`, written out and normalised
        xr += tl.load(h + offs, mask=mask, other=0.0).to(ACC)
        xr = xr.to(residual.dtype.element_ty).to(ACC)
        tl.store(residual + offs, xr.to(residual.dtype.element_ty), mask=mask)
    r = 1.0 / tl.sqrt(tl.sum(xr * xr, 1) / D + eps)
    wr = tl.load(w + cols, mask=cols < D, other=0.0).to(ACC)
    if FLOOR_W:
        wr = floored(wr)
    out = xr * r[:, None] * wr[None, :]
    if ACT != 0:
        g = tl.load(gate + offs, mask=mask, other=0.0).to(ACC)
        out = out * gate_activation(g, ACT)
    tl.store(y + offs, out.to(y.dtype.element_ty), mask=mask)
    tl.store(rstd + rows, r, mask=rows < M)


@triton.jit(do_not_specialize=["M", "rows_per_program"])
def rms_norm_backward_kernel(
    x, gate, w, rstd, dy, d_residual, dx, dh, dgate, dw_partial, M, rows_per_program,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_ROWS: tl.constexpr, ACT: tl.constexpr, ADD_GRAD: tl.constexpr,
    H_GRAD: tl.constexpr, FROM_OUTPUT: tl.constexpr, ACC: tl.constexpr,
):
    """`x`: the norm's input rows, or with FROM_OUTPUT its (ungated) output rows."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    wr = tl.load(w + cols, mask=col_ok, other=0.0).to(ACC)
    if FROM_OUTPUT:
        wr = floored(wr)
        inv_w = 1.0 / wr  # once per program: the rows come back as y * (1 / w)
    dw_acc = tl.zeros([BLOCK_D], dtype=ACC)
    first = pid * rows_per_program
    last = tl.minimum(first + rows_per_program, M)
    for r0 in range(first, last, BLOCK_ROWS):
        rows = r0 + tl.arange(0, BLOCK_ROWS)
        mask = (rows[:, None] < last) & col_ok[None, :]
        offs = rows[:, None].to(tl.int64) * D + cols[None, :]
        xr = tl.load(x + offs, mask=mask, other=0.0).to(ACC)
        r = tl.load(rstd + rows, mask=rows < last, other=0.0)
        dyr = tl.load(dy + offs, mask=mask, other=0.0).to(ACC)
        if FROM_OUTPUT:
            xhat = xr * inv_w[None, :]
        else:
            xhat = xr * r[:, None]
        if ACT != 0:
            g = tl.load(gate + offs, mask=mask, other=0.0).to(ACC)
            s = tl.sigmoid(g)
            if ACT == ACT_SILU:
                a = g * s
                da = s * (1.0 + g * (1.0 - s))
            else:
                a = s
                da = s * (1.0 - s)
            tl.store(dgate + offs, (dyr * xhat * wr[None, :] * da).to(dgate.dtype.element_ty), mask=mask)
            dyr = dyr * a
        dw_acc += tl.sum(dyr * xhat, 0)
        dxhat = dyr * wr[None, :]
        # d/dx of x * rstd(x): rstd * (dxhat - xhat * mean(dxhat * xhat))
        c = tl.sum(dxhat * xhat, 1) / D
        dxr = r[:, None] * (dxhat - xhat * c[:, None])
        if ADD_GRAD:  # the residual stream's own gradient joins the norm's
            dxr += tl.load(d_residual + offs, mask=mask, other=0.0).to(ACC)
        tl.store(dx + offs, dxr.to(dx.dtype.element_ty), mask=mask)
        if H_GRAD:  # `x + h`: h's gradient is x's, in h's dtype
            tl.store(dh + offs, dxr.to(dh.dtype.element_ty), mask=mask)
    tl.store(dw_partial + pid * D + cols, dw_acc, mask=col_ok)


def _block_rows(D: int, launch: RMSNormLaunch) -> tuple[int, int]:
    block_d = triton.next_power_of_2(D)
    return block_d, max(1, launch.row_elements // block_d)


def rms_norm_forward_triton(
    x: Tensor, weight: Tensor, gate: Tensor | None, eps: float, activation: str, out_dtype: torch.dtype,
    launch: RMSNormLaunch = RMS_NORM_LAUNCH, h: Tensor | None = None, residual_dtype: torch.dtype | None = None,
    floor_weight: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """`x`, `gate`, `h` `[M, D]` contiguous, `weight` `[D]` -> (`y` `[M, D]` in `out_dtype`,
    `rstd` `[M]` float32 (float64 for float64 `x`), the normalised rows `x + h` in
    `residual_dtype`, or `x` itself without `h`). `floor_weight`: the weight's magnitude
    floored at WEIGHT_FLOOR, for a backward from `y` (`keeps_output`)."""
    if floor_weight and activation != "none":
        raise ValueError("rms_norm_forward_triton: only the ungated norm's output gives its rows back")
    M, D = x.shape
    acc, acc_tl = accumulation(x.dtype if h is None else residual_dtype)
    y = torch.empty(M, D, device=x.device, dtype=out_dtype)
    rstd = torch.empty(M, device=x.device, dtype=acc)
    residual = x if h is None else torch.empty(M, D, device=x.device, dtype=residual_dtype)
    if M == 0:
        return y, rstd, residual
    block_d, block_rows = _block_rows(D, launch)
    act = ACTIVATIONS[activation]
    rms_norm_forward_kernel[(triton.cdiv(M, block_rows),)](
        x, x if h is None else h, residual, x if gate is None else gate, weight, y, rstd, M, float(eps),
        D=D, BLOCK_D=block_d, BLOCK_ROWS=block_rows, ACT=act, ADD=h is not None, FLOOR_W=floor_weight, ACC=acc_tl,
        num_warps=launch.num_warps,
    )
    return y, rstd, residual


def rms_norm_backward_triton(
    x: Tensor, weight: Tensor, gate: Tensor | None, rstd: Tensor, dy: Tensor, activation: str,
    launch: RMSNormLaunch = RMS_NORM_LAUNCH, d_residual: Tensor | None = None, h_dtype: torch.dtype | None = None,
    from_output: bool = False, x_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None]:
    """(`dx` `[M, D]` in `x_dtype`, `dgate` like `gate` or None, `dweight` `[D]` in the
    accumulation dtype, `dh` in `h_dtype` or None). `x` is the normalised rows, or with
    `from_output` the norm's output (from a forward with `floor_weight`); `x_dtype` is the
    rows' dtype (default `x.dtype`). `d_residual` (like `dx`), the gradient that reaches the
    rows from elsewhere (the residual stream), is added to `dx`; with `h_dtype`, `dh` is
    that sum again in `h_dtype` (the rows were `x + h`)."""
    if from_output and gate is not None:
        raise ValueError("rms_norm_backward_triton: only the ungated norm's output gives its rows back")
    M, D = x.shape
    dx = torch.empty(M, D, device=x.device, dtype=x_dtype or x.dtype)
    dh = None if h_dtype is None else torch.empty(M, D, device=x.device, dtype=h_dtype)
    dgate = None if gate is None else torch.empty_like(gate)
    if x.device.type == "cuda":
        programs = torch.cuda.get_device_properties(x.device).multi_processor_count * launch.backward_programs_per_sm
    else:
        programs = launch.cpu_programs
    programs = max(1, min(programs, M))
    rows_per_program = triton.cdiv(max(M, 1), programs)
    acc, acc_tl = accumulation(dx.dtype)
    dw_partial = torch.empty(programs, D, device=x.device, dtype=acc)
    block_d, block_rows = _block_rows(D, launch)
    rms_norm_backward_kernel[(programs,)](
        x, x if gate is None else gate, weight, rstd, dy, dx if d_residual is None else d_residual, dx,
        dx if dh is None else dh, dx if dgate is None else dgate, dw_partial, M, rows_per_program,
        D=D, BLOCK_D=block_d, BLOCK_ROWS=block_rows, ACT=ACTIVATIONS[activation], ADD_GRAD=d_residual is not None,
        H_GRAD=dh is not None, FROM_OUTPUT=from_output, ACC=acc_tl, num_warps=launch.num_warps,
    )
    return dx, dgate, dw_partial.sum(0), dh
