"""The recurrence, token by token: the definition every other backend is tested against.

This is `RECURRENCE.md` written as a loop and nothing more; `decode_step_naive` is one
token of it for every row of a batch (the decoding step's definition). It is slow (one Python
iteration per sub-step) and meant for tests, for decoding one token at a time, and for
diagnostics that need every intermediate state. Keep it obviously correct; never
optimise it.

Shapes follow flash-linear-attention: activations `[B, T, H, D]`, state `[B, H, K, V]`.
The state is kept in float32, or in float64 when the inputs are float64, so that tests
can run the definition in double precision.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def accumulation_dtype(*tensors: Tensor | None) -> torch.dtype:
    """float64 if any input is float64, else float32: the state is never kept in half."""
    for t in tensors:
        if t is not None and t.dtype == torch.float64:
            return torch.float64
    return torch.float32


def recurrence_step(
    state: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    beta: Tensor | None,
    write_key: Tensor | None,
    erase: Tensor | None,
) -> Tensor:
    """One sub-step of `RECURRENCE.md` on a state `[N, H, K, V]`.

    `k`, `write_key`, `erase`: `[N, H, K]`; `v`: `[N, H, V]`; `beta`: `[N, H]`.
    """
    w = k if write_key is None else write_key
    if erase is not None:
        # S <- S - e (S^T k)^T + b w v^T
        removed = torch.einsum("nhkv,nhk->nhv", state, k)
        b = 1.0 if beta is None else beta[..., None]
        return state - erase[..., :, None] * removed[..., None, :] + w[..., :, None] * (b * v)[..., None, :]
    if beta is not None:
        # S <- S + beta w (v - S^T k)^T
        residual = v - torch.einsum("nhkv,nhk->nhv", state, k)
        return state + w[..., :, None] * (beta[..., None] * residual)[..., None, :]
    # S <- S + w v^T
    return state + w[..., :, None] * v[..., None, :]


def apply_gate(state: Tensor, g: Tensor | None) -> Tensor:
    """The per-token decay: `g` is `[N, H]` (scalar) or `[N, H, K]` (channel), in log space."""
    if g is None:
        return state
    if g.dim() == state.dim() - 2:  # scalar gate [N, H]
        return state * torch.exp(g)[..., None, None]
    return state * torch.exp(g)[..., :, None]


def osdn_update(
    d: Tensor,
    k: Tensor,
    beta: Tensor | None,
    *,
    rho: Tensor | float = 1.0,
    eta: float,
    d_min: float,
    d_max: float,
    beta_aware: bool,
    eps: float,
) -> tuple[Tensor, Tensor]:
    """One sub-step of OSDN's scan (`RECURRENCE.md`, "OSDN") on `d` `[N, H, K]`: the write
    key `d * k` with the current `d`, then the next `d`. `k` `[N, H, K]`, `beta` `[N, H]`,
    `rho` the APF retain `[N, H, 1]` at a token's first sub-step (1 elsewhere)."""
    s = k * k
    norm = torch.clamp(s.sum(-1, keepdim=True), min=eps)
    key = d * k  # emit with the current d, then update
    align = (d * s).sum(-1, keepdim=True)
    if beta_aware:
        b = beta[..., None]
        step = eta * b * (1 - b * align) / norm * s
    else:
        step = eta * (1 - align) / norm * s
    return key, torch.clamp(rho * d + step, d_min, d_max)


def decode_step_naive(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    state: Tensor,
    *,
    g: Tensor | None = None,
    gate: object = None,
    beta: Tensor | None = None,
    write_key: Tensor | None = None,
    erase: Tensor | None = None,
    n_h: int = 1,
    scale: float | None = None,
    d: Tensor | None = None,
    retain: Tensor | None = None,
    eta: float = 0.003,
    d_min: float = 0.5,
    d_max: float = 2.0,
    beta_aware: bool = True,
    eps: float = 1e-6,
) -> Tensor:
    """One token of `RECURRENCE.md` for every row: the gate, `n_h` sub-steps (with OSDN's
    write keys and `d` update when `d` is given), the read-out. Arguments as
    `archspec.kernels.decode_step` (`[B, 1, ...]` token layout); updates `state` (and `d`)
    in place and returns `o` `[B, 1, H, V]` in the dtype of `v`."""
    acc = state.dtype
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    S = apply_gate(state, None if g is None else g[:, 0].to(acc))
    dd = None if d is None else d.to(acc)
    for j in range(n_h):
        kj = k[:, j].to(acc)
        bj = None if beta is None else beta[:, j].to(acc)
        wj = None if write_key is None else write_key[:, j].to(acc)
        if dd is not None:
            rho = retain[:, 0].to(acc)[..., None] if (retain is not None and j == 0) else 1.0
            wj, dd = osdn_update(dd, kj, bj, rho=rho, eta=eta, d_min=d_min, d_max=d_max, beta_aware=beta_aware, eps=eps)
        S = recurrence_step(S, kj, v[:, j].to(acc), beta=bj, write_key=wj,
                            erase=None if erase is None else erase[:, j].to(acc))
    o = torch.einsum("bhkv,bhk->bhv", S, scale * q[:, 0].to(acc))
    state.copy_(S)
    if d is not None:
        d.copy_(dd)
    return o[:, None].to(v.dtype)


def _run_one_sequence(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None,
    beta: Tensor | None,
    write_key: Tensor | None,
    erase: Tensor | None,
    n_h: int,
    scale: float,
    state: Tensor,
    acc: torch.dtype,
) -> tuple[Tensor, Tensor]:
    """Token loop over `[B, T, ...]` inputs from `state` `[B, H, K, V]`; returns (o, state)."""
    T = q.shape[1]
    outputs = []
    for t in range(T):
        if g is not None:
            state = apply_gate(state, g[:, t].to(acc))
        for j in range(n_h):
            i = t * n_h + j
            state = recurrence_step(
                state,
                k[:, i].to(acc),
                v[:, i].to(acc),
                beta=None if beta is None else beta[:, i].to(acc),
                write_key=None if write_key is None else write_key[:, i].to(acc),
                erase=None if erase is None else erase[:, i].to(acc),
            )
        outputs.append(torch.einsum("bhkv,bhk->bhv", state, scale * q[:, t].to(acc)))
    if outputs:
        o = torch.stack(outputs, dim=1)
    else:
        o = q.new_zeros(q.shape[0], 0, q.shape[2], v.shape[-1], dtype=acc)
    return o, state


def linear_recurrence_naive(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    g: Tensor | None = None,
    gate: object = None,
    beta: Tensor | None = None,
    write_key: Tensor | None = None,
    erase: Tensor | None = None,
    n_h: int = 1,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """The token loop of `RECURRENCE.md`; arguments as `archspec.kernels.linear_recurrence`.
    The definition reads the gate's kind from `g`'s shape (`[.., H]` scalar, `[.., H, K]`
    channel), which the API has checked against `gate`."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    acc = accumulation_dtype(q, k, v, g, beta, write_key, erase, initial_state)
    scale = K**-0.5 if scale is None else scale

    if cu_seqlens is None:
        if initial_state is None:
            state = q.new_zeros(B, H, K, V, dtype=acc)
        else:
            state = initial_state.to(acc)
        o, state = _run_one_sequence(q, k, v, g, beta, write_key, erase, n_h, scale, state, acc)
        return o.to(v.dtype), (state if output_final_state else None)

    # Packed variable-length batch: B == 1, each sequence starts from its own state.
    offsets = [int(x) for x in cu_seqlens.tolist()]
    outs, finals = [], []
    for n, (start, end) in enumerate(zip(offsets[:-1], offsets[1:])):
        if initial_state is None:
            state = q.new_zeros(1, H, K, V, dtype=acc)
        else:
            state = initial_state[n : n + 1].to(acc)
        sub = slice(start * n_h, end * n_h)
        o, state = _run_one_sequence(
            q[:, start:end],
            k[:, sub],
            v[:, sub],
            None if g is None else g[:, start:end],
            None if beta is None else beta[:, sub],
            None if write_key is None else write_key[:, sub],
            None if erase is None else erase[:, sub],
            n_h,
            scale,
            state,
            acc,
        )
        outs.append(o)
        finals.append(state)
    o = torch.cat(outs, dim=1).to(v.dtype)
    final = torch.cat(finals, dim=0) if output_final_state else None
    return o, final


def osdn_write_keys_naive(
    k: Tensor,
    beta: Tensor | None,
    *,
    eta: float = 0.003,
    d_min: float = 0.5,
    d_max: float = 2.0,
    retain: Tensor | None = None,
    beta_aware: bool = True,
    d0: Tensor | None = None,
    eps: float = 1e-6,
    cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """OSDN phase 1 (`RECURRENCE.md`), one sub-step at a time.

    `k` `[B, T*n_h, H, K]`, `beta` `[B, T*n_h, H]` (unused when `beta_aware=False`),
    `retain` `[B, T, H]` applied at the first sub-step of each token, `d0` `[B, H, K]` or
    `[H, K]`. With `cu_seqlens` (token offsets, B == 1) `d` restarts from `d0` at each
    sequence. Returns the write keys `d_i * k_i` `[B, T*n_h, H, K]` (dtype of `k`) and the
    final `d` (`[B, H, K]`, or `[N, H, K]` with `cu_seqlens`).
    """
    B, TN, H, K = k.shape
    acc = accumulation_dtype(k, beta, retain, d0)
    n_h = 1 if retain is None else TN // retain.shape[1]
    if beta_aware and beta is None:
        raise ValueError("osdn_write_keys: beta_aware=True needs beta")

    def initial_d(batch: int, sequence: int | None = None) -> Tensor:
        """d_1: ones, a shared `[H, K]` vector, or per-sequence `[B or N, H, K]` rows."""
        if d0 is None:
            return k.new_ones(batch, H, K, dtype=acc)
        d = d0.to(acc)
        if d.dim() == 2:
            return d.expand(batch, H, K)
        return d if sequence is None else d[sequence : sequence + 1]

    def scan(lo: int, hi: int, d: Tensor) -> tuple[list[Tensor], Tensor]:
        keys = []
        for i in range(lo, hi):
            rho = 1.0
            if retain is not None and i % n_h == 0:  # APF acts once per token
                rho = retain[:, i // n_h].to(acc)[..., None]
            key, d = osdn_update(d, k[:, i].to(acc), None if beta is None else beta[:, i].to(acc), rho=rho, eta=eta,
                                 d_min=d_min, d_max=d_max, beta_aware=beta_aware, eps=eps)
            keys.append(key)
        return keys, d

    if cu_seqlens is None:
        keys, d = scan(0, TN, initial_d(B))
        w = torch.stack(keys, dim=1) if keys else k.new_zeros(B, 0, H, K, dtype=acc)
        return w.to(k.dtype), d

    offsets = [int(x) for x in cu_seqlens.tolist()]
    all_keys, finals = [], []
    for n, (start, end) in enumerate(zip(offsets[:-1], offsets[1:])):
        keys, d = scan(start * n_h, end * n_h, initial_d(1, n))
        all_keys.extend(keys)
        finals.append(d)
    w = torch.stack(all_keys, dim=1) if all_keys else k.new_zeros(B, 0, H, K, dtype=acc)
    return w.to(k.dtype), torch.cat(finals, dim=0)
