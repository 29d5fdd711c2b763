"""The chunked PyTorch backend (`backend="torch"`): the recurrence in WY/UT form.

Plain PyTorch, differentiable by autograd, on any device. It computes exactly
`RECURRENCE.md` (the naive loop in `naive.py` is the definition it is tested against)
and is the readable reference of the chunk algorithm that the Triton kernel implements.

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
flash-linear-attention, in these terms):

    nu  = N - P S_0                                  ("v_new")
    S_L = Gamma_L S_0 + Z_end^T nu + Z'_end^T N'
    o   = (q * Gamma_q) S_0 + M_qz nu + M_qz' N'      (computed after the loop, batched)

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
Chunks hold whole tokens: `tokens_per_chunk(n_h)` is the largest power of two with
`tokens * n_h <= CHUNK_SIZE` (at least 1), so `L = tokens * n_h` sub-steps; the power
of two is what the dyadic channel-gate scores need. The state chain costs `2 K V`
multiply-adds per sub-step whatever `L`; the parallel part grows like `L (K + V)` per
sub-step, while short chunks mean more sequential Python steps. `CHUNK_SIZE = 32`
measured fastest on CPU for head sizes 64 (`benchmarks/torch_vs_naive.py`).

Matmuls per chunk (per batch row and head; `Ct` tokens, `L = Ct n_h` sub-steps)
-------------------------------------------------------------------------------
  - `M_qw = q w^T` (decayed, visible part)     [Ct,K]@[K,L]       (rwkv7: also `M_qa`)
  - read-out `(q Gamma_q) S_0`                 [Ct,K]@[K,V]
With a delta rule (householder, rwkv7):
  - `A_kw = k w^T` (strictly lower)            [L,K]@[K,L]        (rwkv7: also `A_ka = k a^T`)
  - `(I + A_ka)^{-1}`                          about L^3/6 multiply-adds (`solve_triangular`
                                               against the identity: FlopCounterMode does not see it)
  - `P`, `N`                                   [L,L]@[L,K], [L,L]@[L,V]   (rwkv7: also `A_kw U`)
  - state chain `P S_0`, `Z_end^T nu`          [L,K]@[K,V], [K,L]@[L,V]   (sequential)
  - read-out `M_qz nu`                         [Ct,L]@[L,V]
Independent writes (diagonal, rwkv7):
  - `Z'_end^T N'`, `M_qz' N'`                  [K,L]@[L,V], [Ct,L]@[L,V]
Gates add no matmul for none/scalar (the score matrices are dense matmuls masked after);
with a channel gate each score matrix is built by dyadic splitting (`decay_scores.py`):
`log2(Ct)` batched matmuls, about half the dense product's multiply-adds.
"""

from __future__ import annotations

import torch

from .api import register_backend
from .decay_scores import make_score_fn
from .naive import accumulation_dtype
from .osdn_scan import osdn_write_keys_scan

Tensor = torch.Tensor

CHUNK_SIZE = 32  # sub-steps per chunk, rounded down to a power-of-two number of tokens

# Cumulative log-gates are kept in log2 units and decays formed with `torch.exp2`: on CPU
# torch's exp2 is vectorized and about 5x faster than its exp (which dominated the channel
# gate's elementwise work). `exp(x) = exp2(x * LOG2_E)`, exponents stay <= 0.
LOG2_E = 1.4426950408889634


def tokens_per_chunk(n_h: int, chunk_size: int | None = None) -> int:
    """Tokens per chunk: the largest power of two with `tokens * n_h <= chunk_size`."""
    budget = max(1, (CHUNK_SIZE if chunk_size is None else chunk_size) // n_h)
    return 1 << (budget.bit_length() - 1)


# ---------------------------------------------------------------------------------------
# Small pieces


def _expand_gate(g: Tensor, n_h: int) -> Tensor:
    """Per-token log-gate `[B, T, H(, K)]` -> per sub-step: `g_t` at `t*n_h`, 0 elsewhere."""
    if n_h == 1:
        return g
    B, T = g.shape[:2]
    zeros = g.new_zeros(B, T, n_h - 1, *g.shape[2:])
    return torch.cat([g.unsqueeze(2), zeros], dim=2).reshape(B, T * n_h, *g.shape[2:])


def _to_chunks(x: Tensor | None, length: int, dtype: torch.dtype) -> Tensor | None:
    """`[B, T, H, ...]` -> `[N, B*H, length, ...]` (chunk-major, so that the sequential
    loop reads contiguous blocks), zero-padding the end of time.

    Padding is harmless: a zero sub-step (k = a = w = u = 0, log-gate 0) leaves the state
    unchanged, and padded read-outs are dropped.
    """
    if x is None:
        return None
    B, T, H = x.shape[:3]
    rest = x.shape[3:]
    n_chunks = -(-T // length)
    pad = n_chunks * length - T
    x = x.to(dtype)
    if pad:
        x = torch.cat([x, x.new_zeros(B, pad, H, *rest)], dim=1)
    x = x.reshape(B, n_chunks, length, H, *rest).transpose(2, 3).transpose(0, 1)  # [N, B, H, length, ...]
    return x.reshape(n_chunks, B * H, length, *rest)


def _decay(x: Tensor, log_decay: Tensor | None) -> Tensor:
    """`x * 2**log_decay` row-wise; `log_decay` (log2 units) is `[..., L]` (scalar) or `[..., L, K]`."""
    if log_decay is None:
        return x
    factor = torch.exp2(log_decay)
    return x * (factor if factor.dim() == x.dim() else factor[..., None])


# ---------------------------------------------------------------------------------------
# The chunked recurrence on one dense batch


def _chunked_dense(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None,
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

    ct = tokens_per_chunk(n_h, chunk_size)
    L = ct * n_h  # sub-steps per chunk
    channel = g is not None and g.dim() == 4
    # [N, B*H, L, ...] per sub-step, [N, B*H, Ct, K] per token
    q = _to_chunks(q, ct, acc) * scale
    k, v, beta, write_key, erase = (_to_chunks(x, L, acc) for x in (k, v, beta, write_key, erase))
    n_chunks = q.shape[0]
    w = k if write_key is None else write_key
    u = v if beta is None else beta[..., None] * v

    # Within-chunk cumulative log-gate per sub-step, in log2 units (see LOG2_E); the decays
    # to each read-out and to the chunk's end (exponents <= 0).
    G = None if g is None else _to_chunks(_expand_gate(g, n_h), L, acc).cumsum(dim=2).mul_(LOG2_E)
    scores = make_score_fn(G, channel, ct, n_h, q.device)
    G_query = None if G is None else G[:, :, n_h - 1 :: n_h]
    G_to_end = None if G is None else G[:, :, -1:] - G
    # Gamma_L per chunk: [N, B*H, K, 1] (channel), [N, B*H, 1, 1] (scalar), None (no gate)
    decay_chunk = None
    if G is not None:
        decay_chunk = torch.exp2(G[:, :, -1, :, None] if channel else G[:, :, -1:, None])

    # Writes whose values depend on the chunk's start state: nu = N - P S_0 (delta rule),
    # and writes whose values do not (Z', N').
    dependent = independent = None
    M_qw = scores(q, w, "queries")  # [N, BH, Ct, L]
    if beta is None and erase is None:
        independent = (_decay(w, G_to_end), u, M_qw)
    else:
        A_kw = scores(k, w, "substeps")  # [N, BH, L, L]
        eye = torch.eye(L, dtype=acc, device=q.device)
        if erase is None:  # householder: a = beta w, rows scaled (see the module docstring)
            inverse = torch.linalg.solve_triangular(eye + beta[..., :, None] * A_kw, eye, upper=False, unitriangular=True)
            P = inverse @ (beta[..., None] * _decay(k, G))  # [N, BH, L, K]
            dependent = (_decay(w, G_to_end), inverse @ u, P, M_qw)
        else:
            A_ka = scores(k, erase, "substeps")
            inverse = torch.linalg.solve_triangular(eye + A_ka, eye, upper=False, unitriangular=True)
            N = -(inverse @ (A_kw @ u))  # [N, BH, L, V]
            dependent = (_decay(erase, G_to_end), N, inverse @ _decay(k, G), scores(q, erase, "queries"))
            independent = (_decay(w, G_to_end), u, M_qw)

    if independent is not None:
        Z_end, N, M_qz = independent
        R = Z_end.transpose(-1, -2) @ N  # [N, BH, K, V]
        o = M_qz @ N  # [N, BH, Ct, V]
    else:
        R, o = None, 0.0
    if dependent is not None:
        Z_end, N, P, M_qz = dependent

    # The only sequential part, chunk after chunk.
    starts, values = [], []
    for c in range(n_chunks):
        starts.append(state)
        new_state = state if decay_chunk is None else decay_chunk[c] * state
        if R is not None:
            new_state = new_state + R[c]
        if dependent is not None:
            nu = torch.baddbmm(N[c], P[c], state, alpha=-1)  # N - P S_0: [BH, L, V]
            values.append(nu)
            new_state = torch.baddbmm(new_state, Z_end[c].transpose(-1, -2), nu)
        state = new_state

    o = o + _decay(q, G_query) @ torch.stack(starts)  # [N, BH, Ct, V]
    if dependent is not None:
        o = o + M_qz @ torch.stack(values)
    o = o.reshape(n_chunks, B, H, ct, V).permute(1, 0, 3, 2, 4).reshape(B, n_chunks * ct, H, V)[:, :T]
    return o, state.reshape(B, H, K, V)


def linear_recurrence_chunked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    g: Tensor | None = None,
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
    """`linear_recurrence` in chunked form; arguments as `archspec.kernels.linear_recurrence`.

    `chunk_size` (sub-steps, rounded down to whole tokens) overrides the module default;
    tests use small values to cross many chunk boundaries with short sequences.
    """
    K = q.shape[-1]
    scale = K**-0.5 if scale is None else scale
    if cu_seqlens is None:
        o, final = _chunked_dense(q, k, v, g, beta, write_key, erase, n_h, scale, initial_state, chunk_size)
        return o.to(v.dtype), (final if output_final_state else None)

    # Packed variable-length batch (B == 1): each sequence alone, from its own state.
    offsets = [int(x) for x in cu_seqlens.tolist()]
    outs, finals = [], []
    for n, (start, end) in enumerate(zip(offsets[:-1], offsets[1:])):
        tok, sub = slice(start, end), slice(start * n_h, end * n_h)
        o, final = _chunked_dense(
            q[:, tok],
            k[:, sub],
            v[:, sub],
            None if g is None else g[:, tok],
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
