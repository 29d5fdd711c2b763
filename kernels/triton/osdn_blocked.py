"""OSDN phase 1's forward in blocks of sub-steps: one dot-product round per block, not per step.

The sequential scan (`osdn.py`) waits on one dot product per sub-step, about 190 ns on the
H200, so 4,096 steps cost 0.79 ms whatever the bandwidth (`docs/kernel.md`, "OSDN phase 1").
Between clips the step is affine in `d`,

    p_j = rho_j d_j + a_j s_j,   a_j = c_j - cb_j <d_j, s_j>,   d_{j+1} = p_j,

so over a block of `M` sub-steps starting from `d` every `<d_j, s_j>` is `P_j X_j` plus the
block's earlier `a_l` through the Gram matrix `G = s s^T`, with `X = s d` the block's only
dot products with `d` (`P_j`, `Q_jl`: the retain gates' products before `j` and strictly
between `l` and `j`):

    (I + diag(cb) (Q o G)_strict) a = c - cb o P o X,   so   a = a0 - Mx X

with `a0` and `Mx` free of `d`: `osdn_block_prepare_kernel` forms them for every block at
once (parallel), and the scan then spends one reduction round per block on `X`, one small
matrix-vector product on `a`, and a scan along the block for the `p_j`. If any `p_j` of a
block leaves `[d_min, d_max]` the clip is active inside it and the affine form no longer
holds: that block runs step by step from its start instead (`_block_steps`), exactly as
the sequential scan. Either way the block stores the same write keys, trajectory and
stats (`|k|^2`, `<d, s>`) that the sequential forward stores, so the backward is unchanged.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .chunks import chunk_of_program, chunk_tables

Tensor = torch.Tensor

# Sub-steps per block: BLOCK_TOKENS tokens of n_h sub-steps each, so that a block starts at
# a token (where the retain gate acts). 16 sub-steps fill a tensor-core tile for `G`.
BLOCK_STEPS = 16


def block_tokens(n_h: int) -> int:
    return max(1, BLOCK_STEPS // n_h)


@triton.jit
def _block_rows(bos, seq_len, c, NH: tl.constexpr, RT: tl.constexpr, BM: tl.constexpr):
    """Sub-step offsets `m` of block `c`, their sub-steps `j` in the sequence, their global
    rows, and whether each is in the sequence."""
    m = tl.arange(0, BM)
    j = c * RT * NH + m
    ok = (m < RT * NH) & (j < seq_len * NH)
    return m, j, bos * NH + j, ok


@triton.jit
def _block_coefficients(k, beta, retain, bos, j, rows, ok, i_h, eps, eta, H: tl.constexpr, K: tl.constexpr,
                        BK: tl.constexpr, NH: tl.constexpr, BETA_AWARE: tl.constexpr, HAS_RETAIN: tl.constexpr,
                        ACC: tl.constexpr):
    """A block's keys `[BM, BK]`, `s = k*k`, `|k|^2`, `c`, `cb` and retain gates, with the
    same operations as the sequential scan's `_ahead_coefficients` (rows outside the
    sequence: `k = 0`, `c = cb = 0`, `rho = 1`)."""
    o = tl.arange(0, BK)
    kk = tl.load(k + (rows[:, None] * H + i_h) * K + o[None, :], mask=ok[:, None] & (o[None, :] < K), other=0.0).to(ACC)
    s = kk * kk
    sq = tl.sum(s, 1)
    rn = 1.0 / tl.maximum(sq, eps)
    en = eta * rn
    if BETA_AWARE:
        b = tl.load(beta + rows * H + i_h, mask=ok, other=0.0).to(ACC)
        c = en * b
        cb = c * b
    else:
        c = en
        cb = en
    c = tl.where(ok, c, 0.0)
    cb = tl.where(ok, cb, 0.0)
    rho = tl.full(sq.shape, 1.0, ACC)
    if HAS_RETAIN:
        rho = tl.load(retain + (bos + j // NH) * H + i_h, mask=ok & (j % NH == 0), other=1.0).to(ACC)
    return kk, s, sq, c, cb, rho


@triton.jit(do_not_specialize=["T"])
def osdn_block_prepare_kernel(
    k, beta, retain, coef, mats, cu_seqlens, table, T, NT, eta, eps,
    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, NH: tl.constexpr, RT: tl.constexpr, BM: tl.constexpr,
    LOG2_BM: tl.constexpr, BETA_AWARE: tl.constexpr, HAS_RETAIN: tl.constexpr, IS_VARLEN: tl.constexpr,
    ACC: tl.constexpr,
):
    """Per block and head: `a0`, `P` (`coef[row, h, 0:2]`) and the rows of `Mx` and of
    `(Q o G)_strict` (`mats[row, h, 0:BM]`, `mats[row, h, BM:2BM]`), all free of `d`."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    _, bos, seq_len, c = chunk_of_program(i_c, T, NT, cu_seqlens, table, IS_VARLEN)
    m, j, rows, ok = _block_rows(bos, seq_len, c, NH, RT, BM)
    _, s, _, cc, cb, rho = _block_coefficients(k, beta, retain, bos, j, rows, ok, i_h, eps, eta, H, K, BK, NH,
                                              BETA_AWARE, HAS_RETAIN, ACC)
    G = tl.dot(s, tl.trans(s), input_precision="ieee", out_dtype=ACC)
    lower = m[:, None] > m[None, :]
    if HAS_RETAIN:
        # P_j = prod_{l<j} rho_l and Q_jl = prod_{l<i<j} rho_i, as exponentials of sums of
        # logarithms whose differences are <= 0 (no overflow)
        lr = tl.log(tl.maximum(rho, 1e-30))  # floored inside the logarithm only: log 0 = -inf
        incl = tl.cumsum(lr, 0)
        excl = incl - lr
        P = tl.exp(excl)
        Q = tl.where(lower, tl.exp(excl[:, None] - incl[None, :]), 0.0)
    else:
        P = tl.full(cc.shape, 1.0, ACC)
        Q = tl.where(lower, 1.0, 0.0).to(ACC)
    QG = Q * G
    A = cb[:, None] * QG
    # (I + A)^-1 = (I - A)(I + A^2)(I + A^4)...: A is strictly lower, so A^BM = 0
    eye = tl.where(m[:, None] == m[None, :], 1.0, 0.0).to(ACC)
    inv = eye - A
    power = A
    for _ in tl.static_range(LOG2_BM - 1):
        power = tl.dot(power, power, input_precision="ieee", out_dtype=ACC)
        inv = tl.dot(inv, eye + power, input_precision="ieee", out_dtype=ACC)
    a0 = tl.sum(inv * cc[None, :], 1)
    Mx = inv * (cb * P)[None, :]
    base = (rows * H + i_h)
    tl.store(coef + base * 2, a0.to(coef.dtype.element_ty), mask=ok)
    tl.store(coef + base * 2 + 1, P.to(coef.dtype.element_ty), mask=ok)
    tl.store(mats + base[:, None] * (2 * BM) + m[None, :], Mx.to(mats.dtype.element_ty), mask=ok[:, None])
    tl.store(mats + base[:, None] * (2 * BM) + BM + m[None, :], QG.to(mats.dtype.element_ty), mask=ok[:, None])


@triton.jit
def _combine_affine(r1, v1, r2, v2):
    """Two affine steps `x -> r x + v`, the first then the second."""
    return r1 * r2, r2 * v1 + v2


@triton.jit
def _block_steps(d, k, beta, retain, w, traj, stats, bos, row0, count, first_token, i_h, eps, eta, d_min, d_max,
                 H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, NH: tl.constexpr, BM: tl.constexpr,
                 BETA_AWARE: tl.constexpr, HAS_RETAIN: tl.constexpr, ACC: tl.constexpr):
    """A block in which the clip acts, step by step from `d` with the sequential scan's
    operations; returns `d` after it. Unrolled over the block's `BM` slots (those past
    `count` change nothing), so that every step's loads, which do not depend on `d`, can
    be issued at the block's start instead of one memory latency per step."""
    o = tl.arange(0, BK)
    mk = o < K
    for u in tl.static_range(BM):
        live = u < count
        i = row0 + u
        kk = tl.load(k + (i * H + i_h) * K + o, mask=mk & live, other=0.0).to(ACC)
        s = kk * kk
        sq = tl.sum(s, 0)
        rn = 1.0 / tl.maximum(sq, eps)
        en = eta * rn
        if BETA_AWARE:
            b_i = tl.load(beta + i * H + i_h, mask=live, other=0.0).to(ACC)
            c = en * b_i
            cb = c * b_i
        else:
            c = en
            cb = en
        rho = 1.0
        if HAS_RETAIN:
            rho = tl.load(retain + (bos + first_token + u // NH) * H + i_h, mask=live & (u % NH == 0),
                          other=1.0).to(ACC)
        tl.store(w + (i * H + i_h) * K + o, (d * kk).to(w.dtype.element_ty), mask=mk & live)
        tl.store(traj + (i * H + i_h) * K + o, d.to(traj.dtype.element_ty), mask=mk & live)
        align = tl.sum(d * s, 0)
        tl.store(stats + (i * H + i_h) * 2, sq.to(stats.dtype.element_ty), mask=live)
        tl.store(stats + (i * H + i_h) * 2 + 1, align.to(stats.dtype.element_ty), mask=live)
        p = (rho * d + c * s) - (cb * s) * align
        d = tl.where(live, tl.minimum(tl.maximum(p, d_min), d_max), d)
    return d


@triton.jit(do_not_specialize=["T"])
def osdn_block_forward_kernel(
    k, beta, retain, d0, coef, mats, w, traj, stats, d_final, stepped_blocks, cu_seqlens, T, eta, d_min, d_max, eps,
    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, NH: tl.constexpr, RT: tl.constexpr, BM: tl.constexpr,
    BETA_AWARE: tl.constexpr, HAS_RETAIN: tl.constexpr, D0_MODE: tl.constexpr, IS_VARLEN: tl.constexpr,
    ACC: tl.constexpr,
):
    """The scan, one program per (sequence, head); `stepped_blocks` counts its blocks that
    the clip made run step by step."""
    i_nh = tl.program_id(0)
    i_n, i_h = i_nh // H, i_nh % H
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int32)
        seq_len = tl.load(cu_seqlens + i_n + 1).to(tl.int32) - bos
    else:
        bos, seq_len = i_n * T, T
    o = tl.arange(0, BK)
    mk = o < K
    if D0_MODE == 0:  # ones
        d = tl.where(mk, 1.0, 0.0).to(ACC)
    elif D0_MODE == 1:  # shared [H, K]
        d = tl.load(d0 + i_h * K + o, mask=mk, other=0.0).to(ACC)
    else:  # per sequence [N, H, K]
        d = tl.load(d0 + i_nh * K + o, mask=mk, other=0.0).to(ACC)
    L = seq_len * NH
    stepped = 0
    for c in range(tl.cdiv(seq_len, RT)):
        m, j, rows, ok = _block_rows(bos, seq_len, c, NH, RT, BM)
        row0 = bos * NH + c * RT * NH  # the block's first row
        count = tl.minimum(RT * NH, L - c * RT * NH)
        _kk, s, sq, _c, _cb, rho = _block_coefficients(k, beta, retain, bos, j, rows, ok, i_h, eps, eta, H, K, BK,
                                                       NH, BETA_AWARE, HAS_RETAIN, ACC)
        base = rows * H + i_h
        a0 = tl.load(coef + base * 2, mask=ok, other=0.0).to(ACC)
        P = tl.load(coef + base * 2 + 1, mask=ok, other=0.0).to(ACC)
        Mx = tl.load(mats + base[:, None] * (2 * BM) + m[None, :], mask=ok[:, None], other=0.0).to(ACC)
        # the block's critical path: its dot products with d, a, the scan along the block
        X = tl.sum(s * d[None, :], 1)
        a = a0 - tl.sum(Mx * X[None, :], 1)
        if HAS_RETAIN:
            R, V = tl.associative_scan((rho[:, None] + tl.zeros_like(s), a[:, None] * s), 0, _combine_affine)
            p = R * d[None, :] + V
        else:
            p = d[None, :] + tl.cumsum(a[:, None] * s, 0)
        inside = (p >= d_min) & (p <= d_max)
        clipped = tl.max(tl.where(ok[:, None] & mk[None, :] & ~inside, 1, 0))
        if clipped > 0:
            d = _block_steps(d, k, beta, retain, w, traj, stats, bos, row0, count, c * RT, i_h, eps, eta,
                             d_min, d_max, H, K, BK, NH, BM, BETA_AWARE, HAS_RETAIN, ACC)
            stepped += 1
        else:
            # d_j for j >= 1 is p_{j-1}: row j-1 of p goes to row j, the block's first row is d
            k_first = tl.load(k + (row0 * H + i_h) * K + o, mask=mk, other=0.0).to(ACC)
            tl.store(w + (row0 * H + i_h) * K + o, (d * k_first).to(w.dtype.element_ty), mask=mk)
            tl.store(traj + (row0 * H + i_h) * K + o, d.to(traj.dtype.element_ty), mask=mk)
            nxt = (m + 1 < count)
            k_next = tl.load(k + ((rows[:, None] + 1) * H + i_h) * K + o[None, :], mask=nxt[:, None] & mk[None, :],
                             other=0.0).to(ACC)
            out = ((rows[:, None] + 1) * H + i_h) * K + o[None, :]
            tl.store(w + out, (p * k_next).to(w.dtype.element_ty), mask=nxt[:, None] & mk[None, :])
            tl.store(traj + out, p.to(traj.dtype.element_ty), mask=nxt[:, None] & mk[None, :])
            QG = tl.load(mats + base[:, None] * (2 * BM) + BM + m[None, :], mask=ok[:, None], other=0.0).to(ACC)
            align = P * X + tl.sum(QG * a[None, :], 1)
            tl.store(stats + base * 2, sq.to(stats.dtype.element_ty), mask=ok)
            tl.store(stats + base * 2 + 1, align.to(stats.dtype.element_ty), mask=ok)
            d = tl.sum(tl.where((m == count - 1)[:, None], p, 0.0), 0)
    tl.store(d_final + i_nh * K + o, d.to(d_final.dtype.element_ty), mask=mk)
    tl.store(stepped_blocks + i_nh, stepped)


def block_forward(k: Tensor, beta: Tensor, retain: Tensor, d0: Tensor, w: Tensor, traj: Tensor, stats: Tensor,
                  d_final: Tensor, cu_seqlens: Tensor | None, T: int, eta: float, d_min: float, d_max: float,
                  eps: float, *, n_seq: int, d0_mode: int, warps: int, meta: dict) -> Tensor:
    """Fill `w`, `traj`, `stats` and `d_final` as the sequential forward does (`meta`: its
    H, K, BK, NH, BETA_AWARE, HAS_RETAIN, IS_VARLEN and ACC); returns, per (sequence,
    head), how many blocks ran step by step because the clip acted in them."""
    B, TN, H, _ = k.shape
    n_h = meta["NH"]
    rt = block_tokens(n_h)
    bm = max(16, triton.next_power_of_2(rt * n_h))
    if cu_seqlens is None:
        nt = triton.cdiv(T, rt)
        table, count = k, B * nt  # no table: any tensor fills the pointer argument
    else:
        nt = 0
        table, _, count = chunk_tables(cu_seqlens, rt)
    acc = traj.dtype
    coef = torch.empty(B, TN, H, 2, device=k.device, dtype=acc)
    mats = torch.empty(B, TN, H, 2 * bm, device=k.device, dtype=acc)
    shared = {name: meta[name] for name in ("H", "K", "BK", "NH", "BETA_AWARE", "HAS_RETAIN", "IS_VARLEN", "ACC")}
    if count:
        osdn_block_prepare_kernel[(count, H)](
            k, beta, retain, coef, mats, cu_seqlens, table, T, nt, eta, eps, RT=rt, BM=bm,
            LOG2_BM=bm.bit_length() - 1, num_warps=4, **shared,
        )
    stepped = torch.zeros(n_seq, H, device=k.device, dtype=torch.int32)
    osdn_block_forward_kernel[(n_seq * H,)](
        k, beta, retain, d0, coef, mats, w, traj, stats, d_final, stepped, cu_seqlens, T, eta, d_min, d_max, eps,
        RT=rt, BM=bm, D0_MODE=d0_mode, num_warps=warps, **shared,
    )
    return stepped
