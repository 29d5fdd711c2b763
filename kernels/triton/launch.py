"""Launch settings of the Triton chunk kernels: warps, pipelining stages and block sizes
per kernel and plan, with the measurements that chose them (B=4 T=4096 H=16 K=V=128 on
the lent H200 unless said otherwise; `benchmarks/results/variants/README.md` lists the
calls). Each is read from an `ARCHSPEC_TRITON_*` environment variable at import, for
tuning in a fresh process (`benchmarks/variants.py`), and read again at every launch, so
`benchmarks/launch_sweep.py` can set them on this module between calls in one process.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .recurrence import Plan


def pow2(n: int) -> int:
    """The next power of two >= n. Host code uses this, not `triton.next_power_of_2`:
    that is a `constexpr_function`, about 3.5 us a call."""
    return 1 << max(0, n - 1).bit_length()


SWEEP = "benchmarks/results/variants/launch-sweep-17.json"  # session 7's in-process sweeps (below)


def half(p: Plan) -> bool:
    """Half-precision dot operands: the settings below that pipeline deeper hold several
    tiles per stage in shared memory, which float32 tiles (twice the bytes) overflow: the
    gated state pass asked for 257 KB with them (the H200 has 227 KB per block)."""
    return p.op in (torch.float16, torch.bfloat16)


# Software pipelining depth of the chunk-parallel kernels' loops; ARCHSPEC_TRITON_STAGES
# sets it for all of them. Default, per kernel (`chunk_stages`), from session 7's sweep
# (bf16; every other setting unchanged, one kernel's GPU time each; `SWEEP`): 2 took the
# channel gate's inverse from 0.263 to 0.203 ms (KDA) and 0.286 to 0.225 (RWKV-7), its
# read-out from 0.225 to 0.214 (KDA), 0.441 to 0.380 (RWKV-7), 0.224 to 0.214 (GLA), the
# scalar gate's read-out from 0.116 to 0.113 (GDN) and 0.116 to 0.111 (scalar GLA),
# RWKV-7's prepare from 0.310 to 0.297 and KDA's chunk_channels_kernel from 1.227 to 1.163
# (below, why only KDA's); it made slower GDN's prepare (0.099 -> 0.116),
# KDA's chunk_pairs_kernel (0.634 -> 0.698) and the one-kernel backward (DeltaNet 0.868
# -> 0.924, GDN 1.226 -> 1.299), which keep 1.
STAGES = os.environ.get("ARCHSPEC_TRITON_STAGES")


def chunk_stages(p: Plan, kernel: str) -> int:
    if STAGES:
        return int(STAGES)
    if not half(p):
        return 1
    # chunk_channels_kernel: KDA's alone, n_h <= 4 (checked right at n_h 1, 2, 4). At 2
    # stages on the H200 (session 7's checks, Triton 3.6) GLA-channel's (capped at 128
    # registers, `backward_maxnreg`) gave d_k and d_g 20 times off (4.8e-2 against 2.4e-3
    # relative) and RWKV-7's at n_h = 8 d_write_key 30 times off (9.8e-2 against 3.0e-3),
    # both right at 1: miscompiles.
    two = ((kernel == "inverse" and p.gate == 2) or (kernel == "output" and p.gate != 0)
           or (kernel == "prepare" and p.mode == 2) or (kernel == "channels" and p.mode == 1 and p.n_h <= 4))
    return 2 if two else 1


# The state passes' own: their loop over a sequence's chunks reads each chunk's rows, which
# do not depend on the carried state, so they are loaded stages - 1 chunks ahead. Forward,
# without a channel gate, 4 (with `state_forward_bv` 64): DeltaNet's state_forward took
# 0.139 ms at 2 (32-wide V blocks) and 0.104 at 4, GDN's 0.143 and 0.109, scalar GLA's 0.102
# and 0.071 (with 8 warps, `state_forward_warps`), near fla's fwd_h (0.107 for DeltaNet); a
# channel gate's at 3 or 4 was slower (KDA 0.222 -> 0.291) or over the shared memory.
# Backward, 3 with a scalar gate's delta rule (GDN 0.235 -> 0.186 ms), 2 otherwise (DeltaNet 0.257 at
# 2, 0.267 at 3; KDA 0.438, 0.570); 4 is over the shared memory. Earlier (session 4),
# 2 against 1: DeltaNet's state_forward 0.242 -> 0.173 ms, state_backward 0.348 -> 0.278.
STATE_STAGES = os.environ.get("ARCHSPEC_TRITON_STATE_STAGES")
STATE_BACKWARD_STAGES = os.environ.get("ARCHSPEC_TRITON_STATE_BACKWARD_STAGES")


def deep_state_forward(p: Plan) -> bool:
    """The forward state pass at 4 stages and 64-wide V blocks: half precision without a
    channel gate, and not RWKV-7's (its erase read-out's tiles took 272 KB of shared memory
    with a scalar gate: over the limit, session 7's check)."""
    return half(p) and p.gate != 2 and p.mode != 2


def state_forward_stages(p: Plan) -> int:
    if STATE_STAGES:
        return int(STATE_STAGES)
    return 4 if deep_state_forward(p) else 2 if half(p) else 1


def state_backward_stages(p: Plan) -> int:
    if STATE_BACKWARD_STAGES or STATE_STAGES:
        return int(STATE_BACKWARD_STAGES or STATE_STAGES)
    # 3 for the scalar-gated delta rule alone: RWKV-7's with a scalar gate asked for 247 KB
    # of shared memory at 3 (session 7's check), the diagonal one's is not timed at 3
    return (3 if p.gate == 1 and p.mode == 1 else 2) if half(p) else 1


# 64: Triton 3.6 on an H200 miscompiled the state backward with 32-wide V blocks and 8-warp
# chunk kernels (compute-sanitizer: invalid shared-memory read in a wgmma); 64 ran clean.
STATE_BV = int(os.environ.get("ARCHSPEC_TRITON_STATE_BV", "64"))
# The forward state pass's V block alone (the miscompile above was the backward's). Without
# a channel gate: 64 in half precision at 4 stages (above; at 2 stages 32 had been faster:
# DeltaNet 0.139 ms against 0.152, session 5), 32 in float32; a channel gate keeps
# `STATE_BV` (KDA 0.222 against 0.250 with 32, session 5).
STATE_FORWARD_BV = os.environ.get("ARCHSPEC_TRITON_STATE_FORWARD_BV")
# (chunk-parallel, state pass) warps per program; ARCHSPEC_TRITON_WARPS="8,4" overrides (tuning)
WARPS = tuple(int(x) for x in os.environ.get("ARCHSPEC_TRITON_WARPS", "8,4").split(","))
# The forward state pass's warps: 8 for a diagonal recurrence without a channel gate in
# half precision (scalar GLA's state_forward 0.084 ms with 4, 0.071 with 8, session 7),
# the state passes' otherwise (GDN's 0.109 with 4, 0.131 with 8).
STATE_FORWARD_WARPS = os.environ.get("ARCHSPEC_TRITON_STATE_FORWARD_WARPS")


def state_forward_warps(p: Plan) -> int:
    if STATE_FORWARD_WARPS:
        return int(STATE_FORWARD_WARPS)
    return 8 if (p.mode == 0 and p.gate != 2 and half(p)) else p.state_warps
# Warps of the last backward kernels (unset: below; ARCHSPEC_TRITON_BACKWARD_WARPS sets all).
# 4 for the one-kernel backward of a delta rule without a gate in half precision: on the
# H200 (session 9, `launch_sweep.py --backward`, bf16) chunk_backward_kernel took 0.861 ms
# at 8 and 0.764 at 4 for DeltaNet, 1.631 and 1.377 for DeltaProduct-2, 3.155 and 2.601 for
# DeltaProduct-4, 0.880 and 0.808 for OSDN-DeltaNet (checked right in bf16 and float32).
# The chunk kernels' otherwise: at 4 a scalar gate's was slower (Gated DeltaProduct-2
# 2.040 -> 2.783, OSDN-GDN 1.246 -> 1.822), KDA's channel kernels gave gradients 7e-2 off
# and GLA-channel's an illegal memory access (miscompiles); float32 is not timed at 4.
# Session 2's one-kernel backward (before the split) at 16: KDA 25.2 -> 24.1 ms
# forward+backward, DeltaNet 3.55 -> 4.05 (benchmarks/results/variants/variants-1-launch.md).
BACKWARD_WARPS = os.environ.get("ARCHSPEC_TRITON_BACKWARD_WARPS")


def backward_warps(p: Plan) -> int:
    if BACKWARD_WARPS:
        return int(BACKWARD_WARPS)
    return 4 if (half(p) and p.mode == 1 and p.gate == 0 and not split_backward(p)) else p.warps


# a register cap for the last backward kernels: at 128 per thread two 8-warp programs share
# an SM and hide each other's load latency, at the price of spills. On the H200 (session 4,
# call 2) GLA-channel's chunk_channels_kernel took 1.58 ms uncapped and 1.02 at 128, but
# KDA's 1.89 and 2.53: so 128 for a channel gate without a delta rule, none otherwise
# (ARCHSPEC_TRITON_BACKWARD_MAXNREG sets a cap for all; 0 for none).
BACKWARD_MAXNREG = os.environ.get("ARCHSPEC_TRITON_BACKWARD_MAXNREG")


def backward_maxnreg(p: Plan) -> int:
    return int(BACKWARD_MAXNREG) if BACKWARD_MAXNREG else 128 if (p.gate == 2 and p.mode == 0) else 0
# the backward's per-channel phases work on slices of this many K columns (registers);
# a channel gate's backward runs as two kernels, the second one program per slice
# (`backward_channel.py`); ARCHSPEC_TRITON_CHANNEL_SPLIT=0 runs it in the one kernel instead
CHANNEL_SPLIT = os.environ.get("ARCHSPEC_TRITON_CHANNEL_SPLIT", "1") != "0"
# Opt-in, slower: the same two kernels without a gate (DeltaNet, DeltaProduct), on 64-column
# slices, so that two programs share each chunk's per-channel phases (a scalar gate's dg
# sums over the slices, so it keeps the one kernel). On the H200 (session 9, bf16)
# DeltaNet's forward+backward took 2.10 ms with it against 1.66 for the one kernel at 8
# warps (chunk_channels_kernel 0.757 + chunk_pairs_kernel 0.548 against 0.861), which at 4
# warps (`backward_warps`) takes 0.764; fla's three kernels for the same step take 0.54.
SPLIT_UNGATED = os.environ.get("ARCHSPEC_TRITON_SPLIT_UNGATED", "0") == "1"


def split_backward(p: Plan) -> bool:
    return CHANNEL_SPLIT and (p.gate == 2 or (p.gate == 0 and SPLIT_UNGATED))
# Slice width, default: all of K in one slice without a channel gate (on the H200 DeltaNet
# took 2.50 ms forward+backward with it, 3.11 with slices of 32, each slice repeating the
# one-kernel backward's loops over V); with one, slices of 64 for the delta rules and 32 for GLA.
# Why 64: with 32-wide slices Triton 3.6 on the H200 gave d_k = inf for KDA and RWKV-7 in
# bfloat16 (float32 and GLA were right; the same kind of fault as the state pass's 32-wide
# V blocks below), whether split in two kernels or not, and with the factorized decay off;
# with 64 KDA checked right in bfloat16 and float32 (benchmarks/results/variants/README.md).
# A channel gate's backward with all of K in one slice needs more shared memory than the
# H200 has in float32.
BACKWARD_BK = os.environ.get("ARCHSPEC_TRITON_BACKWARD_BK")


def backward_bk(p: Plan) -> int:
    if BACKWARD_BK:
        return min(int(BACKWARD_BK), p.BK)
    if p.gate == 0 and split_backward(p):
        return min(64, p.BK)
    return p.BK if p.gate != 2 else min(64 if p.mode != 0 else 32, p.BK)


# The read-out split over value columns (1: one program per V block, each forming the
# chunk's scores again) or not (unset or 0: all of V in one program). Session 4 split it
# without a gate (DeltaNet's read-out 0.23 -> 0.19 ms at 8 warps; Gated DeltaNet's 0.24 ->
# 0.30, its decay matrix formed twice). At the read-out's 4 warps (below) the one program
# is faster: on the H200 (session 9, `launch_sweep.py`, bf16) output_kernel took 0.140 ms
# split and 0.113 not for DeltaNet, 0.221 and 0.194 for DeltaProduct-2, 0.370 and 0.294
# for DeltaProduct-4 (checked right in bf16 and float32).
OUTPUT_SPLIT = os.environ.get("ARCHSPEC_TRITON_OUTPUT_SPLIT")


def output_split(p: Plan) -> bool:
    return OUTPUT_SPLIT == "1"


# warps of the read-out alone: 4 without a channel gate, where on the H200 (session 4, call
# 2) DeltaNet's took 0.192 ms with 8 warps and 0.139 with 4, Gated DeltaNet's 0.160 and
# 0.117; a channel gate's keeps the chunk kernels' 8 (not yet timed at 4)
OUTPUT_WARPS = os.environ.get("ARCHSPEC_TRITON_OUTPUT_WARPS")


def output_warps(p: Plan, channel_pass: int = 0) -> int:
    # 4 for a channel gate's first pass too, except RWKV-7's (two score matrices: 112 B of spills offline)
    return int(OUTPUT_WARPS) if OUTPUT_WARPS else 4 if (p.gate != 2 or (channel_pass == 1 and p.mode != 2)) else p.warps


# A channel gate's read-out kernels run in two launches (`decay.runs_in_pass`): the chunks
# within decay.py's bound, compiled without the slower paths, then the others; as one
# kernel every chunk paid the registers of the slowest path. ARCHSPEC_TRITON_CHANNEL_PASSES=0: one launch.
CHANNEL_PASSES = os.environ.get("ARCHSPEC_TRITON_CHANNEL_PASSES", "1") != "0"
# Opt-in, not adopted: a scalar gate's within-chunk cumulative sum formed by the forward's first
# kernel that reads it (the inverse of a delta rule, the state pass of a diagonal one), which
# stores it for the rest, instead of `gate_cumsum_kernel`'s own launch: one launch fewer
# (Gated DeltaNet 5 -> 4, scalar GLA 3 -> 2). The H200 issued about 0.09 ms of host time per
# launch (`kernels.py host_ms`, session 6), and scalar GLA's forward is host-bound: 0.349 ms
# wall for 0.222 of kernels. (Session 5's form summed the gate in every kernel that read
# it, an O(rows^2) masked sum each time: its kernels were slower, GDN 0.488 -> 0.612.)
# Timed in session 7 (launch_sweep.py): scalar GLA's state pass 0.103 -> 0.123 ms forming
# the sums, GDN's kernels 0.490 -> 0.485, and no gain seen in the wall times, which the
# host's drift hid.
GATE_IN_FIRST = os.environ.get("ARCHSPEC_TRITON_GATE_IN_FIRST", "0") == "1"


def forms_gate_in_first_kernel(p: Plan) -> bool:
    """With `GATE_IN_FIRST`: a scalar gate, formed by the inverse (delta rules) or by the
    state pass (diagonal, one sub-step per token: its rows are the chunk's tokens)."""
    return GATE_IN_FIRST and p.gate == 1 and (p.mode != 0 or p.n_h == 1)


def channel_passes(p: Plan) -> tuple[int, ...]:
    return (1, 2) if (p.gate == 2 and CHANNEL_PASSES) else (0,)


# warps of `prepare_kernel` alone: 4 for the householder plans without a channel gate,
# where on the H200 (session 5, call 1) DeltaNet's took 0.110 ms with 8 and 0.098 with 4,
# Gated DeltaNet's 0.112 and 0.100; KDA's (call A) 0.130 with 8 and 0.148 with 4; RWKV-7's
# keeps 8 (at 4 it spills 544 B offline, Triton 3.6)
PREPARE_WARPS = os.environ.get("ARCHSPEC_TRITON_PREPARE_WARPS")


def prepare_warps(p: Plan) -> int:
    return int(PREPARE_WARPS) if PREPARE_WARPS else 4 if (p.mode == 1 and p.gate != 2) else p.warps


# warps of `inverse_kernel` (the UT transform's latency-bound inverse): few, so that
# several programs share an SM and hide each other's dependent steps (`prepare.py`).
# Measured on the H200 (B=4 T=4096 H=16 K=V=128 bf16, benchmarks/results/variants/):
# DeltaNet 0.12 ms with 2 warps, 0.17 with 4, 0.28 with 8; GDN (session 7) 0.102 with 1,
# 0.125 with 2, 0.193 with 4, so 1 in half precision without a channel gate (float32
# keeps 2: not timed at 1); KDA (channel gate, whose scores need whole [64, K] rows) 2.06
# ms with 2 (spills), 0.69 with 4; a channel gate's first pass (its chunks within
# decay.py's bound, the ungated code) keeps 2. ARCHSPEC_TRITON_INVERSE_WARPS overrides all.
INVERSE_WARPS = os.environ.get("ARCHSPEC_TRITON_INVERSE_WARPS")


def inverse_warps(p: Plan, channel_pass: int) -> int:
    if INVERSE_WARPS:
        return int(INVERSE_WARPS)
    if p.gate == 2:
        return 2 if channel_pass == 1 else 4
    return 1 if half(p) else 2


# the UT transform's inverse (`solve.py`): "substitution" or "doubling" (on the H200 in the
# one-kernel prepare: DeltaNet 1.16 -> 1.06 ms, KDA 1.81 -> 2.60; not timed since the split)
SOLVE = os.environ.get("ARCHSPEC_TRITON_SOLVE", "substitution")
if SOLVE not in ("substitution", "doubling"):
    raise ValueError(f"ARCHSPEC_TRITON_SOLVE={SOLVE!r}: expected 'substitution' or 'doubling'")
def state_forward_bv(p: Plan) -> int:
    if STATE_FORWARD_BV is None and p.gate == 2:
        return p.BVS
    return max(16, min(int(STATE_FORWARD_BV or (64 if deep_state_forward(p) else 32)), pow2(p.V)))
