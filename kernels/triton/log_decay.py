"""The gates' log decay `g = -exp(A_log) * f(proj + bias)` (`f` softplus, sigmoid or
`softplus(-z)`, as `FORM` says: `kinds.DecayForm`), forward and backward, one pass each over `[tokens,
channels]` in float32 registers.

Each program owns `rows x block_c` of the flattened `[N, C]` tensor (`C` the channels a
token's gate has: H for a scalar gate, H * K for a channel gate); the per-channel rate
`exp(A_log)` and bias are loaded once per program. The backward writes `d proj` and, per
program, the partial sums over its rows of `d g * g` (for `A_log`) and of `d proj`'s
float32 value (for `bias`); the host adds the partials.

`softplus(z) = max(z, 0) + log(1 + exp(-|z|))`, `d softplus(z) / dz = sigmoid(z)`;
`d sigmoid(z) / dz = sigmoid(z) (1 - sigmoid(z))`; GLA's `softplus(-z)` has slope `-sigmoid(-z)`. `decay_of` is the one definition of the
form on Triton; the decoding step (`decode.py`) takes it too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kinds import DecayForm
from .kinds import GLA_DECAY, MAMBA2_DECAY, accumulation
from .launch import LOG_DECAY_LAUNCH, LogDecayLaunch

Tensor = torch.Tensor


@triton.jit
def _tile(proj, a_log, bias, N, C, ROWS: tl.constexpr, BC: tl.constexpr, ACC: tl.constexpr):
    """(columns, offsets, mask, rate, z) of this program's tile; masked entries have z = 0."""
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    col_ok = cols < C
    mask = (rows < N)[:, None] & col_ok[None, :]
    offs = rows[:, None] * C + cols[None, :]
    rate = tl.exp(tl.load(a_log + cols, mask=col_ok, other=0.0).to(ACC))
    z = tl.load(proj + offs, mask=mask, other=0.0).to(ACC) + tl.load(bias + cols, mask=col_ok, other=0.0).to(ACC)[None, :]
    return cols, offs, mask, rate, z


@triton.jit
def softplus(z):
    return tl.maximum(z, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(z)))


@triton.jit
def decay_of(z, FORM: tl.constexpr):
    """`f(z)` of the log decay `-rate * f(z)`."""
    # one assignment per form and one return: each specialization compiles one branch
    if FORM == MAMBA2_DECAY:
        f = softplus(z)
    elif FORM == GLA_DECAY:
        f = softplus(-z)
    else:
        f = tl.sigmoid(z)
    return f


@triton.jit
def decay_slope(z, FORM: tl.constexpr):
    """`f'(z)`."""
    if FORM == MAMBA2_DECAY:
        slope = tl.sigmoid(z)
    elif FORM == GLA_DECAY:
        slope = -tl.sigmoid(-z)
    else:
        s = tl.sigmoid(z)
        slope = s * (1.0 - s)
    return slope


@triton.jit
def log_decay_forward_kernel(proj, a_log, bias, g, N, C, ROWS: tl.constexpr, BC: tl.constexpr, FORM: tl.constexpr,
                             ACC: tl.constexpr):
    _, offs, mask, rate, z = _tile(proj, a_log, bias, N, C, ROWS, BC, ACC)
    tl.store(g + offs, (-rate[None, :] * decay_of(z, FORM)).to(g.dtype.element_ty), mask=mask)


@triton.jit
def log_decay_backward_kernel(proj, a_log, bias, dg, d_proj, d_rate_part, d_bias_part, N, C,
                              ROWS: tl.constexpr, BC: tl.constexpr, FORM: tl.constexpr, ACC: tl.constexpr):
    cols, offs, mask, rate, z = _tile(proj, a_log, bias, N, C, ROWS, BC, ACC)
    d = tl.load(dg + offs, mask=mask, other=0.0).to(ACC)  # masked entries: d = 0, so they add nothing
    d_logits = -rate[None, :] * decay_slope(z, FORM) * d
    tl.store(d_proj + offs, d_logits.to(d_proj.dtype.element_ty), mask=mask)
    part = tl.program_id(0).to(tl.int64) * C + cols
    tl.store(d_rate_part + part, tl.sum(-rate[None, :] * decay_of(z, FORM) * d, axis=0), mask=cols < C)
    tl.store(d_bias_part + part, tl.sum(d_logits, axis=0), mask=cols < C)


def _layout(A_log: Tensor, proj: Tensor, bias: Tensor) -> tuple[Tensor, Tensor, int, int]:
    """(per-channel A_log, per-channel bias, N, C) of `proj` flattened to `[N, C]`."""
    C = bias.numel()
    return A_log.expand(bias.shape).reshape(C).contiguous(), bias.reshape(C).contiguous(), proj.numel() // max(C, 1), C


def _grid(N: int, C: int, launch: LogDecayLaunch) -> tuple[tuple[int, int], int]:
    block_c = min(launch.block_c, triton.next_power_of_2(C))
    return (triton.cdiv(N, launch.rows), triton.cdiv(C, block_c)), block_c


def log_decay_forward_triton(A_log: Tensor, proj: Tensor, bias: Tensor, form: DecayForm = DecayForm.MAMBA2,
                             launch: LogDecayLaunch = LOG_DECAY_LAUNCH) -> Tensor:
    """`g` in at least float32, shaped like `proj` (contiguous)."""
    a, b, N, C = _layout(A_log, proj, bias)
    dtype, acc = accumulation(torch.promote_types(proj.dtype, torch.float32))
    g = torch.empty(proj.shape, device=proj.device, dtype=dtype)
    if proj.numel():
        grid, block_c = _grid(N, C, launch)
        log_decay_forward_kernel[grid](proj, a, b, g, N, C, ROWS=launch.rows, BC=block_c, FORM=int(form), ACC=acc,
                                       num_warps=launch.num_warps)
    return g


def log_decay_backward_triton(A_log: Tensor, proj: Tensor, bias: Tensor, dg: Tensor, form: DecayForm = DecayForm.MAMBA2,
                              launch: LogDecayLaunch = LOG_DECAY_LAUNCH) -> tuple[Tensor, Tensor, Tensor]:
    """(`d A_log` shaped like A_log and `d bias` like bias, in the accumulation
    dtype; `d proj` like proj); `proj`, `dg` contiguous."""
    a, b, N, C = _layout(A_log, proj, bias)
    dtype, acc = accumulation(torch.promote_types(proj.dtype, torch.float32))
    grid, block_c = _grid(N, C, launch)
    d_proj = torch.empty_like(proj)
    d_rate = torch.zeros(grid[0], C, device=proj.device, dtype=dtype)
    d_bias = torch.zeros(grid[0], C, device=proj.device, dtype=dtype)
    if proj.numel():
        log_decay_backward_kernel[grid](proj, a, b, dg, d_proj, d_rate, d_bias, N, C, ROWS=launch.rows, BC=block_c,
                                        FORM=int(form), ACC=acc, num_warps=launch.num_warps)
    d_A = d_rate.sum(0).reshape(bias.shape).sum_to_size(A_log.shape)
    return d_A, d_proj, d_bias.sum(0).reshape(bias.shape)
