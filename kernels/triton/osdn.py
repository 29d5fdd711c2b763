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

import torch
import triton
import triton.language as tl

from . import launch
from .kinds import accumulation

Tensor = torch.Tensor

# The scan issues every step's loads `scan_prefetch` steps before the step (they do not
# depend on `d`), so that a memory latency per step leaves its critical path (with loads at
# their use the H200 spent about one load latency, 0.7 us, per step), and forms each step's
# terms that do not depend on `d` off the critical path (`_ahead_terms`); one warp per
# program (`scan_warps`) reduces a step's dot products by shuffles alone. The loop is
# unrolled by `scan_prefetch` steps, so that each queue slot is one set of registers: a
# step reads its slot, and the loads `scan_prefetch` steps on land in it after that last
# read. (Shifted once per step without the unrolling, the queue costs one load latency per
# step after all; likewise a value widened, or a 16-bit value unpacked, at its load is read
# there: hence `_load_ahead`'s raw and packed words.) The forward also stores each step's
# `|k|^2` and `<d, s>` (two floats that do not depend on the step's result), so that the
# backward reads them instead of reducing them again: two of its four dot products per
# step, the second of which its critical path waits on. `docs/kernel.md` ("OSDN phase 1")
# gives the measured times.

# How `d` starts (`initial_d`): ones, a `[H, K]` d0 shared by every sequence, or one per sequence.
D0_ONES = tl.constexpr(0)
D0_SHARED = tl.constexpr(1)
D0_PER_SEQUENCE = tl.constexpr(2)


@triton.jit
def sequence_of(i_n, T, cu_seqlens, IS_VARLEN: tl.constexpr):
    """`(bos, seq_len)` of sequence `i_n`."""
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int32)
        return bos, tl.load(cu_seqlens + i_n + 1).to(tl.int32) - bos
    else:
        return i_n * T, T


@triton.jit
def final_dbar(dd_final, i_nh, K: tl.constexpr, BK: tl.constexpr, HAS_DD: tl.constexpr, ACC: tl.constexpr):
    """The gradient of the final `d` that the reverse scan starts from (0 without one)."""
    o = tl.arange(0, BK)
    dd = tl.zeros([BK], dtype=ACC)
    if HAS_DD:
        dd += tl.load(dd_final + i_nh * K + o, mask=o < K, other=0.0).to(ACC)
    return dd


@triton.jit
def initial_d(d0, i_nh, i_h, K: tl.constexpr, BK: tl.constexpr, D0_MODE: tl.constexpr, ACC: tl.constexpr):
    """`d` before a sequence's first sub-step: ones, a shared `[H, K]` or a per-sequence
    `[N, H, K]` `d0` (`D0_MODE`); 0 past K."""
    o = tl.arange(0, BK)
    mk = o < K
    if D0_MODE == D0_ONES:
        return tl.where(mk, 1.0, 0.0).to(ACC)
    elif D0_MODE == D0_SHARED:
        return tl.load(d0 + i_h * K + o, mask=mk, other=0.0).to(ACC)
    else:
        return tl.load(d0 + i_nh * K + o, mask=mk, other=0.0).to(ACC)


@triton.jit
def _load_ahead(k, beta, retain, bos, j, L, i_h, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                NH: tl.constexpr, BETA_AWARE: tl.constexpr, HAS_RETAIN: tl.constexpr, PACKED: tl.constexpr):
    """Sub-step `j`'s key, beta (0 when unused) and retain gate (1 except at a token's first
    sub-step with APF) for the scan's queue of loads; outside the sequence (`j < 0` or `j >= L`)
    nothing is read. The values as stored, widened only at their use
    (`_widen`), and a 16-bit key as 32-bit words of two halves (`PACKED`), since a value
    is only carried in its own register from its load to its use if nothing reads it in
    between, and 16-bit halves are split into registers of their own at the load."""
    ok = (j >= 0) & (j < L)
    i = bos * NH + j
    if PACKED:
        o = tl.arange(0, BK // 2)
        kk = tl.load(k + (i * H + i_h) * (K // 2) + o, mask=(o < K // 2) & ok, other=0)
    else:
        o = tl.arange(0, BK)
        kk = tl.load(k + (i * H + i_h) * K + o, mask=(o < K) & ok, other=0.0)
    b_i = tl.load(beta + i * H + i_h, mask=ok & BETA_AWARE, other=0.0)
    rho = tl.load(retain + (bos + j // NH) * H + i_h, mask=ok & HAS_RETAIN & (j % NH == 0), other=1.0)
    return kk, b_i, rho


@triton.jit
def _load_ahead_trajectory(traj, dw, stats, bos, j, i_h, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                           NH: tl.constexpr, HAS_DW: tl.constexpr, PACKED_DW: tl.constexpr):
    """The backward's other loads of sub-step `j` for its queue, as `_load_ahead`: `d`
    before the step, the write key's gradient (0 without one), and the forward's `|k|^2`
    and `<d, s>`; nothing is read for `j < 0`."""
    i = bos * NH + j
    o = tl.arange(0, BK)
    d = tl.load(traj + (i * H + i_h) * K + o, mask=(o < K) & (j >= 0), other=0.0)
    if PACKED_DW:
        o2 = tl.arange(0, BK // 2)
        w_bar = tl.load(dw + (i * H + i_h) * (K // 2) + o2, mask=(o2 < K // 2) & (j >= 0) & HAS_DW, other=0)
    else:
        w_bar = tl.load(dw + (i * H + i_h) * K + o, mask=(o < K) & (j >= 0) & HAS_DW, other=0.0)
    sq = tl.load(stats + (i * H + i_h) * 2, mask=j >= 0, other=0.0)
    align = tl.load(stats + (i * H + i_h) * 2 + 1, mask=j >= 0, other=0.0)
    return d, w_bar, sq, align


@triton.jit
def _widen(x, BK: tl.constexpr, PACKED: tl.constexpr, ACC: tl.constexpr):
    """A row of `_load_ahead` in `ACC`: `PACKED` 1 (bfloat16) or 2 (float16) unpacks the
    32-bit words, low half first."""
    if PACKED == 1:
        lo = (x << 16).to(tl.float32, bitcast=True)
        hi = (x & -65536).to(tl.float32, bitcast=True)
        return tl.reshape(tl.join(lo, hi), [BK]).to(ACC)
    elif PACKED == 2:
        lo = x.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (x >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        return tl.reshape(tl.join(lo, hi), [BK]).to(ACC)
    else:
        return x.to(ACC)


@triton.jit
def _ahead_terms(kk, b_i, eps, eta, BETA_AWARE: tl.constexpr):
    """What a step takes from its loads alone (none of it waits on `d`): `s`, `|k|^2`,
    `1/n`, `eta/n`, `c` and `c b`. The forward then forms `p = (rho d + c s) - (c b s) <d, s>`,
    one fma after the dot product; the backward forms the same `p` from the same terms."""
    s = kk * kk
    sq = tl.sum(s, 0)
    rn, en, c, cb = step_coefficients(sq, b_i, eps, eta, BETA_AWARE)
    return s, sq, rn, en, c, cb


@triton.jit
def step_coefficients(sq, b_i, eps, eta, BETA_AWARE: tl.constexpr):
    """`1/n`, `eta/n`, `c` and `c b` from `|k|^2`."""
    rn = 1.0 / tl.maximum(sq, eps)
    en = eta * rn
    if BETA_AWARE:
        c = en * b_i
        cb = c * b_i
    else:
        c = en
        cb = en
    return rn, en, c, cb


@triton.jit
def _forward_step(d, kk, b_i, rho, i, i_h, w, traj, stats, offs, mk, eps, eta, d_min, d_max, H: tl.constexpr,
                  K: tl.constexpr, BK: tl.constexpr, BETA_AWARE: tl.constexpr, PACKED: tl.constexpr, ACC: tl.constexpr):
    """One step of the scan from its loads (`_load_ahead`) at row `i`; returns the next
    `d`, and stores the step's `|k|^2` and `<d, s>` for the backward."""
    kk, b_i, rho = _widen(kk, BK, PACKED, ACC), b_i.to(ACC), rho.to(ACC)
    s, sq, _rn, _en, c, cb = _ahead_terms(kk, b_i, eps, eta, BETA_AWARE)
    tl.store(w + (i * H + i_h) * K + offs, (d * kk).to(w.dtype.element_ty), mask=mk)
    tl.store(traj + (i * H + i_h) * K + offs, d.to(traj.dtype.element_ty), mask=mk)
    # the step's critical path: <d, s>, one fma, the clip
    align = tl.sum(d * s, 0)
    p = (rho * d + c * s) - (cb * s) * align
    tl.store(stats + (i * H + i_h) * 2, sq.to(stats.dtype.element_ty))
    tl.store(stats + (i * H + i_h) * 2 + 1, align.to(stats.dtype.element_ty))
    return tl.minimum(tl.maximum(p, d_min), d_max)


@triton.jit
def _backward_step(dd, kk, b_i, rho, d, w_bar, sq, align, eps, eta, d_min, d_max, mk, BK: tl.constexpr,
                   BETA_AWARE: tl.constexpr, HAS_RETAIN: tl.constexpr, HAS_DW: tl.constexpr, PACKED: tl.constexpr,
                   PACKED_DW: tl.constexpr, ACC: tl.constexpr):
    """One reverse step of the scan from its loads: `dbar` before it and the step's
    gradients of `k`, `beta` and the retain gate (stored by `_backward_store`); `|k|^2` and
    `<d, s>` are the forward's (`sq`, `align`), not reduced again."""
    kk, b_i, rho, d = _widen(kk, BK, PACKED, ACC), b_i.to(ACC), rho.to(ACC), d.to(ACC)
    w_bar = _widen(w_bar, BK, PACKED_DW, ACC)
    # from the loads alone (d is the forward's trajectory): the forward's p, bit for bit
    s = kk * kk
    sq = sq.to(ACC)
    align = align.to(ACC)
    rn, en, c, cb = step_coefficients(sq, b_i, eps, eta, BETA_AWARE)
    cbs = cb * s
    p = (rho * d + c * s) - cbs * align
    m = (p >= d_min) & (p <= d_max) & mk
    ms = tl.where(m, s, 0.0)
    if BETA_AWARE:
        g = 1 - b_i * align
    else:
        g = 1 - align
    e = tl.where(sq >= eps, -(c * rn) * g, 0.0)  # the eps clamp passes no gradient
    # the step's critical path: <dbar', m s>, one fma
    ps = tl.sum(dd * ms, 0)
    pbar = tl.where(m, dd, 0.0)
    base = rho * pbar
    if HAS_DW:
        base += w_bar * kk
    dd = base - cbs * ps
    dkk = (kk + kk) * (((c * g) * pbar + e * ps) - (cb * ps) * d)
    if HAS_DW:
        dkk += w_bar * d
    dbeta_i = ps * (g * en - c * align)
    dretain_i = 0.0
    if HAS_RETAIN:
        dretain_i = tl.sum(pbar * d, 0)
    return dd, dkk, dbeta_i, dretain_i


@triton.jit
def _backward_store(dkk, dbeta_i, dretain_i, bos, j, i_h, dk, dbeta, dretain, offs, mk, H: tl.constexpr,
                    K: tl.constexpr, NH: tl.constexpr, BETA_AWARE: tl.constexpr, HAS_RETAIN: tl.constexpr):
    i = bos * NH + j
    tl.store(dk + (i * H + i_h) * K + offs, dkk.to(dk.dtype.element_ty), mask=mk)
    if BETA_AWARE:
        tl.store(dbeta + i * H + i_h, dbeta_i.to(dbeta.dtype.element_ty))
    if HAS_RETAIN:
        tl.store(dretain + (bos + j // NH) * H + i_h, dretain_i.to(dretain.dtype.element_ty), mask=j % NH == 0)


@triton.jit(do_not_specialize=["T"])
def osdn_forward_kernel(
    k, beta, retain, d0, w, traj, stats, d_final, cu_seqlens, T, eta, d_min, d_max, eps,
    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, NH: tl.constexpr,
    BETA_AWARE: tl.constexpr, HAS_RETAIN: tl.constexpr, D0_MODE: tl.constexpr,
    IS_VARLEN: tl.constexpr, ACC: tl.constexpr, PREFETCH: tl.constexpr, PACKED: tl.constexpr,
):
    i_nh = tl.program_id(0)
    i_n, i_h = i_nh // H, i_nh % H
    bos, seq_len = sequence_of(i_n, T, cu_seqlens, IS_VARLEN)
    offs = tl.arange(0, BK)
    mk = offs < K
    d = initial_d(d0, i_nh, i_h, K, BK, D0_MODE, ACC)
    L = seq_len * NH
    # a queue of the next PREFETCH steps' loads, in a loop unrolled by PREFETCH (module comment)
    q = ()
    for u in tl.static_range(PREFETCH):
        q = q + (_load_ahead(k, beta, retain, bos, u, L, i_h, H, K, BK, NH, BETA_AWARE, HAS_RETAIN, PACKED),)
    for j in tl.range(L, loop_unroll_factor=PREFETCH):
        kk, b_i, rho = q[0]
        d = _forward_step(d, kk, b_i, rho, bos * NH + j, i_h, w, traj, stats, offs, mk, eps, eta, d_min, d_max,
                          H, K, BK, BETA_AWARE, PACKED, ACC)
        # the slot just read takes the loads of PREFETCH steps on, after its last use
        q = q[1:] + (_load_ahead(k, beta, retain, bos, j + PREFETCH, L, i_h, H, K, BK, NH, BETA_AWARE, HAS_RETAIN, PACKED),)
    tl.store(d_final + i_nh * K + offs, d.to(d_final.dtype.element_ty), mask=mk)


@triton.jit(do_not_specialize=["T"])
def osdn_backward_kernel(
    k, beta, retain, traj, stats, dw, dd_final, dk, dbeta, dretain, dd0, cu_seqlens, T, eta, d_min, d_max, eps,
    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, NH: tl.constexpr,
    BETA_AWARE: tl.constexpr, HAS_RETAIN: tl.constexpr, HAS_DW: tl.constexpr, HAS_DD: tl.constexpr,
    IS_VARLEN: tl.constexpr, ACC: tl.constexpr, PREFETCH: tl.constexpr, PACKED: tl.constexpr,
    PACKED_DW: tl.constexpr,
):
    i_nh = tl.program_id(0)
    i_n, i_h = i_nh // H, i_nh % H
    bos, seq_len = sequence_of(i_n, T, cu_seqlens, IS_VARLEN)
    offs = tl.arange(0, BK)
    mk = offs < K
    dd = final_dbar(dd_final, i_nh, K, BK, HAS_DD, ACC)
    L = seq_len * NH
    # as in the forward, with the steps in reverse
    q = ()
    for u in tl.static_range(PREFETCH):
        q = q + (_load_ahead(k, beta, retain, bos, L - 1 - u, L, i_h, H, K, BK, NH, BETA_AWARE, HAS_RETAIN, PACKED)
                 + _load_ahead_trajectory(traj, dw, stats, bos, L - 1 - u, i_h, H, K, BK, NH, HAS_DW, PACKED_DW),)
    for jj in tl.range(L, loop_unroll_factor=PREFETCH):
        j = L - 1 - jj
        kk, b_i, rho, d, w_bar, sq, align = q[0]
        dd, dkk, dbeta_i, dretain_i = _backward_step(dd, kk, b_i, rho, d, w_bar, sq, align, eps, eta, d_min, d_max,
                                                     mk, BK, BETA_AWARE, HAS_RETAIN, HAS_DW, PACKED, PACKED_DW, ACC)
        # the slot just read takes the loads of PREFETCH steps on: after its last use (else a
        # copy at the loop's end waits for them), before the step's stores (which a load
        # cannot pass)
        q = q[1:] + (_load_ahead(k, beta, retain, bos, j - PREFETCH, L, i_h, H, K, BK, NH, BETA_AWARE, HAS_RETAIN, PACKED)
                     + _load_ahead_trajectory(traj, dw, stats, bos, j - PREFETCH, i_h, H, K, BK, NH, HAS_DW, PACKED_DW),)
        _backward_store(dkk, dbeta_i, dretain_i, bos, j, i_h, dk, dbeta, dretain, offs, mk, H, K, NH, BETA_AWARE, HAS_RETAIN)
    tl.store(dd0 + i_nh * K + offs, dd.to(dd0.dtype.element_ty), mask=mk)


def _packed(x: Tensor | None) -> tuple[Tensor | None, int]:
    """A contiguous 16-bit `[..., K]` tensor (K even) as 32-bit words of two values
    (`_load_ahead`) and its `PACKED` code; otherwise the tensor itself and 0."""
    code = {torch.bfloat16: 1, torch.float16: 2}.get(getattr(x, "dtype", None), 0)
    if not code or x.shape[-1] % 2 or x.storage_offset() % 2 or not x.is_contiguous():
        return x, 0
    return x.view(torch.int32), code


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
        d0_mode = (D0_ONES if d0 is None else D0_SHARED if d0.dim() == 2 else D0_PER_SEQUENCE).value
        d0_ = k if d0 is None else d0.contiguous()
        w = torch.empty_like(k)
        traj = torch.empty(B, TN, H, K, device=k.device, dtype=acc)
        d_final = torch.empty(n_seq, H, K, device=k.device, dtype=acc)
        scan = launch.scan_settings()
        meta = dict(H=H, K=K, BK=max(16, triton.next_power_of_2(K)), NH=n_h, BETA_AWARE=beta_aware,
                    HAS_RETAIN=retain is not None, IS_VARLEN=cu_seqlens is not None,
                    ACC=accumulation(acc)[1], PREFETCH=scan.scan_prefetch)
        k_words, meta["PACKED"] = _packed(k)
        stats = torch.empty(B, TN, H, 2, device=k.device, dtype=acc)  # |k|^2 and <d, s> per step
        osdn_forward_kernel[(n_seq * H,)](
            k_words, beta_, retain_, d0_, w, traj, stats, d_final, cu_seqlens, T, eta, d_min, d_max, eps,
            D0_MODE=d0_mode, num_warps=scan.scan_warps, **meta,
        )
        # the contiguous copies: the backward indexes beta and retain as dense [B, T*n_h, H]
        # and [B, T, H] (a view, e.g. a slice of a longer sequence, gave wrong gradients)
        ctx.save_for_backward(k, None if beta is None else beta_, None if retain is None else retain_, traj, stats,
                              cu_seqlens)
        ctx.meta, ctx.warps, ctx.args = meta, scan.scan_warps, (T, eta, d_min, d_max, eps, n_seq, d0_mode)
        ctx.d0_dtype = None if d0 is None else d0.dtype
        return w, d_final

    @staticmethod
    def backward(ctx, dw, dd_final):
        k, beta, retain, traj, stats, cu_seqlens = ctx.saved_tensors
        T, eta, d_min, d_max, eps, n_seq, d0_mode = ctx.args
        meta = ctx.meta
        B, TN, H, K = k.shape
        acc = traj.dtype
        # dk in k's dtype, rounded once in the kernel as `.to` would: a float32 dk and a cast
        # after it would move 201 MB more at B=4 T=4096 H=16 K=128 bf16 (~50 us on an H200)
        dk = torch.empty_like(k)
        dbeta = None if beta is None else torch.zeros(beta.shape, device=k.device, dtype=acc)
        dretain = None if retain is None else torch.zeros(retain.shape, device=k.device, dtype=acc)
        dd0 = torch.empty(n_seq, H, K, device=k.device, dtype=acc)
        dw_words, packed_dw = _packed(None if dw is None else dw.contiguous())
        osdn_backward_kernel[(n_seq * H,)](
            _packed(k)[0], k if beta is None else beta, k if retain is None else retain, traj, stats,
            k if dw is None else dw_words, k if dd_final is None else dd_final.contiguous(),
            dk, k if dbeta is None else dbeta, k if dretain is None else dretain, dd0, cu_seqlens,
            T, eta, d_min, d_max, eps, HAS_DW=dw is not None, HAS_DD=dd_final is not None, PACKED_DW=packed_dw,
            num_warps=ctx.warps, **meta,
        )
        return OsdnScan._gradients(ctx, k, beta, retain, dk, dbeta, dretain, dd0, d0_mode)

    @staticmethod
    def _gradients(ctx, k, beta, retain, dk, dbeta, dretain, dd0, d0_mode):
        """`backward`'s return: each gradient in its input's dtype, `d0`'s summed over the
        sequences when one `d0` was shared."""
        dd0_out = None
        if d0_mode == D0_SHARED.value:
            dd0_out = dd0.sum(0).to(ctx.d0_dtype)
        elif d0_mode == D0_PER_SEQUENCE.value:
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
