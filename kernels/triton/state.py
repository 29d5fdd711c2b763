"""The sequential passes over chunks: the state forward, the state gradient backward.

One program per (sequence, head, block of V columns) carries the `K x BV` state (or its
gradient) in registers through the sequence's chunks; everything else was made
chunk-parallel before (`prepare.py`) or is made after (`output.py`, `backward.py`).

Forward, per chunk with start state `S_0` (stored for the read-out and the backward):

    Y   = X - P S_0                                     (delta rules: erase read-outs)
    S_L = exp(G_L) S_0 + E_end^T Y + W_end^T U          (U: plain writes, absent for householder)

with `E_end = E * exp(G_L - G)`, `W_end = W * exp(G_L - G)`. Backward, from `dS_L`:

    dY   = dY_local + E_end dS_L,   dU = dU_local + W_end dS_L
    dS_0 = exp(G_L) dS_L + Q~^T dO - P^T dY
"""

from __future__ import annotations

import triton
import triton.language as tl

from .chunks import sequence_of_program
from .decay import decay_rows, load_gate, load_rows, mm, store_rows


@triton.jit
def end_decay(p_g, n_tok, i_sub, valid, stride_g, offs_k, GATE: tl.constexpr, NH: tl.constexpr,
               K: tl.constexpr, ACC: tl.constexpr):
    """`(G_L, G_L - G_i)`: the chunk's total log-decay and each sub-step's decay to the end."""
    if GATE == 2:
        g_last = tl.load(p_g + (n_tok - 1) * stride_g + offs_k, mask=offs_k < K, other=0.0).to(ACC)
        gk = load_gate(p_g, i_sub // NH, valid, stride_g, offs_k, GATE, K, ACC)
        return g_last, tl.where(valid[:, None], g_last[None, :] - gk, 0.0)
    elif GATE == 1:
        g_last = tl.load(p_g + (n_tok - 1) * stride_g).to(ACC)
        gk = load_gate(p_g, i_sub // NH, valid, stride_g, offs_k, GATE, K, ACC)
        return g_last, tl.where(valid, g_last - gk, 0.0)
    else:
        return 0.0, 0.0


@triton.jit
def _decay_state(h, g_last, GATE: tl.constexpr):
    if GATE == 2:
        return h * tl.exp(g_last)[:, None]
    elif GATE == 1:
        return h * tl.exp(g_last)
    else:
        return h


@triton.jit(do_not_specialize=["T", "NT"])
def state_forward_kernel(
    k, w, e, beta, v, G, P, X, Y, h_all, h0, ht, cu_seqlens, chunk_offsets, T, NT,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BT: tl.constexpr, TC: tl.constexpr, NH: tl.constexpr,
    MODE: tl.constexpr, GATE: tl.constexpr, HAS_BETA: tl.constexpr,
    USE_H0: tl.constexpr, STORE_HT: tl.constexpr, IS_VARLEN: tl.constexpr,
    ACC: tl.constexpr, OP: tl.constexpr, PREC: tl.constexpr,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    n, i_h = i_nh // H, i_nh % H
    bos, seq_len, first, count = sequence_of_program(n, T, NT, cu_seqlens, chunk_offsets, IS_VARLEN)
    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    i_sub = tl.arange(0, BT)
    state_mask = (offs_k[:, None] < K) & (offs_v[None, :] < V)
    state_offs = offs_k[:, None] * V + offs_v[None, :]
    stride_g = H * K if GATE == 2 else H

    h = tl.zeros([BK, BV], dtype=ACC)
    if USE_H0:
        h += tl.load(h0 + (n * H + i_h) * K * V + state_offs, mask=state_mask, other=0.0).to(ACC)
    for c in range(count):
        tl.store(h_all + ((first + c) * H + i_h) * K * V + state_offs, h.to(h_all.dtype.element_ty), mask=state_mask)
        tok0 = bos + c * TC
        n_tok = tl.minimum(TC, seq_len - c * TC)
        valid = i_sub < n_tok * NH
        row_k = tok0 * NH * H * K + i_h * K
        row_v = tok0 * NH * H * V + i_h * V
        p_g = G + tok0 * stride_g + (i_h * K if GATE == 2 else i_h)
        g_last, to_end = end_decay(p_g, n_tok, i_sub, valid, stride_g, offs_k, GATE, NH, K, ACC)
        h_next = _decay_state(h, g_last, GATE)
        if MODE != 0:
            pp = load_rows(P + row_k, i_sub, valid, H * K, offs_k, K, ACC)
            y = load_rows(X + row_v, i_sub, valid, H * V, offs_v, V, ACC)
            y -= mm(pp, h, OP, PREC, ACC)
            store_rows(Y + row_v, y, i_sub, valid, H * V, offs_v, V)
            ee = load_rows((w if MODE == 1 else e) + row_k, i_sub, valid, H * K, offs_k, K, ACC)
            ee = decay_rows(ee, to_end, GATE)
            h_next += mm(tl.trans(ee), y, OP, PREC, ACC)
        if MODE != 1:
            ww = decay_rows(load_rows(w + row_k, i_sub, valid, H * K, offs_k, K, ACC), to_end, GATE)
            u = load_rows(v + row_v, i_sub, valid, H * V, offs_v, V, ACC)
            if HAS_BETA:
                u *= tl.load(beta + tok0 * NH * H + i_sub * H + i_h, mask=valid, other=0.0).to(ACC)[:, None]
            h_next += mm(tl.trans(ww), u, OP, PREC, ACC)
        h = h_next
    if STORE_HT:
        tl.store(ht + (n * H + i_h) * K * V + state_offs, h.to(ht.dtype.element_ty), mask=state_mask)


@triton.jit(do_not_specialize=["T", "NT"])
def state_backward_kernel(
    q, w, e, beta, G, P, dY, dU, do, dh_all, dht, dh0, cu_seqlens, chunk_offsets, T, NT, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BT: tl.constexpr, TC: tl.constexpr, BQ: tl.constexpr, NH: tl.constexpr,
    MODE: tl.constexpr, GATE: tl.constexpr,
    USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr, IS_VARLEN: tl.constexpr,
    ACC: tl.constexpr, OP: tl.constexpr, PREC: tl.constexpr,
):
    """`dY` and `dU` hold the local parts (`output.py`) on entry and the full gradients on exit."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    n, i_h = i_nh // H, i_nh % H
    bos, seq_len, first, count = sequence_of_program(n, T, NT, cu_seqlens, chunk_offsets, IS_VARLEN)
    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    i_sub = tl.arange(0, BT)
    i_q = tl.arange(0, BQ)
    state_mask = (offs_k[:, None] < K) & (offs_v[None, :] < V)
    state_offs = offs_k[:, None] * V + offs_v[None, :]
    stride_g = H * K if GATE == 2 else H

    dh = tl.zeros([BK, BV], dtype=ACC)
    if USE_DHT:
        dh += tl.load(dht + (n * H + i_h) * K * V + state_offs, mask=state_mask, other=0.0).to(ACC)
    for cc in range(count):
        c = count - 1 - cc
        tl.store(dh_all + ((first + c) * H + i_h) * K * V + state_offs, dh.to(dh_all.dtype.element_ty), mask=state_mask)
        tok0 = bos + c * TC
        n_tok = tl.minimum(TC, seq_len - c * TC)
        valid = i_sub < n_tok * NH
        valid_q = i_q < n_tok
        row_k = tok0 * NH * H * K + i_h * K
        row_v = tok0 * NH * H * V + i_h * V
        p_g = G + tok0 * stride_g + (i_h * K if GATE == 2 else i_h)
        g_last, to_end = end_decay(p_g, n_tok, i_sub, valid, stride_g, offs_k, GATE, NH, K, ACC)

        qq = load_rows(q + tok0 * H * K + i_h * K, i_q, valid_q, H * K, offs_k, K, ACC)
        qq = decay_rows(qq, load_gate(p_g, i_q, valid_q, stride_g, offs_k, GATE, K, ACC), GATE) * scale
        d_o = load_rows(do + tok0 * H * V + i_h * V, i_q, valid_q, H * V, offs_v, V, ACC)
        dh_prev = _decay_state(dh, g_last, GATE) + mm(tl.trans(qq), d_o, OP, PREC, ACC)
        if MODE != 0:
            ee = load_rows((w if MODE == 1 else e) + row_k, i_sub, valid, H * K, offs_k, K, ACC)
            ee = decay_rows(ee, to_end, GATE)
            dy = load_rows(dY + row_v, i_sub, valid, H * V, offs_v, V, ACC)
            dy += mm(ee, dh, OP, PREC, ACC)
            store_rows(dY + row_v, dy, i_sub, valid, H * V, offs_v, V)
            pp = load_rows(P + row_k, i_sub, valid, H * K, offs_k, K, ACC)
            dh_prev -= mm(tl.trans(pp), dy, OP, PREC, ACC)
        if MODE != 1:
            ww = decay_rows(load_rows(w + row_k, i_sub, valid, H * K, offs_k, K, ACC), to_end, GATE)
            du = load_rows(dU + row_v, i_sub, valid, H * V, offs_v, V, ACC)
            du += mm(ww, dh, OP, PREC, ACC)
            store_rows(dU + row_v, du, i_sub, valid, H * V, offs_v, V)
        dh = dh_prev
    if STORE_DH0:
        tl.store(dh0 + (n * H + i_h) * K * V + state_offs, dh.to(dh0.dtype.element_ty), mask=state_mask)
