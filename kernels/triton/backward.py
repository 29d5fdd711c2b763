"""Backward, last step (chunk-parallel): every input gradient of one chunk.

Inputs: the chunk's start state `S_0` and the gradient `dS_L` at its end (from the two
state passes), `Y`, and the full `dY`/`dU` (`state.py`). Writing `x~` for a row decayed
to the chunk start (`k~ = k exp(G)`, `e~ = e exp(-G)`, never formed: see `decay.py`),
the forward of a chunk is

    Y   = Tinv (Z - diag(c) K~ S_0),   Tinv = (I + diag(c) strictly_lower(K~ E~^T))^{-1}
    O   = Q~ S_0 + M_E Y + M_W U
    S_L = exp(G_L) [S_0 + E~^T Y + W~^T U]

and this kernel applies the chain rule to it (`docs/kernel.md` lists every term):

    dP = -dY S_0^T,  dT = dY Z^T + dP (c K~)^T,  dA = -strictly_lower(Tinv^T dT Tinv^T)
    dZ = Tinv^T dY   ->  householder: dv = beta dZ;  rwkv7: dU -= S_kw^T dZ, dS_kw = -dZ U^T

Gate gradients use one identity: a term `x_a^T diag(exp(G_a - G_b)) y_b` contributes
`x_a * dx_a` to `dG_a` and `-y_b * dy_b` to `dG_b`, so with every gradient in hand

    dG_i = k_i * dk_i - e_i * de_i - w_i * dw_i   (sub-steps),   dG_t += q_t * dq_t   (queries)

plus the chunk-end terms, and `dg_t` is the reverse cumulative sum over the chunk's tokens.

Registers are the limit (a `[64, 128]` float32 block is 32 KB of the 256 KB register file),
so the work runs in phases, each with few blocks alive, re-reading the chunk's
`S_0`/`dS_L` V-blocks (L2-resident) instead of holding every accumulator at once. The
phases fall into two groups by what they sum over:

  pair_grads (the `C x C` matrices; needs the whole of K, done `BKS` columns at a time)
    K  over K slices: dP K~^T (dP = -dY S_0^T, over V), the score S_ke / S_kw
    A  over V: dM_E, dM_W, dT's Z-part, dS_kw; writes dv
       then dA = -strictly_lower(Tinv^T dT Tinv^T) and dbeta
  channel_grads (per channel: any slice of K on its own, given the pair matrices)
    B  the UT transform's backward: dk, de/dw's in-chunk part  (kept in registers for D)
    C  over V: dO S_0^T -> dq
    D  over V: Y dS_L^T, U dS_L^T -> dk, de, dw complete; the gate's gradient

Every gradient is stored once, from registers (none is written in part and read back),
so the gradient buffers may be in the inputs' dtype. `chunk_backward_kernel` runs both
groups in one program, `channel_grads` in a loop over the slices (no gate or a scalar
gate, whose `dg` sums over K). A channel gate's slices are independent, so
`backward_channel.py` runs the groups as two kernels with the pair matrices passed
through a scratch buffer: see there why.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .chunks import chunk_of_program
from .decay import (
    apply_left,
    apply_right,
    causal_mask,
    decay_rows,
    load_gate,
    load_rows,
    mm,
    scores,
    store_rows,
)
from .kinds import CHANNEL_GATE, DIAGONAL, HOUSEHOLDER, NO_GATE, RWKV7, SCALAR_GATE
from .state import end_decay


@triton.jit(do_not_specialize=["T", "NT"])
def chunk_backward_kernel(
    q, k, w, e, beta, v, G, Tinv, h_all, dh_all, Y, dY, dU, do,
    dq, dk, dw, de, dv, dbeta, dg,
    cu_seqlens, chunk_table, T, NT, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BKS: tl.constexpr, BV: tl.constexpr,
    BT: tl.constexpr, TC: tl.constexpr, BQ: tl.constexpr, NH: tl.constexpr, SC: tl.constexpr,
    MODE: tl.constexpr, GATE: tl.constexpr, HAS_BETA: tl.constexpr, TIED: tl.constexpr,
    IS_VARLEN: tl.constexpr, ACC: tl.constexpr, OP: tl.constexpr, PREC: tl.constexpr,
):
    """Every input gradient of one chunk and head in one program, K in slices of `BKS`
    columns (fewer blocks alive than with the whole of K: a `[64, 128]` float32 block is
    32 KB, an eighth of the register file)."""
    i_chunk, i_h = tl.program_id(0), tl.program_id(1)
    _, bos, seq_len, c = chunk_of_program(i_chunk, T, NT, cu_seqlens, chunk_table, IS_VARLEN)
    tok0 = bos + c * TC
    n_tok = tl.minimum(TC, seq_len - c * TC)
    dm_e, dm_w, da, ds_kw = pair_grads(k, w, e, beta, v, G, Tinv, h_all, Y, dY, dU, do, dv, dbeta,
                                       i_chunk, i_h, tok0, n_tok, H, K, V, BKS, BV, BT, BQ, NH, SC,
                                       MODE, GATE, HAS_BETA, ACC, OP, PREC)
    dg_tok = tl.zeros([BQ], dtype=ACC)  # a scalar gate's dg, summed over the slices
    for i_k in range(tl.cdiv(K, BKS)):
        dg_tok += channel_grads(q, k, w, e, beta, v, G, Tinv, h_all, dh_all, Y, dY, do, dq, dk, dw, de, dg,
                                dm_e, dm_w, da, ds_kw, i_chunk, i_h, tok0, n_tok, scale, i_k * BKS,
                                H, K, V, BKS, BV, BT, BQ, NH, SC, MODE, GATE, HAS_BETA, TIED, ACC, OP, PREC)
    if GATE == SCALAR_GATE:
        i_q = tl.arange(0, BQ)
        tl.store(dg + (tok0 + i_q) * H + i_h, dg_tok.to(dg.dtype.element_ty), mask=i_q < n_tok)


@triton.jit
def times_state(p_x, rows, ok, stride_x, p_s, offs_k, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
                ACC: tl.constexpr, OP: tl.constexpr, PREC: tl.constexpr):
    """`X S^T` for rows of a `[*, V]` array `X` and a chunk's `[K, V]` state `S` (columns
    `offs_k` of the result), over V blocks: `[R, len(offs_k)]`."""
    out = tl.zeros([rows.shape[0], offs_k.shape[0]], dtype=ACC)
    for i_v in range(tl.cdiv(V, BV)):
        offs_v = i_v * BV + tl.arange(0, BV)
        x = load_rows(p_x, rows, ok, stride_x, offs_v, V, ACC)
        s = tl.load(p_s + offs_k[:, None] * V + offs_v[None, :],
                    mask=(offs_k[:, None] < K) & (offs_v[None, :] < V), other=0.0)
        out += mm(x, tl.trans(s), OP, PREC, ACC)
    return out


@triton.jit
def k_sums(
    k, w, G, h_all, dY, i_chunk, i_h, tok0, n_tok,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BKS: tl.constexpr, BV: tl.constexpr,
    BT: tl.constexpr, NH: tl.constexpr, SC: tl.constexpr, GATE: tl.constexpr,
    ACC: tl.constexpr, OP: tl.constexpr, PREC: tl.constexpr,
    CHUNK_ONLY: tl.constexpr = False,
):
    """Phase K, the `C x C` sums over K, `BKS` columns at a time: `(dP K~^T, S_kw)` with
    `dP = -dY S_0^T` and `S_kw` the strictly causal decayed scores of `k` against the write
    key `w` (householder: the erase direction, i.e. `S_ke`)."""
    n_sub = n_tok * NH
    i_sub = tl.arange(0, BT)
    valid = i_sub < n_sub
    row_k = tok0 * NH * H * K + i_h * K
    stride_g = H * K if GATE == CHANNEL_GATE else H
    p_g = G + tok0 * stride_g + (i_h * K if GATE == CHANNEL_GATE else i_h)
    p_w = w + row_k
    x_k = tl.zeros([BT, BT], dtype=ACC)
    s_kw = tl.zeros([BT, BT], dtype=ACC)
    for i_k in range(tl.cdiv(K, BKS)):
        offs_k = i_k * BKS + tl.arange(0, BKS)
        gk = load_gate(p_g, i_sub // NH, valid, stride_g, offs_k, GATE, K, ACC)
        kk = load_rows(k + row_k, i_sub, valid, H * K, offs_k, K, ACC)
        dp = -times_state(dY + tok0 * NH * H * V + i_h * V, i_sub, valid, H * V, h_all + (i_chunk * H + i_h) * K * V,
                          offs_k, K, V, BV, ACC, OP, PREC)
        x_k += mm(dp, tl.trans(decay_rows(kk, gk, GATE)), OP, PREC, ACC)
        ww = load_rows(p_w, i_sub, valid, H * K, offs_k, K, ACC)
        s_kw += scores(kk, gk, i_sub, valid, ww, gk, i_sub, valid, p_g, stride_g, n_sub,
                       True, GATE, NH, BT, SC, K, BKS, ACC, OP, PREC, i_k * BKS, CHUNK_ONLY=CHUNK_ONLY)
    return x_k, s_kw


@triton.jit
def _chunk_positions(n_tok, BT: tl.constexpr, BQ: tl.constexpr, NH: tl.constexpr):
    """A chunk's sub-step rows and query rows: `(n_sub, i_sub, valid, i_q, valid_q, pos_q)`,
    `pos_q` the sub-step after which query `i_q` reads."""
    i_sub = tl.arange(0, BT)
    i_q = tl.arange(0, BQ)
    return n_tok * NH, i_sub, i_sub < n_tok * NH, i_q, i_q < n_tok, i_q * NH + NH - 1


@triton.jit
def pair_grads(
    k, w, e, beta, v, G, Tinv, h_all, Y, dY, dU, do, dv, dbeta,
    i_chunk, i_h, tok0, n_tok,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BKS: tl.constexpr, BV: tl.constexpr,
    BT: tl.constexpr, BQ: tl.constexpr, NH: tl.constexpr, SC: tl.constexpr,
    MODE: tl.constexpr, GATE: tl.constexpr, HAS_BETA: tl.constexpr,
    ACC: tl.constexpr, OP: tl.constexpr, PREC: tl.constexpr,
    CHUNK_ONLY: tl.constexpr = False,
):
    """Phases K and A: writes dv and dbeta, returns `(dM_E, dM_W, dA, dS_kw)`, each zero
    outside its causal mask; `dA` is already scaled by `c` (the UT transform's row factor),
    so that `channel_grads` needs no beta. Paths without a term return zeros for it.

    K is read `BKS` columns at a time (the scores and `dP K~^T` are sums over K), so no
    `[BT, K]` block is ever alive whole when `BKS < K`.
    """
    _, i_sub, valid, i_q, valid_q, pos_q = _chunk_positions(n_tok, BT, BQ, NH)
    row_v = tok0 * NH * H * V + i_h * V
    row_o = tok0 * H * V + i_h * V
    p_beta = beta + tok0 * NH * H + i_sub * H + i_h
    strict = causal_mask(i_sub, valid, i_sub, valid, True)
    qmask = causal_mask(pos_q, valid_q, i_sub, valid, False)
    if MODE != DIAGONAL:
        tinv = tl.load(Tinv + (i_chunk * H + i_h) * BT * BT + i_sub[:, None] * BT + i_sub[None, :]).to(ACC)
    if MODE == HOUSEHOLDER:
        cb = tl.load(p_beta, mask=valid, other=0.0).to(ACC)
    if MODE == RWKV7 and HAS_BETA:
        bb = tl.load(p_beta, mask=valid, other=0.0).to(ACC)

    # ---- phase K (rwkv7: before A, which needs S_kw)
    x_k = tl.zeros([BT, BT], dtype=ACC)  # dP K~^T
    s_kx = tl.zeros([BT, BT], dtype=ACC)  # householder: S_ke (for dbeta); rwkv7: S_kw
    if MODE == RWKV7:
        x_k, s_kx = k_sums(k, w, G, h_all, dY, i_chunk, i_h, tok0, n_tok, H, K, V, BKS, BV, BT, NH, SC,
                           GATE, ACC, OP, PREC, CHUNK_ONLY=CHUNK_ONLY)

    # ---- phase A: contractions over V
    dm_e = tl.zeros([BQ, BT], dtype=ACC)  # dO Y^T
    dm_w = tl.zeros([BQ, BT], dtype=ACC)  # dO U^T
    dt = tl.zeros([BT, BT], dtype=ACC)  # dY Z^T (rwkv7: dY U^T, times -S_kw^T below)
    ds_kw = tl.zeros([BT, BT], dtype=ACC)
    dc_v = tl.zeros([BT], dtype=ACC)  # beta's gradient through Z (householder) or U (rwkv7)
    for i_v in range(tl.cdiv(V, BV)):
        offs_v = i_v * BV + tl.arange(0, BV)
        d_o = load_rows(do + row_o, i_q, valid_q, H * V, offs_v, V, ACC)
        vv = load_rows(v + row_v, i_sub, valid, H * V, offs_v, V, ACC)
        if MODE != DIAGONAL:
            y = load_rows(Y + row_v, i_sub, valid, H * V, offs_v, V, ACC)
            dy = load_rows(dY + row_v, i_sub, valid, H * V, offs_v, V, ACC)
            dm_e += mm(d_o, tl.trans(y), OP, PREC, ACC)
            dz = mm(tl.trans(tinv), dy, OP, PREC, ACC)
            if MODE == HOUSEHOLDER:
                dt += mm(dy, tl.trans(vv * cb[:, None]), OP, PREC, ACC)
                dc_v += tl.sum(dz * vv, 1)
                store_rows(dv + row_v, dz * cb[:, None], i_sub, valid, H * V, offs_v, V)
        if MODE != HOUSEHOLDER:
            u = vv
            if MODE == RWKV7 and HAS_BETA:
                u = vv * bb[:, None]
            dm_w += mm(d_o, tl.trans(u), OP, PREC, ACC)
            du = load_rows(dU + row_v, i_sub, valid, H * V, offs_v, V, ACC)
            if MODE == RWKV7:
                dt += mm(dy, tl.trans(u), OP, PREC, ACC)
                ds_kw -= mm(dz, tl.trans(u), OP, PREC, ACC)
                du -= mm(tl.trans(s_kx), dz, OP, PREC, ACC)
                if HAS_BETA:
                    dc_v += tl.sum(du * vv, 1)
                    du = du * bb[:, None]
            store_rows(dv + row_v, du, i_sub, valid, H * V, offs_v, V)
    dm_e = tl.where(qmask, dm_e, 0.0)
    dm_w = tl.where(qmask, dm_w, 0.0)

    # ---- the UT transform's C x C part: Y = X - P S_0, X = Tinv Z, P = Tinv diag(c) K~
    da = tl.zeros([BT, BT], dtype=ACC)
    if MODE == HOUSEHOLDER:  # phase K after A: fewer blocks alive during A
        x_k, s_kx = k_sums(k, w, G, h_all, dY, i_chunk, i_h, tok0, n_tok, H, K, V, BKS, BV, BT, NH, SC,
                           GATE, ACC, OP, PREC, CHUNK_ONLY=CHUNK_ONLY)
    if MODE != DIAGONAL:
        if MODE == HOUSEHOLDER:
            dt += x_k * cb[None, :]
        else:
            dt = x_k - mm(dt, tl.trans(s_kx), OP, PREC, ACC)
        da = -mm(mm(tl.trans(tinv), dt, OP, PREC, ACC), tl.trans(tinv), OP, PREC, ACC)
        da = tl.where(strict, da, 0.0)
        if MODE == HOUSEHOLDER:
            # through P: sum_k K~ * (Tinv^T dP) = column sums of Tinv * (dP K~^T)
            tl.store(dbeta + tok0 * NH * H + i_sub * H + i_h,
                     (tl.sum(tinv * x_k, 0) + tl.sum(da * s_kx, 1) + dc_v).to(dbeta.dtype.element_ty), mask=valid)
            da = da * cb[:, None]
    if MODE == RWKV7:
        ds_kw = tl.where(strict, ds_kw, 0.0)
        if HAS_BETA:
            tl.store(dbeta + tok0 * NH * H + i_sub * H + i_h, dc_v.to(dbeta.dtype.element_ty), mask=valid)
    return dm_e, dm_w, da, ds_kw


@triton.jit
def pair_tile(x, R: tl.constexpr, BT: tl.constexpr, ACC: tl.constexpr):
    """A `[R, BT]` matrix of `pair_grads`: `x` itself, or loaded from the scratch tile that
    `x` points at (`backward_channel.py`), at the point of use, so that it is not held in
    registers between its uses."""
    if x.dtype.is_ptr():
        return tl.load(x + tl.arange(0, R)[:, None] * BT + tl.arange(0, BT)[None, :]).to(ACC)
    else:
        return x


@triton.jit
def channel_grads(
    q, k, w, e, beta, v, G, Tinv, h_all, dh_all, Y, dY, do, dq, dk, dw, de, dg,
    dm_e, dm_w, da, ds_kw, i_chunk, i_h, tok0, n_tok, scale, k0,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BKS: tl.constexpr, BV: tl.constexpr,
    BT: tl.constexpr, BQ: tl.constexpr, NH: tl.constexpr, SC: tl.constexpr,
    MODE: tl.constexpr, GATE: tl.constexpr, HAS_BETA: tl.constexpr, TIED: tl.constexpr,
    ACC: tl.constexpr, OP: tl.constexpr, PREC: tl.constexpr,
    CHUNK_ONLY: tl.constexpr = False,
):
    """Phases B, C, D for the `BKS` columns of K from `k0`, given `pair_grads`' matrices
    (values, or pointers to their scratch tiles: `pair_tile`): writes dq, dk, dw, de and a
    channel gate's dg there. A scalar gate's `dg` sums over K: returns this slice's part
    of it (`[BQ]`; zeros for other gates)."""
    n_sub, i_sub, valid, i_q, valid_q, pos_q = _chunk_positions(n_tok, BT, BQ, NH)
    offs_k = k0 + tl.arange(0, BKS)
    row_k = tok0 * NH * H * K + i_h * K
    row_v = tok0 * NH * H * V + i_h * V
    row_q = tok0 * H * K + i_h * K
    row_o = tok0 * H * V + i_h * V
    stride_g = H * K if GATE == CHANNEL_GATE else H
    p_g = G + tok0 * stride_g + (i_h * K if GATE == CHANNEL_GATE else i_h)
    p_beta = beta + tok0 * NH * H + i_sub * H + i_h
    p_e = (w if MODE == HOUSEHOLDER else e) + row_k  # the erase direction (householder: the write key)
    p_w = w + row_k
    o_state = (i_chunk * H + i_h) * K * V
    gk = load_gate(p_g, i_sub // NH, valid, stride_g, offs_k, GATE, K, ACC)

    # ---- phase B: the UT transform, Y = X - P S_0, X = Tinv Z, P = Tinv diag(c) K~
    # (every gradient is stored once, from registers: the buffers may be in the inputs' dtype)
    dkk = tl.zeros([BT, BKS], dtype=ACC)
    dee = tl.zeros([BT, BKS], dtype=ACC)  # d erase direction (householder: d write key)
    dww = tl.zeros([BT, BKS], dtype=ACC)  # d write key (plain writes)
    if MODE != DIAGONAL:
        tinv = tl.load(Tinv + (i_chunk * H + i_h) * BT * BT + i_sub[:, None] * BT + i_sub[None, :]).to(ACC)
        tdp = -mm(tl.trans(tinv), times_state(dY + row_v, i_sub, valid, H * V, h_all + o_state, offs_k,
                                                K, V, BV, ACC, OP, PREC), OP, PREC, ACC)  # Tinv^T dP
        if MODE == HOUSEHOLDER:
            tdp = tdp * tl.load(p_beta, mask=valid, other=0.0).to(ACC)[:, None]
        dkk += decay_rows(tdp, gk, GATE)
        kk = load_rows(k + row_k, i_sub, valid, H * K, offs_k, K, ACC)
        ee = load_rows(p_e, i_sub, valid, H * K, offs_k, K, ACC)
        dkk += apply_left(pair_tile(da, BT, BT, ACC), ee, gk, i_sub, valid, gk, i_sub, valid, p_g, stride_g, n_sub,
                          GATE, NH, BT, SC, K, BKS, ACC, OP, PREC, k0, CHUNK_ONLY=CHUNK_ONLY)
        dee = apply_right(pair_tile(da, BT, BT, ACC), kk, gk, i_sub, valid, gk, i_sub, valid, p_g, stride_g,
                          n_sub, GATE, NH, BT, SC, K, BKS, ACC, OP, PREC, k0, CHUNK_ONLY=CHUNK_ONLY)
    if MODE == RWKV7:
        ww = load_rows(p_w, i_sub, valid, H * K, offs_k, K, ACC)
        dkk += apply_left(pair_tile(ds_kw, BT, BT, ACC), ww, gk, i_sub, valid, gk, i_sub, valid, p_g, stride_g, n_sub,
                          GATE, NH, BT, SC, K, BKS, ACC, OP, PREC, k0, CHUNK_ONLY=CHUNK_ONLY)
        dww = apply_right(pair_tile(ds_kw, BT, BT, ACC), kk, gk, i_sub, valid, gk, i_sub, valid, p_g, stride_g,
                          n_sub, GATE, NH, BT, SC, K, BKS, ACC, OP, PREC, k0, CHUNK_ONLY=CHUNK_ONLY)
    if not TIED:  # complete (a tied key adds dw at the end)
        store_rows(dk + row_k, dkk, i_sub, valid, H * K, offs_k, K)

    # ---- phase C: queries, O = Q~ S_0 + M_E Y + M_W U
    gq = load_gate(p_g, i_q, valid_q, stride_g, offs_k, GATE, K, ACC)
    dq_state = times_state(do + row_o, i_q, valid_q, H * V, h_all + o_state, offs_k, K, V, BV, ACC, OP, PREC)
    dqq = decay_rows(dq_state, gq, GATE) * scale
    if MODE != DIAGONAL:
        dqq += scale * apply_left(pair_tile(dm_e, BQ, BT, ACC), load_rows(p_e, i_sub, valid, H * K, offs_k, K, ACC), gq, pos_q, valid_q, gk,
                                  i_sub, valid, p_g, stride_g, n_sub, GATE, NH, BT, SC, K, BKS, ACC, OP,
                                  PREC, k0, CHUNK_ONLY=CHUNK_ONLY)
    if MODE != HOUSEHOLDER:
        dqq += scale * apply_left(pair_tile(dm_w, BQ, BT, ACC), load_rows(p_w, i_sub, valid, H * K, offs_k, K, ACC), gq, pos_q, valid_q, gk,
                                  i_sub, valid, p_g, stride_g, n_sub, GATE, NH, BT, SC, K, BKS, ACC, OP,
                                  PREC, k0, CHUNK_ONLY=CHUNK_ONLY)
    store_rows(dq + row_q, dqq, i_q, valid_q, H * K, offs_k, K)

    # ---- phase D: the chunk end, S_L = exp(G_L) [S_0 + E~^T Y + W~^T U]
    g_last, to_end = end_decay(p_g, n_tok, i_sub, valid, stride_g, offs_k, GATE, NH, K, ACC)
    end_e = tl.zeros([BT, BKS], dtype=ACC)  # Y dS_L^T
    end_w = tl.zeros([BT, BKS], dtype=ACC)  # U dS_L^T
    dlast_state = tl.zeros([BKS], dtype=ACC)  # sum_v S_0 * dS_L
    dg_tok = tl.zeros([BQ], dtype=ACC)  # scalar gate: this slice's part of dg
    for i_v in range(tl.cdiv(V, BV)):
        offs_v = i_v * BV + tl.arange(0, BV)
        state_offs = o_state + offs_k[:, None] * V + offs_v[None, :]
        state_mask = (offs_k[:, None] < K) & (offs_v[None, :] < V)
        dh = tl.load(dh_all + state_offs, mask=state_mask, other=0.0)
        if GATE != NO_GATE:
            h = tl.load(h_all + state_offs, mask=state_mask, other=0.0).to(ACC)
            dlast_state += tl.sum(h * dh.to(ACC), 1)
        if MODE != DIAGONAL:
            y = load_rows(Y + row_v, i_sub, valid, H * V, offs_v, V, ACC)
            end_e += mm(y, tl.trans(dh), OP, PREC, ACC)
        if MODE != HOUSEHOLDER:
            u = load_rows(v + row_v, i_sub, valid, H * V, offs_v, V, ACC)
            if MODE == RWKV7 and HAS_BETA:
                u = u * tl.load(p_beta, mask=valid, other=0.0).to(ACC)[:, None]
            end_w += mm(u, tl.trans(dh), OP, PREC, ACC)
    qq = load_rows(q + row_q, i_q, valid_q, H * K, offs_k, K, ACC)
    dlast = tl.zeros([BKS], dtype=ACC)  # d G_L (channel; a scalar gate keeps its total in slot 0)
    if GATE == CHANNEL_GATE:
        dlast += tl.exp(g_last) * dlast_state
    elif GATE == SCALAR_GATE:
        dlast += tl.where(tl.arange(0, BKS) == 0, tl.exp(g_last) * tl.sum(dlast_state, 0), 0.0)
    dgam = tl.zeros([BT, BKS], dtype=ACC)  # dG per sub-step, before the token sums
    if MODE != DIAGONAL:
        ee = load_rows(p_e, i_sub, valid, H * K, offs_k, K, ACC)
        end_e = decay_rows(end_e, to_end, GATE)
        dee += end_e
        dee += scale * apply_right(pair_tile(dm_e, BQ, BT, ACC), qq, gq, pos_q, valid_q, gk, i_sub, valid, p_g, stride_g,
                                   n_sub, GATE, NH, BT, SC, K, BKS, ACC, OP, PREC, k0, CHUNK_ONLY=CHUNK_ONLY)
        dlast += _sum_rows(ee * end_e, GATE)
        dgam -= ee * dee
    if MODE != HOUSEHOLDER:
        ww = load_rows(p_w, i_sub, valid, H * K, offs_k, K, ACC)
        end_w = decay_rows(end_w, to_end, GATE)
        dww += end_w
        dww += scale * apply_right(pair_tile(dm_w, BQ, BT, ACC), qq, gq, pos_q, valid_q, gk, i_sub, valid, p_g, stride_g,
                                   n_sub, GATE, NH, BT, SC, K, BKS, ACC, OP, PREC, k0, CHUNK_ONLY=CHUNK_ONLY)
        dlast += _sum_rows(ww * end_w, GATE)
        dgam -= ww * dww
    if GATE != NO_GATE:
        kk = load_rows(k + row_k, i_sub, valid, H * K, offs_k, K, ACC)
        dgam += kk * dkk
        # dg_t: the sum over the chunk's rows at or after token t, plus the chunk end
        after_tok = ((i_sub[None, :] // NH) >= i_q[:, None]) & valid[None, :] & valid_q[:, None]
        after_q = (i_q[None, :] >= i_q[:, None]) & valid_q[None, :] & valid_q[:, None]
        dgq = qq * dqq
        if GATE == CHANNEL_GATE:
            if NH == 1 and BQ == BT:  # a sub-step per token: one reverse running sum over the rows
                dgt = tl.cumsum(dgam + dgq, axis=0, reverse=True)
            else:  # tokens of several sub-steps: the sums as products with 0/1 masks (exact in ieee)
                dgt = tl.dot(tl.where(after_tok, 1.0, 0.0).to(ACC), dgam, input_precision="ieee", out_dtype=ACC)
                dgt += tl.dot(tl.where(after_q, 1.0, 0.0).to(ACC), dgq, input_precision="ieee", out_dtype=ACC)
            dgt += dlast[None, :]
            store_rows(dg + tok0 * H * K + i_h * K, dgt, i_q, valid_q, H * K, offs_k, K)
        else:
            dgam_s = tl.sum(dgam, 1)
            dgq_s = tl.sum(dgq, 1)
            dg_tok += tl.sum(tl.where(after_tok, dgam_s[None, :], 0.0), 1) + tl.sum(tl.where(after_q, dgq_s[None, :], 0.0), 1)
            dg_tok += tl.sum(dlast, 0)

    # ---- complete de / dw (a tied write key's gradient joins k's)
    if MODE == HOUSEHOLDER:
        if TIED:
            store_rows(dk + row_k, dkk + dee, i_sub, valid, H * K, offs_k, K)
        else:
            store_rows(dw + row_k, dee, i_sub, valid, H * K, offs_k, K)
    else:
        if MODE == RWKV7:
            store_rows(de + row_k, dee, i_sub, valid, H * K, offs_k, K)
        if TIED:
            store_rows(dk + row_k, dkk + dww, i_sub, valid, H * K, offs_k, K)
        else:
            store_rows(dw + row_k, dww, i_sub, valid, H * K, offs_k, K)
    return dg_tok


@triton.jit
def _sum_rows(x, GATE: tl.constexpr):
    """Sum a `[BT, BK]` block over its rows; for a scalar gate, the total in slot 0."""
    if GATE == SCALAR_GATE:
        return tl.where(tl.arange(0, x.shape[1]) == 0, tl.sum(tl.sum(x, 1), 0), 0.0)
    else:
        return tl.sum(x, 0)
