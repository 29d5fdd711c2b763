"""`(I + A)^{-1}` for a strictly lower-triangular `A`: the UT transform's triangular solve.

The chunk's `BT x BT` matrix is cut into `SUB x SUB` diagonal blocks (`SUB` = 16):

1. each diagonal block is inverted by forward substitution (row `i` of the inverse is
   `e_i - sum_{j<i} A[i, j] inv[j]`), all blocks at once as a `[BT/SUB, SUB, SUB]`
   tensor: 16 short steps of element-wise work instead of `BT` steps over the whole
   matrix;
2. with `D` the block-diagonal inverse and `N = D A_off` (`A_off`: the blocks below the
   diagonal), `(I + A)^{-1} = (I + N)^{-1} D = (I - N + N^2 - ...) D`, a finite series
   because `N` is strictly block-lower (`N^{BT/SUB} = 0`): `BT/SUB` tensor-core products.

Triton cannot slice a register tensor into blocks, so `A` and `D` pass once through a
`BT x BT` float32 scratch area in global memory (L1/L2-resident; the caller's own slot
for the result). The products run at `PREC` ("tf32x3" on GPUs: float32-accurate; the
inverse's entries grow when beta nears 2 and its errors feed every later product).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def unit_lower_inverse(a, scratch, BT: tl.constexpr, SUB: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr):
    """`(I + a)^{-1}` for `a` `[BT, BT]` strictly lower triangular; `scratch` holds BT*BT floats."""
    NB: tl.constexpr = BT // SUB
    rows = tl.arange(0, BT)
    tl.store(scratch + rows[:, None] * BT + rows[None, :], a.to(scratch.dtype.element_ty))
    tl.debug_barrier()
    # 1. the diagonal blocks, [NB, SUB, SUB], by forward substitution
    blk = tl.arange(0, NB)[:, None, None]
    ri = tl.arange(0, SUB)[None, :, None]
    cj = tl.arange(0, SUB)[None, None, :]
    diag = tl.load(scratch + (blk * SUB + ri) * BT + blk * SUB + cj).to(ACC)
    inv = tl.zeros([NB, SUB, SUB], dtype=ACC)
    for i in tl.static_range(SUB):
        a_i = tl.sum(tl.where(ri == i, diag, 0.0), 1)  # row i of each block, [NB, SUB]
        row = tl.where(cj == i, 1.0, 0.0).to(ACC) - tl.sum(a_i[:, :, None] * inv, 1)[:, None, :]
        inv = tl.where(ri == i, row, inv)
    if NB == 1:
        return tl.reshape(inv, [BT, BT])
    tl.debug_barrier()
    tl.store(scratch + (blk * SUB + ri) * BT + blk * SUB + cj, inv.to(scratch.dtype.element_ty))
    tl.debug_barrier()
    same = (rows[:, None] // SUB) == (rows[None, :] // SUB)
    d = tl.load(scratch + rows[:, None] * BT + rows[None, :], mask=same, other=0.0).to(ACC)
    # 2. merge: (I - N + N^2 - ...) D with N = D A_off
    n = tl.dot(d, tl.where(same, 0.0, a), input_precision=PREC, out_dtype=ACC)
    term = d
    out = d
    for m in tl.static_range(1, NB):
        term = -tl.dot(n, term, input_precision=PREC, out_dtype=ACC)
        out += term
    return out
