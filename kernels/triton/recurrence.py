"""`linear_recurrence` on the Triton chunk kernel: launches, flags and autograd.

One kernel family serves every plan; the flags below are `tl.constexpr`, so each plan
compiles to its own specialization and a plain DeltaNet carries no gate, erase or
beta-free code:

    MODE      the transition (`kinds.Mode`): diagonal (no delta rule), householder (beta,
              no erase), rwkv7 (erase)
    GATE      the gate kind (`kinds.Gate`): none, scalar `[B, T, H]`, channel `[B, T, H, K]`
    NH        sub-steps per token (chunks align to tokens, read-outs only at a token's last)
    HAS_BETA  rwkv7 writes `beta * v` (else `v`); householder always has beta
    tied write key: `w` is the same tensor as `k` (no flag needed; gradients are summed)
    USE_H0 / STORE_HT, IS_VARLEN (cu_seqlens), ACC (float32, or float64 for float64 inputs)

Forward: [gate cumsum] -> inverse, prepare (UT transform, delta rules only) -> state pass -> output.
Backward: local output gradients -> reverse state pass -> one chunk-parallel kernel for
every input gradient (`backward.py`; a channel gate: two, `backward_channel.py`). Each
launch's warps and stages come from `launch.py`'s table. See `docs/kernel.md` for the
algorithm and numbers.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton.language as tl

from ..chunking import TRITON_CHUNK_SIZE
from ..kinds import Gate, Mode, triton_interpreter_on
from ..recompute import Recompute, pack, unpack
from . import decay, launch
from .backward import chunk_backward_kernel
from .backward_channel import chunk_channels_kernel, chunk_pairs_kernel
from .chunks import chunk_tables
from .gate import gate_cumsum_kernel
from .kinds import accumulation, channel_passes
from .launch import Launch, pow2
from .output import output_backward_kernel, output_kernel
from .prepare import inverse_kernel, prepare_kernel
from .state import state_backward_kernel, state_forward_kernel

Tensor = torch.Tensor

SUB_CHUNK = 16  # channel-gate sub-chunk: pairs inside it are decayed element by element
MAX_HEAD_DIM = 256
# The narrowest K and V blocks of the chunk kernels' tensor-core products. On the H200
# (Triton 3.6) blocks 16 wide, at heads of 8 or 16 in K or V, raised an illegal memory
# access in float32 (tf32x3) and gave wrong values in bfloat16 (relative errors 0.3-1.9
# against float64, no error raised); 32-wide blocks, the narrow heads masked in them, were
# right in both (`test_small_heads_on_cuda`). Slices of 16 inside a wider block are not
# affected (`INVERSE_BK_WITHIN_BOUND`, `SUB_CHUNK` pass the GPU check at K = 128).
MIN_BLOCK = 32
GATE_CUMSUM_BK = 32  # a channel gate's columns per program of the cumulative sum (`gate.py`)
PREPARE_BK = 64  # P's columns per slice in `prepare_kernel` without a channel gate
INVERSE_BK = 32  # K columns per slice of the inverse's scores (16 in a channel gate's first pass)
INVERSE_BK_WITHIN_BOUND = 16  # the gated slices' 166 registers at 2 warps, not 246


@dataclass(frozen=True)
class Plan:
    """Everything that selects a specialization and a launch grid."""

    B: int
    T: int
    H: int
    K: int
    V: int
    n_h: int
    mode: Mode
    gate: Gate
    has_beta: bool
    BT: int
    TC: int
    BQ: int
    BK: int
    BV: int
    BVS: int  # V block of the state passes
    SC: int
    NT: int
    n_seq: int
    n_chunks: int
    acc: torch.dtype
    prec: str
    launch: Launch
    op: torch.dtype  # dot operands
    stored: torch.dtype  # the stored intermediates P, X, Y and chunk states (`_stored_dtype`)

    @property
    def tl_acc(self):
        return accumulation(self.acc)[1]

    @property
    def tl_op(self):
        return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}.get(self.op, tl.float64)

    @property
    def state_forward_bv(self) -> int:
        return max(MIN_BLOCK, min(self.launch.state_forward_bv, pow2(self.V)))

    @property
    def backward_bk(self) -> int:
        return min(self.launch.backward_bk or self.BK, self.BK)


def _operand_dtype(dtype: torch.dtype, acc: torch.dtype, interpret: bool) -> torch.dtype:
    """Half inputs keep their dtype for dot operands (full-rate tensor cores); float32 and
    float64 keep theirs. Triton 3.7's interpreter computes bfloat16 dots wrongly (garbage
    magnitudes, seen on CPU), so under it bfloat16 operands are widened to float32; the
    GPU check (`benchmarks/gpu_check.py`) runs the real bfloat16 path."""
    if dtype == torch.float16 or (dtype == torch.bfloat16 and not interpret):
        return dtype
    return acc


def _stored_dtype(dtype: torch.dtype, acc: torch.dtype, interpret: bool, emulated: bool) -> torch.dtype:
    """The operands' dtype, except bfloat16 on the interpreter with the GPU's products
    emulated (`decay.EMULATED_BF16_PRODUCTS`, tests only): the intermediates are then stored
    in bfloat16 as on the GPU, rounded to nearest as the GPU rounds (`decay.stored`)."""
    if emulated and dtype == torch.bfloat16:
        return dtype
    return _operand_dtype(dtype, acc, interpret)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _plan(q, k, v, gate: Gate, beta, erase, n_h, cu_seqlens, chunk_table_count, chunk_size) -> Plan:
    n_seq = q.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
    interpret = triton_interpreter_on()
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    mode = Mode.of(beta, erase)
    settings = launch.settings(mode, gate, _operand_dtype(q.dtype, acc, interpret))
    return _plan_of(tuple(q.shape), v.shape[-1], q.dtype, mode, gate, beta is not None, n_h, n_seq,
                    None if cu_seqlens is None else chunk_table_count, chunk_size, interpret, settings,
                    interpret and bool(decay.EMULATED_BF16_PRODUCTS.value))


@functools.lru_cache(maxsize=256)
def _plan_of(shape: tuple, V: int, dtype: torch.dtype, mode: Mode, gate: Gate, has_beta: bool, n_h: int, n_seq: int,
             chunk_table_count: int | None, chunk_size: int | None, interpret: bool, settings: Launch,
             emulated: bool = False) -> Plan:
    """The plan of a call, cached: a training step calls with the same shapes every time,
    and building the plan is host time that can leave a short forward waiting on the CPU."""
    B, T, H, K = shape
    if K > MAX_HEAD_DIM or V > MAX_HEAD_DIM:
        raise ValueError(f"linear_recurrence(backend='triton'): head dims K={K}, V={V} exceed {MAX_HEAD_DIM}")
    BT = chunk_size or TRITON_CHUNK_SIZE
    if n_h > BT:
        raise ValueError(f"linear_recurrence(backend='triton'): n_h={n_h} exceeds the chunk size {BT}")
    TC = BT // n_h
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    NT = _cdiv(T, TC)
    return Plan(
        B=B, T=T, H=H, K=K, V=V, n_h=n_h, mode=mode, gate=gate, has_beta=has_beta,
        BT=BT, TC=TC, BQ=max(settings.min_query_rows, pow2(TC)),
        BK=max(MIN_BLOCK, pow2(K)), BV=max(MIN_BLOCK, min(settings.chunk_bv, pow2(V))),
        BVS=max(MIN_BLOCK, min(settings.state_bv, pow2(V))),
        SC=min(SUB_CHUNK, BT), NT=NT, n_seq=n_seq,
        n_chunks=B * NT if chunk_table_count is None else chunk_table_count,
        acc=acc, prec={torch.float64: "ieee", torch.float32: "tf32x3"}.get(dtype, "tf32"),
        launch=settings, op=_operand_dtype(dtype, acc, interpret), stored=_stored_dtype(dtype, acc, interpret, emulated),
    )


def _common(p: Plan, state: bool = False) -> dict:
    """Constexprs shared by every kernel; the state passes take narrower V blocks (more
    programs in flight, a smaller state tile in registers)."""
    return dict(H=p.H, K=p.K, V=p.V, BK=p.BK, BV=p.BVS if state else p.BV, BT=p.BT, TC=p.TC, NH=p.n_h,
                ACC=p.tl_acc, OP=p.tl_op, PREC=p.prec)


class ChunkRecurrence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, gate, beta, write_key, erase, initial_state, scale, n_h, output_final_state, cu_seqlens,
                chunk_size, recompute=None):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        g = None if g is None else g.contiguous()
        beta = None if beta is None else beta.contiguous()
        w = k if write_key is None else write_key.contiguous()
        e = None if erase is None else erase.contiguous()
        if cu_seqlens is not None:
            table, offsets, count = chunk_tables(cu_seqlens, (chunk_size or TRITON_CHUNK_SIZE) // n_h)
        else:
            table = offsets = None
            count = 0
        p = _plan(q, k, v, gate, beta, e, n_h, cu_seqlens, count, chunk_size)
        run = p.launch
        dev = q.device
        varlen = cu_seqlens is not None
        channel = p.gate == Gate.CHANNEL
        dummy = k  # stands in for absent optional tensors (never read: its flag is off)

        G = None if p.gate == Gate.NONE else _gate_cumsum(p, g, cu_seqlens, table)
        Tinv = None
        if p.mode != Mode.DIAGONAL:
            Tinv = torch.empty(p.n_chunks, p.H, p.BT, p.BT, device=dev, dtype=p.acc)
            # a channel gate: the chunks within decay.py's bound first, marking the others in `slow`
            slow = torch.empty(p.n_chunks * p.H, device=dev, dtype=torch.int8) if channel else dummy
            for channel_pass in channel_passes(p.gate):
                within = channel_pass == channel_pass.WITHIN_BOUND
                inverse_kernel[(p.n_chunks, p.H)](
                    k, w, dummy if e is None else e, dummy if beta is None else beta, dummy if G is None else G,
                    Tinv, slow, cu_seqlens, table, p.T, p.NT, H=p.H, K=p.K, BK=p.BK,
                    BKI=min(p.BK, INVERSE_BK_WITHIN_BOUND if within else INVERSE_BK),
                    BT=p.BT, TC=p.TC, NH=p.n_h, SC=p.SC, MODE=p.mode.value, GATE=p.gate.value, IS_VARLEN=varlen, ACC=p.tl_acc,
                    OP=p.tl_op, PREC=p.prec, INV_PREC="ieee" if p.acc == torch.float64 else "tf32x3",
                    CHANNEL_PASS=channel_pass.value, num_warps=run.inverse_warps_within_bound if within else run.inverse_warps,
                    num_stages=run.inverse_stages,
                )
        initial_state = None if initial_state is None else initial_state.contiguous()
        final = torch.empty(p.n_seq, p.H, p.K, p.V, device=dev, dtype=p.acc) if output_final_state else None
        _, Y, h_all = _chunk_states(p, k, w, e, beta, v, G, Tinv, initial_state, final, cu_seqlens, table, offsets)
        o = torch.empty(p.B, p.T, p.H, p.V, device=dev, dtype=v.dtype)
        for channel_pass in channel_passes(p.gate):
            within = channel_pass == channel_pass.WITHIN_BOUND
            output_kernel[(p.n_chunks, p.H)](
                q, w, dummy if e is None else e, dummy if beta is None else beta, v, dummy if G is None else G,
                dummy if Y is None else Y, h_all, o, cu_seqlens, table, p.T, p.NT, scale,
                BQ=p.BQ, SC=p.SC, MODE=p.mode.value, GATE=p.gate.value, HAS_BETA=p.has_beta, IS_VARLEN=varlen,
                CHANNEL_PASS=channel_pass.value, num_warps=run.output_warps_within_bound if within else run.output_warps,
                num_stages=run.output_stages, **_common(p),
            )
        # P, Y and the chunk states (K x V per chunk and head, as much as P and Y together)
        # are not kept: the backward forms them again from Tinv, as fla's kernels recompute
        # theirs from their A. Inputs with a `Recompute` are formed again too, from what
        # their recipe needs (`kernels/recompute.py`).
        again = dict(recompute or {})
        inputs = {"q": q, "k": k, "v": v, "write_key": None if write_key is None else w, "g": g}
        kept = [None if name in again else t for name, t in inputs.items() if name != "g"]
        G_kept = None if "g" in again else G  # the gate's chunk sums, formed again from g
        recipe_tensors, ctx.recipes = pack(again)
        own = (*kept, beta, e, G_kept, Tinv, initial_state, cu_seqlens, table, offsets)
        ctx.n_own = len(own)  # the recipes' tensors follow
        ctx.save_for_backward(*own, *recipe_tensors)
        ctx.shapes = {name: (t.shape, t.dtype) for name, t in inputs.items() if name in again}
        ctx.plan, ctx.scale, ctx.tied = p, scale, write_key is None
        ctx.has_h0 = initial_state is not None
        ctx.dtypes = (q.dtype, k.dtype, v.dtype, None if g is None else g.dtype, None if beta is None else beta.dtype,
                      w.dtype, None if e is None else e.dtype, None if initial_state is None else initial_state.dtype)
        if final is not None:
            final = final.float() if p.acc != torch.float64 else final
        return o, final

    @staticmethod
    def backward(ctx, do, dfinal):
        saved = ctx.saved_tensors
        q, k, v, w, beta, e, G, Tinv, initial_state, cu_seqlens, table, offsets = saved[:ctx.n_own]
        again = unpack(ctx.recipes, saved[ctx.n_own:])
        for name, t in again.items():
            shape, dtype = ctx.shapes[name]
            if t.shape != shape or t.dtype != dtype:
                raise RuntimeError(f"linear_recurrence: the recompute of {name} gave {tuple(t.shape)} {t.dtype}, "
                                   f"the forward had {tuple(shape)} {dtype}")
        q, k, v = (again[n].contiguous() if n in again else t for n, t in (("q", q), ("k", k), ("v", v)))
        w = k if ctx.tied else again["write_key"].contiguous() if "write_key" in again else w
        p, scale = ctx.plan, ctx.scale
        if "g" in again:
            G = _gate_cumsum(p, again["g"].contiguous(), cu_seqlens, table)
        run = p.launch
        varlen = cu_seqlens is not None
        dummy = k
        do = do.contiguous()
        TN = p.T * p.n_h
        dev = q.device
        P, Y, h_all = _chunk_states(p, k, w, e, beta, v, G, Tinv, initial_state, None, cu_seqlens, table, offsets)
        dY = torch.empty(p.B, TN, p.H, p.V, device=dev, dtype=p.acc) if p.mode != Mode.DIAGONAL else None
        dU = torch.empty(p.B, TN, p.H, p.V, device=dev, dtype=p.acc) if p.mode != Mode.HOUSEHOLDER else None
        e_ = dummy if e is None else e
        G_ = dummy if G is None else G
        beta_ = dummy if beta is None else beta
        for channel_pass in channel_passes(p.gate):
            output_backward_kernel[(p.n_chunks, p.H)](
                q, w, e_, G_, do, dummy if dY is None else dY, dummy if dU is None else dU, cu_seqlens, table, p.T, p.NT, scale,
                BQ=p.BQ, SC=p.SC, MODE=p.mode.value, GATE=p.gate.value, IS_VARLEN=varlen, CHANNEL_PASS=channel_pass.value,
                num_warps=run.chunk_warps, num_stages=1, **_common(p),
            )
        dh_all = torch.empty(h_all.shape, device=dev, dtype=p.stored)
        dh0 = torch.empty(p.n_seq, p.H, p.K, p.V, device=dev, dtype=p.acc) if ctx.has_h0 else None
        state_backward_kernel[(_cdiv(p.V, p.BVS), p.n_seq * p.H)](
            q, w, e_, beta_, G_, dummy if P is None else P, dummy if dY is None else dY, dummy if dU is None else dU, do,
            dh_all, dummy if dfinal is None else dfinal.contiguous(), dummy if dh0 is None else dh0,
            cu_seqlens, offsets, p.T, p.NT, scale, BQ=p.BQ, MODE=p.mode.value, GATE=p.gate.value,
            USE_DHT=dfinal is not None, STORE_DH0=dh0 is not None, IS_VARLEN=varlen, num_warps=run.state_warps,
            num_stages=run.state_backward_stages, **_common(p, state=True),
        )
        # every input gradient is stored once by the last kernels, from float32 registers, so
        # its buffer takes the input's dtype (no cast kernels after them)
        tq, tk, tv, tg, tb, tw, te, th = ctx.dtypes
        grad = lambda x, dt: torch.empty(x.shape, device=dev, dtype=dt)  # noqa: E731
        dq, dk, dv = grad(q, tq), grad(k, tk), grad(v, tv)
        dw = None if ctx.tied else grad(w, tw)  # a tied key's gradient joins dk's in the kernel
        de = None if e is None else grad(e, te)
        dbeta = None if beta is None else grad(beta, tb)
        dg = None if G is None else grad(G, tg)
        args = (q, k, w, e_, beta_, v, G_, dummy if Tinv is None else Tinv, h_all, dh_all,
                dummy if Y is None else Y, dummy if dY is None else dY, dummy if dU is None else dU, do)
        flags = {**{name: val for name, val in _common(p).items() if name != "BK"}, "BKS": p.backward_bk,
                 "BQ": p.BQ, "SC": p.SC, "MODE": p.mode.value, "GATE": p.gate.value, "HAS_BETA": p.has_beta, "IS_VARLEN": varlen,
                 "num_warps": run.backward_warps, "num_stages": run.backward_stages}
        if run.backward_maxnreg:
            flags["maxnreg"] = run.backward_maxnreg
        if p.gate == Gate.CHANNEL:
            _channel_backward(p, args, (dq, dk, dw, de, dv, dbeta, dg), cu_seqlens, table, scale, ctx.tied, flags)
        else:
            chunk_backward_kernel[(p.n_chunks, p.H)](
                *args, dq, dk, dummy if dw is None else dw, dummy if de is None else de, dv,
                dummy if dbeta is None else dbeta, dummy if dg is None else dg,
                cu_seqlens, table, p.T, p.NT, scale, TIED=ctx.tied, **flags,
            )
        return (dq, dk, dv, dg, None, dbeta, dw, de, None if dh0 is None else dh0.to(th), None, None, None, None, None,
                None, None)


def _gate_cumsum(p: Plan, g: Tensor, cu_seqlens, table) -> Tensor:
    """`G`, the gate's log decay summed within each chunk (in the accumulation dtype)."""
    channel = p.gate == Gate.CHANNEL
    G = torch.empty_like(g, dtype=p.acc)
    bkc = min(p.BK, GATE_CUMSUM_BK) if channel else p.BK
    gate_cumsum_kernel[(p.n_chunks, p.H, _cdiv(p.K, bkc) if channel else 1)](
        g, G, cu_seqlens, table, p.T, p.NT, H=p.H, K=p.K, BK=bkc, TC=p.TC, BQ=p.BQ,
        CHANNEL=channel, IS_VARLEN=cu_seqlens is not None, ACC=p.tl_acc,
    )
    return G


def _chunk_states(p: Plan, k, w, e, beta, v, G, Tinv, initial_state, final, cu_seqlens, table,
                  offsets) -> tuple[Tensor | None, Tensor | None, Tensor]:
    """`(P, Y, chunk start states)`: for a delta rule `prepare` (`P = Tinv diag(c) K~`,
    `X = Tinv Z`) and then the sequential state pass (`Y = X - P S_0`, every chunk's
    starting state, and the final state where `final` is given). The forward runs both,
    and the backward again instead of keeping their outputs."""
    dummy = k
    varlen = cu_seqlens is not None
    TN = p.T * p.n_h
    P = X = Y = None
    if p.mode != Mode.DIAGONAL:
        P = torch.empty(p.B, TN, p.H, p.K, device=k.device, dtype=p.stored)
        X = torch.empty(p.B, TN, p.H, p.V, device=k.device, dtype=p.stored)
        Y = torch.empty_like(X)
        prepare_kernel[(p.n_chunks, p.H)](
            k, w, dummy if beta is None else beta, v, dummy if G is None else G,
            Tinv, P, X, cu_seqlens, table, p.T, p.NT, BKP=p.BK if p.gate == Gate.CHANNEL else min(p.BK, PREPARE_BK),
            SC=p.SC, MODE=p.mode.value, GATE=p.gate.value, HAS_BETA=p.has_beta, IS_VARLEN=varlen,
            num_warps=p.launch.prepare_warps, num_stages=p.launch.prepare_stages, **_common(p),
        )
    h_all = torch.empty(p.n_chunks, p.H, p.K, p.V, device=k.device, dtype=p.stored)
    bvf = p.state_forward_bv
    state_forward_kernel[(_cdiv(p.V, bvf), p.n_seq * p.H)](
        k, w, dummy if e is None else e, dummy if beta is None else beta, v, dummy if G is None else G,
        dummy if P is None else P, dummy if X is None else X, dummy if Y is None else Y,
        h_all, dummy if initial_state is None else initial_state, dummy if final is None else final,
        cu_seqlens, offsets, p.T, p.NT, MODE=p.mode.value, GATE=p.gate.value, HAS_BETA=p.has_beta,
        USE_H0=initial_state is not None, STORE_HT=final is not None, IS_VARLEN=varlen,
        num_warps=p.launch.state_forward_warps, num_stages=p.launch.state_forward_stages,
        **{**_common(p, state=True), "BV": bvf},
    )
    return P, Y, h_all


def _channel_backward(p: Plan, args: tuple, grads: tuple, cu_seqlens, table, scale: float, tied: bool,
                      flags: dict) -> None:
    """A channel gate's last backward step: `chunk_pairs_kernel`, then `chunk_channels_kernel`
    on slices of `BKS` columns of K, the `C x C` matrices passed in float32 scratch."""
    q, k, w, e, beta, v, G, Tinv, h_all, dh_all, Y, dY, dU, do = args
    dq, dk, dw, de, dv, dbeta, dg = grads
    delta, plain = p.mode != Mode.DIAGONAL, p.mode != Mode.HOUSEHOLDER
    scratch = lambda rows, used: (torch.empty(p.n_chunks, p.H, rows, p.BT, device=q.device, dtype=p.acc)  # noqa: E731
                                  if used else q)
    s_a, s_kw, s_me, s_mw = scratch(p.BT, delta), scratch(p.BT, p.mode == Mode.RWKV7), scratch(p.BQ, delta), scratch(p.BQ, plain)
    dummy = k
    for channel_pass in channel_passes(p.gate):  # each chunk's pass decided the same way in both kernels
        chunk_pairs_kernel[(p.n_chunks, p.H)](
            k, w, e, beta, v, G, Tinv, h_all, Y, dY, dU, do, dv, dummy if dbeta is None else dbeta,
            s_a, s_kw, s_me, s_mw, cu_seqlens, table, p.T, p.NT, BKG=p.BK, CHANNEL_PASS=channel_pass.value, **flags,
        )
    for channel_pass in channel_passes(p.gate):
        chunk_channels_kernel[(_cdiv(p.K, flags["BKS"]), p.n_chunks, p.H)](
            q, k, w, e, beta, v, G, Tinv, h_all, dh_all, Y, dY, do, dq, dk, dummy if dw is None else dw,
            dummy if de is None else de, dg, s_a, s_kw, s_me, s_mw, cu_seqlens, table, p.T, p.NT, scale, TIED=tied,
            BKG=p.BK, CHANNEL_PASS=channel_pass.value, **flags,
        )


def linear_recurrence_triton(
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
    recompute: dict[str, Recompute] | None = None,
) -> tuple[Tensor, Tensor | None]:
    """The Triton backend of `archspec.kernels.linear_recurrence` (inputs already checked;
    `gate` is the kind of `g`, as the API resolved it). `recompute`: the inputs the
    backward forms again instead of keeping (`kernels/recompute.py`); an input the call
    changes on its way to the kernel (float64 queries take the scale, half-precision heads
    below 64 are padded) is kept instead.

    `chunk_size` (sub-steps per chunk, a power of two >= 16) is for tests; the default is
    `TRITON_CHUNK_SIZE`.
    """
    recompute = dict(recompute or {})
    gate = Gate.of(g) if gate is None else gate
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if q.shape[1] == 0:  # nothing to run: the state passes through unchanged
        B, _, H, K = q.shape
        o = v.new_zeros(B, 0, H, v.shape[-1])
        if not output_final_state:
            return o, None
        n_seq = B if cu_seqlens is None else cu_seqlens.numel() - 1
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        final = q.new_zeros(n_seq, H, K, v.shape[-1], dtype=acc) if initial_state is None else initial_state.to(acc).clone()
        return o, final
    if q.dtype == torch.float64 and scale != 1.0:
        # A float argument reaches a compiled kernel as float32: the scale would carry 7
        # digits (1.8e-8 off at K = 48 on the H200). In float64 the queries take it here.
        q, scale = q * scale, 1.0
        recompute.pop("q", None)
    K, V = q.shape[-1], v.shape[-1]
    padded = half_precision_head_dims(K, V)
    if q.is_cuda and launch.Precision.of(q.dtype) == launch.Precision.HALF and padded != (K, V):
        return _with_padded_heads(q, k, v, g, gate, beta, write_key, erase, n_h, scale, initial_state,
                                  output_final_state, cu_seqlens, chunk_size, padded)
    return ChunkRecurrence.apply(
        q, k, v, g, gate, beta, write_key, erase, initial_state, scale, n_h, output_final_state, cu_seqlens, chunk_size,
        recompute,
    )


# The narrowest head a bfloat16 / float16 call runs at on CUDA (`half_precision_head_dims`).
HALF_PRECISION_MIN_HEAD = 64


def half_precision_head_dims(K: int, V: int) -> tuple[int, int]:
    """The head sizes a bfloat16 / float16 call runs at on CUDA (`(K, V)` when unpadded):
    powers of two of at least `HALF_PRECISION_MIN_HEAD`.

    On the H200 (Triton 3.6), against float64, in bfloat16 (float32 was right at every
    shape): DeltaNet was right at 64x64, 64x128, 128x64, 128x128 and 128x256, and silently
    wrong, no error raised, at 24x40 (relative error 3.7), 32x64 (3.4 in dk) and 64x32 (1.1
    in the output). At 32x32 DeltaNet, RWKV-7 and KDA were right, but RWKV-7 with n_h = 2,
    beta up to 2 and a channel gate was wrong at heads of 4x6, 8x8 and 16x16 run at 32x32,
    and right at 24x40 run at 64x64 (`test_small_channel_gated_heads_on_cuda`). So every
    half-precision head below 64 runs at 64: the cost falls only on heads that small, whose
    layers are launch-bound anyway."""
    return max(pow2(K), HALF_PRECISION_MIN_HEAD), max(pow2(V), HALF_PRECISION_MIN_HEAD)


def _with_padded_heads(q, k, v, g, gate: Gate, beta, write_key, erase, n_h: int, scale: float, initial_state,
                       output_final_state: bool, cu_seqlens, chunk_size, padded: tuple[int, int]
                       ) -> tuple[Tensor, Tensor | None]:
    """The recurrence with K and V zero-padded to `padded` (`half_precision_head_dims`),
    the padding cut off again. Zero key channels add nothing to any product, zero value
    columns give zero outputs, and the gradients of the padding are dropped by the cut; the
    scale stays that of the real K."""
    K, V = q.shape[-1], v.shape[-1]
    pad_k, pad_v = (0, padded[0] - K), (0, padded[1] - V)

    def keys(t: Tensor | None) -> Tensor | None:
        return None if t is None else F.pad(t, pad_k)

    o, final = ChunkRecurrence.apply(
        keys(q), keys(k), F.pad(v, pad_v), keys(g) if gate == Gate.CHANNEL else g, gate, beta, keys(write_key),
        keys(erase), None if initial_state is None else F.pad(initial_state, pad_v + pad_k), scale, n_h,
        output_final_state, cu_seqlens, chunk_size,
    )
    return o[..., :V].contiguous(), None if final is None else final[..., :K, :V].contiguous()
