"""Decayed products inside one chunk: the only place where gates meet the algebra.

Every gate-dependent product of the chunk algorithm has the form

    x_a^T diag(exp(G_a - G_b)) y_b      for row `a` at or after row `b` in time,

where `G` is the within-chunk cumulative log-gate (`G_a - G_b <= 0`). Three shapes of it
are needed, with `M` a `[RA, BT]` matrix that is already zero outside the causal mask:

    scores       S[a, b] = sum_k xa[a, k] xb[b, k] exp(Ga[a, k] - Gb[b, k])     (masked)
    apply_left   out[a]  = sum_b M[a, b] xb[b] * exp(Ga[a] - Gb[b])               [RA, K]
    apply_right  out[b]  = sum_a M[a, b] xa[a] * exp(Ga[a] - Gb[b])               [BT, K]

Rows `b` are the chunk's sub-steps (`BT` of them, position `b`). Rows `a` are either
sub-steps too or query tokens (query `t` reads after its last sub-step, position
`t*NH + NH - 1`), so a read-out is never formed for the `NH - 1` empty sub-steps.

Numerics (why this file exists). With no gate the products are plain `tl.dot`s; with a
scalar gate the decay is a `[RA, BT]` matrix `exp(Ga - Gb)` applied to one `tl.dot`.
With a channel gate the usual factorization `(xa * exp(Ga)) (xb * exp(-Gb))^T` forms
`exp(-G)`, which overflows float32 once a chunk decays by more than e^88. The exact path
avoids it level by level: a pair with `pos_b < pos_a` is factorized around the middle of
the smallest aligned block holding both (the block of `2w` positions, `w` the highest bit
in which the positions differ), which lies between them in time, so both factors are
`exp(<= 0)`. Each of the `log2(BT)` levels is one tensor-core product of rows decayed from
or to their block's middle, masked to pairs within one block; the pairs at one position
take no decay. Nothing ever evaluates `exp` of a positive number, whatever the gates, so
the channel path is exact for every `g <= 0`, at two `[R, K]` exponentials and two
gathers of gate rows per level. (It replaced pairs within a 16-row sub-chunk formed
element by element: a dependent loop of 16 gathers, `[R, K]` exponentials and row sums.)

The fastest way, taken when the chunk as a whole decays by at most twice a bound in every
channel (`-G_end <= 2 bound`: `chunk_fits`), is the usual factorization itself, around the
midpoint of the chunk's cumulative gate, `mid = G_end / 2` per channel:
`exp(Ga - Gb) = exp(Ga - mid) exp(mid - Gb)`, one tensor-core product per decayed product.
Every row's cumulative gate lies in `[G_end, 0]`, within `bound` of `mid`, so each factor is
within `e^(+-bound)`: neither overflows, and each keeps its relative precision (every term
of the sum is then rounded as in a plain product). Around the chunk's start instead (the
first form of this path, `exp(Ga) exp(-Gb)`) the same bound on a factor admitted half the
decay: the gates of trained KDA layers (`logsigmoid(x)`, about 0.8 nats a token, 52 a
chunk) fell past it in every chunk and took the sub-chunk path, 1.7x the time of this one
(KDA forward+backward 6.40 against 3.84 ms with mild gates, `kernel_times.md`); around the
midpoint every such chunk fits. Gates under 80/64 = 1.25 nats per token on average take
it. The products' entries for pairs outside the causal mask (`b` after `a`) may grow to
`e^(2 bound)` and are discarded by the mask (a select, so even an overflow there would not
leak). Otherwise (decided per program, so one launch mixes the three) the sub-chunk forms
below apply.

The exact path costs `log2(BT)` products and `4 log2(BT)` `[R, K]` gathers and
exponentials. So when every sub-chunk's cumulative gate stays within a bound of its
midpoint in every channel (`ref(s)`, halfway between its first and last sub-steps';
`|ref - G| <= bound`, checked per call over the rows `b` at hand: `_within_bound`), its
inner pairs too are factorized around those midpoints, in three factors:

    exp(Ga - Gb) = exp(Ga - ref(a)) * exp(ref(a) - ref(b)) * exp(ref(b) - Gb)

The outer two are one `[R, K]` exponential each, every row decayed to the midpoint of its
own sub-chunk (within `e^(+-bound)`); the middle one is per channel and pair of
sub-chunks, at most 1 (a later sub-chunk's midpoint is lower), applied to the rows `b`
as a running product over the sub-chunks (one `[K]` exponential and one multiply per
sub-chunk), so each sub-chunk `s` costs one tensor-core product and no `[R, K]`
exponential (the first form of this path took two per sub-chunk: 8 where there are now 2).
`bound` is 40 (e^40 = 2.4e17, far from the float32 and bfloat16 limits of 3e38; each factor
keeps its relative precision) and 8 for float16 operands (max 65504). A sub-chunk whose
gates decay faster than `2 bound / SC` per step falls back to the exact path, decided per
program, so no path ever overflows.

Gathers: the gate at a row's sub-chunk ends or block middle is re-read from memory
(Triton cannot index a register tensor; `p_g` points at the chunk's first token of the
cumulative gate, one row per token: sub-step `b` reads token `b // NH`); those rows are
inputs, cached in L1/L2.

Column blocks: the decay is per channel, so every product is a sum (scores) or a
concatenation (apply_left / apply_right) over columns. The `[R, K]` operands may hold only
the `BK` columns from `k0` (default: all of them from 0); the gathers then read those
columns only, and a kernel can work on a slice of K at a time (`backward_channel.py`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .chunks import chunk_of_program
from .kinds import ALL_CHUNKS, CHANNEL_GATE, NO_GATE, SCALAR_GATE, WITHIN_BOUND

# The factorization bound (module docstring): the most a factor may grow is e^40 with
# bfloat16 and float32 operands (`decay_bound`: e^8 with float16 ones).
DECAY_BOUND = tl.constexpr(40.0)

# Tests only: the CPU interpreter widens bfloat16 operands to float32
# (`recurrence._operand_dtype`: its own bfloat16 products are wrong), so it cannot show
# what rounding the operands of tensor-core products does. With this set (by
# `tests/kernels/half_rounding.py`, around bfloat16 inputs on the interpreter), `mm` and
# `mm_fine` round their operands to bfloat16 as the GPU does, and bfloat16 buffers are
# written rounded to nearest (`stored`). The interpreter reads it at each call; a compiled
# kernel sees False and has no such branch (`compile_report` gives the same registers).
EMULATED_BF16_PRODUCTS = tl.constexpr(False)


@triton.jit
def bf16_rounded(x):
    """float32 `x` rounded to the nearest bfloat16 (ties to even), kept in float32."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def mm(a, b, OP: tl.constexpr, PREC: tl.constexpr, ACC: tl.constexpr):
    """`a @ b` with operands in `OP` (the inputs' dtype for half precision: tensor cores at
    full rate) and accumulation in `ACC` (float32)."""
    if EMULATED_BF16_PRODUCTS:
        return tl.dot(bf16_rounded(a.to(tl.float32)), bf16_rounded(b.to(tl.float32)), input_precision="ieee",
                      out_dtype=ACC)
    else:
        return tl.dot(a.to(OP), b.to(OP), input_precision=PREC, out_dtype=ACC)


@triton.jit
def mm_fine(a, b, OP: tl.constexpr, PREC: tl.constexpr, ACC: tl.constexpr):
    """`a @ b` as `mm`, with `b` (a decayed operand) carried to about 16 bits of mantissa
    when the operands are half precision: `b = hi + lo`, both halves rounded to `OP`, two
    tensor-core products. Why: a channel gate's gradient `dg` sums `q * dq - k * dk ...`
    over the chunk, where each pair of rows adds its decayed product once with each sign;
    `apply_left` and `apply_right` form the two signs from differently decayed operands
    (`k exp(-Gb)` and `q exp(Ga)`), so rounding those to bfloat16 (8 bits) leaves every
    pair's two terms unequal by ~2^-9 of the pair, and the sums of `dg` over tokens (the
    gradients of `A_log` and `dt_bias`), which cancel to a few percent of their terms, were
    5e-2 to 1e-1 off on the H200 (fla's KDA: 3e-3; with this, 2e-3 to 5e-3). `m`, rounded
    once, is the same on both sides and cancels. The cost: a second product per decayed
    product of the backward (KDA forward+backward 1.06x with mild gates, 1.24x strong).
    The interpreter cannot show any of this: it widens bfloat16 operands to float32."""
    if EMULATED_BF16_PRODUCTS:
        a_op = bf16_rounded(a.to(tl.float32))
        hi = bf16_rounded(b.to(tl.float32))
        lo = bf16_rounded(b.to(tl.float32) - hi)
        return tl.dot(a_op, lo, tl.dot(a_op, hi, input_precision="ieee", out_dtype=ACC), input_precision="ieee",
                      out_dtype=ACC)
    elif OP == tl.bfloat16 or OP == tl.float16:
        a_op = a.to(OP)
        hi = b.to(OP)
        lo = (b - hi.to(ACC)).to(OP)
        return tl.dot(a_op, lo, tl.dot(a_op, hi, input_precision=PREC, out_dtype=ACC), input_precision=PREC, out_dtype=ACC)
    else:
        return mm(a, b, OP, PREC, ACC)


@triton.jit
def causal_mask(pos_a, valid_a, pos_b, valid_b, STRICT: tl.constexpr):
    """`[RA, BT]`: the pairs that interact (b before a, or up to a's position)."""
    if STRICT:
        m = pos_b[None, :] < pos_a[:, None]
    else:
        m = pos_b[None, :] <= pos_a[:, None]
    return m & valid_a[:, None] & valid_b[None, :]


@triton.jit
def load_rows(p, rows, ok, stride, offs_k, K: tl.constexpr, ACC: tl.constexpr):
    """Rows `rows[r]` of a `[*, K]` array (zero where not `ok`), as `[R, BK]`."""
    ptrs = p + rows[:, None] * stride + offs_k[None, :]
    return tl.load(ptrs, mask=ok[:, None] & (offs_k[None, :] < K), other=0.0).to(ACC)


@triton.jit
def stored(x, p):
    """`x` in the dtype of the buffer `p` points into. Under the emulation (tests only) a
    bfloat16 buffer's values are rounded to nearest first, as the GPU rounds them: the
    interpreter's own conversion truncates."""
    if EMULATED_BF16_PRODUCTS:
        if p.dtype.element_ty == tl.bfloat16:
            return bf16_rounded(x.to(tl.float32)).to(tl.bfloat16)
        else:
            return x.to(p.dtype.element_ty)
    else:
        return x.to(p.dtype.element_ty)


@triton.jit
def store_rows(p, x, rows, ok, stride, offs_k, K: tl.constexpr):
    """Store `[R, BK]` into rows `rows[r]` of a `[*, K]` array where `ok`."""
    ptrs = p + rows[:, None] * stride + offs_k[None, :]
    tl.store(ptrs, stored(x, p), mask=ok[:, None] & (offs_k[None, :] < K))


@triton.jit
def load_gate(p_g, rows, ok, stride_g, offs_k, GATE: tl.constexpr, K: tl.constexpr, ACC: tl.constexpr):
    """Cumulative log-gate of token rows `rows`: `[R, BK]` (channel), `[R]` (scalar), or 0."""
    if GATE == CHANNEL_GATE:
        return load_rows(p_g, rows, ok, stride_g, offs_k, K, ACC)
    elif GATE == SCALAR_GATE:
        return tl.load(p_g + rows * stride_g, mask=ok, other=0.0).to(ACC)
    else:
        return tl.zeros([rows.shape[0]], dtype=ACC)


@triton.jit
def decay_rows(x, gamma, GATE: tl.constexpr):
    """`x * exp(gamma)` row-wise for a `[R, BK]` block (gamma `[R, BK]`, `[R]`, or none)."""
    if GATE == CHANNEL_GATE:
        return x * tl.exp(gamma)
    elif GATE == SCALAR_GATE:
        return x * tl.exp(gamma)[:, None]
    else:
        return x


@triton.jit
def _ref_gate(p_g, s, n_sub, stride_g, offs_k, SC: tl.constexpr, NH: tl.constexpr, K: tl.constexpr, ACC: tl.constexpr):
    """Sub-chunk `s`'s reference: the midpoint of its cumulative gate, halfway between its
    first and last sub-steps' (their tokens' rows); 0 for an empty sub-chunk."""
    first = s * SC
    last = tl.minimum(first + SC, n_sub) - 1
    ok = (offs_k < K) & (first < n_sub)
    g_first = tl.load(p_g + (first // NH) * stride_g + offs_k, mask=ok, other=0.0).to(ACC)
    g_last = tl.load(p_g + (last // NH) * stride_g + offs_k, mask=ok, other=0.0).to(ACC)
    return 0.5 * (g_first + g_last)


@triton.jit
def _sub_refs(p_g, pos, valid, n_sub, stride_g, offs_k, SC: tl.constexpr, NH: tl.constexpr, K: tl.constexpr,
              ACC: tl.constexpr):
    """`[R, BK]`: for each row at sub-step `pos`, its sub-chunk's reference (`_ref_gate`,
    the same arithmetic; two gathers, cached: the chunk's gate rows are inputs)."""
    first = (pos // SC) * SC
    last = tl.minimum(first + SC, n_sub) - 1
    g_first = load_rows(p_g, first // NH, valid, stride_g, offs_k, K, ACC)
    g_last = load_rows(p_g, last // NH, valid, stride_g, offs_k, K, ACC)
    return 0.5 * (g_first + g_last)


@triton.jit
def decay_bound(OP: tl.constexpr):
    """The most a factor may grow: `e^bound` (float16 operands: e^8, their max is 65504)."""
    return min(8.0, DECAY_BOUND) if OP == tl.float16 else DECAY_BOUND


@triton.jit
def chunk_fits(g_end, OP: tl.constexpr):
    """Whether a chunk whose cumulative gate ends at `g_end` (`[BK]`, its last row) may be
    factorized around its midpoint (module docstring, path 1): it decays by at most twice
    the bound in every channel. The cumulative gate only falls, so the last row decides."""
    return tl.max(-g_end, 0) <= 2 * decay_bound(OP)


@triton.jit
def chunk_end_gate(p_g, n_sub, stride_g, offs_k, NH: tl.constexpr, K: tl.constexpr, ACC: tl.constexpr):
    """The cumulative gate at the chunk's last sub-step (its token's row) on the channels
    `offs_k`: the chunk's least, since the cumulative gate never rises (`g <= 0`)."""
    return tl.load(p_g + ((n_sub - 1) // NH) * stride_g + offs_k, mask=offs_k < K, other=0.0).to(ACC)


@triton.jit
def _chunk_mid(p_g, n_sub, stride_g, k0, NH: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, ACC: tl.constexpr):
    """`[BK]`: path 1's reference, half the chunk's cumulative gate at its last sub-step (the
    row of that sub-step's token), per channel of the slice `k0 .. k0 + BK`. Every row of the
    chunk lies in `[G_end, 0]`, so any rows at hand keep both factors within `e^bound` when the
    chunk fits. A load of the row (cached: the gate rows are inputs), so every call of a
    chunk, whatever rows it holds, takes the same reference and the same path as the launch
    that `runs_in_pass` chose for it."""
    return 0.5 * chunk_end_gate(p_g, n_sub, stride_g, k0 + tl.arange(0, BK), NH, K, ACC)


@triton.jit
def mid_decay(x, g, mid, valid):
    """`x * exp(g - mid)` for `[R, BK]` rows `x`, `g` and a per-channel reference `mid`
    (`[BK]`); rows not `valid` give 0. Path 1 decays rows `a` with `(ga, mid)` and rows `b`
    with `(-gb, -mid)`: each factor within `e^bound` when the chunk fits (`chunk_fits`)."""
    return x * tl.exp(tl.where(valid[:, None], g - mid[None, :], float("-inf")))


@triton.jit
def runs_in_pass(p_g, n_sub, stride_g, NH: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, GATE: tl.constexpr,
                 CHANNEL_PASS: tl.constexpr, OP: tl.constexpr, ACC: tl.constexpr):
    """Whether a chunk is this launch's: a channel-gate kernel runs in two passes
    (`kinds.ChannelPass`), first the chunks that fit path 1 (`chunk_fits`;
    `CHUNK_ONLY` products: few registers), then the others (every path); without
    a channel gate every chunk is the one launch's. The cumulative gate never rises
    (`g <= 0`), so the chunk's last row decides."""
    if GATE == CHANNEL_GATE and CHANNEL_PASS != ALL_CHUNKS:
        g_end = chunk_end_gate(p_g, n_sub, stride_g, tl.arange(0, BK), NH, K, ACC)
        return chunk_fits(g_end, OP) == (CHANNEL_PASS == WITHIN_BOUND)
    else:
        return True


@triton.jit
def chunk_in_pass(G, i_chunk, i_h, T, NT, cu_seqlens, chunk_table, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                  TC: tl.constexpr, NH: tl.constexpr, GATE: tl.constexpr, CHANNEL_PASS: tl.constexpr,
                  IS_VARLEN: tl.constexpr, OP: tl.constexpr, ACC: tl.constexpr):
    """`(tok0, n_tok, runs)` of a chunk-parallel program: its chunk's first token and number
    of tokens, and whether the chunk is this launch's (`runs_in_pass`)."""
    _, bos, seq_len, c = chunk_of_program(i_chunk, T, NT, cu_seqlens, chunk_table, IS_VARLEN)
    tok0 = bos + c * TC
    n_tok = tl.minimum(TC, seq_len - c * TC)
    stride_g = H * K if GATE == CHANNEL_GATE else H
    p_g = G + tok0 * stride_g + (i_h * K if GATE == CHANNEL_GATE else i_h)
    return tok0, n_tok, runs_in_pass(p_g, n_tok * NH, stride_g, NH, K, BK, GATE, CHANNEL_PASS, OP, ACC)


@triton.jit
def _within_bound(ref_b, gb, valid_b, OP: tl.constexpr):
    """Whether every sub-chunk may be factorized around its midpoint (module docstring,
    path 2): `|ref(b) - G_b| <= bound` for every valid row `b`. Every row of a sub-chunk,
    query rows included, has its cumulative gate between the sub-chunk's first and last
    sub-steps', so the rows `b` decide for the rows `a` too."""
    spread = tl.max(tl.max(tl.where(valid_b[:, None], tl.abs(ref_b - gb), 0.0), 1), 0)
    return spread <= decay_bound(OP)


@triton.jit
def _step_decay(p_g, s_from, s_to, n_sub, stride_g, offs_k, SC: tl.constexpr, NH: tl.constexpr, K: tl.constexpr,
                ACC: tl.constexpr):
    """`exp(ref(s_to) - ref(s_from))` per channel for sub-chunks `s_from <= s_to`: at most 1
    (the cumulative gate never grows, so neither do the midpoints; an empty sub-chunk reads
    0, clamped)."""
    a = _ref_gate(p_g, s_from, n_sub, stride_g, offs_k, SC, NH, K, ACC)
    b = _ref_gate(p_g, s_to, n_sub, stride_g, offs_k, SC, NH, K, ACC)
    return tl.exp(tl.minimum(b - a, 0.0))


@triton.jit
def _level_rows(p_g, pos, valid, n_sub, stride_g, offs_k, w, UPPER: tl.constexpr,
                NH: tl.constexpr, K: tl.constexpr, ACC: tl.constexpr):
    """Level `w` of the exact path (module docstring): `(rows, block, g_mid)`, the rows in
    the upper (`UPPER`) or lower half of their `2w`-block, that block, and the cumulative
    gate at its middle (the block's `w`-th position: between every lower row and every upper
    one in time). A lower row whose block has no middle among the chunk's sub-steps has no
    partner and is left out (its factor would read a gate of 0)."""
    block = pos // (2 * w)
    mid = block * (2 * w) + w
    if UPPER:
        rows = ((pos // w) % 2 == 1) & valid
    else:
        rows = ((pos // w) % 2 == 0) & valid & (mid < n_sub)
    return rows, block, load_rows(p_g, mid // NH, rows, stride_g, offs_k, K, ACC)


@triton.jit
def _level_factors(xa, ga, pos_a, valid_a, xb, gb, pos_b, valid_b, p_g, stride_g, n_sub, offs_k, w,
                   NH: tl.constexpr, K: tl.constexpr, ACC: tl.constexpr):
    """`(fa, fb, same)` of level `w`: rows `a` decayed from their block's middle
    (`exp(Ga - G_mid) <= 1`), rows `b` decayed to it (`exp(G_mid - Gb) <= 1`), zero outside
    the upper and lower halves, and `same[a, b]`: the pair shares a block. Every pair with
    `pos_b < pos_a` is at exactly one level, that of the highest bit in which the two
    positions differ, so the levels and the diagonal (`pos_a == pos_b`) cover each causal
    pair once, each as one product."""
    up, block_a, mid_a = _level_rows(p_g, pos_a, valid_a, n_sub, stride_g, offs_k, w, True, NH, K, ACC)
    low, block_b, mid_b = _level_rows(p_g, pos_b, valid_b, n_sub, stride_g, offs_k, w, False, NH, K, ACC)
    fa = xa * tl.exp(tl.where(up[:, None], ga - mid_a, float("-inf")))
    fb = xb * tl.exp(tl.where(low[:, None], mid_b - gb, float("-inf")))
    return fa, fb, block_a[:, None] == block_b[None, :]


@triton.jit
def _sub_chunk_scores(
    xa, ga, pos_a, valid_a, xb, gb, pos_b, valid_b, p_g, stride_g, n_sub,
    STRICT: tl.constexpr, NH: tl.constexpr, BT: tl.constexpr, SC: tl.constexpr,
    K: tl.constexpr, BK: tl.constexpr, ACC: tl.constexpr, OP: tl.constexpr, PREC: tl.constexpr, k0,
):
    """`scores` of a chunk that does not fit path 1: per sub-chunk (unmasked)."""
    offs_k = k0 + tl.arange(0, BK)
    ref_b = _sub_refs(p_g, pos_b, valid_b, n_sub, stride_g, offs_k, SC, NH, K, ACC)
    out = tl.zeros([xa.shape[0], BT], dtype=ACC)
    if _within_bound(ref_b, gb, valid_b, OP):
        # exp(Ga - Gb) = exp(Ga - ref(a)) exp(ref(a) - ref(b)) exp(ref(b) - Gb): each row
        # decayed once to its sub-chunk's midpoint, and the middle factor (per sub-chunk
        # pair and channel) applied to the rows b as a running product over sub-chunks
        fa = xa * tl.exp(tl.where(valid_a[:, None], ga - _sub_refs(p_g, pos_a, valid_a, n_sub, stride_g, offs_k, SC, NH, K, ACC),
                                  float("-inf")))
        fb = xb * tl.exp(tl.where(valid_b[:, None], ref_b - gb, float("-inf")))
        carry = tl.zeros([BT, BK], dtype=ACC)  # rows b of sub-chunks <= s, decayed to s's midpoint
        for s in tl.static_range(0, BT // SC):
            if s > 0:
                carry = carry * _step_decay(p_g, s - 1, s, n_sub, stride_g, offs_k, SC, NH, K, ACC)[None, :]
            carry = tl.where(((pos_b // SC) == s)[:, None], fb, carry)
            out += tl.where(((pos_a // SC) == s)[:, None], mm(fa, tl.trans(carry), OP, PREC, ACC), 0.0)
    else:
        # level by level (`_level_factors`): one product each, every factor exp(<= 0)
        w = BT // 2
        while w >= 1:  # a loop, not unrolled: one level's tiles live at a time
            fa, fb, same = _level_factors(xa, ga, pos_a, valid_a, xb, gb, pos_b, valid_b, p_g, stride_g, n_sub,
                                          offs_k, w, NH, K, ACC)
            out += tl.where(same, mm(fa, tl.trans(fb), OP, PREC, ACC), 0.0)
            w = w // 2
        if not STRICT:  # the pairs at one position: no decay
            out += tl.where(pos_a[:, None] == pos_b[None, :], mm(xa, tl.trans(xb), OP, PREC, ACC), 0.0)
    return out


@triton.jit
def _sub_chunk_left(
    m, xb, ga, pos_a, valid_a, gb, pos_b, valid_b, p_g, stride_g, n_sub,
    NH: tl.constexpr, BT: tl.constexpr, SC: tl.constexpr,
    K: tl.constexpr, BK: tl.constexpr, ACC: tl.constexpr, OP: tl.constexpr, PREC: tl.constexpr, k0,
):
    """`apply_left` of a chunk that does not fit path 1: per sub-chunk."""
    offs_k = k0 + tl.arange(0, BK)
    ref_b = _sub_refs(p_g, pos_b, valid_b, n_sub, stride_g, offs_k, SC, NH, K, ACC)
    out = tl.zeros([m.shape[0], BK], dtype=ACC)
    if _within_bound(ref_b, gb, valid_b, OP):  # as in `scores`
        fb = xb * tl.exp(tl.where(valid_b[:, None], ref_b - gb, float("-inf")))
        carry = tl.zeros([BT, BK], dtype=ACC)
        for s in tl.static_range(0, BT // SC):
            if s > 0:
                carry = carry * _step_decay(p_g, s - 1, s, n_sub, stride_g, offs_k, SC, NH, K, ACC)[None, :]
            carry = tl.where(((pos_b // SC) == s)[:, None], fb, carry)
            out += tl.where(((pos_a // SC) == s)[:, None], mm_fine(m, carry, OP, PREC, ACC), 0.0)
        out = out * tl.exp(tl.where(valid_a[:, None], ga - _sub_refs(p_g, pos_a, valid_a, n_sub, stride_g, offs_k, SC, NH, K, ACC),
                                    float("-inf")))
    else:  # level by level, as in `scores`: rows a take their factor after the product
        ones = tl.full([m.shape[0], BK], 1.0, dtype=ACC)
        w = BT // 2
        while w >= 1:
            fa, fb, same = _level_factors(ones, ga, pos_a, valid_a, xb, gb, pos_b, valid_b, p_g, stride_g, n_sub,
                                          offs_k, w, NH, K, ACC)
            out += fa * mm_fine(tl.where(same, m, 0.0), fb, OP, PREC, ACC)
            w = w // 2
        out += mm_fine(tl.where(pos_a[:, None] == pos_b[None, :], m, 0.0), xb, OP, PREC, ACC)
    return out


@triton.jit
def _sub_chunk_right(
    m, xa, ga, pos_a, valid_a, gb, pos_b, valid_b, p_g, stride_g, n_sub,
    NH: tl.constexpr, BT: tl.constexpr, SC: tl.constexpr,
    K: tl.constexpr, BK: tl.constexpr, ACC: tl.constexpr, OP: tl.constexpr, PREC: tl.constexpr, k0,
):
    """`apply_right` of a chunk that does not fit path 1: per sub-chunk."""
    offs_k = k0 + tl.arange(0, BK)
    ref_b = _sub_refs(p_g, pos_b, valid_b, n_sub, stride_g, offs_k, SC, NH, K, ACC)
    out = tl.zeros([BT, BK], dtype=ACC)
    if _within_bound(ref_b, gb, valid_b, OP):  # as in `scores`, the running product backwards in time
        fa = xa * tl.exp(tl.where(valid_a[:, None], ga - _sub_refs(p_g, pos_a, valid_a, n_sub, stride_g, offs_k, SC, NH, K, ACC),
                                  float("-inf")))
        carry = tl.zeros([m.shape[0], BK], dtype=ACC)  # rows a of sub-chunks >= t, decayed to t's midpoint
        for i in tl.static_range(0, BT // SC):
            t = BT // SC - 1 - i
            if i > 0:
                carry = carry * _step_decay(p_g, t, t + 1, n_sub, stride_g, offs_k, SC, NH, K, ACC)[None, :]
            carry = tl.where(((pos_a // SC) == t)[:, None], fa, carry)
            out += tl.where(((pos_b // SC) == t)[:, None], mm_fine(tl.trans(m), carry, OP, PREC, ACC), 0.0)
        out = out * tl.exp(tl.where(valid_b[:, None], ref_b - gb, float("-inf")))
    else:  # level by level, as in `scores`: rows b take their factor after the product
        ones = tl.full([BT, BK], 1.0, dtype=ACC)
        w = BT // 2
        while w >= 1:
            fa, fb, same = _level_factors(xa, ga, pos_a, valid_a, ones, gb, pos_b, valid_b, p_g, stride_g, n_sub,
                                          offs_k, w, NH, K, ACC)
            out += fb * mm_fine(tl.trans(tl.where(same, m, 0.0)), fa, OP, PREC, ACC)
            w = w // 2
        out += mm_fine(tl.trans(tl.where(pos_a[:, None] == pos_b[None, :], m, 0.0)), xa, OP, PREC, ACC)
    return out


@triton.jit
def scores(
    xa, ga, pos_a, valid_a, xb, gb, pos_b, valid_b, p_g, stride_g, n_sub,
    STRICT: tl.constexpr, GATE: tl.constexpr, NH: tl.constexpr, BT: tl.constexpr, SC: tl.constexpr,
    K: tl.constexpr, BK: tl.constexpr, ACC: tl.constexpr, OP: tl.constexpr, PREC: tl.constexpr, k0=0,
    CHUNK_ONLY: tl.constexpr = False,
):
    """`S[a, b] = xa_a^T diag(exp(Ga_a - Gb_b)) xb_b` on the causal pairs, 0 elsewhere
    (the part of the sum over columns `k0 .. k0 + BK` when `xa`, `xb` hold those only).
    `CHUNK_ONLY`: the caller knows the chunk fits path 1 (no slower paths compiled)."""
    mask = causal_mask(pos_a, valid_a, pos_b, valid_b, STRICT)
    if GATE == NO_GATE:
        return tl.where(mask, mm(xa, tl.trans(xb), OP, PREC, ACC), 0.0)
    elif GATE == SCALAR_GATE:
        decay = tl.exp(tl.where(mask, ga[:, None] - gb[None, :], float("-inf")))
        return mm(xa, tl.trans(xb), OP, PREC, ACC) * decay
    else:
        mid = _chunk_mid(p_g, n_sub, stride_g, k0, NH, K, BK, ACC)
        if CHUNK_ONLY:  # noqa: SIM114 (a constexpr branch: the other paths are not compiled)
            out = mm(mid_decay(xa, ga, mid, valid_a), tl.trans(mid_decay(xb, -gb, -mid, valid_b)), OP, PREC, ACC)
        elif chunk_fits(2 * mid, OP):  # exp(Ga - Gb) = exp(Ga - mid) exp(mid - Gb): one product
            out = mm(mid_decay(xa, ga, mid, valid_a), tl.trans(mid_decay(xb, -gb, -mid, valid_b)), OP, PREC, ACC)
        else:
            out = _sub_chunk_scores(xa, ga, pos_a, valid_a, xb, gb, pos_b, valid_b, p_g, stride_g, n_sub,
                                    STRICT, NH, BT, SC, K, BK, ACC, OP, PREC, k0)
        return tl.where(mask, out, 0.0)


@triton.jit
def apply_left(
    m, xb, ga, pos_a, valid_a, gb, pos_b, valid_b, p_g, stride_g, n_sub,
    GATE: tl.constexpr, NH: tl.constexpr, BT: tl.constexpr, SC: tl.constexpr,
    K: tl.constexpr, BK: tl.constexpr, ACC: tl.constexpr, OP: tl.constexpr, PREC: tl.constexpr, k0=0,
    CHUNK_ONLY: tl.constexpr = False,
):
    """`out[a] = sum_b m[a, b] exp(Ga_a - Gb_b) * xb[b]` (`m` zero outside the causal pairs)."""
    if GATE == NO_GATE:
        return mm(m, xb, OP, PREC, ACC)
    elif GATE == SCALAR_GATE:
        mask = causal_mask(pos_a, valid_a, pos_b, valid_b, False)
        decay = tl.exp(tl.where(mask, ga[:, None] - gb[None, :], float("-inf")))
        return mm(m * decay, xb, OP, PREC, ACC)
    else:  # as in `scores` (one assignment per branch: Triton returns once, after a runtime branch)
        mid = _chunk_mid(p_g, n_sub, stride_g, k0, NH, K, BK, ACC)
        if CHUNK_ONLY:  # noqa: SIM114 (a constexpr branch: the other paths are not compiled)
            out = mid_decay(mm_fine(m, mid_decay(xb, -gb, -mid, valid_b), OP, PREC, ACC), ga, mid, valid_a)
        elif chunk_fits(2 * mid, OP):
            out = mid_decay(mm_fine(m, mid_decay(xb, -gb, -mid, valid_b), OP, PREC, ACC), ga, mid, valid_a)
        else:
            out = _sub_chunk_left(m, xb, ga, pos_a, valid_a, gb, pos_b, valid_b, p_g, stride_g, n_sub,
                                  NH, BT, SC, K, BK, ACC, OP, PREC, k0)
        return out


@triton.jit
def apply_right(
    m, xa, ga, pos_a, valid_a, gb, pos_b, valid_b, p_g, stride_g, n_sub,
    GATE: tl.constexpr, NH: tl.constexpr, BT: tl.constexpr, SC: tl.constexpr,
    K: tl.constexpr, BK: tl.constexpr, ACC: tl.constexpr, OP: tl.constexpr, PREC: tl.constexpr, k0=0,
    CHUNK_ONLY: tl.constexpr = False,
):
    """`out[b] = sum_a m[a, b] exp(Ga_a - Gb_b) * xa[a]` (`m` zero outside the causal pairs;
    rows `a` are sub-steps or query tokens, placed by `pos_a`)."""
    if GATE == NO_GATE:
        return mm(tl.trans(m), xa, OP, PREC, ACC)
    elif GATE == SCALAR_GATE:
        mask = causal_mask(pos_a, valid_a, pos_b, valid_b, False)
        decay = tl.exp(tl.where(mask, ga[:, None] - gb[None, :], float("-inf")))
        return mm(tl.trans(m * decay), xa, OP, PREC, ACC)
    else:  # as in `scores`
        mid = _chunk_mid(p_g, n_sub, stride_g, k0, NH, K, BK, ACC)
        if CHUNK_ONLY:  # noqa: SIM114 (a constexpr branch: the other paths are not compiled)
            out = mid_decay(mm_fine(tl.trans(m), mid_decay(xa, ga, mid, valid_a), OP, PREC, ACC), -gb, -mid, valid_b)
        elif chunk_fits(2 * mid, OP):
            out = mid_decay(mm_fine(tl.trans(m), mid_decay(xa, ga, mid, valid_a), OP, PREC, ACC), -gb, -mid, valid_b)
        else:
            out = _sub_chunk_right(m, xa, ga, pos_a, valid_a, gb, pos_b, valid_b, p_g, stride_g, n_sub,
                                   NH, BT, SC, K, BK, ACC, OP, PREC, k0)
        return out
