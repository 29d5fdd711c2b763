"""The within-chunk cumulative log-gate, and its backward (a reverse cumulative sum).

`G[t] = sum of g over the chunk's tokens up to and including t`, one row per token (a
token's sub-steps share it: the gate acts before the first sub-step). Stored in the
accumulation dtype so that every kernel of the chunk reads the same decays; the channel
path also gathers rows of it (see `decay.py`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .chunks import chunk_of_program


@triton.jit(do_not_specialize=["T", "NT"])
def gate_cumsum_kernel(
    g, G, cu_seqlens, chunk_table, T, NT,
    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, TC: tl.constexpr, BQ: tl.constexpr,
    CHANNEL: tl.constexpr, IS_VARLEN: tl.constexpr, ACC: tl.constexpr,
):
    """A channel gate's columns in blocks of `BK` (the third grid axis): the scan runs down
    the rows, so a narrow block leaves each program few registers (163 for all 128 columns
    with 4 warps, Triton 3.6) and four times the programs in flight."""
    i_chunk, i_h, i_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    _, bos, seq_len, c = chunk_of_program(i_chunk, T, NT, cu_seqlens, chunk_table, IS_VARLEN)
    tok0 = c * TC
    rows = tl.arange(0, BQ)
    valid = (rows < TC) & (tok0 + rows < seq_len)
    if CHANNEL:
        offs_k = i_k * BK + tl.arange(0, BK)
        offs = (bos + tok0 + rows[:, None]) * (H * K) + i_h * K + offs_k[None, :]
        mask = valid[:, None] & (offs_k[None, :] < K)
        x = tl.load(g + offs, mask=mask, other=0.0).to(ACC)
        tl.store(G + offs, tl.cumsum(x, 0).to(G.dtype.element_ty), mask=mask)
    else:
        offs = (bos + tok0 + rows) * H + i_h
        x = tl.load(g + offs, mask=valid, other=0.0).to(ACC)
        tl.store(G + offs, tl.cumsum(x, 0).to(G.dtype.element_ty), mask=valid)
