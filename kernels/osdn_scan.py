"""OSDN phase 1 (`RECURRENCE.md`, "OSDN") as a vectorized scan with an explicit backward.

The preconditioner `d` is scanned sequentially over the expanded sequence, but each step
is a handful of `[B, H, K]` operations. Written with autograd, a long sequence would
record ~10 graph nodes per sub-step; here one `torch.autograd.Function` runs the loop
without a graph, saves only the trajectory `d_1 .. d_{T*n_h}` and replays the loop
backwards, so memory is one `[T*n_h, B, H, K]` tensor whatever the length.

Every variant is the one clipped update

    d_{i+1} = clip(rho_i d_i + c_i (1 - b_i <d_i, s_i>) s_i, d_min, d_max),   s_i = k_i * k_i

    beta-aware: c_i = eta beta_i / n_i,  b_i = beta_i
    beta-free:  c_i = eta / n_i,         b_i = 1          (n_i = max(|k_i|^2, eps))

with `rho_i` the APF retain gate at a token's first sub-step and 1 elsewhere. `s`, `c`,
`b` and `rho` are formed outside the Function with ordinary autograd, so the Function's
backward only differentiates the clipped update itself; gradients reach `k`, `beta`,
`retain` and `d0` through them. The write keys `w_i = d_i * k_i` are formed outside too.

Backward of one step, with `p_i` the pre-clip value, `m_i = [d_min <= p_i <= d_max]` (the
same inclusive convention as `torch.clamp`: zero gradient where clipped) and
`pbar = m_i * dbar_{i+1}`:

    dbar_i   += rho_i pbar - c_i b_i <pbar, s_i> s_i
    rhobar_i  = <pbar, d_i>
    cbar_i    = <pbar, s_i> (1 - b_i <d_i, s_i>)
    bbar_i    = -c_i <d_i, s_i> <pbar, s_i>
    sbar_i    = c_i (1 - b_i <d_i, s_i>) pbar - c_i b_i <pbar, s_i> d_i

Only the `dbar` chain is sequential; the rest is computed for all steps at once.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from .naive import accumulation_dtype
from .packed import host_offsets

Tensor = torch.Tensor


def _pre_clip(d: Tensor, s: Tensor, c: Tensor, b: Tensor, rho: Tensor) -> tuple[Tensor, Tensor]:
    """`(p, <d, s>)` for one step or, with a leading time axis, for all steps at once."""
    align = (d * s).sum(-1, keepdim=True)
    return rho * d + c * (1 - b * align) * s, align


class ClippedPreconditionerScan(torch.autograd.Function):
    """`(s, c, b, rho, d0) -> (D, d_final)`; time-major: `s` `[TN, B, H, K]`, `c`, `b`, `rho`
    `[TN, B, H, 1]`, `d0` `[B, H, K]`; `D[i] = d_i` (the value before step `i`)."""

    @staticmethod
    def forward(ctx, s, c, b, rho, d0, d_min: float, d_max: float):
        trajectory = torch.empty_like(s)
        d = d0.clone()  # a fresh tensor even for an empty sequence
        for i in range(s.shape[0]):
            trajectory[i] = d
            p, _ = _pre_clip(d, s[i], c[i], b[i], rho[i])
            d = p.clamp(d_min, d_max)
        ctx.save_for_backward(s, c, b, rho, trajectory)
        ctx.bounds = (d_min, d_max)
        return trajectory, d

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_trajectory, grad_final):
        s, c, b, rho, trajectory = ctx.saved_tensors
        d_min, d_max = ctx.bounds
        if grad_trajectory is None:
            grad_trajectory = torch.zeros_like(trajectory)
        grad_d = torch.zeros_like(trajectory[0]) if grad_final is None else grad_final
        p, align = _pre_clip(trajectory, s, c, b, rho)
        passes = ((p >= d_min) & (p <= d_max)).to(p.dtype)
        cb = c * b
        grad_p = torch.empty_like(trajectory)
        for i in range(s.shape[0] - 1, -1, -1):
            gp = passes[i] * grad_d
            grad_p[i] = gp
            grad_d = grad_trajectory[i] + rho[i] * gp - cb[i] * (gp * s[i]).sum(-1, keepdim=True) * s[i]
        ps = (grad_p * s).sum(-1, keepdim=True)
        grad_s = c * (1 - b * align) * grad_p - cb * ps * trajectory
        grad_c = ps * (1 - b * align)
        grad_b = -c * align * ps
        grad_rho = (grad_p * trajectory).sum(-1, keepdim=True)
        return grad_s, grad_c, grad_b, grad_rho, grad_d, None, None


def _time_major(x: Tensor) -> Tensor:
    """`[B, TN, ...]` -> contiguous `[TN, B, ...]`, so that each step reads one block."""
    return x.transpose(0, 1).contiguous()


def _scan_dense(
    k: Tensor,
    beta: Tensor | None,
    rho: Tensor,
    d0: Tensor,
    eta: float,
    d_min: float,
    d_max: float,
    beta_aware: bool,
    eps: float,
) -> tuple[Tensor, Tensor]:
    """`k` `[B, TN, H, K]`, `beta`/`rho` `[B, TN, H]`, `d0` `[B, H, K]`, all in the
    accumulation dtype; returns the write keys `[B, TN, H, K]` and the final `d`."""
    s = k * k
    inv_norm = 1.0 / torch.clamp(s.sum(-1), min=eps)
    if beta_aware:
        c, b = eta * beta * inv_norm, beta
    else:
        c, b = eta * inv_norm, torch.ones_like(inv_norm)
    trajectory, d_final = ClippedPreconditionerScan.apply(
        _time_major(s),
        _time_major(c[..., None]),
        _time_major(b[..., None]),
        _time_major(rho[..., None]),
        d0,
        d_min,
        d_max,
    )
    return trajectory.transpose(0, 1) * k, d_final


def _retain_per_substep(retain: Tensor | None, B: int, TN: int, H: int, dtype: torch.dtype, device) -> Tensor:
    """APF's retain gate `[B, T, H]` at each token's first sub-step, 1 at the others."""
    if retain is None:
        return torch.ones(B, TN, H, dtype=dtype, device=device)
    T = retain.shape[1]
    n_h = TN // T
    retain = retain.to(dtype)
    ones = torch.ones(B, T, n_h - 1, H, dtype=dtype, device=device)
    return torch.cat([retain.unsqueeze(2), ones], dim=2).reshape(B, TN, H)


def osdn_write_keys_scan(
    k: Tensor,
    beta: Tensor | None,
    *,
    eta: float = 0.003,
    d_min: float = 0.5,
    d_max: float = 2.0,
    retain: Tensor | None = None,
    beta_aware: bool = True,
    d0: Tensor | None = None,
    eps: float = 1e-6,
    cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """`osdn_write_keys` for `backend="torch"`; arguments as `archspec.kernels.osdn_write_keys`.

    With `cu_seqlens` (token offsets, B == 1) `d` restarts at each sequence from `d0`
    (`[H, K]`, or `[N, H, K]` per sequence). As in the definition (`naive.py`), token
    offsets are turned into sub-step offsets with `n_h = T*n_h / retain.shape[1]`, so
    without `retain` the offsets count sub-steps.
    """
    B, TN, H, K = k.shape
    acc = accumulation_dtype(k, beta, retain, d0)
    n_h = 1 if retain is None else TN // retain.shape[1]
    rho = _retain_per_substep(retain, B, TN, H, acc, k.device)
    k_acc = k.to(acc)
    beta_acc = None if beta is None else beta.to(acc)

    def initial_d(rows: int, sequence: int | None = None) -> Tensor:
        if d0 is None:
            return k.new_ones(rows, H, K, dtype=acc)
        d = d0.to(acc)
        if d.dim() == 2:
            return d.expand(rows, H, K)
        return d if sequence is None else d[sequence : sequence + 1]

    def run(sub: slice, d_start: Tensor) -> tuple[Tensor, Tensor]:
        return _scan_dense(
            k_acc[:, sub],
            None if beta_acc is None else beta_acc[:, sub],
            rho[:, sub],
            d_start,
            eta,
            d_min,
            d_max,
            beta_aware,
            eps,
        )

    if cu_seqlens is None:
        w, d_final = run(slice(0, TN), initial_d(B))
        return w.to(k.dtype), d_final

    offsets = host_offsets(cu_seqlens)
    keys, finals = [], []
    for n, (start, end) in enumerate(zip(offsets[:-1], offsets[1:])):
        w, d_final = run(slice(start * n_h, end * n_h), initial_d(1, n))
        keys.append(w)
        finals.append(d_final)
    return torch.cat(keys, dim=1).to(k.dtype), torch.cat(finals, dim=0)
