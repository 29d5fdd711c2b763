"""Read-out (chunk-parallel): the output, and the local part of its backward.

For the chunk's query tokens (one row per token: the read-out after its last sub-step),

    O = Q~ S_0 + M_E Y + M_W U,    Q~ = scale * q * exp(G),
    M_E[t, j] = scale * q_t^T diag(exp(G_t - G_j)) E_j    for sub-steps j up to t's last

(`M_W` likewise with the write keys; `M_E Y` only with a delta rule, `M_W U` only with
plain writes). The backward's local parts `dY_local = M_E^T dO`, `dU_local = M_W^T dO`
reuse the same scores; the state pass (`state.py`) adds what flows from later chunks.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .decay import chunk_in_pass, decay_rows, load_gate, load_rows, mm, scores, store_rows
from .kinds import ALL_CHUNKS, CHANNEL_GATE, DIAGONAL, HOUSEHOLDER, WITHIN_BOUND


@triton.jit
def query_scores(
    q, w, e, G, tok0, n_tok, i_h, scale,
    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, BQ: tl.constexpr,
    NH: tl.constexpr, SC: tl.constexpr, MODE: tl.constexpr, GATE: tl.constexpr,
    ACC: tl.constexpr, OP: tl.constexpr, PREC: tl.constexpr, CHUNK_ONLY: tl.constexpr = False,
):
    """`(Q~, M_E, M_W)` of one chunk (`M_E`/`M_W` are zeros where the path has none)."""
    i_sub = tl.arange(0, BT)
    i_q = tl.arange(0, BQ)
    n_sub = n_tok * NH
    valid = i_sub < n_sub
    valid_q = i_q < n_tok
    pos_q = i_q * NH + NH - 1
    offs_k = tl.arange(0, BK)
    row_k = tok0 * NH * H * K + i_h * K
    stride_g = H * K if GATE == CHANNEL_GATE else H
    p_g = G + tok0 * stride_g + (i_h * K if GATE == CHANNEL_GATE else i_h)
    # rows loaded in the operand dtype (exact: the inputs' own dtype, or wider); the scores'
    # arithmetic widens them where it needs to
    qq = load_rows(q + tok0 * H * K + i_h * K, i_q, valid_q, H * K, offs_k, K, OP)
    gq = load_gate(p_g, i_q, valid_q, stride_g, offs_k, GATE, K, ACC)
    gk = load_gate(p_g, i_sub // NH, valid, stride_g, offs_k, GATE, K, ACC)
    m_e = tl.zeros([BQ, BT], dtype=ACC)
    m_w = tl.zeros([BQ, BT], dtype=ACC)
    if MODE != DIAGONAL:
        p_e = (w if MODE == HOUSEHOLDER else e) + row_k
        ee = load_rows(p_e, i_sub, valid, H * K, offs_k, K, OP)
        m_e = scores(qq, gq, pos_q, valid_q, ee, gk, i_sub, valid, p_g, stride_g, n_sub,
                     False, GATE, NH, BT, SC, K, BK, ACC, OP, PREC, CHUNK_ONLY=CHUNK_ONLY) * scale
    if MODE != HOUSEHOLDER:
        ww = load_rows(w + row_k, i_sub, valid, H * K, offs_k, K, OP)
        m_w = scores(qq, gq, pos_q, valid_q, ww, gk, i_sub, valid, p_g, stride_g, n_sub,
                     False, GATE, NH, BT, SC, K, BK, ACC, OP, PREC, CHUNK_ONLY=CHUNK_ONLY) * scale
    return decay_rows(qq, gq, GATE) * scale, m_e, m_w


@triton.jit(do_not_specialize=["T", "NT"])
def output_kernel(
    q, w, e, beta, v, G, Y, h_all, o, cu_seqlens, chunk_table, T, NT, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BT: tl.constexpr, TC: tl.constexpr, BQ: tl.constexpr, NH: tl.constexpr, SC: tl.constexpr,
    MODE: tl.constexpr, GATE: tl.constexpr, HAS_BETA: tl.constexpr, IS_VARLEN: tl.constexpr,
    ACC: tl.constexpr, OP: tl.constexpr, PREC: tl.constexpr,
    CHANNEL_PASS: tl.constexpr = ALL_CHUNKS,
):
    """`O` of one chunk: its scores formed once, then applied to every V block."""
    i_chunk, i_h = tl.program_id(0), tl.program_id(1)
    tok0, n_tok, runs = chunk_in_pass(G, i_chunk, i_h, T, NT, cu_seqlens, chunk_table, H, K, BK, TC, NH, GATE, CHANNEL_PASS,
                                      IS_VARLEN, OP, ACC)
    if runs:
        qt, m_e, m_w = query_scores(q, w, e, G, tok0, n_tok, i_h, scale, H, K, BK, BT, BQ, NH, SC, MODE, GATE, ACC, OP, PREC,
                                       CHUNK_ONLY=CHANNEL_PASS == WITHIN_BOUND)
        i_sub = tl.arange(0, BT)
        i_q = tl.arange(0, BQ)
        valid = i_sub < n_tok * NH
        valid_q = i_q < n_tok
        offs_k = tl.arange(0, BK)
        row_v = tok0 * NH * H * V + i_h * V
        if MODE != HOUSEHOLDER and HAS_BETA:
            bb = tl.load(beta + tok0 * NH * H + i_sub * H + i_h, mask=valid, other=0.0).to(ACC)
        # the dot operands rounded to OP once, here and at each load, as `mm` would at every use
        qt, m_e, m_w = qt.to(OP), m_e.to(OP), m_w.to(OP)
        for i_v in range(tl.cdiv(V, BV)):
            offs_v = i_v * BV + tl.arange(0, BV)
            h = tl.load(h_all + (i_chunk * H + i_h) * K * V + offs_k[:, None] * V + offs_v[None, :],
                        mask=(offs_k[:, None] < K) & (offs_v[None, :] < V), other=0.0).to(OP)
            out = mm(qt, h, OP, PREC, ACC)
            if MODE != DIAGONAL:
                y = load_rows(Y + row_v, i_sub, valid, H * V, offs_v, V, OP)
                out += mm(m_e, y, OP, PREC, ACC)
            if MODE != HOUSEHOLDER:
                u = load_rows(v + row_v, i_sub, valid, H * V, offs_v, V, ACC)
                if HAS_BETA:
                    u *= bb[:, None]
                out += mm(m_w, u, OP, PREC, ACC)
            store_rows(o + tok0 * H * V + i_h * V, out, i_q, valid_q, H * V, offs_v, V)


@triton.jit(do_not_specialize=["T", "NT"])
def output_backward_kernel(
    q, w, e, G, do, dY, dU, cu_seqlens, chunk_table, T, NT, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BT: tl.constexpr, TC: tl.constexpr, BQ: tl.constexpr, NH: tl.constexpr, SC: tl.constexpr,
    MODE: tl.constexpr, GATE: tl.constexpr, IS_VARLEN: tl.constexpr,
    ACC: tl.constexpr, OP: tl.constexpr, PREC: tl.constexpr,
    CHANNEL_PASS: tl.constexpr = ALL_CHUNKS,
):
    """`dY = M_E^T dO` and `dU = M_W^T dO` (the within-chunk parts)."""
    i_chunk, i_h = tl.program_id(0), tl.program_id(1)
    tok0, n_tok, runs = chunk_in_pass(G, i_chunk, i_h, T, NT, cu_seqlens, chunk_table, H, K, BK, TC, NH, GATE, CHANNEL_PASS,
                                      IS_VARLEN, OP, ACC)
    if runs:
        _qt, m_e, m_w = query_scores(q, w, e, G, tok0, n_tok, i_h, scale, H, K, BK, BT, BQ, NH, SC, MODE, GATE, ACC, OP, PREC,
                                       CHUNK_ONLY=CHANNEL_PASS == WITHIN_BOUND)
        i_sub = tl.arange(0, BT)
        i_q = tl.arange(0, BQ)
        valid = i_sub < n_tok * NH
        valid_q = i_q < n_tok
        row_v = tok0 * NH * H * V + i_h * V
        for i_v in range(tl.cdiv(V, BV)):
            offs_v = i_v * BV + tl.arange(0, BV)
            d_o = load_rows(do + tok0 * H * V + i_h * V, i_q, valid_q, H * V, offs_v, V, ACC)
            if MODE != DIAGONAL:
                store_rows(dY + row_v, mm(tl.trans(m_e), d_o, OP, PREC, ACC), i_sub, valid, H * V, offs_v, V)
            if MODE != HOUSEHOLDER:
                store_rows(dU + row_v, mm(tl.trans(m_w), d_o, OP, PREC, ACC), i_sub, valid, H * V, offs_v, V)
