"""The chunked PyTorch backend (`backend="torch"`): the recurrence in WY/UT form.

Plain PyTorch, differentiable, on any device. It computes exactly `RECURRENCE.md` (the
naive loop in `naive.py` is the definition it is tested against) and is the readable
reference of the chunk algorithm that the Triton kernel implements. Two parts have an
explicit backward (`torch.autograd.Function`) because autograd's is several times slower
there: the chunk-to-chunk state chain (`_StateChain`) and the channel-gate scores
(`decay_scores._DyadicScores`); the rest is ordinary autograd.

Without autograd (no input requires a gradient, or grad mode is off: inference) the
same matmuls run with less
memory traffic, since nothing need be kept for a backward (the no-grad forward of every
path is tested against the naive loop too):

  - the chain does each chunk's read-out, independent writes and state update from one
    current state (`_chain_without_grad`), so no `[chunks, K, V]` tensor is written;
  - with a channel gate, the dyadic scores hand back the operands decayed from the
    chunk's start (`q Gamma_q`, `k Gamma`) and to its end (`Z_end`, `Z'_end`) and the
    chunk's decay (`decay_scores.Ends`: one more in-place doubling of their running
    products) in place of `exp2(G)`, `exp2(G_L - G)` and the products with them, `G`
    itself is not formed, and the keys are read as views of the input layout
    (`_chunk_view`), not copied into chunks;
  - RWKV-7 with a channel gate and `n_h == 1` (`_rwkv7_chain_without_grad`): the
    read-out and the removal keys are rows of one interleaved matrix (`Ends.stacked_rows`),
    so `[q Gamma_q; k Gamma] S_0` is one matmul per chunk, `[M_qw; A_kw] U` one batched
    matmul (`Ends.stacked_scores`, as the chain's base), and `T = (I + A_ka)^{-1}` is applied
    in the chain to `r = k Gamma S_0 + A_kw U` (`nu = -T r`), so `P = T (k Gamma)` and
    `T A_kw` are never formed.

On one CPU thread (T=512, B=2, H=4, K=V=64) these, with the dyadic scores' running
products (`decay_scores.py`) and the right-side triangular solve (`_unit_lower_inverse`),
take the forwards of KDA, RWKV-7 and GLA from 5.2, 7.3 and 3.6 ms to about 3.9, 4.9 and
2.4 ms, and the delta paths without a channel gate 10-25% down. RWKV-7's forward then
spends about 2.1 ms in the chain (matmuls at MKL's 85-90 GFLOP/s for these small shapes)
and 1.8 ms in the dyadic scores.

One generalized form serves every path
--------------------------------------
Every sub-step `i` of the expanded sequence (length `T*n_h`) is

    S_i = (I - a_i k_i^T) D_i S_{i-1} + w_i u_i^T

with `D_i = diag(exp(g_t))` at the first sub-step of token `t` (`i = t*n_h`) and `I`
elsewhere, `w_i` the write key (`write_key` or `k`), and

    householder (beta, no erase):  a_i = beta_i w_i,  u_i = beta_i v_i
    rwkv7       (erase):           a_i = erase_i,     u_i = b_i v_i  (b = beta or 1)
    diagonal    (neither):         a_i = 0,           u_i = v_i

Inside a chunk of `L` sub-steps, with the within-chunk cumulative log-gate `G_i` (per
key channel, or scalar) and `Gamma_i = diag(exp(G_i))`, unrolling from the chunk's start
state `S_0` gives

    S_i = Gamma_i S_0 + sum_{j<=i} exp(G_i - G_j) (a_j y_j^T + w_j u_j^T)
    y_j = -(D_j S_{j-1})^T k_j                    (what the erase removes)

and stacking the `y_j` as rows of `Y` turns their sequential dependence into one unit
lower-triangular solve (the UT transform):

    (I + A_ka) Y = -(k * Gamma) S_0 - A_kw U,
    A_ka[j, m] = k_j^T diag(exp(G_j - G_m)) a_m  (likewise A_kw with w),  for m < j,

so `Y = -Tk S_0 - Tu` with `[Tk | Tu] = (I + A_ka)^{-1} [k * Gamma | A_kw U]`; the unit
lower-triangular inverse is formed explicitly (one solve against the identity), which on
CPU is several times faster than a solve against the `K + V` right-hand sides.

The chunk therefore writes the state with keys `Z` and values `nu = N - P S_0` that depend
on its start state, plus (rwkv7 only) writes `Z'`, `N'` that do not:

    diagonal:     (none)                                      Z' = w,  N' = U
    rwkv7:        Z = a,  N = -Tu,  P = Tk                    Z' = w,  N' = U
    householder:  Z = w,  N = T U,  P = T (beta * k * Gamma), T = (I + diag(beta) A_kw)^{-1}

For householder `a = beta w` folds the erase into the write: the value written with
`w_j` is `u_j + beta_j y_j`, and the push-through identity
`(I + A D)^{-1} A = A (I + D A)^{-1}` (with `D = diag(beta)`, `A_ka = A_kw D`) turns
`U - D (Tk S_0 + Tu)` into `T (U - D (k * Gamma) S_0)`: one inverse with beta on the rows,
as in flash-linear-attention's DeltaNet (its `w` and `u` are `P` and `N` here).

The only sequential part is then, chunk after chunk (the `chunk_delta_h` loop of
flash-linear-attention, in these terms; `_StateChain`):

    nu  = N - P S_0                                  ("v_new")
    S_L = Gamma_L S_0 + Z_end^T nu + Z'_end^T N'     (Z'_end^T N' batched before the loop)
    o   = (q * Gamma_q) S_0 + M_qz nu + M_qz' N'      (computed after the loop, batched)

(`q` carries the read-out scale.) With autograd the batched parts are batched over all
chunks and the chain keeps every chunk's start state for its backward; without it
(inference, the benchmark's forward) `_chain_without_grad` does all three lines chunk by
chunk from one current state, so that no `[chunks, K, V]` tensor is written (5-8% of the
forward at T=512, K=V=64 on CPU: the working set stays in cache).

where `Z_end = Z * exp(G_L - G)` carries each write to the chunk's end and
`M_qz[t, j] = q_t^T diag(exp(G_p - G_j)) z_j` for `j <= p`, with `p = t*n_h + n_h - 1`
the token's last sub-step: the query is read only there, the `n_h - 1` empty read-outs
are never formed.

Numerical safety: every decay factor is `exp(G_r - G_c)` with `r` at or after `c`, so
its exponent is <= 0; `exp(+large)` is never formed (see `decay_scores.py` for the
score matrices; `k * Gamma`, `q * Gamma_q` and `Z_end` only decay). Strong channel
decays over long chunks stay finite.

Chunk size
----------
Chunks hold whole tokens: `chunking.torch_tokens_per_chunk(n_h, delta=...)` is the largest
power of two with `tokens * n_h <= TORCH_DELTA_CHUNK_SIZE` (16, with a delta rule) or
`TORCH_CHUNK_SIZE` (32, without), at least 1, so `L = tokens * n_h` sub-steps; the power of two is what the
dyadic channel-gate scores need. The state chain and the read-out of `S_0` cost about
`3 K V` multiply-adds per sub-step whatever `L`; the parallel part grows like
`L (K + V)` per sub-step, while short chunks mean more sequential Python steps. With a
delta rule the parallel part also holds the triangular inverse, whose batched LAPACK
solve costs per matrix rather than per multiply-add (left-side solve 32x32: ~3.6 us,
16x16: ~0.9 us on the development CPU; the right-side solve now used: ~1.6 and ~0.4 us),
so 16 sub-steps measure 10-20% faster than 32 for every delta path at head size 64
(T=512, one thread), and 8 no better than 16. Without one (GLA-like), 32 and 16 now measure the same (fewer chain steps against
fewer dyadic levels); 32 stays.

Matmuls per chunk (per batch row and head; `Ct` tokens, `L = Ct n_h` sub-steps)
-------------------------------------------------------------------------------
  - `M_qw = q w^T` (decayed, visible part)     [Ct,K]@[K,L]       (rwkv7: also `M_qa`)
  - read-out `(q Gamma_q) S_0`                 [Ct,K]@[K,V]
With a delta rule (householder, rwkv7):
  - `A_kw = k w^T` (strictly lower)            [L,K]@[K,L]        (rwkv7: also `A_ka = k a^T`)
  - `(I + A_ka)^{-1}`                          about L^3/6 multiply-adds (`solve_triangular`
                                               against the identity: FlopCounterMode does not see it)
  - `P`, `N`                                   [L,L]@[L,K], [L,L]@[L,V]   (rwkv7: also `T A_kw`
                                               [L,L]@[L,L], then `N = (T A_kw) U`; without
                                               autograd, channel gate, n_h = 1: neither, but
                                               `[M_qw; A_kw] U` [2L,L]@[L,V] once, and per chunk
                                               `[q; k] S_0` [2L,K]@[K,V] and `T r` [L,L]@[L,V]
                                               in place of `P S_0`, the read-out of `S_0` and
                                               `M_qz' N'`: `_rwkv7_chain_without_grad`)
  - state chain `P S_0`, `Z_end^T nu`          [L,K]@[K,V], [K,L]@[L,V]   (sequential)
  - read-out `M_qz nu`                         [Ct,L]@[L,V]
Independent writes (diagonal, rwkv7):
  - `Z'_end^T N'`, `M_qz' N'`                  [K,L]@[L,V], [Ct,L]@[L,V]
Gates add no matmul for none/scalar (the score matrices are dense matmuls masked after);
with a channel gate each score matrix is built by dyadic splitting (`decay_scores.py`):
`log2(Ct)` batched matmuls, about half the dense product's multiply-adds.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any
import itertools

import torch
from torch.autograd.function import once_differentiable

from .api import register_backend
from .chunking import torch_tokens_per_chunk
from .kinds import Gate
from .decay_scores import score_matrices, score_matrices_and_ends
from .naive import accumulation_dtype
from .osdn_scan import osdn_write_keys_scan
from .packed import host_offsets

Tensor = torch.Tensor


# Cumulative log-gates are kept in log2 units and decays formed with `torch.exp2`: on CPU
# torch's exp2 is vectorized and about 5x faster than its exp (which dominated the channel
# gate's elementwise work). `exp(x) = exp2(x * LOG2_E)`, exponents stay <= 0.
LOG2_E = 1.4426950408889634


# ---------------------------------------------------------------------------------------
# Small pieces


def _to_chunks(x: Tensor | None, length: int, dtype: torch.dtype, scale: float | Tensor | None = None) -> Tensor | None:
    """`[B, T, H, ...]` -> `[N, B*H, length, ...]` (chunk-major, so that the sequential
    loop reads contiguous blocks), zero-padding the end of time, times `scale` if given
    (in the same pass as the layout copy, without autograd): a number, or a tensor that
    broadcasts against `[N, B, H, length, ...]` (RWKV-7's `beta` for `u = beta v`).

    Padding is harmless: a zero sub-step (k = a = w = u = 0, log-gate 0) leaves the state
    unchanged, and padded read-outs are dropped.
    """
    if x is None:
        return None
    B, T, H = x.shape[:3]
    rest = x.shape[3:]
    n_chunks = -(-T // length)
    pad = n_chunks * length - T
    if pad:
        x = torch.cat([x, x.new_zeros(B, pad, H, *rest)], dim=1)
    view = x.reshape(B, n_chunks, length, H, *rest).permute(1, 0, 3, 2, *range(4, 4 + len(rest)))  # [N, B, H, length, ...]
    out = torch.empty(view.shape, dtype=dtype, device=x.device)
    wants_grad = torch.is_grad_enabled() and (x.requires_grad or (isinstance(scale, Tensor) and scale.requires_grad))
    if scale is not None and not wants_grad:
        torch.mul(view, scale, out=out)  # (out= is not differentiable)
    else:
        out.copy_(view)
        if isinstance(scale, Tensor):
            out = out * scale
        elif scale is not None:
            out.mul_(scale)
    return out.view(n_chunks, B * H, length, *rest)


class _Decays:
    """Operands decayed from the chunk's start (`start`) or to its end (`end`), and the
    chunk's whole decay (`chunk`: `[N, BH, K, 1]` channel, `[N, BH, 1, 1]` scalar, None
    without a gate), every exponent <= 0. Formed from `G` when first asked for, unless the
    channel-gate scores already made them (`remember`: looked up by operand)."""

    def __init__(self, G: Tensor | None, gated: bool, channel: bool, n_h: int):
        self.G, self.gated, self.channel, self.n_h = G, gated, channel, n_h
        self.starts: dict[int, Tensor] = {}
        self.ends: dict[int, Tensor] = {}
        self.whole: Tensor | None = None

    @functools.cached_property
    def from_start(self) -> Tensor:
        return torch.exp2(self.G)

    @functools.cached_property
    def to_end(self) -> Tensor:
        return torch.sub(self.G[:, :, -1:], self.G).exp2_()

    def remember(self, rows: list[tuple[Tensor, str]], cols: list[Tensor], ends) -> None:
        self.starts.update((id(x), x_start) for (x, _), x_start in zip(rows, ends.rows))
        self.ends.update((id(y), y_end) for y, y_end in zip(cols, ends.cols))
        self.whole = ends.decay[..., None]

    def start(self, x: Tensor, per_token: bool = False) -> Tensor:
        """`x * exp2(G)` at `x`'s positions: every sub-step, or (`per_token`) each token's last."""
        if not self.gated or id(x) in self.starts:
            return self.starts.get(id(x), x)
        factor = self.from_start[:, :, self.n_h - 1 :: self.n_h] if per_token else self.from_start
        return _decay(x, factor)

    def end(self, x: Tensor) -> Tensor:
        """`x * exp2(G_L - G)`."""
        if not self.gated or id(x) in self.ends:
            return self.ends.get(id(x), x)
        return _decay(x, self.to_end)

    def chunk(self) -> Tensor | None:
        if not self.gated or self.whole is not None:
            return self.whole
        last = self.from_start[:, :, -1]
        return last[..., None] if self.channel else last[..., None, None]


def _chunk_view(x: Tensor | None, length: int, dtype: torch.dtype) -> Tensor | None:
    """`[B, T, H, K]` -> `[N, B, H, length, K]`, a view of `x` when no padding or cast is
    needed (else a copy, `_to_chunks`): for consumers that accept any leading shape."""
    if x is None:
        return None
    B, T, H, K = x.shape
    if T % length or x.dtype != dtype:
        return _to_chunks(x, length, dtype).view(-1, B, H, length, K)
    return x.view(B, T // length, length, H, K).permute(1, 0, 3, 2, 4)


def _decay(x: Tensor, factor: Tensor | None) -> Tensor:
    """`x` times a decay factor per row, `[..., L]` (scalar gate) or `[..., L, K]` (channel)."""
    if factor is None:
        return x
    return x * (factor if factor.dim() == x.dim() else factor[..., None])


def baddmm(input: Tensor | None, x: Tensor, y: Tensor, *, alpha: float = 1.0) -> Tensor:
    """`input + alpha * (x @ y)` (`input` None: just the product) in one matmul call, for
    any number of leading batch dimensions: MKL's alpha and accumulation cost no extra
    pass over the result."""
    batch, rows, cols = x.shape[:-2], x.shape[-2], y.shape[-1]
    base, beta = (x.new_zeros(()), 0.0) if input is None else (input.reshape(-1, rows, cols), 1.0)
    out = torch.baddbmm(base, x.reshape(-1, rows, x.shape[-1]), y.reshape(-1, *y.shape[-2:]), beta=beta, alpha=alpha)
    return out.view(*batch, rows, cols)


def _scale_columns(m: Tensor, factor: Tensor) -> Tensor:
    """`m @ diag(factor)` for `m` `[..., R, C]` and `factor` `[..., C]`."""
    return m * factor[..., None, :]


def _unit_lower_inverse(A: Tensor) -> Tensor:
    """`(I + A)^{-1}` for the strictly lower triangle of `A` `[..., L, L]` (the rest of `A`
    is never read): a unit lower-triangular solve against the identity, from the right
    (`X (I + A) = I`; the same inverse): on CPU LAPACK's right-side solve of a batch of
    16x16 systems took less than half the time of the left-side one (~0.4 against
    ~0.85 us per matrix)."""
    eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)
    # (A strided view, such as RWKV-7's A_ka stored by column operand, took the solve from
    # ~0.1 to ~0.16 ms at the benchmark's shape; a contiguous copy first costs ~7 us.)
    return torch.linalg.solve_triangular(A.contiguous(), eye, upper=False, unitriangular=True, left=False)


# ---------------------------------------------------------------------------------------
# The sequential part


def _per_chunk(x: Tensor | None, n: int) -> tuple:
    """`x`'s chunks as views, made at once (`[None] * n` for an absent input)."""
    return (None,) * n if x is None else x.unbind(0)


def _flat(x: Tensor) -> Tensor:
    """`[n, BH, r, c]` -> `[n*BH, r, c]` (a view) for batched matmuls."""
    return x.reshape(-1, *x.shape[-2:])


class _StateChain(torch.autograd.Function):
    """The chunk-to-chunk state recurrence and the read-out that uses its states, with an
    explicit backward.

    `(S_0, Gamma, R, N, P, Z, sign, Q, M) -> (o, final)`, chunk-major: for `c = 0 .. n-1`

        nu[c]  = sign N[c] - P[c] S_c                  (delta rule only; sign = +-1)
        S_c+1  = Gamma[c] * S_c + R[c] + Z[c]^T nu[c]
        o[c]   = Q[c] S_c + M[c] nu[c]

    with `S_0` `[BH, K, V]`, `Gamma` `[n, BH, K, 1]` (channel) or `[n, BH, 1, 1]` (scalar)
    or None, `R` `[n, BH, K, V]` (independent writes) or None, `N` `[n, BH, L, V]`, `P`
    and `Z` `[n, BH, L, K]`, `M` `[n, BH, Ct, L]`, or all four None (no delta rule),
    `Q` `[n, BH, Ct, K]` (the decayed, scaled queries); `final = S_n`.

    Written with autograd, every chunk would record its own graph nodes, and the backward
    of indexing chunk `c` out of `N`, `P`, `Z` allocates a zero gradient of the whole
    tensor per chunk. Here the forward writes into preallocated tensors, and the backward
    runs only the gradient of the state backwards through the chunks,

        dnu[c]   = M[c]^T do[c] + Z[c] dS_c+1
        dS_c     = Gamma[c] * dS_c+1 + Q[c]^T do[c] - P[c]^T dnu[c]

    (the read-out's share `Q^T do` accumulated where the state is hot, rather than as a
    batched matmul over all chunks with a short inner dimension) and then forms every
    other gradient for all chunks at once (`dP = -dnu S^T`, `dZ = nu dS^T`, `dR = dS`,
    `dGamma = sum(dS * S)`, `dN = sign dnu`, `dQ = do S^T`, `dM = do nu^T`).
    """

    @staticmethod
    def forward(ctx, state, decay, R, N, P, Z, sign, Q, M):
        n = Q.shape[0]
        starts, final = state.new_empty(n, *state.shape), torch.empty_like(state)
        starts[0] = state
        nu = state.new_empty(0) if N is None else torch.empty_like(N)
        # per-chunk views made once (indexing in the loop costs as much as a small op)
        S_ = (*starts.unbind(0), final)
        nu_, N_, P_, D_, R_ = (_per_chunk(x, n) for x in (nu, N, P, decay, R))
        Zt_ = _per_chunk(None if Z is None else Z.transpose(-1, -2), n)
        for c in range(n):
            S, new = S_[c], S_[c + 1]
            if decay is None and R is None:
                base = S  # the write below reads S and writes `new`
            else:
                base = new
                if decay is None:
                    torch.add(S, R_[c], out=new)
                elif R is None:
                    torch.mul(S, D_[c], out=new)
                else:
                    torch.addcmul(R_[c], S, D_[c], out=new)
            if N is not None:
                torch.baddbmm(N_[c], P_[c], S, beta=sign, alpha=-1, out=nu_[c])
                torch.baddbmm(base, Zt_[c], nu_[c], out=new)
            elif base is S:
                new.copy_(S)
        o = torch.bmm(_flat(Q), _flat(starts))
        if N is not None:  # (out= rather than baddbmm_: FlopCounterMode counts only the former)
            torch.baddbmm(o, _flat(M), _flat(nu), out=o)
        ctx.save_for_backward(starts, nu, decay, P, Z, Q, M)
        ctx.has_R, ctx.sign = R is not None, sign
        return o.view(*Q.shape[:-1], state.shape[-1]), final

    @staticmethod
    @once_differentiable
    def backward(ctx, d_o, d_final):
        starts, nu, decay, P, Z, Q, M = ctx.saved_tensors
        n = starts.shape[0]
        dependent = P is not None
        needs = ctx.needs_input_grad
        # after[c] = dL/dS_c+1 through every path; the loop writes after[c - 1] from after[c]
        after = torch.empty_like(starts)
        after[n - 1] = d_final
        d_state = torch.empty_like(d_final)
        d_nu = M.transpose(-1, -2) @ d_o if dependent else None  # the read-out's share, completed in the loop
        g_ = (d_state, *after.unbind(0))  # g_[c] = dL/dS_c
        do_, dnu_, Z_, D_ = (_per_chunk(x, n) for x in (d_o, d_nu, Z, decay))
        Pt_ = _per_chunk(P.transpose(-1, -2) if dependent else None, n)
        Qt_ = Q.transpose(-1, -2).unbind(0)
        for c in reversed(range(n)):
            later, now = g_[c + 1], g_[c]
            if dependent:
                dnu_[c].baddbmm_(Z_[c], later)
            if decay is None:
                torch.baddbmm(later, Qt_[c], do_[c], out=now)
            else:
                torch.mul(later, D_[c], out=now)
                now.baddbmm_(Qt_[c], do_[c])
            if dependent:
                now.baddbmm_(Pt_[c], dnu_[c], alpha=-1)
        d_decay = (after * starts).sum_to_size(decay.shape) if decay is not None and needs[1] else None
        d_R = after if ctx.has_R and needs[2] else None
        d_Q = d_o @ starts.transpose(-1, -2) if needs[7] else None
        d_N = d_P = d_Z = d_M = None
        if dependent:
            d_N = d_nu if ctx.sign == 1 else -d_nu
            d_P = baddmm(None, d_nu, starts.transpose(-1, -2), alpha=-1.0) if needs[4] else None
            d_Z = nu @ after.transpose(-1, -2) if needs[5] else None
            d_M = d_o @ nu.transpose(-1, -2) if needs[8] else None
        return d_state, d_decay, d_R, d_N, d_P, d_Z, None, d_Q, d_M


def _chain_without_grad(state, decay, independent, N, P, Z, sign, Q, M) -> tuple[Tensor, Tensor]:
    """`_StateChain`'s forward, with the independent writes `(Z', N', M')` folded in, when no
    gradient is wanted: chunk by chunk, keeping only the current state.

        nu     = sign N[c] - P[c] S                      (delta rule only)
        o[c]   = Q[c] S + M[c] nu + M'[c] N'[c]
        S     <- Gamma[c] * S + Z'[c]^T N'[c] + Z[c]^T nu

    The same matmuls as the autograd path (which needs every chunk's start state and `nu`
    for its backward, and batches `Z'^T N'`, `M' N'` and `Q S` over all chunks), but no
    `[n, BH, K, V]` tensor of states or of independent writes is ever written: the
    working set stays in cache, which on CPU is worth more than the larger batches.
    """
    n = Q.shape[0]
    o = Q.new_empty(*Q.shape[:-1], state.shape[-1])
    buffers = (torch.empty_like(state), torch.empty_like(state))
    nu = None if N is None else torch.empty_like(N[0])
    Z_ind, N_ind, M_ind = (None, None, None) if independent is None else independent
    o_, Q_, N_, P_, M_, D_, Ni_, Mi_ = (_per_chunk(x, n) for x in (o, Q, N, P, M, decay, N_ind, M_ind))
    Zt_, Zit_ = (_per_chunk(None if x is None else x.transpose(-1, -2), n) for x in (Z, Z_ind))
    S = state
    for c in range(n):
        new = buffers[c % 2]
        if N is not None:
            torch.baddbmm(N_[c], P_[c], S, beta=sign, alpha=-1, out=nu)
        torch.bmm(Q_[c], S, out=o_[c])
        if N is not None:
            torch.baddbmm(o_[c], M_[c], nu, out=o_[c])
        if Z_ind is not None:
            torch.baddbmm(o_[c], Mi_[c], Ni_[c], out=o_[c])
        base = S
        if decay is not None:
            base = torch.mul(S, D_[c], out=new)
        if Z_ind is not None:
            base = torch.baddbmm(base, Zit_[c], Ni_[c], out=new)
        if N is not None:
            base = torch.baddbmm(base, Zt_[c], nu, out=new)
        S = base
    return o, S


def _rwkv7_chain_without_grad(state, decay, T, rows, base, M_qa, a_end, w_end, u) -> tuple[Tensor, Tensor]:
    """RWKV-7's chain without autograd when the read-out and the removal keys are rows of
    one matrix (`n_h == 1`, channel gate: `decay_scores.Ends.stacked_rows`): per chunk

        [q S + M_qw U ; k S + A_kw U] = base[c] + rows[c] S     (one matmul, rows interleaved)
        r      = k S + A_kw U,   nu = -T r                      (T = (I + A_ka)^{-1})
        o[c]   = (q S + M_qw U) - M_qa (T r)
        S     <- Gamma[c] * S + w_end^T U - a_end^T (T r)

    with `base = [M_qw ; A_kw] U` batched over all chunks beforehand. The same result as
    `_chain_without_grad` with `N = (T A_kw) U`, `P = T (k Gamma)`: `nu = -N - P S = -T r`;
    but `P` and `N` are never formed, the read-out `q S` shares the matmul of `k S`, and
    `M_qz' N'` is in `base`: per chunk one `[2L, K] @ [K, V]` and one `[L, L] @ [L, V]`
    in place of two `[L, K] @ [K, V]` and two `[Ct, L] @ [L, V]`.

    `rows` `[n, BH, 2L, K]` and `base` `[n, BH, 2L, V]` interleave (q_t, k_t); `base` is
    overwritten.
    """
    n = T.shape[0]
    o = base.new_empty(n, *base.shape[1:-2], base.shape[-2] // 2, state.shape[-1])
    buffers = (torch.empty_like(state), torch.empty_like(state))
    t_r = torch.empty_like(u[0])
    o_, base_, rows_, T_, M_, D_, u_ = (_per_chunk(x, n) for x in (o, base, rows, T, M_qa, decay, u))
    At_, Wt_ = (_per_chunk(x.transpose(-1, -2), n) for x in (a_end, w_end))
    by_row = base.unflatten(-2, (-1, 2))  # (the q and k rows of `base` as views, made at once)
    bq_, bk_ = (_per_chunk(by_row[..., i, :], n) for i in (0, 1))
    S = state
    for c in range(n):
        new = buffers[c % 2]
        torch.baddbmm(base_[c], rows_[c], S, out=base_[c])
        torch.bmm(T_[c], bk_[c], out=t_r)
        torch.baddbmm(bq_[c], M_[c], t_r, alpha=-1, out=o_[c])
        torch.mul(S, D_[c], out=new)
        torch.baddbmm(new, Wt_[c], u_[c], out=new)
        S = torch.baddbmm(new, At_[c], t_r, alpha=-1, out=new)
    return o, S


# ---------------------------------------------------------------------------------------
# The chunked recurrence on one dense batch


def _chunked_dense(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None,
    gate: Gate,
    beta: Tensor | None,
    write_key: Tensor | None,
    erase: Tensor | None,
    n_h: int,
    scale: float,
    initial_state: Tensor | None,
    chunk_size: int | None,
) -> tuple[Tensor, Tensor]:
    """Inputs in `[B, T(*n_h), H, D]` layout; returns `o` `[B, T, H, V]` and the final state,
    both in the accumulation dtype."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    acc = accumulation_dtype(q, k, v, g, beta, write_key, erase, initial_state)
    state = q.new_zeros(B, H, K, V, dtype=acc) if initial_state is None else initial_state.to(acc)
    if T == 0:
        return q.new_zeros(B, 0, H, V, dtype=acc), state
    state = state.reshape(B * H, K, V)

    ct = torch_tokens_per_chunk(n_h, chunk_size, delta=beta is not None or erase is not None)
    L = ct * n_h  # sub-steps per chunk
    channel = gate == Gate.CHANNEL
    # [N, B*H, L, ...] per sub-step, [N, B*H, Ct, K] per token; the read-out scale goes
    # into q (one pass; as the read-out matmuls' alpha it would cost passes over the
    # larger gradients of the states in the backward).
    q = _to_chunks(q, ct, acc, scale=scale)
    beta = _to_chunks(beta, L, acc)
    if erase is not None and beta is not None:  # rwkv7 needs only u = beta v: made in the layout copy
        v = _to_chunks(v, L, acc, scale=beta.view(beta.shape[0], B, H, L, 1))
    else:
        v = _to_chunks(v, L, acc)
    # Without autograd, a channel gate's keys enter only the dyadic scores, which read them
    # in place from the input layout (`_chunk_view`); otherwise they are copied into chunks.
    wants_grad = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, g, beta, write_key, erase, initial_state))
    by_products = channel and not wants_grad
    keys = _chunk_view if by_products else _to_chunks
    k, write_key, erase = (keys(x, L, acc) for x in (k, write_key, erase))
    w = k if write_key is None else write_key

    # Within-chunk cumulative log-gate per sub-step, in log2 units (see LOG2_E), and the
    # decays (exponents <= 0), each evaluated once: from the chunk's start to every sub-step
    # (read-outs sit at their token's last sub-step), to the chunk's end from every
    # sub-step, and over the whole chunk (Gamma_L: [N, B*H, K, 1] channel, [N, B*H, 1, 1]
    # scalar, None without a gate).
    # (Per token first: within a token the gate sits at its first sub-step, so G is the same
    # at all its sub-steps; each token's own decay exp2(g_t) is what the channel-gate
    # scores are built from.)
    # Without autograd, the channel-gate scores also hand back the operands decayed from the
    # chunk's start and to its end (`decay_scores.Ends`), which `decays` then returns, and G
    # itself is not needed.
    G = token_decay = None
    if g is not None:
        g_tokens = _to_chunks(g, ct, acc, scale=LOG2_E)  # [N, B*H, Ct(, K)]
        if channel:
            token_decay = g_tokens.exp2_() if by_products else torch.exp2(g_tokens)  # (in place when G is not formed)
        if not by_products:
            G = g_tokens.cumsum(dim=2)
            if n_h > 1:
                G = G.repeat_interleave(n_h, dim=2)
    decays = _Decays(G, g is not None, channel, n_h)
    # `k * Gamma` enters as the rows of P; a scalar gate is a column scaling of T instead.
    t_columns = decays.from_start if g is not None and not channel else None

    def k_start() -> Tensor:
        return decays.start(k) if channel else k
    stacked = []  # (`decay_scores.Ends.stacked_rows`, `.stacked_scores`) when made
    def scores(rows, cols):
        if not by_products:
            return score_matrices(G, channel, ct, n_h, rows, cols, token_decay)
        matrices, ends = score_matrices_and_ends(G, token_decay, ct, n_h, rows, cols)
        decays.remember(rows, cols, ends)
        if ends.stacked_rows is not None:
            stacked[:] = [ends.stacked_rows, ends.stacked_scores]
        return matrices

    # Writes whose values depend on the chunk's start state: nu = N - P S_0 (delta rule),
    # and writes whose values do not (Z', N'), each with the (scaled) scores of its
    # keys against the queries.
    dependent = independent = None
    if beta is None and erase is None:  # diagonal
        ((M_qw,),) = scores([(q, "queries")], [w])
        independent = (decays.end(w), v, M_qw)
    elif erase is None:  # householder: a = beta w, rows scaled (see the module docstring)
        (M_qw,), (A_kw,) = scores([(q, "queries"), (k, "substeps")], [w])
        inverse = _unit_lower_inverse(A_kw * beta[..., None])
        t_beta = _scale_columns(inverse, beta)  # T diag(beta)
        P = (t_beta if t_columns is None else _scale_columns(t_beta, t_columns)) @ k_start()  # [N, BH, L, K]
        dependent = (decays.end(w), t_beta @ v, P, M_qw)
    else:  # rwkv7
        u = v  # (beta v when beta is given: `_to_chunks` made it)
        (M_qa, M_qw), (A_ka, A_kw) = scores([(q, "queries"), (k, "substeps")], [erase, w])
        inverse = _unit_lower_inverse(A_ka)
        if stacked and len(stacked[1]) == 2:  # (no autograd, channel gate, n_h == 1)
            rows_qk, (_, scores_w) = stacked
            o, final = _rwkv7_chain_without_grad(state, decays.chunk(), inverse, rows_qk, scores_w @ u, M_qa, decays.end(erase), decays.end(w), u)
            return _from_chunks(o, B, H, T), final.reshape(B, H, K, V)
        # T A_kw U, entering nu negated (sign): [N, BH, L, V]. (T A_kw) U rather than
        # T (A_kw U): L^3 + L^2 V multiply-adds instead of 2 L^2 V (2-3% of the forward).
        N = (inverse @ A_kw) @ u
        P = (inverse if t_columns is None else _scale_columns(inverse, t_columns)) @ k_start()
        dependent = (decays.end(erase), N, P, M_qa)
        independent = (decays.end(w), u, M_qw)

    Z_end, N, P, M_qz = dependent if dependent is not None else (None, None, None, None)
    sign = -1 if erase is not None else 1  # rwkv7: nu = -(T A_kw U) - P S_0
    q_start, decay_chunk = decays.start(q, per_token=True), decays.chunk()
    chain_inputs = (state, decay_chunk, N, P, Z_end, q_start, M_qz, *(independent or ()))
    if not any(x is not None and x.requires_grad for x in chain_inputs):
        o, final = _chain_without_grad(state, decay_chunk, independent, N, P, Z_end, sign, q_start, M_qz)
    else:
        # Independent writes go straight to the chunk's end state (R) and to the read-out.
        R = None
        if independent is not None:
            Z_ind, N_ind, M_ind = independent
            R = Z_ind.transpose(-1, -2) @ N_ind  # [N, BH, K, V]
        o, final = _StateChain.apply(state, decay_chunk, R, N, P, Z_end, sign, q_start, M_qz)
        if independent is not None:
            o = baddmm(o, M_ind, N_ind)  # [N, BH, Ct, V]
    return _from_chunks(o, B, H, T), final.reshape(B, H, K, V)


def _from_chunks(o: Tensor, B: int, H: int, T: int) -> Tensor:
    """Read-outs `[N, B*H, Ct, V]` -> `[B, T, H, V]` (dropping the padding)."""
    n_chunks, _, ct, V = o.shape
    return o.reshape(n_chunks, B, H, ct, V).permute(1, 0, 3, 2, 4).reshape(B, n_chunks * ct, H, V)[:, :T]


def _without_autocast(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run `fn` with autocast off on `q`'s device: this backend picks its own precision, and
    under CUDA autocast the chain's matmuls would run in bfloat16 and refuse their float32
    `out=` buffers."""

    @functools.wraps(fn)
    def run(q: Tensor, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(q.device.type, enabled=False):
            return fn(q, *args, **kwargs)

    return run


@_without_autocast
def linear_recurrence_chunked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    g: Tensor | None = None,
    gate: Gate | None = None,
    beta: Tensor | None = None,
    write_key: Tensor | None = None,
    erase: Tensor | None = None,
    n_h: int = 1,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    chunk_size: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """`linear_recurrence` in chunked form; arguments as `archspec.kernels.linear_recurrence`
    (`gate`: the kind of `g`, as the API resolved it).

    `chunk_size` (sub-steps, rounded down to whole tokens) overrides the module default;
    tests use small values to cross many chunk boundaries with short sequences.
    """
    K = q.shape[-1]
    scale = K**-0.5 if scale is None else scale
    gate = Gate.of(g) if gate is None else gate
    if cu_seqlens is None:
        o, final = _chunked_dense(q, k, v, g, gate, beta, write_key, erase, n_h, scale, initial_state, chunk_size)
        return o.to(v.dtype), (final if output_final_state else None)

    # Packed variable-length batch (B == 1): each sequence alone, from its own state.
    offsets = host_offsets(cu_seqlens)
    outs, finals = [], []
    for n, (start, end) in enumerate(itertools.pairwise(offsets)):
        tok, sub = slice(start, end), slice(start * n_h, end * n_h)
        o, final = _chunked_dense(
            q[:, tok],
            k[:, sub],
            v[:, sub],
            None if g is None else g[:, tok],
            gate,
            None if beta is None else beta[:, sub],
            None if write_key is None else write_key[:, sub],
            None if erase is None else erase[:, sub],
            n_h,
            scale,
            None if initial_state is None else initial_state[n : n + 1],
            chunk_size,
        )
        outs.append(o)
        finals.append(final)
    o = torch.cat(outs, dim=1).to(v.dtype)
    return o, (torch.cat(finals, dim=0) if output_final_state else None)


register_backend("torch", recurrence=linear_recurrence_chunked, osdn=osdn_write_keys_scan)
