"""Forward, step 1 (chunk-parallel): the UT transform of every chunk.

With a delta rule (`MODE` 1 householder, 2 rwkv7) each chunk's erase read-outs obey one
unit lower-triangular system (`docs/kernel.md`, "Algorithm"):

    Y = (I + A)^{-1} (Z - c * K~ S_0),    A = diag(c) strictly_lower(K~ E~^T)

with `c = beta` and `E = W` (householder) or `c = 1` and `E` = the erase vectors
(rwkv7), `K~ = k * exp(G)`. This kernel stores `Tinv = (I + A)^{-1}` (for the backward),
`P = Tinv diag(c) K~` and `X = Tinv Z`, so that the sequential state pass only computes
`Y = X - P S_0`. `Z = beta * v` (householder) or `-strictly_lower(K~ W~^T) (b * v)`
(rwkv7, `b = beta` or 1).

Two launches, because their costs differ in kind. `inverse_kernel` forms `A` and its
inverse: a chain of small dependent steps (`solve.py`), latency-bound, so it runs with
few warps and few registers, several programs per SM hiding each other's latency.
`prepare_kernel` reads `Tinv` back (16 KB per chunk, L2-resident) and forms `P` and `X`:
a few wide tensor-core products. As one kernel (measured on the H200, DeltaNet B=4
T=4096 H=16 K=V=128 bfloat16) it took 1.16 ms, about 37 us per program at one program
per SM (255 registers), most of it in the inverse's dependent steps.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .chunks import chunk_of_program
from .decay import causal_mask, chunk_end_gate, chunk_fits, decay_rows, load_gate, load_rows, mid_decay, mm, scores, store_rows
from .kinds import ALL_CHUNKS, CHANNEL_GATE, HOUSEHOLDER, RWKV7, SCALAR_GATE, WITHIN_BOUND
from .solve import unit_lower_inverse


@triton.jit
def _chunk_rows(i_chunk, i_h, G, cu_seqlens, chunk_table, T, NT, H: tl.constexpr, K: tl.constexpr,
                BT: tl.constexpr, TC: tl.constexpr, NH: tl.constexpr, GATE: tl.constexpr, IS_VARLEN: tl.constexpr):
    """`(tok0, n_sub, i_sub, valid, row_k, stride_g, p_g)` of a chunk and head: its first
    token, its valid sub-steps and their rows, the offset of its sub-step 0 in `[*, H, K]`
    rows, and its cumulative gate."""
    _, bos, seq_len, c = chunk_of_program(i_chunk, T, NT, cu_seqlens, chunk_table, IS_VARLEN)
    tok0 = bos + c * TC
    n_sub = tl.minimum(TC, seq_len - c * TC) * NH
    i_sub = tl.arange(0, BT)
    stride_g = H * K if GATE == CHANNEL_GATE else H
    p_g = G + tok0 * stride_g + (i_h * K if GATE == CHANNEL_GATE else i_h)
    return tok0, n_sub, i_sub, i_sub < n_sub, tok0 * NH * H * K + i_h * K, stride_g, p_g


@triton.jit(do_not_specialize=["T", "NT"])
def inverse_kernel(
    k, w, e, beta, G, Tinv, slow, cu_seqlens, chunk_table, T, NT,
    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BKI: tl.constexpr, BT: tl.constexpr, TC: tl.constexpr,
    NH: tl.constexpr, SC: tl.constexpr, MODE: tl.constexpr, GATE: tl.constexpr, IS_VARLEN: tl.constexpr,
    ACC: tl.constexpr, OP: tl.constexpr, PREC: tl.constexpr, INV_PREC: tl.constexpr,
    CHANNEL_PASS: tl.constexpr = ALL_CHUNKS,
):
    """`Tinv = (I + A)^{-1}` of one chunk, `A = diag(c) strictly_lower(K~ E~^T)`.

    A channel gate runs it twice (`CHANNEL_PASS`): pass 1 takes the chunks that decay by
    less than `decay.py`'s bound in every channel, whose scores are one factorized product
    that K slices can form like the ungated ones (few registers, several programs per
    SM), and marks the others in `slow`; pass 2 forms the marked chunks' scores on whole
    rows (`decay.scores`: sub-chunks, the exact loop) and leaves the rest at once. As one
    kernel, every chunk paid the registers of the slowest path (255 and spills with 4
    warps, Triton 3.6): KDA's took 0.315 ms on the H200 against DeltaNet's 0.122.
    """
    i_chunk, i_h = tl.program_id(0), tl.program_id(1)
    tok0, n_sub, i_sub, valid, row_k, stride_g, p_g = _chunk_rows(i_chunk, i_h, G, cu_seqlens, chunk_table, T, NT,
                                                                   H, K, BT, TC, NH, GATE, IS_VARLEN)
    offs_k = tl.arange(0, BK)
    p_e = w + row_k if MODE == HOUSEHOLDER else e + row_k
    o_t = (i_chunk * H + i_h) * BT * BT
    if GATE == CHANNEL_GATE and CHANNEL_PASS == WITHIN_BOUND:
        fast = chunk_fits(chunk_end_gate(p_g, n_sub, stride_g, offs_k, NH, K, ACC), OP)
        tl.store(slow + i_chunk * H + i_h, tl.where(fast, 0, 1).to(tl.int8))
        if fast:  # decay.py's path 1, around the chunk's midpoint, K a slice at a time
            a = tl.zeros([BT, BT], dtype=ACC)
            for i_k in range(0, BK, BKI):
                offs_ki = i_k + tl.arange(0, BKI)
                mid = 0.5 * chunk_end_gate(p_g, n_sub, stride_g, offs_ki, NH, K, ACC)
                gk = load_gate(p_g, i_sub // NH, valid, stride_g, offs_ki, GATE, K, ACC)
                kk = mid_decay(load_rows(k + row_k, i_sub, valid, H * K, offs_ki, K, ACC), gk, mid, valid)
                ee = mid_decay(load_rows(p_e, i_sub, valid, H * K, offs_ki, K, ACC), -gk, -mid, valid)
                a += mm(kk, tl.trans(ee), OP, PREC, ACC)
            a = tl.where(causal_mask(i_sub, valid, i_sub, valid, True), a, 0.0)
            if MODE == HOUSEHOLDER:
                a = a * tl.load(beta + tok0 * NH * H + i_sub * H + i_h, mask=valid, other=0.0).to(ACC)[:, None]
            unit_lower_inverse(a, Tinv + o_t, BT, SC, ACC, INV_PREC)
    elif GATE == CHANNEL_GATE:  # the second pass: the marked chunks' products need whole rows
        if tl.load(slow + i_chunk * H + i_h) != 0:
            kk = load_rows(k + row_k, i_sub, valid, H * K, offs_k, K, ACC)
            ee = load_rows(p_e, i_sub, valid, H * K, offs_k, K, ACC)
            gk = load_gate(p_g, i_sub // NH, valid, stride_g, offs_k, GATE, K, ACC)
            a = scores(kk, gk, i_sub, valid, ee, gk, i_sub, valid, p_g, stride_g, n_sub,
                       True, GATE, NH, BT, SC, K, BK, ACC, OP, PREC)
            if MODE == HOUSEHOLDER:
                a = a * tl.load(beta + tok0 * NH * H + i_sub * H + i_h, mask=valid, other=0.0).to(ACC)[:, None]
            unit_lower_inverse(a, Tinv + o_t, BT, SC, ACC, INV_PREC)
    else:  # K in slices: fewer live registers, so more programs per SM
        gk = load_gate(p_g, i_sub // NH, valid, stride_g, offs_k, GATE, K, ACC)
        a = tl.zeros([BT, BT], dtype=ACC)
        for i_k in range(0, BK, BKI):  # a loop, not unrolled: unrolled, every slice's loads were hoisted
            offs_ki = i_k + tl.arange(0, BKI)
            kk = load_rows(k + row_k, i_sub, valid, H * K, offs_ki, K, ACC)
            ee = load_rows(p_e, i_sub, valid, H * K, offs_ki, K, ACC)
            a += mm(kk, tl.trans(ee), OP, PREC, ACC)
        a = tl.where(causal_mask(i_sub, valid, i_sub, valid, True), a, 0.0)
        if GATE == SCALAR_GATE:  # the scalar decay, once for all slices
            a *= tl.exp(tl.where(i_sub[None, :] < i_sub[:, None], gk[:, None] - gk[None, :], float("-inf")))
        if MODE == HOUSEHOLDER:
            a = a * tl.load(beta + tok0 * NH * H + i_sub * H + i_h, mask=valid, other=0.0).to(ACC)[:, None]
        unit_lower_inverse(a, Tinv + o_t, BT, SC, ACC, INV_PREC)


@triton.jit(do_not_specialize=["T", "NT"])
def prepare_kernel(
    k, w, beta, v, G, Tinv, P, X, cu_seqlens, chunk_table, T, NT,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BKP: tl.constexpr, BV: tl.constexpr,
    BT: tl.constexpr, TC: tl.constexpr, NH: tl.constexpr, SC: tl.constexpr,
    MODE: tl.constexpr, GATE: tl.constexpr, HAS_BETA: tl.constexpr, IS_VARLEN: tl.constexpr,
    ACC: tl.constexpr, OP: tl.constexpr, PREC: tl.constexpr,
):
    """`P = Tinv diag(c) K~` and `X = Tinv Z` of one chunk, from `inverse_kernel`'s `Tinv`."""
    i_chunk, i_h = tl.program_id(0), tl.program_id(1)
    tok0, n_sub, i_sub, valid, row_k, stride_g, p_g = _chunk_rows(i_chunk, i_h, G, cu_seqlens, chunk_table, T, NT,
                                                                   H, K, BT, TC, NH, GATE, IS_VARLEN)
    offs_k = tl.arange(0, BK)

    tinv = tl.load(Tinv + (i_chunk * H + i_h) * BT * BT + i_sub[:, None] * BT + i_sub[None, :]).to(ACC)
    if MODE == HOUSEHOLDER:
        cb = tl.load(beta + tok0 * NH * H + i_sub * H + i_h, mask=valid, other=0.0).to(ACC)
    for i_k in range(0, BK, BKP):  # P's columns in slices (a loop, so one slice's tiles are alive)
        offs_kp = i_k + tl.arange(0, BKP)
        kt = decay_rows(load_rows(k + row_k, i_sub, valid, H * K, offs_kp, K, ACC),
                        load_gate(p_g, i_sub // NH, valid, stride_g, offs_kp, GATE, K, ACC), GATE)
        if MODE == HOUSEHOLDER:
            kt = kt * cb[:, None]
        store_rows(P + row_k, mm(tinv, kt, OP, PREC, ACC), i_sub, valid, H * K, offs_kp, K)

    if MODE == RWKV7:
        kk = load_rows(k + row_k, i_sub, valid, H * K, offs_k, K, ACC)
        gk = load_gate(p_g, i_sub // NH, valid, stride_g, offs_k, GATE, K, ACC)
        p_w = w + row_k
        ww = load_rows(p_w, i_sub, valid, H * K, offs_k, K, ACC)
        s_kw = scores(kk, gk, i_sub, valid, ww, gk, i_sub, valid, p_g, stride_g, n_sub,
                      True, GATE, NH, BT, SC, K, BK, ACC, OP, PREC)
        mix = -mm(tinv, s_kw, OP, PREC, ACC)
        if HAS_BETA:
            cb = tl.load(beta + tok0 * NH * H + i_sub * H + i_h, mask=valid, other=0.0).to(ACC)
    row_v = tok0 * NH * H * V + i_h * V
    for i_v in range(tl.cdiv(V, BV)):
        offs_v = i_v * BV + tl.arange(0, BV)
        vv = load_rows(v + row_v, i_sub, valid, H * V, offs_v, V, ACC)
        if MODE == HOUSEHOLDER:
            x = mm(tinv, vv * cb[:, None], OP, PREC, ACC)
        else:
            if HAS_BETA:
                vv = vv * cb[:, None]
            x = mm(mix, vv, OP, PREC, ACC)
        store_rows(X + row_v, x, i_sub, valid, H * V, offs_v, V)
