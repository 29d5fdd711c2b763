"""The decoding step on Triton: one launch per layer per token, every plan of the chunk kernel.

One token of `RECURRENCE.md` for every row of a batch: the gate, the `n_h` sub-steps and
the read-out, with OSDN's write keys formed and its `d` updated in the same launch. The
step is bound by memory (the state is read and written once, the token's vectors are
small), so a program owns one `[K, BV]` tile of one row's state for one head: it loads
the tile once, applies every sub-step to it in registers and writes it back in place.
`S^T k` and the read-out are column sums over K, so tiles split along V need nothing from
each other; OSDN's `d` is a K-vector that every V-tile of a head recomputes identically
(a few dozen flops) and the first one stores.

Flags (`tl.constexpr`, one specialization each, named as `kinds.py` names them):

    MODE          diagonal, householder or rwkv7 (`kinds.Mode`)
    GATE          no, scalar `[B, 1, H]` or channel `[B, 1, H, K]` gate (`kinds.Gate`)
    NH            sub-steps per token
    HAS_BETA      rwkv7 writes `beta * v` (else `v`); householder always has beta
    HAS_WRITE_KEY an untied write key (else `w = k`, or `d * k` with OSDN)
    OSDN, APF, BETA_AWARE   the preconditioner, its retain gate and its update rule
    ACC           float32, or float64 for a float64 state

Layout: the token tensors as `kernels.decode_step` takes them (`[B, n_h, H, ...]`,
contiguous); `state` `[B, H, K, V]` and `d` `[B, H, K]` contiguous, updated in place.

Beside it, the short convolution's decoding step (`kernels.short_conv.short_conv_step`):
a program owns a block of channels of one row (one head with the L2 norm), reads the
`W-1` carried inputs and the token, forms the conv, SiLU and norm, writes the output and
shifts the tail in place: one launch per stream instead of a dozen small ones.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kinds import Gate, Mode
from .kinds import CHANNEL_GATE, DIAGONAL, HOUSEHOLDER, SCALAR_GATE, accumulation
from .launch import DECODE_LAUNCH, SHORT_CONV_LAUNCH, DecodeLaunch, ShortConvLaunch, pow2

Tensor = torch.Tensor

MAX_HEAD_DIM = 256  # K of one program's tile (the chunk kernel's limit too)


@triton.jit
def decode_step_kernel(
    q, k, v, g, beta, w, e, retain, state, d, o,
    scale, eta, d_min, d_max, eps,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NH: tl.constexpr,
    MODE: tl.constexpr, GATE: tl.constexpr, HAS_BETA: tl.constexpr, HAS_WRITE_KEY: tl.constexpr,
    OSDN: tl.constexpr, APF: tl.constexpr, BETA_AWARE: tl.constexpr, ACC: tl.constexpr,
):
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    kk = tl.arange(0, BK)
    vv = i_v * BV + tl.arange(0, BV)
    k_ok = kk < K
    v_ok = vv < V
    tile = k_ok[:, None] & v_ok[None, :]
    s_ptr = state + i_bh.to(tl.int64) * K * V + kk[:, None] * V + vv[None, :]
    S = tl.load(s_ptr, mask=tile, other=0.0).to(ACC)

    # The gate, once per token, before the sub-steps.
    if GATE == SCALAR_GATE:
        S = S * tl.exp(tl.load(g + i_bh).to(ACC))
    elif GATE == CHANNEL_GATE:
        S = S * tl.exp(tl.load(g + i_bh * K + kk, mask=k_ok, other=0.0).to(ACC))[:, None]

    if OSDN:
        dv = tl.load(d + i_bh * K + kk, mask=k_ok, other=0.0).to(ACC)

    for j in tl.static_range(NH):
        row = (i_b * NH + j) * H + i_h  # sub-step j of this row and head in `[B, NH, H]`
        kj = tl.load(k + row * K + kk, mask=k_ok, other=0.0).to(ACC)
        vj = tl.load(v + row * V + vv, mask=v_ok, other=0.0).to(ACC)
        if HAS_BETA:
            bj = tl.load(beta + row).to(ACC)
        if OSDN:
            # The write key with the current d, then d's update (`osdn_write_keys`).
            wj = dv * kj
            sq = kj * kj
            norm = tl.maximum(tl.sum(sq, 0), eps)
            align = tl.sum(dv * sq, 0)
            if BETA_AWARE:
                change = eta * bj * (1.0 - bj * align) / norm * sq
            else:
                change = eta * (1.0 - align) / norm * sq
            if APF and j == 0:
                dv = tl.load(retain + i_bh).to(ACC) * dv
            dv = tl.minimum(tl.maximum(dv + change, d_min), d_max)
        elif HAS_WRITE_KEY:
            wj = tl.load(w + row * K + kk, mask=k_ok, other=0.0).to(ACC)
        else:
            wj = kj
        if MODE == DIAGONAL:
            S += wj[:, None] * vj[None, :]
        elif MODE == HOUSEHOLDER:
            residual = vj - tl.sum(S * kj[:, None], 0)
            S += wj[:, None] * (bj * residual)[None, :]
        else:  # rwkv7: S - e (S^T k)^T + b w v^T
            removed = tl.sum(S * kj[:, None], 0)
            ej = tl.load(e + row * K + kk, mask=k_ok, other=0.0).to(ACC)
            if HAS_BETA:
                vj = bj * vj
            S = S - ej[:, None] * removed[None, :] + wj[:, None] * vj[None, :]

    qv = tl.load(q + i_bh * K + kk, mask=k_ok, other=0.0).to(ACC) * scale
    out = tl.sum(S * qv[:, None], 0)
    tl.store(o + i_bh.to(tl.int64) * V + vv, out.to(o.dtype.element_ty), mask=v_ok)
    tl.store(s_ptr, S.to(state.dtype.element_ty), mask=tile)
    if OSDN:
        if i_v == 0:
            tl.store(d + i_bh * K + kk, dv.to(d.dtype.element_ty), mask=k_ok)


def decode_step_triton(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    state: Tensor,
    *,
    g: Tensor | None = None,
    gate: Gate = Gate.NONE,
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
    launch: DecodeLaunch = DECODE_LAUNCH,
) -> Tensor:
    """`kernels.decode_step` on one launch (arguments checked by the API)."""
    B, _, H, K = q.shape
    V = v.shape[-1]
    if K > MAX_HEAD_DIM:
        raise NotImplementedError(f"decode_step on Triton: head_dim K={K} > {MAX_HEAD_DIM}")
    o = torch.empty(B, 1, H, V, device=v.device, dtype=v.dtype)
    if B == 0:
        return o
    BV = min(launch.block_v, max(16, pow2(V)))
    scale = K**-0.5 if scale is None else float(scale)
    if q.dtype == torch.float64 and scale != 1.0:  # a float argument reaches the kernel as float32 (`recurrence.py`)
        q, scale = q * scale, 1.0
    contiguous = [None if t is None else t.contiguous() for t in (q, k, v, g, beta, write_key, erase, retain)]
    q, k, v, g, beta, write_key, erase, retain = contiguous
    mode = Mode.of(beta, erase)
    acc = accumulation(state.dtype)[1]
    grid = (triton.cdiv(V, BV), B * H)
    decode_step_kernel[grid](
        q, k, v, q if g is None else g, q if beta is None else beta, q if write_key is None else write_key,
        q if erase is None else erase, q if retain is None else retain, state, state if d is None else d, o,
        scale, float(eta), float(d_min), float(d_max), float(eps),
        H=H, K=K, V=V, BK=max(16, pow2(K)), BV=BV, NH=n_h,
        MODE=int(mode), GATE=int(gate), HAS_BETA=beta is not None, HAS_WRITE_KEY=write_key is not None,
        OSDN=d is not None, APF=retain is not None, BETA_AWARE=bool(beta_aware), ACC=acc,
        num_warps=launch.num_warps, num_stages=launch.num_stages,
    )
    return o


@triton.jit
def short_conv_step_kernel(
    x, w, tail, y, C, eps,
    W: tl.constexpr, BC: tl.constexpr, HEAD: tl.constexpr, ACT: tl.constexpr, NORM: tl.constexpr, ACC: tl.constexpr,
):
    i_c, b = tl.program_id(0), tl.program_id(1)
    if NORM:
        cc = i_c * HEAD + tl.arange(0, BC)
        ok = tl.arange(0, BC) < HEAD
    else:
        cc = i_c * BC + tl.arange(0, BC)
        ok = cc < C
    row = b.to(tl.int64)
    xt = tl.load(x + row * C + cc, mask=ok, other=0.0).to(ACC)
    z = xt * tl.load(w + cc * W + (W - 1), mask=ok, other=0.0).to(ACC)
    # tap j reads input t-(W-1)+j, the tail's row j; then the tail moves one input along
    for j in tl.static_range(W - 1):
        tj = tl.load(tail + (row * (W - 1) + j) * C + cc, mask=ok, other=0.0).to(ACC)
        z += tj * tl.load(w + cc * W + j, mask=ok, other=0.0).to(ACC)
        if j > 0:
            tl.store(tail + (row * (W - 1) + j - 1) * C + cc, tj.to(tail.dtype.element_ty), mask=ok)
    if W > 1:
        tl.store(tail + (row * (W - 1) + W - 2) * C + cc, xt.to(tail.dtype.element_ty), mask=ok)
    if ACT:
        z = z * tl.sigmoid(z)
    if NORM:
        z = z / tl.maximum(tl.sqrt(tl.sum(z * z, 0)), eps)
    tl.store(y + row * C + cc, z.to(y.dtype.element_ty), mask=ok)


def short_conv_step_triton(x: Tensor, w: Tensor, tail: Tensor, *, activation: bool, head: int, eps: float,
                           launch: ShortConvLaunch = SHORT_CONV_LAUNCH) -> Tensor:
    """`x` `[B, 1, C]`, `w` `[C, W]`, `tail` `[B, W-1, C]` contiguous (shifted in place);
    `head` > 0 normalises each group of `head` channels. Checked by the caller."""
    B, _, C = x.shape
    W = w.shape[1]
    x = x.contiguous()
    w = w.contiguous()
    y = torch.empty_like(x)
    if B == 0:
        return y
    if head:
        grid, block_c = (C // head, B), pow2(head)
    else:
        block_c = min(launch.block_c, pow2(C))
        grid = (triton.cdiv(C, block_c), B)
    acc = accumulation(x.dtype)[1]
    short_conv_step_kernel[grid](x, w, tail, y, C, float(eps), W=W, BC=block_c, HEAD=max(head, 1), ACT=activation,
                                 NORM=head > 0, ACC=acc, num_warps=launch.num_warps)
    return y
