"""`(I + A)^{-1}` for a strictly lower-triangular `A`: the UT transform's triangular solve.

The result is written to `out` (the chunk's `BT x BT` float32 slot of `Tinv`), which the
solve also uses as its scratch area: Triton cannot slice a register tensor into blocks, so
blocks pass through memory (L1/L2-resident).

**Block substitution.** The matrix is cut into `SUB x SUB` blocks (`SUB` = 16,
`NB = BT / SUB` per side):

1. each diagonal block is inverted by forward substitution (row `i` of the inverse is
   `e_i - sum_{j<i} A[i, j] inv[j]`), all blocks at once as a `[NB, SUB, SUB]` tensor,
   row `i` of `A` read from memory at each step, so a step is one reduction;
2. the blocks below the diagonal by block forward substitution, one block row after the
   other: `X_ij = -D_i sum_{j <= k < i} A_ik X_kj` (`D_i` the inverted diagonal block),
   `NB (NB - 1) (NB + 4) / 6` products of `SUB x SUB` tiles (16 for `NB = 4`), each
   block written in place over `A_ij` once the row's earlier blocks no longer need it.

Its live tiles are `SUB x SUB` (two registers per thread at four warps), so the kernel
stays small and several programs share an SM. The earlier merge formed the same result
as the finite series `(I - N + N^2 - ...) D` on whole `BT x BT` tiles (`N = D A_off`):
four float32 `[64, 64]` tiles alive at once, about 215 registers per thread at four warps.
On the H200 the old one-kernel `prepare` (this merge inside) took 1.16 ms for DeltaNet
(B=4 T=4096 H=16): 154 barriers per program at one program per SM.

Each entry is formed from bounded inverse blocks and entries of `A`, never from powers of
`A`: the Neumann series `sum (-A)^m` is exact in exact arithmetic but sums terms of order
`2^m` to an inverse of order 1 when beta nears 2 (every factor a reflection). In float32
the relative error is 1e-6 at beta near 2 and key correlation 0.999 (measured on the
interpreter against float64).

Products run at `PREC` ("tf32x3" on GPUs: float32-accurate; the inverse's entries grow
when beta nears 2 and its errors feed every later product).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def unit_lower_inverse(a, out, BT: tl.constexpr, SUB: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr):
    """Write `(I + a)^{-1}` for `a` `[BT, BT]` strictly lower triangular to `out` (BT*BT
    floats, row-major), by block forward substitution (module docstring)."""
    NB: tl.constexpr = BT // SUB
    rows = tl.arange(0, BT)
    tl.store(out + rows[:, None] * BT + rows[None, :], a.to(out.dtype.element_ty))  # upper blocks: 0, final
    tl.debug_barrier()
    # 1. the diagonal blocks, [NB, SUB, SUB], by forward substitution
    blk = tl.arange(0, NB)[:, None, None]
    ri = tl.arange(0, SUB)[None, :, None]
    cj = tl.arange(0, SUB)[None, None, :]
    p_diag = out + (blk * SUB) * BT + blk * SUB  # [NB, 1, 1]: each diagonal block's corner
    inv = tl.zeros([NB, SUB, SUB], dtype=ACC)
    for i in range(SUB):  # a loop, not unrolled: unrolled, all 16 row loads were hoisted (more registers)
        a_i = tl.load(p_diag + i * BT + ri).to(ACC)  # row i of each block, along axis 1: [NB, SUB, 1]
        row = tl.where(cj == i, 1.0, 0.0).to(ACC) - tl.sum(a_i * inv, 1)[:, None, :]
        inv = tl.where(ri == i, row, inv)
    tl.debug_barrier()  # every read of A's diagonal blocks is done
    tl.store(p_diag + ri * BT + cj, inv.to(out.dtype.element_ty))
    # 2. the blocks below the diagonal, block row by block row, in place over A
    r = tl.arange(0, SUB)[:, None]
    c = tl.arange(0, SUB)[None, :]
    for i in tl.static_range(1, NB):
        tl.debug_barrier()  # block rows before i are final
        d_i = tl.load(out + (i * SUB + r) * BT + i * SUB + c).to(ACC)
        for j in tl.static_range(0, i):
            acc = tl.zeros([SUB, SUB], dtype=ACC)
            for kb in tl.static_range(j, i):
                a_ik = tl.load(out + (i * SUB + r) * BT + kb * SUB + c).to(ACC)
                x_kj = tl.load(out + (kb * SUB + r) * BT + j * SUB + c).to(ACC)
                acc += tl.dot(a_ik, x_kj, input_precision=PREC, out_dtype=ACC)
            x_ij = -tl.dot(d_i, acc, input_precision=PREC, out_dtype=ACC)
            tl.debug_barrier()  # no thread still reads A_ij (this row's later blocks need only A_ik, k > j)
            tl.store(out + (i * SUB + r) * BT + j * SUB + c, x_ij.to(out.dtype.element_ty))
