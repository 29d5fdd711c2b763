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
key channel, or scalar) and `Gamma_i = diag(exp(G_i))`, unrolling the recurrence from
the chunk's start state `S_0` gives

    S_i = Gamma_i S_0 + sum_{j<=i} exp(G_i - G_j) (a_j y_j^T + w_j u_j^T)
    y_j = -(D_j S_{j-1})^T k_j                    (what the erase removes)

and stacking the `y_j` as rows of `Y` turns their sequential dependence into one unit
lower-triangular solve (the UT transform):

    (I + A_ka) Y = -(k * Gamma) S_0 - A_kw U,
    A_ka[j, m] = k_j^T diag(exp(G_j - G_m)) a_m   and likewise A_kw with w,  for m < j.

So `Y = -Tk S_0 - Tu` with `[Tk | Tu] = (I + A_ka)^{-1} [k * Gamma | A_kw U]`, and the
chunk becomes an affine map of its start state, computed for all chunks in parallel:

    S_L = M S_0 + R,       M  = Gamma_L - a_end^T Tk,      R    = w_end^T U - a_end^T Tu
    o_t = Qeff_t S_0 + Oeff_t,  Qeff = q * Gamma_q - M_qa Tk,  Oeff = M_qw U - M_qa Tu

where `a_end = a * exp(G_L - G)` (likewise `w_end`), `M_qa[t, j] = q_t^T diag(exp(G_p -
G_j)) a_j` for `j <= p` (likewise `M_qw`), and `p = t*n_h + n_h - 1` is the token's last
sub-step: the query is read only there, the `n_h - 1` empty read-outs are never formed.
Only the chain `S <- M S + R` over chunks is sequential. Without erase (`a = 0`) the solve
disappears and `M` is the diagonal `Gamma_L`.

Numerical safety: every decay factor is `exp(G_r - G_c)` with `r` at or after `c`, so
its exponent is <= 0; `exp(+large)` (what the usual `k * exp(G)`, `a * exp(-G)`
factorization produces for strong channel decays) is never formed. For scalar (or no)
gates the ratios multiply a `[L, L]` matmul; for channel gates they form a `[L, L, K]`
tensor, which is why channel gates use shorter chunks.

Chunk size
----------
Chunks are aligned to tokens: `tokens_per_chunk(n_h, channel) = max(1, size // n_h)`
tokens, i.e. `L = tokens_per_chunk * n_h` sub-steps, with `size = CHUNK_SIZE` (64) for
no or scalar gates and `CHANNEL_CHUNK_SIZE` (32) for channel gates. 64 is the usual
matmul tile of chunk kernels and, on CPU, balances the parallel `O(T L (K+V))` work
against the `T/L` sequential `K x K x V` steps; channel gates pay `O(T L K)` elementwise
memory for the decay tensor, which halving `L` keeps small (see
`benchmarks/torch_vs_naive.py`).

Matmuls per chunk (per batch row and head; `Ct` tokens, `L` sub-steps, `n_h = L / Ct`)
--------------------------------------------------------------------------------------
With a delta rule (householder or rwkv7):
  1. `A_ka = k a^T`, `A_kw = k w^T`          2 x [L,K]@[K,L]
  2. `A_kw U`                                [L,L]@[L,V]
  3. triangular solve for `[Tk | Tu]`        L^2 (K+V) multiply-adds (`solve_triangular`,
                                             not seen by torch's FlopCounterMode)
  4. `a_end^T Tk`                            [K,L]@[L,K]
  5. `w_end^T U`, `a_end^T Tu`               2 x [K,L]@[L,V]
  6. `M_qa = q a^T`, `M_qw = q w^T`          2 x [Ct,K]@[K,L]
  7. `M_qa Tk`                               [Ct,L]@[L,K]
  8. `M_qw U`, `M_qa Tu`                     2 x [Ct,L]@[L,V]
  9. state chain `M S`                       [K,K]@[K,V]   (sequential over chunks)
 10. read-out `Qeff S`                       [Ct,K]@[K,V]
Without a delta rule (diagonal): `w_end^T U` [K,L]@[L,V], `M_qw = q w^T` [Ct,K]@[K,L],
`M_qw U` [Ct,L]@[L,V], read-out [Ct,K]@[K,V]; the state chain is elementwise.
With a channel gate the score matrices of steps 1 and 6 are elementwise products summed
over `K` on a `[rows, L, K]` tensor instead of matmuls (same multiply-adds, not seen by
FlopCounterMode); everything else is unchanged.
"""

from __future__ import annotations

import torch

from .api import register_backend
from .naive import accumulation_dtype
from .osdn_scan import osdn_write_keys_scan

Tensor = torch.Tensor

CHUNK_SIZE = 64  # sub-steps per chunk without a gate or with a scalar gate
CHANNEL_CHUNK_SIZE = 32  # sub-steps per chunk with a channel gate ([L, L, K] decay tensor)


def tokens_per_chunk(n_h: int, channel_gate: bool, chunk_size: int | None = None) -> int:
    """Tokens per chunk: chunks hold whole tokens, about `chunk_size` sub-steps."""
    size = chunk_size if chunk_size is not None else CHANNEL_CHUNK_SIZE if channel_gate else CHUNK_SIZE
    return max(1, size // n_h)


# ---------------------------------------------------------------------------------------
# Small pieces


def _heads_first(x: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """`[B, T, H, ...]` -> `[B, H, T, ...]` in the accumulation dtype."""
    return None if x is None else x.transpose(1, 2).to(dtype)


def _generalized_inputs(
    k: Tensor, v: Tensor, beta: Tensor | None, write_key: Tensor | None, erase: Tensor | None
) -> tuple[Tensor | None, Tensor, Tensor]:
    """`(a, w, u)` of `S <- (I - a k^T) D S + w u^T` for the three update rules."""
    w = k if write_key is None else write_key
    if erase is not None:
        return erase, w, (v if beta is None else beta[..., None] * v)
    if beta is not None:
        return beta[..., None] * w, w, beta[..., None] * v
    return None, w, v


def _expand_gate(g: Tensor, n_h: int) -> Tensor:
    """Per-token log-gate `[B, H, T(, K)]` -> per sub-step: `g_t` at `t*n_h`, 0 elsewhere."""
    B, H, T = g.shape[:3]
    if n_h == 1:
        return g
    zeros = g.new_zeros(B, H, T, n_h - 1, *g.shape[3:])
    return torch.cat([g.unsqueeze(3), zeros], dim=3).reshape(B, H, T * n_h, *g.shape[3:])


def _to_chunks(x: Tensor, length: int) -> Tensor:
    """`[B, H, T, ...]` -> `[B, H, N, length, ...]`, zero-padding the end of time.

    Padding is harmless: a zero sub-step (k = a = w = u = 0, log-gate 0) leaves the state
    unchanged, and padded read-outs are dropped.
    """
    B, H, T = x.shape[:3]
    n_chunks = -(-T // length)
    pad = n_chunks * length - T
    if pad:
        x = torch.cat([x, x.new_zeros(B, H, pad, *x.shape[3:])], dim=2)
    return x.reshape(B, H, n_chunks, length, *x.shape[3:])


def _decay(x: Tensor, log_decay: Tensor) -> Tensor:
    """`x * exp(log_decay)` row-wise; `log_decay` is `[..., L]` (scalar) or `[..., L, K]`."""
    factor = torch.exp(log_decay)
    return x * (factor if factor.dim() == x.dim() else factor[..., None])


def _decayed_scores(x: Tensor, y: Tensor, gx: Tensor | None, gy: Tensor | None, mask: Tensor) -> Tensor:
    """`P[r, c] = x_r^T diag(exp(gx_r - gy_c)) y_c` where `mask[r, c]`, else 0.

    `mask` only allows `r` at or after `c` in time, so the exponent is <= 0 wherever it
    is evaluated; masked entries get `-inf` before `exp` (never `exp(+large)`).
    `x` `[..., R, K]`, `y` `[..., C, K]`, `gx`/`gy` `[..., R]`/`[..., C]` (scalar gate),
    `[..., R, K]`/`[..., C, K]` (channel gate) or None (no gate); `mask` `[R, C]` bool.
    """
    if gx is None:
        return (x @ y.transpose(-1, -2)).masked_fill(~mask, 0.0)
    if gx.dim() == x.dim() - 1:  # scalar gate: ratio matrix times a matmul
        ratio = (gx[..., :, None] - gy[..., None, :]).masked_fill(~mask, float("-inf"))
        return (x @ y.transpose(-1, -2)) * torch.exp(ratio)
    # channel gate: a [R, C, K] ratio tensor, contracted over K
    ratio = (gx[..., :, None, :] - gy[..., None, :, :]).masked_fill(~mask[..., None], float("-inf"))
    return (x[..., :, None, :] * torch.exp(ratio) * y[..., None, :, :]).sum(-1)


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

    q, k, v, g, beta, write_key, erase = (
        _heads_first(x, acc) for x in (q, k, v, g, beta, write_key, erase)
    )
    q = q * scale
    a, w, u = _generalized_inputs(k, v, beta, write_key, erase)
    channel = g is not None and g.dim() == 4
    ct = tokens_per_chunk(n_h, channel, chunk_size)
    L = ct * n_h  # sub-steps per chunk

    # [B, H, N, L, ...] (sub-steps) and [B, H, N, Ct, K] (queries)
    k, w, u = (_to_chunks(x, L) for x in (k, w, u))
    a = None if a is None else _to_chunks(a, L)
    q = _to_chunks(q, ct)
    n_chunks = q.shape[2]

    # Within-chunk cumulative log-gate per sub-step, and at each token's query sub-step.
    if g is None:
        G = G_query = G_last = None
    else:
        G = _to_chunks(_expand_gate(g, n_h), L).cumsum(dim=3)
        G_query = G[:, :, :, n_h - 1 :: n_h]
        G_last = G[:, :, :, -1:]

    def to_end(x: Tensor) -> Tensor:
        """x_j * exp(G_L - G_j): sub-step j's contribution carried to the chunk's end."""
        return x if G is None else _decay(x, G_last - G)

    def from_start(x: Tensor, g_rows: Tensor | None) -> Tensor:
        """x_r * exp(G_r): the chunk's start state decayed to row r."""
        return x if g_rows is None else _decay(x, g_rows)

    sub = torch.arange(L, device=q.device)
    strictly_earlier = sub[:, None] > sub[None, :]  # [L, L]: m < j
    query_sees = (sub[None, :] // n_h) <= torch.arange(ct, device=q.device)[:, None]  # [Ct, L]

    M_qw = _decayed_scores(q, w, G_query, G, query_sees)  # [.., Ct, L]
    O_eff = M_qw @ u  # [.., Ct, V]
    Q_eff = from_start(q, G_query)  # [.., Ct, K]
    R = to_end(w).transpose(-1, -2) @ u  # [.., K, V]
    # exp(G_L) per chunk, [B, H, N, K] (channel) or [B, H, N, 1] (scalar); None: no gate
    decay_chunk = None
    if G is not None:
        decay_chunk = torch.exp(G[:, :, :, -1] if channel else G[:, :, :, -1:])
    M = None  # full chunk transition [.., K, K]; None: diagonal decay only

    if a is not None:
        A_ka = _decayed_scores(k, a, G, G, strictly_earlier)  # [.., L, L]
        A_kw = _decayed_scores(k, w, G, G, strictly_earlier)
        eye = torch.eye(L, dtype=acc, device=q.device)
        rhs = torch.cat([from_start(k, G), A_kw @ u], dim=-1)  # [.., L, K + V]
        TkTu = torch.linalg.solve_triangular(eye + A_ka, rhs, upper=False, unitriangular=True)
        Tk, Tu = TkTu[..., :K], TkTu[..., K:]
        a_end_t = to_end(a).transpose(-1, -2)  # [.., K, L]
        M = -(a_end_t @ Tk)
        diag = torch.ones(K, dtype=acc, device=q.device) if decay_chunk is None else decay_chunk
        M = M + torch.diag_embed(diag.expand(M.shape[:-1]))  # Gamma_L - a_end^T Tk
        R = R - a_end_t @ Tu
        M_qa = _decayed_scores(q, a, G_query, G, query_sees)
        Q_eff = Q_eff - M_qa @ Tk
        O_eff = O_eff - M_qa @ Tu

    # The only sequential part: S <- M S + R from chunk to chunk.
    starts = []
    for c in range(n_chunks):
        starts.append(state)
        if M is not None:
            state = M[:, :, c] @ state + R[:, :, c]
        elif decay_chunk is not None:
            state = decay_chunk[:, :, c, :, None] * state + R[:, :, c]
        else:
            state = state + R[:, :, c]
    start_states = torch.stack(starts, dim=2)  # [B, H, N, K, V]

    o = Q_eff @ start_states + O_eff  # [B, H, N, Ct, V]
    o = o.reshape(B, H, n_chunks * ct, V)[:, :, :T].transpose(1, 2)
    return o, state


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
