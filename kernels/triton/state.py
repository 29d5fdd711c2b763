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
from .decay import load_gate, load_rows, mm, store_rows, stored
from .kinds import CHANNEL_GATE, DIAGONAL, HOUSEHOLDER, SCALAR_GATE


@triton.jit
def end_decay(p_g, n_tok, i_sub, valid, stride_g, offs_k, GATE: tl.constexpr, NH: tl.constexpr,
               K: tl.constexpr, ACC: tl.constexpr):
    """`(G_L, G_L - G_i)`: the chunk's total log-decay and each sub-step's decay to the end."""
    if GATE == CHANNEL_GATE:
        g_last = tl.load(p_g + (n_tok - 1) * stride_g + offs_k, mask=offs_k < K, other=0.0).to(ACC)
        gk = load_gate(p_g, i_sub // NH, valid, stride_g, offs_k, GATE, K, ACC)
        return g_last, tl.where(valid[:, None], g_last[None, :] - gk, 0.0)
    elif GATE == SCALAR_GATE:
        g_last = tl.load(p_g + (n_tok - 1) * stride_g).to(ACC)
        gk = load_gate(p_g, i_sub // NH, valid, stride_g, offs_k, GATE, K, ACC)
        return g_last, tl.where(valid, g_last - gk, 0.0)
    else:
        return 0.0, 0.0


@triton.jit
def _decay_state(h, g_last, GATE: tl.constexpr):
    if GATE == CHANNEL_GATE:
        return h * tl.exp(g_last)[:, None]
    elif GATE == SCALAR_GATE:
        return h * tl.exp(g_last)
    else:
        return h


# A scalar gate's decay `exp(G)` of a row is one number, so it may scale either factor of a
# product over that row: the state passes put it on the `[BT, BV]` value side, which lets
# the `[BT, K]` key-side rows go from memory to the tensor cores in their own dtype (no
# float32 copy of a [64, 128] tile: fewer registers and no conversions in the sequential
# loop, as fla's `fwd_h` does). A channel gate decays each key column apart, so it stays on
# the key side, whose rows are then loaded in the accumulator's dtype.
@triton.jit
def load_keys(p, rows, ok, stride, offs_k, K: tl.constexpr, GATE: tl.constexpr, OP: tl.constexpr, ACC: tl.constexpr):
    """Key-side rows `[R, BK]` in the dot operands' dtype, or the accumulator's for a channel gate."""
    if GATE == CHANNEL_GATE:
        return load_rows(p, rows, ok, stride, offs_k, K, ACC)
    else:
        return load_rows(p, rows, ok, stride, offs_k, K, OP)


@triton.jit
def key_decay(x, gamma, GATE: tl.constexpr):
    """`x * exp(gamma)` for a channel gate's `[R, BK]` rows; unchanged otherwise."""
    if GATE == CHANNEL_GATE:
        return x * tl.exp(gamma)
    else:
        return x


@triton.jit
def value_decay(x, gamma, GATE: tl.constexpr):
    """`x * exp(gamma)[:, None]` for a scalar gate's `[R, BV]` rows; unchanged otherwise."""
    if GATE == SCALAR_GATE:
        return x * tl.exp(gamma)[:, None]
    else:
        return x


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
    stride_g = H * K if GATE == CHANNEL_GATE else H

    h = tl.zeros([BK, BV], dtype=ACC)
    if USE_H0:
        h += tl.load(h0 + (n * H + i_h) * K * V + state_offs, mask=state_mask, other=0.0).to(ACC)
    for c in range(count):
        tl.store(h_all + ((first + c) * H + i_h) * K * V + state_offs, stored(h, h_all), mask=state_mask)
        tok0 = bos + c * TC
        n_tok = tl.minimum(TC, seq_len - c * TC)
        valid = i_sub < n_tok * NH
        row_k = tok0 * NH * H * K + i_h * K
        row_v = tok0 * NH * H * V + i_h * V
        p_g = G + tok0 * stride_g + (i_h * K if GATE == CHANNEL_GATE else i_h)
        g_last, to_end = end_decay(p_g, n_tok, i_sub, valid, stride_g, offs_k, GATE, NH, K, ACC)
        if MODE != DIAGONAL:  # the erase read-outs first: after them the old state is dead (registers)
            pp = load_rows(P + row_k, i_sub, valid, H * K, offs_k, K, OP)
            y = load_rows(X + row_v, i_sub, valid, H * V, offs_v, V, ACC)
            y -= mm(pp, h, OP, PREC, ACC)
            store_rows(Y + row_v, y, i_sub, valid, H * V, offs_v, V)
        h = _decay_state(h, g_last, GATE)
        if MODE != DIAGONAL:
            ee = load_keys((w if MODE == HOUSEHOLDER else e) + row_k, i_sub, valid, H * K, offs_k, K, GATE, OP, ACC)
            h += mm(tl.trans(key_decay(ee, to_end, GATE)), value_decay(y, to_end, GATE), OP, PREC, ACC)
        if MODE != HOUSEHOLDER:
            ww = load_keys(w + row_k, i_sub, valid, H * K, offs_k, K, GATE, OP, ACC)
            u = load_rows(v + row_v, i_sub, valid, H * V, offs_v, V, ACC)
            if HAS_BETA:
                u *= tl.load(beta + tok0 * NH * H + i_sub * H + i_h, mask=valid, other=0.0).to(ACC)[:, None]
            h += mm(tl.trans(key_decay(ww, to_end, GATE)), value_decay(u, to_end, GATE), OP, PREC, ACC)
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
    stride_g = H * K if GATE == CHANNEL_GATE else H

    dh = tl.zeros([BK, BV], dtype=ACC)
    if USE_DHT:
        dh += tl.load(dht + (n * H + i_h) * K * V + state_offs, mask=state_mask, other=0.0).to(ACC)
    for cc in range(count):
        c = count - 1 - cc
        tl.store(dh_all + ((first + c) * H + i_h) * K * V + state_offs, stored(dh, dh_all), mask=state_mask)
        tok0 = bos + c * TC
        n_tok = tl.minimum(TC, seq_len - c * TC)
        valid = i_sub < n_tok * NH
        valid_q = i_q < n_tok
        row_k = tok0 * NH * H * K + i_h * K
        row_v = tok0 * NH * H * V + i_h * V
        p_g = G + tok0 * stride_g + (i_h * K if GATE == CHANNEL_GATE else i_h)
        g_last, to_end = end_decay(p_g, n_tok, i_sub, valid, stride_g, offs_k, GATE, NH, K, ACC)

        qq = load_keys(q + tok0 * H * K + i_h * K, i_q, valid_q, H * K, offs_k, K, GATE, OP, ACC)
        g_q = load_gate(p_g, i_q, valid_q, stride_g, offs_k, GATE, K, ACC)
        d_o = load_rows(do + tok0 * H * V + i_h * V, i_q, valid_q, H * V, offs_v, V, ACC) * scale
        dh_prev = _decay_state(dh, g_last, GATE) + mm(tl.trans(key_decay(qq, g_q, GATE)), value_decay(d_o, g_q, GATE),
                                                      OP, PREC, ACC)
        if MODE != DIAGONAL:
            ee = load_keys((w if MODE == HOUSEHOLDER else e) + row_k, i_sub, valid, H * K, offs_k, K, GATE, OP, ACC)
            dy = load_rows(dY + row_v, i_sub, valid, H * V, offs_v, V, ACC)
            dy += value_decay(mm(key_decay(ee, to_end, GATE), dh, OP, PREC, ACC), to_end, GATE)
            store_rows(dY + row_v, dy, i_sub, valid, H * V, offs_v, V)
            pp = load_rows(P + row_k, i_sub, valid, H * K, offs_k, K, OP)
            dh_prev -= mm(tl.trans(pp), dy, OP, PREC, ACC)
        if MODE != HOUSEHOLDER:
            ww = load_keys(w + row_k, i_sub, valid, H * K, offs_k, K, GATE, OP, ACC)
            du = load_rows(dU + row_v, i_sub, valid, H * V, offs_v, V, ACC)
            du += value_decay(mm(key_decay(ww, to_end, GATE), dh, OP, PREC, ACC), to_end, GATE)
            store_rows(dU + row_v, du, i_sub, valid, H * V, offs_v, V)
        dh = dh_prev
    if STORE_DH0:
        tl.store(dh0 + (n * H + i_h) * K * V + state_offs, dh.to(dh0.dtype.element_ty), mask=state_mask)
