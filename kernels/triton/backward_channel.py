"""Backward, last step, for a channel gate (KDA, GLA-channel, RWKV-7): two kernels.

The chain rule is `backward.py`'s, in the same two groups, but run as two launches:

    chunk_pairs_kernel     grid (chunks, H)              pair_grads: dv, dbeta, and the
                                                         C x C matrices -> scratch
    chunk_channels_kernel  grid (K / BKS, chunks, H)     channel_grads on BKS columns of K:
                                                         dq, dk, dw, de, dg

Why: with a channel gate every decayed product is a sub-chunk loop over `[64, K]` blocks
(`decay.py`), and with the whole of K in one program the compiler keeps too many of them
alive: `chunk_backward_kernel`'s KDA specialization compiled (sm_90, 8 warps) to 255
registers and 4.9 KB of stack per thread. But a channel gate's decay is per channel, so
everything except the `C x C` algebra (which sums over K) splits over column slices of K:
the pairs kernel reads K a slice at a time, and each channels program owns one slice, so
no `[64, K]` float32 block is ever alive whole. Without a channel gate the same helpers run
the slices in a loop inside one program (`chunk_backward_kernel`): a scalar gate's `dg`
sums over K, and a plain DeltaNet gains nothing from a second launch.

What passes between the two: `dA` (already times `c`, masked), `dS_kw` (rwkv7),
`dM_E`, `dM_W` (`[BQ, BT]`), in the accumulation dtype (float32; exact as before), one
`[rows, BT]` tile each per (chunk, head): 32 KB per program for KDA, 16 KB for GLA-channel,
64 KB for RWKV-7, written once and read by each of the `K / BKS` slice programs
(neighbours in the grid, so that the later reads are likely L2 hits). The channels kernel
passes `channel_grads` pointers to the tiles, not the tiles: each is loaded where it is
used (`pair_tile`) rather than held in registers across phases.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .backward import channel_grads, pair_grads
from .decay import chunk_in_pass
from .kinds import ALL_CHUNKS, HOUSEHOLDER, DIAGONAL, RWKV7, WITHIN_BOUND


@triton.jit
def _tile(p, i_chunk, i_h, H: tl.constexpr, R: tl.constexpr, BT: tl.constexpr):
    """Pointers to the `[R, BT]` scratch tile of one (chunk, head)."""
    rows = tl.arange(0, R)
    cols = tl.arange(0, BT)
    return p + (i_chunk * H + i_h) * R * BT + rows[:, None] * BT + cols[None, :]


@triton.jit(do_not_specialize=["T", "NT"])
def chunk_pairs_kernel(
    k, w, e, beta, v, G, Tinv, h_all, Y, dY, dU, do, dv, dbeta,
    s_a, s_kw, s_me, s_mw,
    cu_seqlens, chunk_table, T, NT,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BKS: tl.constexpr, BV: tl.constexpr,
    BT: tl.constexpr, TC: tl.constexpr, BQ: tl.constexpr, NH: tl.constexpr, SC: tl.constexpr,
    MODE: tl.constexpr, GATE: tl.constexpr, HAS_BETA: tl.constexpr,
    IS_VARLEN: tl.constexpr, ACC: tl.constexpr, OP: tl.constexpr, PREC: tl.constexpr,
    BKG: tl.constexpr = 16, CHANNEL_PASS: tl.constexpr = ALL_CHUNKS,
):
    i_chunk, i_h = tl.program_id(0), tl.program_id(1)
    # the pass is decided on all K columns (BKG of them) in both kernels
    tok0, n_tok, runs = chunk_in_pass(G, i_chunk, i_h, T, NT, cu_seqlens, chunk_table, H, K, BKG, TC, NH, GATE, CHANNEL_PASS,
                                      IS_VARLEN, OP, ACC)
    if runs:
        dm_e, dm_w, da, ds_kw = pair_grads(k, w, e, beta, v, G, Tinv, h_all, Y, dY, dU, do, dv, dbeta,
                                           i_chunk, i_h, tok0, n_tok, H, K, V, BKS, BV, BT, BQ, NH, SC,
                                           MODE, GATE, HAS_BETA, ACC, OP, PREC, CHUNK_ONLY=CHANNEL_PASS == WITHIN_BOUND)
        if MODE != DIAGONAL:
            tl.store(_tile(s_a, i_chunk, i_h, H, BT, BT), da.to(s_a.dtype.element_ty))
            tl.store(_tile(s_me, i_chunk, i_h, H, BQ, BT), dm_e.to(s_me.dtype.element_ty))
        if MODE == RWKV7:
            tl.store(_tile(s_kw, i_chunk, i_h, H, BT, BT), ds_kw.to(s_kw.dtype.element_ty))
        if MODE != HOUSEHOLDER:
            tl.store(_tile(s_mw, i_chunk, i_h, H, BQ, BT), dm_w.to(s_mw.dtype.element_ty))


@triton.jit(do_not_specialize=["T", "NT"])
def chunk_channels_kernel(
    q, k, w, e, beta, v, G, Tinv, h_all, dh_all, Y, dY, do,
    dq, dk, dw, de, dg,
    s_a, s_kw, s_me, s_mw,
    cu_seqlens, chunk_table, T, NT, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BKS: tl.constexpr, BV: tl.constexpr,
    BT: tl.constexpr, TC: tl.constexpr, BQ: tl.constexpr, NH: tl.constexpr, SC: tl.constexpr,
    MODE: tl.constexpr, GATE: tl.constexpr, HAS_BETA: tl.constexpr, TIED: tl.constexpr,
    IS_VARLEN: tl.constexpr, ACC: tl.constexpr, OP: tl.constexpr, PREC: tl.constexpr,
    BKG: tl.constexpr = 16, CHANNEL_PASS: tl.constexpr = ALL_CHUNKS,
):
    i_k, i_chunk, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    # the pass is decided on all K columns (BKG of them) in both kernels
    tok0, n_tok, runs = chunk_in_pass(G, i_chunk, i_h, T, NT, cu_seqlens, chunk_table, H, K, BKG, TC, NH, GATE, CHANNEL_PASS,
                                      IS_VARLEN, OP, ACC)
    if runs:
        o_tile = (i_chunk * H + i_h) * BT  # the matrices are loaded where channel_grads uses them
        da, ds_kw, dm_e, dm_w = s_a + o_tile * BT, s_kw + o_tile * BT, s_me + o_tile * BQ, s_mw + o_tile * BQ
        channel_grads(q, k, w, e, beta, v, G, Tinv, h_all, dh_all, Y, dY, do, dq, dk, dw, de, dg,
                      dm_e, dm_w, da, ds_kw, i_chunk, i_h, tok0, n_tok, scale, i_k * BKS,
                      H, K, V, BKS, BV, BT, BQ, NH, SC, MODE, GATE, HAS_BETA, TIED, ACC, OP, PREC,
                      CHUNK_ONLY=CHANNEL_PASS == WITHIN_BOUND)
