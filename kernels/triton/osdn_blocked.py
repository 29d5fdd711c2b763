"""OSDN phase 1's forward in blocks of sub-steps: one dot-product round per block, not per step.

The sequential scan (`osdn.py`) waits on one dot product per sub-step, about 190 ns on the
H200, so 4,096 steps cost 0.79 ms whatever the bandwidth (`docs/kernel.md`, "OSDN phase 1").
Between clips the step is affine in `d`,

    p_j = rho_j d_j + a_j s_j,   a_j = c_j - cb_j <d_j, s_j>,   d_{j+1} = p_j,

so over a block of `M` sub-steps starting from `d` every `<d_j, s_j>` is `P_j X_j` plus the
block's earlier `a_l` through the Gram matrix `G = s s^T`, with `X = s d` (`P_j`, `Q_jl`:
the retain gates' products before `j` and strictly between `l` and `j`):

    (I + diag(cb) (Q o G)_strict) a = c - cb o P o X,   so   a = a0 - Mx s d = a0 - Z d

with `a0` and `Z = Mx s` (`[M, K]`) free of `d`: `osdn_block_prepare_kernel` forms them for
every block at once (parallel). The scan then spends, per block, one reduction over K for
`a` (no layout change: `a` lands in the rows of the block's tiles), a scan down the block's
rows for the `p_j`, and one reduction for the clip check; with one warp and 8 sub-steps per
block the float32 tiles hold a block's rows in each lane, so the row scan and the next `d`
are in registers. If any `p_j` leaves `[d_min, d_max]` the clip acts inside the block and the
affine form no longer holds. If instead every coordinate of `d` sits at a bound that each
of the block's steps pushes it past, `d` is held through the block (checked from the same
dot products `X`): with APF's retain gates this is the usual case, since they pull `d` onto
`d_min` and hold it there. Otherwise the block runs step by step from its start
(`_block_steps`, the sequential scan's operations on the block's rows already loaded).
Either way the block stores the write keys, trajectory and stats (`|k|^2`, `<d, s>`) that
the sequential forward stores, so the backward is unchanged. Each block's loads are issued
one block ahead: they do not depend on `d`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .chunks import chunk_of_program, chunk_tables
from .osdn import _backward_step, final_dbar, initial_d, sequence_of, step_coefficients

Tensor = torch.Tensor

# Sub-steps per block (a power of two): BLOCK_STEPS // n_h tokens (at least one) of n_h
# sub-steps, so that a block starts at a token, where the retain gate acts.
BLOCK_STEPS = 8
# With APF the trajectory is recovered from the scan as d_j = (p_j - a_j s_j) / rho_j; a
# block with a retain gate below this runs step by step rather than divide by it.
RETAIN_FLOOR = tl.constexpr(0.125)


def block_tokens(n_h: int) -> int:
    return max(1, BLOCK_STEPS // n_h)


@triton.jit
def _block_rows(bos, seq_len, c, NH: tl.constexpr, RT: tl.constexpr, BM: tl.constexpr):
    """Sub-step offsets `m` of block `c`, their sub-steps `j` in the sequence, their global
    rows, and whether each is in the sequence."""
    m = tl.arange(0, BM)
    j = c * RT * NH + m
    # j >= 0: the backward loads block c - 1 one block ahead, block -1 at its last step
    # (unused, but on the GPU a read before the tensor is an illegal address; the CPU
    # interpreter reads it silently)
    ok = (m < RT * NH) & (j >= 0) & (j < seq_len * NH)
    return m, j, bos * NH + j, ok


@triton.jit
def _block_loads(k, beta, retain, coef, Z, bos, seq_len, c, i_h, H: tl.constexpr, K: tl.constexpr,
                 BK: tl.constexpr, NH: tl.constexpr, RT: tl.constexpr, BM: tl.constexpr,
                 BETA_AWARE: tl.constexpr, HAS_RETAIN: tl.constexpr, PREPARED: tl.constexpr):
    """Block `c`'s loads, as stored (nothing outside the sequence is read): keys `[BM, BK]`,
    beta and retain gates `[BM]` (0 and 1 where unused), and with PREPARED the prepass's
    `a0` `[BM]` and `Z` `[BM, BK]`."""
    _, j, rows, ok = _block_rows(bos, seq_len, c, NH, RT, BM)
    o = tl.arange(0, BK)
    tile = ok[:, None] & (o[None, :] < K)
    kk = tl.load(k + (rows[:, None] * H + i_h) * K + o[None, :], mask=tile, other=0.0)
    b = tl.load(beta + rows * H + i_h, mask=ok & BETA_AWARE, other=0.0)
    rho = tl.load(retain + (bos + j // NH) * H + i_h, mask=ok & HAS_RETAIN & (j % NH == 0), other=1.0)
    a0 = tl.zeros([BM], dtype=tl.float32)
    z = tl.zeros([BM, BK], dtype=tl.float32)
    if PREPARED:
        a0 = tl.load(coef + rows * H + i_h, mask=ok, other=0.0)
        z = tl.load(Z + (rows[:, None] * H + i_h) * K + o[None, :], mask=tile, other=0.0)
    return kk, b, rho, a0, z


@triton.jit
def _coefficients(kk, b, eps, eta, BETA_AWARE: tl.constexpr):
    """`s = k*k`, `|k|^2`, `c` and `cb` of a block's rows, by the sequential scan's
    `osdn.step_coefficients`."""
    s = kk * kk
    sq = tl.sum(s, 1)
    _, _, c, cb = step_coefficients(sq, b, eps, eta, BETA_AWARE)
    return s, sq, c, cb


@triton.jit
def _mm_small(x, y):
    """`x @ y` for small blocks (`[BM, BM] @ [BM, N]`) as a broadcast sum: exact float32,
    and no tensor-core shape limits."""
    return tl.sum(x[:, :, None] * y[None, :, :], 1)


@triton.jit
def _unit_triangular_inverse(A, m, LOG2_BM: tl.constexpr, ACC: tl.constexpr):
    """`(I + A)^-1` for a strictly triangular `[BM, BM]` `A` (`m`: `arange(BM)`), as
    `(I - A)(I + A^2)(I + A^4)...`: `A^BM = 0`."""
    eye = tl.where(m[:, None] == m[None, :], 1.0, 0.0).to(ACC)
    inv = eye - A
    power = A
    for _ in tl.static_range(LOG2_BM - 1):
        power = _mm_small(power, power)
        inv = _mm_small(inv, eye + power)
    return inv


@triton.jit(do_not_specialize=["T"])
def osdn_block_prepare_kernel(
    k, beta, retain, coef, Z, cu_seqlens, table, T, NT, eta, eps,
    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, NH: tl.constexpr, RT: tl.constexpr, BM: tl.constexpr,
    LOG2_BM: tl.constexpr, BETA_AWARE: tl.constexpr, HAS_RETAIN: tl.constexpr, IS_VARLEN: tl.constexpr,
    ACC: tl.constexpr,
):
    """Per block and head: `a0` (`coef[row, h]`) and `Z = Mx s` (`Z[row, h, :]`), free of `d`."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    _, bos, seq_len, c = chunk_of_program(i_c, T, NT, cu_seqlens, table, IS_VARLEN)
    m, _, rows, ok = _block_rows(bos, seq_len, c, NH, RT, BM)
    kk, b, rho, _, _ = _block_loads(k, beta, retain, coef, Z, bos, seq_len, c, i_h, H, K, BK, NH, RT, BM,
                                    BETA_AWARE, HAS_RETAIN, False)
    s, _, cc, cb = _coefficients(kk.to(ACC), b.to(ACC), eps, eta, BETA_AWARE)
    cc = tl.where(ok, cc, 0.0)
    cb = tl.where(ok, cb, 0.0)
    G = tl.sum(s[:, None, :] * s[None, :, :], 2)
    lower = m[:, None] > m[None, :]
    if HAS_RETAIN:
        # P_j = prod_{l<j} rho_l and Q_jl = prod_{l<i<j} rho_i, as exponentials of sums of
        # logarithms whose differences are <= 0 (no overflow)
        lr = tl.log(tl.maximum(rho.to(ACC), 1e-30))  # floored inside the logarithm only: log 0 = -inf
        incl = tl.cumsum(lr, 0)
        excl = incl - lr
        P = tl.exp(excl)
        Q = tl.where(lower, tl.exp(excl[:, None] - incl[None, :]), 0.0)
    else:
        P = tl.full(cc.shape, 1.0, ACC)
        Q = tl.where(lower, 1.0, 0.0).to(ACC)
    inv = _unit_triangular_inverse(cb[:, None] * (Q * G), m, LOG2_BM, ACC)
    a0 = tl.sum(inv * cc[None, :], 1)
    z = _mm_small(inv * (cb * P)[None, :], s)
    o = tl.arange(0, BK)
    tl.store(coef + rows * H + i_h, a0.to(coef.dtype.element_ty), mask=ok)
    tl.store(Z + (rows[:, None] * H + i_h) * K + o[None, :], z.to(Z.dtype.element_ty),
             mask=ok[:, None] & (o[None, :] < K))


@triton.jit
def _combine_affine(r1, v1, r2, v2):
    """Two affine steps `x -> r x + v`, the first then the second."""
    return r1 * r2, r2 * v1 + v2


@triton.jit
def _block_steps(d, kk, s, sq, c, cb, rho, rows, count, i_h, w, traj, stats, d_min, d_max,
                 H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BM: tl.constexpr):
    """A block in which the clip acts, step by step from `d` with the sequential scan's
    operations on the block's rows (already in registers); returns `d` after it."""
    o = tl.arange(0, BK)
    mk = o < K
    m = tl.arange(0, BM)
    for u in tl.static_range(BM):
        live = u < count
        pick = (m == u)[:, None]
        k_u = tl.sum(tl.where(pick, kk, 0.0), 0)
        s_u = tl.sum(tl.where(pick, s, 0.0), 0)
        at = m == u
        sq_u = tl.sum(tl.where(at, sq, 0.0), 0)
        c_u = tl.sum(tl.where(at, c, 0.0), 0)
        cb_u = tl.sum(tl.where(at, cb, 0.0), 0)
        rho_u = tl.sum(tl.where(at, rho, 0.0), 0)
        i = tl.sum(tl.where(at, rows, 0), 0)
        tl.store(w + (i * H + i_h) * K + o, (d * k_u).to(w.dtype.element_ty), mask=mk & live)
        tl.store(traj + (i * H + i_h) * K + o, d.to(traj.dtype.element_ty), mask=mk & live)
        align = tl.sum(d * s_u, 0)
        tl.store(stats + (i * H + i_h) * 2, sq_u.to(stats.dtype.element_ty), mask=live)
        tl.store(stats + (i * H + i_h) * 2 + 1, align.to(stats.dtype.element_ty), mask=live)
        p = (rho_u * d + c_u * s_u) - (cb_u * s_u) * align
        d = tl.where(live, tl.minimum(tl.maximum(p, d_min), d_max), d)
    return d


@triton.jit(do_not_specialize=["T"])
def osdn_block_forward_kernel(
    k, beta, retain, d0, coef, Z, w, traj, stats, d_final, block_counts, cu_seqlens, T, eta, d_min, d_max, eps,
    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, NH: tl.constexpr, RT: tl.constexpr, BM: tl.constexpr,
    BETA_AWARE: tl.constexpr, HAS_RETAIN: tl.constexpr, D0_MODE: tl.constexpr, IS_VARLEN: tl.constexpr,
    ACC: tl.constexpr,
):
    """The scan, one program per (sequence, head); `block_counts` gets how many of its
    blocks ran step by step (the clip acted and moved `d`) and how many held `d`."""
    i_nh = tl.program_id(0)
    i_n, i_h = i_nh // H, i_nh % H
    bos, seq_len = sequence_of(i_n, T, cu_seqlens, IS_VARLEN)
    o = tl.arange(0, BK)
    mk = o < K
    d = initial_d(d0, i_nh, i_h, K, BK, D0_MODE, ACC)
    L = seq_len * NH
    stepped = 0
    held = 0
    ahead = _block_loads(k, beta, retain, coef, Z, bos, seq_len, 0, i_h, H, K, BK, NH, RT, BM, BETA_AWARE,
                         HAS_RETAIN, True)
    for c in range(tl.cdiv(seq_len, RT)):
        kk, b, rho, a0, z = ahead
        # the next block's loads, issued before this block's work (none of it waits on d)
        ahead = _block_loads(k, beta, retain, coef, Z, bos, seq_len, c + 1, i_h, H, K, BK, NH, RT, BM, BETA_AWARE,
                             HAS_RETAIN, True)
        m, _, rows, ok = _block_rows(bos, seq_len, c, NH, RT, BM)
        count = tl.minimum(RT * NH, L - c * RT * NH)
        kk, rho = kk.to(ACC), rho.to(ACC)
        s, sq, cc, cb = _coefficients(kk, b.to(ACC), eps, eta, BETA_AWARE)
        # the block's critical path: a from one reduction over K, the scan down the rows
        a = a0.to(ACC) - tl.sum(z.to(ACC) * d[None, :], 1)
        if HAS_RETAIN:
            R, V = tl.associative_scan((rho[:, None] + tl.zeros_like(s), a[:, None] * s), 0, _combine_affine)
            p = R * d[None, :] + V
        else:
            p = d[None, :] + tl.cumsum(a[:, None] * s, 0)
        tile = ok[:, None] & mk[None, :]
        outside = tile & ((p < d_min) | (p > d_max))
        clipped = tl.max(tl.where(outside, 1, 0))
        if HAS_RETAIN:
            clipped += tl.max(tl.where(ok & (rho < RETAIN_FLOOR), 1, 0))
        # the other exact case: d held where it is, each coordinate at a bound that every
        # step pushes it past (APF's retain gates hold d at d_min; `docs/kernel.md`)
        X = tl.sum(s * d[None, :], 1)
        pc = rho[:, None] * d[None, :] + (cc - cb * X)[:, None] * s
        moved = tl.max(tl.where(tile & (tl.minimum(tl.maximum(pc, d_min), d_max) != d[None, :]), 1, 0))
        if clipped > 0 and moved > 0:
            d = _block_steps(d, kk, s, sq, cc, cb, rho, rows, count, i_h, w, traj, stats, d_min, d_max, H, K, BK, BM)
            stepped += 1
        elif clipped > 0:  # held: every d_j is d
            out = (rows[:, None] * H + i_h) * K + o[None, :]
            tl.store(w + out, (d[None, :] * kk).to(w.dtype.element_ty), mask=tile)
            tl.store(traj + out, (d[None, :] + tl.zeros_like(kk)).to(traj.dtype.element_ty), mask=tile)
            tl.store(stats + (rows * H + i_h) * 2, sq.to(stats.dtype.element_ty), mask=ok)
            tl.store(stats + (rows * H + i_h) * 2 + 1, X.to(stats.dtype.element_ty), mask=ok)
            held += 1
        else:
            # the trajectory: d_j = (p_j - a_j s_j) / rho_j, the state before step j
            D = p - a[:, None] * s
            if HAS_RETAIN:
                D = D / rho[:, None]
            out = (rows[:, None] * H + i_h) * K + o[None, :]
            tl.store(w + out, (D * kk).to(w.dtype.element_ty), mask=tile)
            tl.store(traj + out, D.to(traj.dtype.element_ty), mask=tile)
            tl.store(stats + (rows * H + i_h) * 2, sq.to(stats.dtype.element_ty), mask=ok)
            tl.store(stats + (rows * H + i_h) * 2 + 1, tl.sum(D * s, 1).to(stats.dtype.element_ty), mask=ok)
            d = tl.sum(tl.where((m == count - 1)[:, None], p, 0.0), 0)
    tl.store(d_final + i_nh * K + o, d.to(d_final.dtype.element_ty), mask=mk)
    tl.store(block_counts + i_nh * 2, stepped)
    tl.store(block_counts + i_nh * 2 + 1, held)


def _blocks(k: Tensor, cu_seqlens: Tensor | None, T: int, acc: torch.dtype, meta: dict) -> tuple:
    """The blocks of a call: tokens per block, blocks per sequence (0 when packed), the
    packed batch's block table, how many blocks, the prepass's `[B, TN, H]` and
    `[B, TN, H, K]` outputs, and the constexprs every blocked kernel takes from `meta`."""
    B, TN, H, K = k.shape
    rt = block_tokens(meta["NH"])
    if cu_seqlens is None:
        nt = triton.cdiv(T, rt)
        table, count = k, B * nt  # no table: any tensor fills the pointer argument
    else:
        nt = 0
        table, _, count = chunk_tables(cu_seqlens, rt)
    coef = torch.empty(B, TN, H, device=k.device, dtype=acc)
    Z = torch.empty(B, TN, H, K, device=k.device, dtype=acc)
    shared = {name: meta[name] for name in ("H", "K", "BK", "NH", "BETA_AWARE", "HAS_RETAIN", "IS_VARLEN", "ACC")}
    return rt, nt, table, count, coef, Z, shared


def block_forward(k: Tensor, beta: Tensor, retain: Tensor, d0: Tensor, w: Tensor, traj: Tensor, stats: Tensor,
                  d_final: Tensor, cu_seqlens: Tensor | None, T: int, eta: float, d_min: float, d_max: float,
                  eps: float, *, n_seq: int, d0_mode: int, warps: int, meta: dict) -> Tensor:
    """Fill `w`, `traj`, `stats` and `d_final` as the sequential forward does (`meta`: its
    H, K, BK, NH, BETA_AWARE, HAS_RETAIN, IS_VARLEN and ACC); returns, per (sequence,
    head), how many blocks ran step by step because the clip acted in them and moved `d`
    (`[..., 0]`), and how many held `d` at its bounds (`[..., 1]`)."""
    H = k.shape[2]
    rt, nt, table, count, coef, Z, shared = _blocks(k, cu_seqlens, T, traj.dtype, meta)
    if count:
        osdn_block_prepare_kernel[(count, H)](
            k, beta, retain, coef, Z, cu_seqlens, table, T, nt, eta, eps, RT=rt, BM=BLOCK_STEPS,
            LOG2_BM=BLOCK_STEPS.bit_length() - 1, num_warps=4, **shared,
        )
    counts = torch.zeros(n_seq, H, 2, device=k.device, dtype=torch.int32)
    osdn_block_forward_kernel[(n_seq * H,)](
        k, beta, retain, d0, coef, Z, w, traj, stats, d_final, counts, cu_seqlens, T, eta, d_min, d_max, eps,
        RT=rt, BM=BLOCK_STEPS, D0_MODE=d0_mode, num_warps=warps, **shared,
    )
    return counts


# ---------------------------------------------------------------------------------------
# The backward in blocks. Reverse steps (`osdn._backward_step`), with `m` the clip's mask
# of the step and `pbar = m dbar'`:
#
#     ps_j = <dbar_{j+1}, m s_j>,   dbar_j = rho_j pbar_j + wbar_j k_j - cb_j ps_j s_j
#
# A block whose masks are all true (no coordinate clipped) is affine in the `dbar` after it:
# `ps = b0 + Zb dbar` with `b0`, `Zb` from `osdn_block_backward_prepare_kernel` (the
# forward's algebra reversed: `(I + U) ps = A o Y + r`, `U` strictly upper); a block whose
# masks are all false (`d` held at its bounds) passes no gradient through `d`:
# `pbar = 0`, `ps = 0`, `dbar_j = wbar_j k_j`; any other block runs the reverse steps.
# Either way every row's gradients are the reverse step's formulas.


@triton.jit
def _mm_small_t(x, y):
    """`x @ y^T` for small blocks (`[BM, N] x [BM', N] -> [BM, BM']`) as a broadcast sum."""
    return tl.sum(x[:, None, :] * y[None, :, :], 2)


@triton.jit(do_not_specialize=["T"])
def osdn_block_backward_prepare_kernel(
    k, beta, retain, stats, dw, coef, Z, cu_seqlens, table, T, NT, eta, eps,
    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, NH: tl.constexpr, RT: tl.constexpr, BM: tl.constexpr,
    LOG2_BM: tl.constexpr, BETA_AWARE: tl.constexpr, HAS_RETAIN: tl.constexpr, HAS_DW: tl.constexpr,
    IS_VARLEN: tl.constexpr, ACC: tl.constexpr,
):
    """Per block and head: `b0` (`coef[row, h]`) and `Zb` (`Z[row, h, :]`), free of `dbar`."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    _, bos, seq_len, c = chunk_of_program(i_c, T, NT, cu_seqlens, table, IS_VARLEN)
    m, _, rows, ok = _block_rows(bos, seq_len, c, NH, RT, BM)
    kk, b, rho, _, _ = _block_loads(k, beta, retain, coef, Z, bos, seq_len, c, i_h, H, K, BK, NH, RT, BM,
                                    BETA_AWARE, HAS_RETAIN, False)
    kk = kk.to(ACC)
    s = kk * kk
    sq = tl.load(stats + (rows * H + i_h) * 2, mask=ok, other=1.0).to(ACC)
    _, _, _, cb = step_coefficients(sq, b.to(ACC), eps, eta, BETA_AWARE)
    cb = tl.where(ok, cb, 0.0)
    o = tl.arange(0, BK)
    tile = ok[:, None] & (o[None, :] < K)
    upper = m[:, None] < m[None, :]
    if HAS_RETAIN:
        # A_j = prod_{j<i<BM} rho_i, B_jl = prod_{j<i<l} rho_i (l > j), from sums of logarithms
        lr = tl.log(tl.maximum(rho.to(ACC), 1e-30))  # floored inside the logarithm only: log 0 = -inf
        incl = tl.cumsum(lr, 0)
        A = tl.exp(tl.sum(lr, 0) - incl)
        Bm = tl.where(upper, tl.exp((incl - lr)[None, :] - incl[:, None]), 0.0)
    else:
        A = tl.full(sq.shape, 1.0, ACC)
        Bm = tl.where(upper, 1.0, 0.0).to(ACC)
    r = tl.zeros([BM], dtype=ACC)
    if HAS_DW:
        wbar = tl.load(dw + (rows[:, None] * H + i_h) * K + o[None, :], mask=tile, other=0.0).to(ACC)
        r = tl.sum(Bm * _mm_small_t(s, wbar * kk), 1)  # sum_{l>j} B_jl <wbar_l k_l, s_j>
    inv = _unit_triangular_inverse(Bm * _mm_small_t(s, s) * cb[None, :], m, LOG2_BM, ACC)
    b0 = tl.sum(inv * r[None, :], 1)
    zb = _mm_small(inv * A[None, :], s)
    tl.store(coef + rows * H + i_h, b0.to(coef.dtype.element_ty), mask=ok)
    tl.store(Z + (rows[:, None] * H + i_h) * K + o[None, :], zb.to(Z.dtype.element_ty), mask=tile)


@triton.jit
def _block_backward_loads(k, beta, retain, traj, stats, dw, coef, Z, bos, seq_len, c, i_h, H: tl.constexpr,
                          K: tl.constexpr, BK: tl.constexpr, NH: tl.constexpr, RT: tl.constexpr, BM: tl.constexpr,
                          BETA_AWARE: tl.constexpr, HAS_RETAIN: tl.constexpr, HAS_DW: tl.constexpr):
    """Block `c`'s loads for the backward: the forward's (`_block_loads`, with `b0`, `Zb`),
    the trajectory rows, the stats and the write key's gradient (0 without one)."""
    kk, b, rho, b0, zb = _block_loads(k, beta, retain, coef, Z, bos, seq_len, c, i_h, H, K, BK, NH, RT, BM,
                                      BETA_AWARE, HAS_RETAIN, True)
    _, _, rows, ok = _block_rows(bos, seq_len, c, NH, RT, BM)
    o = tl.arange(0, BK)
    tile = ok[:, None] & (o[None, :] < K)
    D = tl.load(traj + (rows[:, None] * H + i_h) * K + o[None, :], mask=tile, other=0.0)
    wbar = tl.load(dw + (rows[:, None] * H + i_h) * K + o[None, :], mask=tile & HAS_DW, other=0.0)
    sq = tl.load(stats + (rows * H + i_h) * 2, mask=ok, other=1.0)
    align = tl.load(stats + (rows * H + i_h) * 2 + 1, mask=ok, other=0.0)
    return kk, b, rho, b0, zb, D, wbar, sq, align


@triton.jit(do_not_specialize=["T"])
def osdn_block_backward_kernel(
    k, beta, retain, traj, stats, dw, dd_final, coef, Z, dk, dbeta, dretain, dd0, block_counts, cu_seqlens, T,
    eta, d_min, d_max, eps,
    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, NH: tl.constexpr, RT: tl.constexpr, BM: tl.constexpr,
    BETA_AWARE: tl.constexpr, HAS_RETAIN: tl.constexpr, HAS_DW: tl.constexpr, HAS_DD: tl.constexpr,
    IS_VARLEN: tl.constexpr, ACC: tl.constexpr,
):
    """The reverse scan over blocks, one program per (sequence, head); `block_counts` gets
    how many of its blocks ran step by step and how many passed no gradient through `d`."""
    i_nh = tl.program_id(0)
    i_n, i_h = i_nh // H, i_nh % H
    bos, seq_len = sequence_of(i_n, T, cu_seqlens, IS_VARLEN)
    o = tl.arange(0, BK)
    mk = o < K
    dd = final_dbar(dd_final, i_nh, K, BK, HAS_DD, ACC)
    L = seq_len * NH
    n_blocks = tl.cdiv(seq_len, RT)
    stepped = 0
    held = 0
    ahead = _block_backward_loads(k, beta, retain, traj, stats, dw, coef, Z, bos, seq_len, n_blocks - 1, i_h, H, K,
                                  BK, NH, RT, BM, BETA_AWARE, HAS_RETAIN, HAS_DW)
    for cc_ in range(n_blocks):
        c = n_blocks - 1 - cc_
        kk, b, rho, b0, zb, D, wbar, sq, align = ahead
        ahead = _block_backward_loads(k, beta, retain, traj, stats, dw, coef, Z, bos, seq_len, c - 1, i_h, H, K,
                                      BK, NH, RT, BM, BETA_AWARE, HAS_RETAIN, HAS_DW)
        m, j, rows, ok = _block_rows(bos, seq_len, c, NH, RT, BM)
        count = tl.minimum(RT * NH, L - c * RT * NH)
        kk, b, rho, D, wbar = kk.to(ACC), b.to(ACC), rho.to(ACC), D.to(ACC), wbar.to(ACC)
        sq, align = sq.to(ACC), align.to(ACC)
        s = kk * kk
        rn, en, cc, cb = step_coefficients(sq, b, eps, eta, BETA_AWARE)
        # the forward's p of every row, as the reverse step forms it, and its clip mask
        p = (rho[:, None] * D + cc[:, None] * s) - (cb[:, None] * s) * align[:, None]
        tile = ok[:, None] & mk[None, :]
        inside = (p >= d_min) & (p <= d_max)
        some_out = tl.max(tl.where(tile & ~inside, 1, 0))
        some_in = tl.max(tl.where(tile & inside, 1, 0))
        if BETA_AWARE:
            g = 1 - b * align
        else:
            g = 1 - align
        e = tl.where(sq >= eps, -(cc * rn) * g, 0.0)  # the eps clamp passes no gradient
        if some_out > 0 and some_in > 0:
            for u in tl.static_range(BM):
                jj = BM - 1 - u
                if jj < count:
                    pick = (m == jj)[:, None]
                    at = m == jj
                    dd, dkk, dbeta_i, dretain_i = _backward_step(
                        dd, tl.sum(tl.where(pick, kk, 0.0), 0), tl.sum(tl.where(at, b, 0.0), 0),
                        tl.sum(tl.where(at, rho, 0.0), 0), tl.sum(tl.where(pick, D, 0.0), 0),
                        tl.sum(tl.where(pick, wbar, 0.0), 0), tl.sum(tl.where(at, sq, 0.0), 0),
                        tl.sum(tl.where(at, align, 0.0), 0), eps, eta, d_min, d_max, mk, BK, BETA_AWARE, HAS_RETAIN,
                        HAS_DW, 0, 0, ACC, True)
                    i = tl.sum(tl.where(at, rows, 0), 0)
                    j_u = tl.sum(tl.where(at, j, 0), 0)
                    tl.store(dk + (i * H + i_h) * K + o, dkk.to(dk.dtype.element_ty), mask=mk)
                    if BETA_AWARE:
                        tl.store(dbeta + i * H + i_h, dbeta_i.to(dbeta.dtype.element_ty))
                    if HAS_RETAIN:
                        tl.store(dretain + (bos + j_u // NH) * H + i_h, dretain_i.to(dretain.dtype.element_ty),
                                 mask=j_u % NH == 0)
            stepped += 1
        else:
            if some_out > 0:  # held: no gradient through d, dbar_j = wbar_j k_j
                pbar = tl.zeros_like(s)
                ps = tl.zeros_like(sq)
                dd = tl.sum(tl.where((m == 0)[:, None], wbar * kk, 0.0), 0)
                held += 1
            else:  # affine
                ps = b0.to(ACC) + tl.sum(zb.to(ACC) * dd[None, :], 1)
                v = wbar * kk - (cb * ps)[:, None] * s
                if HAS_RETAIN:
                    # dbar_{j+1} = A_j dbar + sum_{l>j} B_jl v_l
                    lr = tl.log(tl.maximum(rho, 1e-30))
                    incl = tl.cumsum(lr, 0)
                    A = tl.exp(tl.sum(lr, 0) - incl)
                    Bm = tl.where(m[:, None] < m[None, :], tl.exp((incl - lr)[None, :] - incl[:, None]), 0.0)
                    pbar = A[:, None] * dd[None, :] + _mm_small(Bm, v)
                else:
                    pbar = dd[None, :] + (tl.cumsum(v, 0, reverse=True) - v)
                dd = tl.sum(tl.where((m == 0)[:, None], rho[:, None] * pbar + v, 0.0), 0)
            dkk = (kk + kk) * (((cc * g)[:, None] * pbar + (e * ps)[:, None]) - (cb * ps)[:, None] * D) + wbar * D
            out = (rows[:, None] * H + i_h) * K + o[None, :]
            tl.store(dk + out, dkk.to(dk.dtype.element_ty), mask=tile)
            if BETA_AWARE:
                tl.store(dbeta + rows * H + i_h, (ps * (g * en - cc * align)).to(dbeta.dtype.element_ty), mask=ok)
            if HAS_RETAIN:
                tl.store(dretain + (bos + j // NH) * H + i_h, tl.sum(pbar * D, 1).to(dretain.dtype.element_ty),
                         mask=ok & (j % NH == 0))
    tl.store(dd0 + i_nh * K + o, dd.to(dd0.dtype.element_ty), mask=mk)
    tl.store(block_counts + i_nh * 2, stepped)
    tl.store(block_counts + i_nh * 2 + 1, held)


def block_backward(k: Tensor, beta: Tensor, retain: Tensor, traj: Tensor, stats: Tensor, dw: Tensor,
                   dd_final: Tensor, dk: Tensor, dbeta: Tensor, dretain: Tensor, dd0: Tensor,
                   cu_seqlens: Tensor | None, T: int, eta: float, d_min: float, d_max: float, eps: float, *,
                   n_seq: int, has_dw: bool, has_dd: bool, warps: int, meta: dict) -> Tensor:
    """Fill `dk`, `dbeta`, `dretain` and `dd0` as the sequential backward does, from the
    forward's trajectory and stats (either forward's); returns, per (sequence, head), how
    many blocks ran step by step (`[..., 0]`) and how many passed no gradient through `d`
    (`[..., 1]`)."""
    H = k.shape[2]
    rt, nt, table, count, coef, Z, shared = _blocks(k, cu_seqlens, T, traj.dtype, meta)
    if count:
        osdn_block_backward_prepare_kernel[(count, H)](
            k, beta, retain, stats, dw, coef, Z, cu_seqlens, table, T, nt, eta, eps, RT=rt, BM=BLOCK_STEPS,
            LOG2_BM=BLOCK_STEPS.bit_length() - 1, HAS_DW=has_dw, num_warps=4, **shared,
        )
    counts = torch.zeros(n_seq, H, 2, device=k.device, dtype=torch.int32)
    osdn_block_backward_kernel[(n_seq * H,)](
        k, beta, retain, traj, stats, dw, dd_final, coef, Z, dk, dbeta, dretain, dd0, counts, cu_seqlens, T,
        eta, d_min, d_max, eps, RT=rt, BM=BLOCK_STEPS, HAS_DW=has_dw, HAS_DD=has_dd, num_warps=warps, **shared,
    )
    return counts
