"""`(I + A)^{-1}` for a strictly lower-triangular `A`: the UT transform's triangular solve.

Two methods, chosen by the `DOUBLING` flag (`ARCHSPEC_TRITON_SOLVE`, read by
`recurrence.py`; the default stays the one measured on the GPU until the other is):

**Substitution** (measured on the H200). The chunk's `BT x BT` matrix is cut into
`SUB x SUB` diagonal blocks (`SUB` = 16):

1. each diagonal block is inverted by forward substitution (row `i` of the inverse is
   `e_i - sum_{j<i} A[i, j] inv[j]`), all blocks at once as a `[BT/SUB, SUB, SUB]`
   tensor: 16 short steps of element-wise work instead of `BT` steps over the whole
   matrix;
2. with `D` the block-diagonal inverse and `N = D A_off` (`A_off`: the blocks below the
   diagonal), `(I + A)^{-1} = (I + N)^{-1} D = (I - N + N^2 - ...) D`, a finite series
   because `N` is strictly block-lower (`N^{BT/SUB} = 0`): `BT/SUB` tensor-core products.

Triton cannot slice a register tensor into blocks, so `A` and `D` pass once through a
`BT x BT` float32 scratch area in global memory (L1/L2-resident; the caller's own slot
for the result). On the H200 this took most of `prepare_kernel`'s 1.16 ms (DeltaNet,
B=4 T=4096 H=16): its machine code has 154 barriers and 600 shared-memory stores per
program, from the layout changes of the dependent steps, at one program per SM.

**Doubling** (compiled for sm_90 and exact on the interpreter; not yet timed). Let `X_s`
be the inverse of the block-diagonal part of `I + A` with blocks of size `s` (`X_1 = I`).
A block of size `2s` is `[[L11, 0], [L21, L22]]`, its inverse `[[X11, 0], [-X22 L21 X11,
X22]]`, so `X_2s = X_s - X_s M_s X_s` with `M_s` the part of `A` in rows of each
2s-block's second half and columns of its first half: `log2(BT)` levels of two `BT x BT`
products (`X_2 = I - M_1` needs none), no dependent element-wise steps, no scratch (21
barriers; but 10 products instead of 4 and 60% more instructions). Each entry is formed as
in blocked substitution, from bounded inverse blocks and entries of `A`, never from
powers of `A`: the Neumann series `sum (-A)^m` is exact in exact arithmetic but sums terms
of order `2^m` to an inverse of order 1 when beta nears 2 (every factor a reflection).
In float32 both methods are equally accurate (relative error 1e-6 at beta near 2 and
key correlation 0.999, measured on the interpreter against float64).

Products run at `PREC` ("tf32x3" on GPUs: float32-accurate; the inverse's entries grow
when beta nears 2 and its errors feed every later product).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def unit_lower_inverse(a, scratch, BT: tl.constexpr, SUB: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr,
                       DOUBLING: tl.constexpr):
    """`(I + a)^{-1}` for `a` `[BT, BT]` strictly lower triangular; `scratch` (BT*BT floats)
    is used by substitution only."""
    if DOUBLING:
        return inverse_by_doubling(a, BT, ACC, PREC)
    else:
        return inverse_by_substitution(a, scratch, BT, SUB, ACC, PREC)


@triton.jit
def inverse_by_doubling(a, BT: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr):
    """`(I + a)^{-1}` for `a` `[BT, BT]` strictly lower triangular (`BT` a power of two)."""
    rows = tl.arange(0, BT)
    r = rows[:, None]
    c = rows[None, :]
    # blocks of 2: the inverse of [[1, 0], [a, 1]] is [[1, 0], [-a, 1]]
    x = tl.where(r == c, 1.0, 0.0).to(ACC) - tl.where((r // 2 == c // 2) & (r > c), a, 0.0).to(ACC)
    for level in tl.static_range(1, 7):  # blocks of s = 2, 4, ..., BT/2 merge into 2s (BT <= 128)
        if (1 << level) < BT:
            s = 1 << level
            m = tl.where((r // (2 * s) == c // (2 * s)) & (r // s != c // s) & (r > c), a, 0.0).to(ACC)
            y = tl.dot(x, m, input_precision=PREC, out_dtype=ACC)
            x = x - tl.dot(y, x, input_precision=PREC, out_dtype=ACC)
    return x


@triton.jit
def inverse_by_substitution(a, scratch, BT: tl.constexpr, SUB: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr):
    """`(I + a)^{-1}`, `a` `[BT, BT]` strictly lower triangular; `scratch` holds BT*BT floats."""
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
