"""`(I + A)^{-1}` for a strictly lower-triangular `A`: the UT transform's triangular solve.

Forward substitution, one row at a time, in the accumulation dtype: row `i` of the
inverse is `e_i - sum_{j<i} A[i, j] inv[j]`. It runs in float32 (never tf32) because
the inverse's entries grow with `beta` near 2 and its errors feed every later product.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def unit_lower_inverse(a, BT: tl.constexpr, ACC: tl.constexpr):
    """`(I + a)^{-1}` for `a` `[BT, BT]` strictly lower triangular."""
    rows = tl.arange(0, BT)
    inv = tl.zeros([BT, BT], dtype=ACC)
    for i in range(BT):
        a_i = tl.sum(tl.where(rows[:, None] == i, a, 0.0), 0)  # row i of a (zero from column i on)
        row = tl.where(rows == i, 1.0, 0.0).to(ACC) - tl.sum(a_i[:, None] * inv, 0)
        inv = tl.where(rows[:, None] == i, row[None, :], inv)
    return inv
