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
    BETA_LOGITS   beta given as logits (`beta_scale * sigmoid`)
    DECAY, FORM   g given as the gate's projection (the log decay formed here, in that form)
    ACC           float32, or float64 for a float64 state

Layout: the token tensors as `kernels.decode_step` takes them (`[B, n_h, H, ...]`, each
row contiguous, read through its batch stride); `state` `[B, H, K, V]` and `d` `[B, H, K]`
contiguous, updated in place.

With `decay` the gate's log decay is formed in the step from its projection
(`-exp(A_log) * f(proj + bias)`, `log_decay.decay_of`), and with `beta_scale` beta from its logits:
the model's step hands over one projection's output instead of launching the gate and
the sigmoid apart. Every token tensor is read through its batch stride, so column slices
of that output go in without a copy.

Beside it, the mixer's streams of one token (`kernels.short_conv.stream_step`): q, k, v
(and a write key) side by side in one row, one launch for all of them. A program owns a
block of channels of one stream of one row (one head where the stream is L2-normalised),
reads the `W-1` carried inputs and the token, forms the conv, SiLU and norm, writes the
output and shifts the tail in place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kinds import DecayForm, Gate, Mode
from .kinds import CHANNEL_GATE, DIAGONAL, HOUSEHOLDER, SCALAR_GATE, accumulation
from .log_decay import decay_of
from .launch import DECODE_LAUNCH, SHORT_CONV_LAUNCH, DecodeLaunch, ShortConvLaunch, overlapped, pow2

Tensor = torch.Tensor

MAX_HEAD_DIM = 256  # K of one program's tile (the chunk kernel's limit too)


@triton.jit
def decode_step_kernel(
    q, k, v, g, beta, w, e, retain, state, d, o, a_log, decay_bias,
    q_sb, k_sb, v_sb, g_sb, beta_sb, w_sb, e_sb,
    scale, beta_scale, eta, d_min, d_max, eps,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NH: tl.constexpr,
    MODE: tl.constexpr, GATE: tl.constexpr, HAS_BETA: tl.constexpr, HAS_WRITE_KEY: tl.constexpr,
    OSDN: tl.constexpr, APF: tl.constexpr, BETA_AWARE: tl.constexpr, BETA_LOGITS: tl.constexpr,
    DECAY: tl.constexpr, FORM: tl.constexpr, OVERLAP: tl.constexpr, ACC: tl.constexpr,
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
    # With OVERLAP nothing is read before the kernel before this one has finished: that
    # may be the previous token's step of this state (steps called back to back), whose
    # writes a load ahead of the wait would race.
    if OVERLAP:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    S = tl.load(s_ptr, mask=tile, other=0.0).to(ACC)
    # Each token tensor is read through its own batch stride: they may be column slices
    # of one projection's output row.
    b = i_b.to(tl.int64)

    # The gate, once per token, before the sub-steps; with DECAY, g holds the gate's
    # projection and the log decay is formed here (`kernels.gate_log_decay`).
    if GATE == SCALAR_GATE:
        gv = tl.load(g + b * g_sb + i_h).to(ACC)
        if DECAY:
            gv = -tl.exp(tl.load(a_log + i_h).to(ACC)) * decay_of(gv + tl.load(decay_bias + i_h).to(ACC), FORM)
        S = S * tl.exp(gv)
    elif GATE == CHANNEL_GATE:
        gv = tl.load(g + b * g_sb + i_h * K + kk, mask=k_ok, other=0.0).to(ACC)
        if DECAY:
            bias = tl.load(decay_bias + i_h * K + kk, mask=k_ok, other=0.0).to(ACC)
            gv = -tl.exp(tl.load(a_log + i_h).to(ACC)) * decay_of(gv + bias, FORM)
        S = S * tl.exp(gv)[:, None]

    if OSDN:
        dv = tl.load(d + i_bh * K + kk, mask=k_ok, other=0.0).to(ACC)

    for j in tl.static_range(NH):
        sub = j * H + i_h  # sub-step j of this head in a row's `[NH, H]`
        kj = tl.load(k + b * k_sb + sub * K + kk, mask=k_ok, other=0.0).to(ACC)
        vj = tl.load(v + b * v_sb + sub * V + vv, mask=v_ok, other=0.0).to(ACC)
        if HAS_BETA:
            bj = tl.load(beta + b * beta_sb + sub).to(ACC)
            if BETA_LOGITS:
                bj = beta_scale * tl.sigmoid(bj)
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
            wj = tl.load(w + b * w_sb + sub * K + kk, mask=k_ok, other=0.0).to(ACC)
        else:
            wj = kj
        if MODE == DIAGONAL:
            S += wj[:, None] * vj[None, :]
        elif MODE == HOUSEHOLDER:
            residual = vj - tl.sum(S * kj[:, None], 0)
            S += wj[:, None] * (bj * residual)[None, :]
        else:  # rwkv7: S - e (S^T k)^T + b w v^T
            removed = tl.sum(S * kj[:, None], 0)
            ej = tl.load(e + b * e_sb + sub * K + kk, mask=k_ok, other=0.0).to(ACC)
            if HAS_BETA:
                vj = bj * vj
            S = S - ej[:, None] * removed[None, :] + wj[:, None] * vj[None, :]

    qv = tl.load(q + b * q_sb + i_h * K + kk, mask=k_ok, other=0.0).to(ACC) * scale
    out = tl.sum(S * qv[:, None], 0)
    tl.store(o + i_bh.to(tl.int64) * V + vv, out.to(o.dtype.element_ty), mask=v_ok)
    tl.store(s_ptr, S.to(state.dtype.element_ty), mask=tile)
    if OSDN:
        if i_v == 0:
            tl.store(d + i_bh * K + kk, dv.to(d.dtype.element_ty), mask=k_ok)


def _rows(t: Tensor | None) -> tuple[Tensor | None, int]:
    """`t` `[B, ...]` with each row contiguous (a copy only when a row is not), and its
    batch stride: a column slice of a wider `[B, C]` output is read in place."""
    if t is None:
        return None, 0
    if t.shape[0] and not t[0].is_contiguous():
        t = t.contiguous()
    return t, t.stride(0)


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
    beta_scale: float | None = None,
    decay: tuple[Tensor, Tensor] | None = None,
    decay_form: DecayForm = DecayForm.MAMBA2,
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
    (q, q_sb), (k, k_sb), (v, v_sb), (g, g_sb), (beta, beta_sb), (write_key, w_sb), (erase, e_sb) = (
        _rows(t) for t in (q, k, v, g, beta, write_key, erase))
    retain = None if retain is None else retain.contiguous()
    a_log, decay_bias = (q, q) if decay is None else (decay[0].contiguous(), decay[1].contiguous())
    mode = Mode.of(beta, erase)
    acc = accumulation(state.dtype)[1]
    overlap = overlapped(q.device)
    grid = (triton.cdiv(V, BV), B * H)
    decode_step_kernel[grid](
        q, k, v, q if g is None else g, q if beta is None else beta, q if write_key is None else write_key,
        q if erase is None else erase, q if retain is None else retain, state, state if d is None else d, o,
        a_log, decay_bias, q_sb, k_sb, v_sb, g_sb, beta_sb, w_sb, e_sb,
        scale, float(beta_scale or 1.0), float(eta), float(d_min), float(d_max), float(eps),
        H=H, K=K, V=V, BK=max(16, pow2(K)), BV=BV, NH=n_h,
        MODE=int(mode), GATE=int(gate), HAS_BETA=beta is not None, HAS_WRITE_KEY=write_key is not None,
        OSDN=d is not None, APF=retain is not None, BETA_AWARE=bool(beta_aware), BETA_LOGITS=beta_scale is not None,
        DECAY=decay is not None, FORM=int(decay_form), OVERLAP=overlap, ACC=acc, num_warps=launch.num_warps, num_stages=launch.num_stages,
        **({"launch_pdl": True} if overlap else {}),
    )
    return o


# The most streams `stream_step_triton` takes (q, k, v and a write key).
MAX_STREAMS = 4


@triton.jit
def _pick(seg, a0, a1, a2, a3):
    return tl.where(seg == 0, a0, tl.where(seg == 1, a1, tl.where(seg == 2, a2, a3)))


@triton.jit
def stream_step_kernel(
    x, w, tail, y, x_sb, C, eps,
    start0, width0, head0, start1, width1, head1, start2, width2, head2, start3, width3, head3,
    W: tl.constexpr, BC: tl.constexpr, CONV: tl.constexpr, OVERLAP: tl.constexpr, ACC: tl.constexpr,
):
    i_blk, seg, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    if OVERLAP:  # nothing is read before the kernel before this one has finished
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    start = _pick(seg, start0, start1, start2, start3)
    width = _pick(seg, width0, width1, width2, width3)
    head = _pick(seg, head0, head1, head2, head3)  # > 0: the L2 norm over groups of `head`
    size = tl.where(head > 0, head, BC)  # channels of this block
    lo = i_blk * size
    if lo < width:  # the grid fits the widest stream; the others' extra programs stop here
        offs = tl.arange(0, BC)
        ok = (offs < size) & (lo + offs < width)
        cc = start + lo + offs
        xt = tl.load(x + b * x_sb + cc, mask=ok, other=0.0).to(ACC)
        z = xt
        if CONV:
            z = xt * tl.load(w + cc * W + (W - 1), mask=ok, other=0.0).to(ACC)
            # tap j reads input t-(W-1)+j, the tail's row j; then the tail moves one input along
            for j in tl.static_range(W - 1):
                tj = tl.load(tail + (b * (W - 1) + j) * C + cc, mask=ok, other=0.0).to(ACC)
                z += tj * tl.load(w + cc * W + j, mask=ok, other=0.0).to(ACC)
                if j > 0:
                    tl.store(tail + (b * (W - 1) + j - 1) * C + cc, tj.to(tail.dtype.element_ty), mask=ok)
            if W > 1:
                tl.store(tail + (b * (W - 1) + W - 2) * C + cc, xt.to(tail.dtype.element_ty), mask=ok)
        z = z * tl.sigmoid(z)
        z = tl.where(head > 0, z / tl.maximum(tl.sqrt(tl.sum(z * z, 0)), eps), z)
        tl.store(y + b * C + cc, z.to(y.dtype.element_ty), mask=ok)


def stream_step_triton(x: Tensor, weight: Tensor | None, tail: Tensor | None, segments: tuple[tuple[int, int], ...],
                       eps: float, launch: ShortConvLaunch = SHORT_CONV_LAUNCH) -> Tensor:
    """`kernels.short_conv.stream_step` in one launch (arguments checked there): `x`
    `[B, 1, C]` with contiguous rows, `weight` `[C, W]`, `tail` `[B, W-1, C]` contiguous
    (shifted in place), or both None (no conv)."""
    B, _, C = x.shape
    y = torch.empty(B, 1, C, device=x.device, dtype=x.dtype)
    if B == 0:
        return y
    heads = [head for _, head in segments]
    block_c = max(pow2(max(heads)), min(launch.block_c, pow2(max(width for width, _ in segments))))
    slots, start = [], 0
    for width, head in segments:
        slots += [start, width, head]
        start += width
    slots += [C, 0, 0] * (MAX_STREAMS - len(segments))
    blocks = max(triton.cdiv(width, head or block_c) for width, head in segments)
    conv = weight is not None
    W = weight.shape[1] if conv else 1
    overlap = overlapped(x.device)
    stream_step_kernel[(blocks, len(segments), B)](
        x, weight if conv else x, tail if conv and W > 1 else x, y, x.stride(0), C, float(eps), *slots,
        W=W, BC=block_c, CONV=conv, OVERLAP=overlap, ACC=accumulation(x.dtype)[1], num_warps=launch.num_warps,
        **({"launch_pdl": True} if overlap else {}))
    return y
