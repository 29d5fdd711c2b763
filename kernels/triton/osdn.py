"""OSDN phase 1 (`RECURRENCE.md`, "OSDN") as a Triton scan, forward and backward.

One program per (sequence, head) carries the preconditioner `d` (`K` floats) through the
sub-steps; each step is a few vector operations and one dot product, so the scan is
latency-bound, not bandwidth-bound (`docs/kernel.md`, "OSDN"). Per sub-step `i`:

    s = k*k,  n = max(|k|^2, eps),  w_i = d * k          (emitted with the current d)
    beta-aware: c = eta beta / n, b = beta;   beta-free: c = eta / n, b = 1
    p = rho d + c (1 - b <d, s>) s,   d <- clip(p, d_min, d_max)

with `rho` the APF retain gate at a token's first sub-step (1 elsewhere). The forward
stores the trajectory of `d` (float32) for the backward, which runs the steps in reverse:
with `m = [d_min <= p <= d_max]` (`torch.clamp`'s convention) and `pbar = m * dbar'`,

    dbar  = rho pbar - c b <pbar, s> s + wbar * k
    rhobar = <pbar, d>,  cbar = <pbar, s> (1 - b <d, s>),  bbar = -c <d, s> <pbar, s>
    sbar  = c (1 - b <d, s>) pbar - c b <pbar, s> d
    kbar  = wbar * d + 2 k * sbar + 2 k * nbar [|k|^2 >= eps],   nbar = -cbar c / n
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

Tensor = torch.Tensor


@triton.jit
def _sequence(i_n, T, cu_seqlens, IS_VARLEN: tl.constexpr):
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int32)
        return bos, tl.load(cu_seqlens + i_n + 1).to(tl.int32) - bos
    else:
        return i_n * T, T


@triton.jit
def _step_terms(d, kk, b_i, eps, eta, BETA_AWARE: tl.constexpr):
    """`(s, n, c, b, <d, s>)` of one sub-step."""
    s = kk * kk
    sq = tl.sum(s, 0)
    n = tl.maximum(sq, eps)
    if BETA_AWARE:
        c = eta * b_i / n
        b = b_i
    else:
        c = eta / n
        b = 1.0
    return s, sq, n, c, b, tl.sum(d * s, 0)


PREFETCH = tl.constexpr(3)  # with AHEAD: steps whose loads are in flight ahead of the one computed
# Two launch choices, opt-in until timed and checked on the GPU (`benchmarks/variants.py`,
# e.g. the variant `8,4:osdn_ahead=1:osdn_warps=1`): AHEAD issues every step's loads
# PREFETCH steps before the step (they do not depend on `d`), so that a memory latency per
# step leaves the scan's critical path (the H200 spent about 0.7 us per step, one load
# latency, with loads at their use); one warp per program reduces a step's two dot
# products by shuffles alone, with no barrier between warps. Both are exact on the
# interpreter and compile for sm_90 without spills.
AHEAD = os.environ.get("ARCHSPEC_TRITON_OSDN_AHEAD", "0") == "1"
SCAN_WARPS = int(os.environ.get("ARCHSPEC_TRITON_OSDN_WARPS", "4"))


@triton.jit
def _load_step(k, beta, retain, bos, j, L, i_h, offs, mk, H: tl.constexpr, K: tl.constexpr, NH: tl.constexpr,
               BETA_AWARE: tl.constexpr, HAS_RETAIN: tl.constexpr, ACC: tl.constexpr):
    """Sub-step `j`'s key, beta (0 when unused) and retain gate (1 except at a token's first
    sub-step with APF); outside the sequence (`j < 0` or `j >= L`) nothing is read."""
    ok = (j >= 0) & (j < L)
    i = bos * NH + j
    kk = tl.load(k + (i * H + i_h) * K + offs, mask=mk & ok, other=0.0).to(ACC)
    b_i = tl.load(beta + i * H + i_h, mask=ok & BETA_AWARE, other=0.0).to(ACC)
    rho = tl.load(retain + (bos + j // NH) * H + i_h, mask=ok & HAS_RETAIN & (j % NH == 0), other=1.0).to(ACC)
    return kk, b_i, rho


@triton.jit(do_not_specialize=["T"])
def osdn_forward_kernel(
    k, beta, retain, d0, w, traj, d_final, cu_seqlens, T, eta, d_min, d_max, eps,
    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, NH: tl.constexpr,
    BETA_AWARE: tl.constexpr, HAS_RETAIN: tl.constexpr, D0_MODE: tl.constexpr,
    IS_VARLEN: tl.constexpr, ACC: tl.constexpr, AHEAD: tl.constexpr,
):
    i_nh = tl.program_id(0)
    i_n, i_h = i_nh // H, i_nh % H
    bos, seq_len = _sequence(i_n, T, cu_seqlens, IS_VARLEN)
    offs = tl.arange(0, BK)
    mk = offs < K
    if D0_MODE == 0:  # ones
        d = tl.where(mk, 1.0, 0.0).to(ACC)
    elif D0_MODE == 1:  # shared [H, K]
        d = tl.load(d0 + i_h * K + offs, mask=mk, other=0.0).to(ACC)
    else:  # per sequence [N, H, K]
        d = tl.load(d0 + i_nh * K + offs, mask=mk, other=0.0).to(ACC)
    L = seq_len * NH
    if AHEAD:  # a register queue of the next steps' loads, carried through the loop
        k1, b1, r1 = _load_step(k, beta, retain, bos, 0, L, i_h, offs, mk, H, K, NH, BETA_AWARE, HAS_RETAIN, ACC)
        k2, b2, r2 = _load_step(k, beta, retain, bos, 1, L, i_h, offs, mk, H, K, NH, BETA_AWARE, HAS_RETAIN, ACC)
        k3, b3, r3 = _load_step(k, beta, retain, bos, 2, L, i_h, offs, mk, H, K, NH, BETA_AWARE, HAS_RETAIN, ACC)
    for j in range(L):
        i = bos * NH + j
        if AHEAD:
            kk, b_i, rho = k1, b1, r1
            k1, b1, r1 = k2, b2, r2
            k2, b2, r2 = k3, b3, r3
            k3, b3, r3 = _load_step(k, beta, retain, bos, j + PREFETCH, L, i_h, offs, mk, H, K, NH, BETA_AWARE, HAS_RETAIN, ACC)
        else:  # each load at its use (the form checked on the H200)
            kk = tl.load(k + (i * H + i_h) * K + offs, mask=mk, other=0.0).to(ACC)
            b_i = 0.0
            if BETA_AWARE:
                b_i = tl.load(beta + i * H + i_h).to(ACC)
            rho = 1.0
            if HAS_RETAIN:  # APF: the retain gate acts once per token, at its first sub-step
                rho = tl.load(retain + (bos + j // NH) * H + i_h, mask=j % NH == 0, other=1.0).to(ACC)
        tl.store(w + (i * H + i_h) * K + offs, (d * kk).to(w.dtype.element_ty), mask=mk)
        tl.store(traj + (i * H + i_h) * K + offs, d.to(traj.dtype.element_ty), mask=mk)
        s, sq, n, c, b, align = _step_terms(d, kk, b_i, eps, eta, BETA_AWARE)
        p = rho * d + c * (1 - b * align) * s
        d = tl.minimum(tl.maximum(p, d_min), d_max)
    tl.store(d_final + i_nh * K + offs, d.to(d_final.dtype.element_ty), mask=mk)


@triton.jit
def _load_trajectory(traj, dw, bos, j, i_h, offs, mk, H: tl.constexpr, K: tl.constexpr, NH: tl.constexpr,
                     HAS_DW: tl.constexpr, ACC: tl.constexpr):
    """The backward's other loads of sub-step `j`: `d` before the step and the write
    key's gradient (0 without one); nothing is read for `j < 0`."""
    row = ((bos * NH + j) * H + i_h) * K + offs
    ok = mk & (j >= 0)
    return tl.load(traj + row, mask=ok, other=0.0).to(ACC), tl.load(dw + row, mask=ok & HAS_DW, other=0.0).to(ACC)


@triton.jit(do_not_specialize=["T"])
def osdn_backward_kernel(
    k, beta, retain, traj, dw, dd_final, dk, dbeta, dretain, dd0, cu_seqlens, T, eta, d_min, d_max, eps,
    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, NH: tl.constexpr,
    BETA_AWARE: tl.constexpr, HAS_RETAIN: tl.constexpr, HAS_DW: tl.constexpr, HAS_DD: tl.constexpr,
    IS_VARLEN: tl.constexpr, ACC: tl.constexpr, AHEAD: tl.constexpr,
):
    i_nh = tl.program_id(0)
    i_n, i_h = i_nh // H, i_nh % H
    bos, seq_len = _sequence(i_n, T, cu_seqlens, IS_VARLEN)
    offs = tl.arange(0, BK)
    mk = offs < K
    dd = tl.zeros([BK], dtype=ACC)
    if HAS_DD:
        dd += tl.load(dd_final + i_nh * K + offs, mask=mk, other=0.0).to(ACC)
    L = seq_len * NH
    if AHEAD:  # as in the forward, with the steps in reverse
        k1, b1, r1 = _load_step(k, beta, retain, bos, L - 1, L, i_h, offs, mk, H, K, NH, BETA_AWARE, HAS_RETAIN, ACC)
        k2, b2, r2 = _load_step(k, beta, retain, bos, L - 2, L, i_h, offs, mk, H, K, NH, BETA_AWARE, HAS_RETAIN, ACC)
        k3, b3, r3 = _load_step(k, beta, retain, bos, L - 3, L, i_h, offs, mk, H, K, NH, BETA_AWARE, HAS_RETAIN, ACC)
        d1, w1 = _load_trajectory(traj, dw, bos, L - 1, i_h, offs, mk, H, K, NH, HAS_DW, ACC)
        d2, w2 = _load_trajectory(traj, dw, bos, L - 2, i_h, offs, mk, H, K, NH, HAS_DW, ACC)
        d3, w3 = _load_trajectory(traj, dw, bos, L - 3, i_h, offs, mk, H, K, NH, HAS_DW, ACC)
    for jj in range(L):
        j = L - 1 - jj
        i = bos * NH + j
        o_row = (i * H + i_h) * K + offs
        if AHEAD:
            kk, b_i, rho, d, w_bar = k1, b1, r1, d1, w1
            k1, b1, r1, d1, w1 = k2, b2, r2, d2, w2
            k2, b2, r2, d2, w2 = k3, b3, r3, d3, w3
            k3, b3, r3 = _load_step(k, beta, retain, bos, j - PREFETCH, L, i_h, offs, mk, H, K, NH, BETA_AWARE, HAS_RETAIN, ACC)
            d3, w3 = _load_trajectory(traj, dw, bos, j - PREFETCH, i_h, offs, mk, H, K, NH, HAS_DW, ACC)
        else:  # each load at its use (the form checked on the H200)
            kk = tl.load(k + o_row, mask=mk, other=0.0).to(ACC)
            d = tl.load(traj + o_row, mask=mk, other=0.0).to(ACC)
            b_i = 0.0
            if BETA_AWARE:
                b_i = tl.load(beta + i * H + i_h).to(ACC)
            rho = 1.0
            if HAS_RETAIN:
                rho = tl.load(retain + (bos + j // NH) * H + i_h, mask=j % NH == 0, other=1.0).to(ACC)
            w_bar = 0.0
            if HAS_DW:
                w_bar = tl.load(dw + o_row, mask=mk, other=0.0).to(ACC)
        s, sq, n, c, b, align = _step_terms(d, kk, b_i, eps, eta, BETA_AWARE)
        p = rho * d + c * (1 - b * align) * s
        pbar = tl.where((p >= d_min) & (p <= d_max) & mk, dd, 0.0)
        ps = tl.sum(pbar * s, 0)
        dd = rho * pbar - c * b * ps * s
        dkk = 2 * kk * (c * (1 - b * align) * pbar - c * b * ps * d)
        cbar = ps * (1 - b * align)
        dkk += tl.where(sq >= eps, 2 * kk * (-cbar * c / n), 0.0)  # the eps clamp passes no gradient
        if HAS_DW:
            dd += w_bar * kk
            dkk += w_bar * d
        tl.store(dk + o_row, dkk.to(dk.dtype.element_ty), mask=mk)
        if BETA_AWARE:
            tl.store(dbeta + i * H + i_h, (cbar * eta / n - c * align * ps).to(dbeta.dtype.element_ty))
        if HAS_RETAIN:
            tl.store(dretain + (bos + j // NH) * H + i_h, tl.sum(pbar * d, 0).to(dretain.dtype.element_ty), mask=j % NH == 0)
    tl.store(dd0 + i_nh * K + offs, dd.to(dd0.dtype.element_ty), mask=mk)


class OsdnScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, k, beta, retain, d0, eta, d_min, d_max, eps, beta_aware, cu_seqlens):
        k = k.contiguous()
        B, TN, H, K = k.shape
        n_h = 1 if retain is None else TN // retain.shape[1]
        T = TN // n_h
        n_seq = B if cu_seqlens is None else cu_seqlens.numel() - 1
        acc = torch.float64 if torch.float64 in (k.dtype, getattr(beta, "dtype", None), getattr(d0, "dtype", None)) else torch.float32
        beta_ = k if beta is None else beta.contiguous()
        retain_ = k if retain is None else retain.contiguous()
        d0_mode = 0 if d0 is None else 1 if d0.dim() == 2 else 2
        d0_ = k if d0 is None else d0.contiguous()
        w = torch.empty_like(k)
        traj = torch.empty(B, TN, H, K, device=k.device, dtype=acc)
        d_final = torch.empty(n_seq, H, K, device=k.device, dtype=acc)
        meta = dict(H=H, K=K, BK=max(16, triton.next_power_of_2(K)), NH=n_h, BETA_AWARE=beta_aware,
                    HAS_RETAIN=retain is not None, IS_VARLEN=cu_seqlens is not None,
                    ACC=tl.float64 if acc == torch.float64 else tl.float32, AHEAD=AHEAD)
        osdn_forward_kernel[(n_seq * H,)](
            k, beta_, retain_, d0_, w, traj, d_final, cu_seqlens, T, eta, d_min, d_max, eps, D0_MODE=d0_mode,
            num_warps=SCAN_WARPS, **meta,
        )
        ctx.save_for_backward(k, beta, retain, traj, cu_seqlens)
        ctx.meta, ctx.args = meta, (T, eta, d_min, d_max, eps, n_seq, d0_mode)
        ctx.d0_dtype = None if d0 is None else d0.dtype
        return w, d_final

    @staticmethod
    def backward(ctx, dw, dd_final):
        k, beta, retain, traj, cu_seqlens = ctx.saved_tensors
        T, eta, d_min, d_max, eps, n_seq, d0_mode = ctx.args
        meta = ctx.meta
        B, TN, H, K = k.shape
        acc = traj.dtype
        dk = torch.empty(k.shape, device=k.device, dtype=acc)
        dbeta = None if beta is None else torch.zeros(beta.shape, device=k.device, dtype=acc)
        dretain = None if retain is None else torch.zeros(retain.shape, device=k.device, dtype=acc)
        dd0 = torch.empty(n_seq, H, K, device=k.device, dtype=acc)
        osdn_backward_kernel[(n_seq * H,)](
            k, k if beta is None else beta, k if retain is None else retain, traj,
            k if dw is None else dw.contiguous(), k if dd_final is None else dd_final.contiguous(),
            dk, k if dbeta is None else dbeta, k if dretain is None else dretain, dd0, cu_seqlens,
            T, eta, d_min, d_max, eps, HAS_DW=dw is not None, HAS_DD=dd_final is not None, num_warps=SCAN_WARPS, **meta,
        )
        dd0_out = None
        if d0_mode == 1:
            dd0_out = dd0.sum(0).to(ctx.d0_dtype)
        elif d0_mode == 2:
            dd0_out = dd0.to(ctx.d0_dtype)
        cast = lambda x, like: None if x is None else x.to(like.dtype)  # noqa: E731
        return dk.to(k.dtype), cast(dbeta, beta), cast(dretain, retain), dd0_out, None, None, None, None, None, None


def osdn_write_keys_triton(
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
    """The Triton backend of `archspec.kernels.osdn_write_keys` (inputs already checked)."""
    return OsdnScan.apply(k, beta if beta_aware else None, retain, d0, float(eta), float(d_min), float(d_max),
                          float(eps), beta_aware, cu_seqlens)
