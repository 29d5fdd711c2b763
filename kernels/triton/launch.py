"""How each Triton kernel is launched: one typed table, keyed by plan family and precision.

A plan family is the kernel's mode (the transition) and gate kind; the precision is that
of the dot operands (half: bfloat16 and float16 at full tensor-core rate; full: float32
and float64). Every entry was chosen by sweeping the setting on an H200 (Triton 3.6, B=4
T=4096 H=16 K=V=128) and checked against float64 there; `docs/kernel.md` ("Launch
settings") gives the reasons and the measured times. Two kinds of entries are guards, not
speed: settings the H200 miscompiled or refused are avoided (`docs/kernel.md` lists them,
and `tests/kernels/test_launch.py` pins each guard).

Sweeps and tests change the chunk kernels' settings only through `overridden(...)`, a
context manager; no environment variable changes how a kernel runs. The fused pieces of
the training step (cross-entropy, RMSNorm, short convolution) have one entry each, below
the table, and so has the decoding step; their functions take another entry as an argument.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Iterator
from dataclasses import dataclass, replace
from enum import Enum

import torch

from ..kinds import Gate, Mode, triton_interpreter_on


class Precision(Enum):
    HALF = "half"  # bfloat16 / float16 operands
    FULL = "full"  # float32 / float64 operands

    @classmethod
    def of(cls, operands: torch.dtype) -> Precision:
        return cls.HALF if operands in (torch.float16, torch.bfloat16) else cls.FULL


@dataclass(frozen=True)
class Launch:
    """Warps, pipelining stages and block widths of the chunk kernels of one plan family."""

    chunk_warps: int = 8  # the chunk-parallel kernels unless named below
    state_warps: int = 4  # the sequential state passes unless named below
    chunk_bv: int = 64  # V columns per block of the chunk-parallel kernels
    min_query_rows: int = 16  # rows of the query tile at least
    inverse_warps: int = 1  # the UT transform's latency-bound inverse
    inverse_warps_within_bound: int = 2  # a channel gate's first pass (chunks within decay.py's bound)
    inverse_stages: int = 1
    prepare_warps: int = 8
    prepare_stages: int = 1
    state_bv: int = 64  # V columns per program of the state passes
    state_forward_bv: int = 32
    state_forward_warps: int = 4
    state_forward_stages: int = 2
    state_backward_stages: int = 2
    output_warps: int = 4
    output_warps_within_bound: int = 4
    output_stages: int = 1
    backward_warps: int = 8  # the last backward kernels
    backward_stages: int = 1
    backward_maxnreg: int = 0  # a register cap for them (0: none)
    backward_bk: int = 0  # K columns per slice of their per-channel phases (0: all of K)
    # the OSDN scan (`osdn.py`): warps per program, and steps whose loads are in flight
    # ahead of the one computed
    scan_warps: int = 1
    scan_prefetch: int = 8


FIELDS = frozenset(f.name for f in dataclasses.fields(Launch))

HALF = Launch()
FULL = Launch(chunk_bv=32, min_query_rows=32, inverse_warps=2, state_forward_stages=1, state_backward_stages=1)

# Each family's differences from its precision's defaults.
_DEEP_STATE_FORWARD = dict(state_forward_stages=4, state_forward_bv=64)
_CHANNEL_GATE = dict(inverse_warps=4, state_forward_bv=64, output_warps=8)
_HALF_FAMILIES = {
    (Mode.DIAGONAL, Gate.NONE): dict(**_DEEP_STATE_FORWARD, state_forward_warps=8),
    (Mode.DIAGONAL, Gate.SCALAR): dict(**_DEEP_STATE_FORWARD, state_forward_warps=8, output_stages=2),
    # K slices of 64: at 32, with the float32 gate a model forms, chunk_channels_kernel made
    # an illegal memory access on the H200 (bfloat16 gates ran).
    (Mode.DIAGONAL, Gate.CHANNEL): dict(**_CHANNEL_GATE, inverse_stages=2, output_stages=2, backward_maxnreg=128,
                                        backward_bk=64),
    (Mode.HOUSEHOLDER, Gate.NONE): dict(**_DEEP_STATE_FORWARD, prepare_warps=4, backward_warps=4),
    (Mode.HOUSEHOLDER, Gate.SCALAR): dict(**_DEEP_STATE_FORWARD, prepare_warps=4, state_backward_stages=3,
                                          output_stages=2),
    (Mode.HOUSEHOLDER, Gate.CHANNEL): dict(**_CHANNEL_GATE, inverse_stages=2, output_stages=2, backward_bk=64),
    (Mode.RWKV7, Gate.NONE): dict(prepare_stages=2),
    (Mode.RWKV7, Gate.SCALAR): dict(prepare_stages=2, output_stages=2),
    (Mode.RWKV7, Gate.CHANNEL): dict(**_CHANNEL_GATE, inverse_stages=2, prepare_stages=2, output_stages=2,
                                     output_warps_within_bound=8, backward_bk=64),
}
_FULL_FAMILIES = {
    (Mode.DIAGONAL, Gate.CHANNEL): dict(**_CHANNEL_GATE, backward_maxnreg=128, backward_bk=32),
    (Mode.HOUSEHOLDER, Gate.NONE): dict(prepare_warps=4),
    (Mode.HOUSEHOLDER, Gate.SCALAR): dict(prepare_warps=4),
    (Mode.HOUSEHOLDER, Gate.CHANNEL): dict(**_CHANNEL_GATE, backward_bk=64),
    (Mode.RWKV7, Gate.CHANNEL): dict(**_CHANNEL_GATE, output_warps_within_bound=8, backward_bk=64),
}
TABLE: dict[tuple[Mode, Gate, Precision], Launch] = {
    (mode, gate, precision): replace(base, **families.get((mode, gate), {}))
    for precision, base, families in ((Precision.HALF, HALF, _HALF_FAMILIES), (Precision.FULL, FULL, _FULL_FAMILIES))
    for mode in Mode for gate in Gate
}

_OVERRIDES: contextvars.ContextVar[dict] = contextvars.ContextVar("launch_overrides", default={})


@contextlib.contextmanager
def overridden(**settings: int) -> Iterator[None]:
    """Inside the block every launch takes these settings over the table's, for every
    family (a sweep times one setting at a time; a test runs a path the table does not
    choose). Nested blocks add to the outer one's settings."""
    unknown = set(settings) - FIELDS
    if unknown:
        raise ValueError(f"unknown launch settings {sorted(unknown)}; known: {sorted(FIELDS)}")
    bad = {k: v for k, v in settings.items() if not isinstance(v, int) or isinstance(v, bool) or v < 0}
    if bad:
        raise ValueError(f"launch settings must be non-negative integers, got {bad}")
    token = _OVERRIDES.set({**_OVERRIDES.get(), **settings})
    try:
        yield
    finally:
        _OVERRIDES.reset(token)


def settings(mode: Mode, gate: Gate, operands: torch.dtype) -> Launch:
    """The launch settings of one call: the table's entry, with any `overridden` ones."""
    entry = TABLE[(mode, gate, Precision.of(operands))]
    overrides = _OVERRIDES.get()
    return replace(entry, **overrides) if overrides else entry


# The fused pieces of the training step beside the recurrence (`fused.py`): one entry each,
# whatever the plan.

@dataclass(frozen=True)
class CrossEntropyLaunch:
    """Launch settings: vocabulary columns per loop iteration and warps per row.

    A row of 32,000 bfloat16 logits is 64 KB: 4 blocks of 8,192 columns keep each pass a
    short loop of wide, coalesced loads; 16 warps give every thread 16 columns a block.
    On the H100 (`benchmarks/loss.py`, all 16,384 rows of the 166M model's step): 0.83 ms
    against 1.05 at 4,096 columns and 8 warps and 1.00 holding the row whole in one block
    of 32,768 at 32 warps; two reads and one write at the measured copy rate take 1.04, so
    the second read comes from L2.
    """

    block_v: int = 8192
    num_warps: int = 16


CROSS_ENTROPY_LAUNCH = CrossEntropyLaunch()


@dataclass(frozen=True)
class RMSNormLaunch:
    """Launch settings. A block of rows per program keeps a narrow head (V = 128) from
    leaving most of a warp idle; the backward runs a few programs per multiprocessor, each
    looping over its share of rows, so the weight's gradient has few partial sums."""

    row_elements: int = 4096  # rows per block = max(1, row_elements // pow2(D))
    num_warps: int = 4
    backward_programs_per_sm: int = 2
    cpu_programs: int = 4  # the interpreter's backward grid


RMS_NORM_LAUNCH = RMSNormLaunch()


@dataclass(frozen=True)
class SwiGLULaunch:
    """Elements per program of SwiGLU's elementwise kernels: 4 warps with 8 elements a
    thread, one 16-byte load of bfloat16 per tensor and thread."""

    block: int = 1024
    num_warps: int = 4


SWIGLU_LAUNCH = SwiGLULaunch()


@dataclass(frozen=True)
class LogDecayLaunch:
    """Tokens and channels per program of the gates' log-decay kernels: a 64 x 128 tile is
    64 float32 values a thread at 4 warps, and a channel gate of 1,024 channels at 16k
    tokens gives 256 x 8 programs."""

    rows: int = 64
    block_c: int = 128
    num_warps: int = 4


LOG_DECAY_LAUNCH = LogDecayLaunch()


@dataclass(frozen=True)
class ShortConvLaunch:
    """Tokens and channels per program, forward and both backward passes alike."""

    block_t: int = 64
    block_c: int = 64  # without normalisation; with it, one head (the next power of two)
    num_warps: int = 4


SHORT_CONV_LAUNCH = ShortConvLaunch()


@dataclass(frozen=True)
class DecodeLaunch:
    """The decoding step (`decode.py`): V columns of a head's state per program, warps and
    stages. The step moves the state once and little else, so what matters is enough
    programs in flight at batch 1 (B * H * V / block_v of them) with each tile
    (`K x block_v` float32, 16 KB at K = 128) in registers. Not yet swept on the H200."""

    block_v: int = 32
    num_warps: int = 4
    num_stages: int = 1


DECODE_LAUNCH = DecodeLaunch()


@dataclass(frozen=True)
class RowLinearLaunch:
    """The decoding step's matrix-vector products (`row_linear.py`), per prologue: outputs
    per program, weight columns per tile (a head-norm tile rounds it to whole heads),
    warps, pipelining stages."""

    block_n: int = 4
    block_k: int = 512
    num_warps: int = 4
    num_stages: int = 1


# The most rows (the decoding batch) `row_linear` takes on Triton: more rows go to cuBLAS,
# whose matrix-matrix kernels read each weight once for all of them.
ROW_LINEAR_MAX_ROWS = 4
# Swept on the H200 at batch 1 on the 166M LM's shapes, the weights rotated past the L2
# cache as a model's stream from HBM; microseconds ours / cuBLAS with the prologue's own
# kernel: q-k-v-beta 3,080 x 1,024 4.2 / 6.2, SwiGLU's gate-up 5,472 x 1,024 5.7 / 7.4,
# the head 32,000 x 1,024 20.5 / 20.7, o_proj 1,024 x 1,024 2.7 / 9.6, down_proj
# 1,024 x 2,736 4.7 / 7.7, KDA's low-rank second stages 1,024 x 128 2.0 / 3.0.
ROW_LINEAR_LAUNCH: dict[str, RowLinearLaunch] = {
    "none": RowLinearLaunch(block_k=128),
    "norm": RowLinearLaunch(block_n=8),
    "head_norm": RowLinearLaunch(block_n=2, block_k=1024),
    "swiglu": RowLinearLaunch(block_n=2, block_k=1024, num_warps=8),
}


# The decoding step's kernels (`decode.py`'s two, `row_linear.py`) launch with programmatic
# dependent launch where the device has it (sm_90 on): each may start while the kernel
# before it finishes. `row_linear` loads its first weight tile (no decoding kernel writes a
# weight) and only then waits for that kernel (`gdc_wait`); the step and the streams wait
# first, since the kernel before may be the previous token's step of the same state. At
# batch 1 the step is a chain of some 50 kernels of a few microseconds each, bound by the
# latency of their launches and first loads.
DECODE_OVERLAP = True


@functools.lru_cache(maxsize=None)
def _major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def overlap_supported(device: torch.device) -> bool:
    """Whether `device` can launch overlapped: CUDA at compute capability 9 or more, not
    under Triton's interpreter."""
    if device.type != "cuda" or triton_interpreter_on():
        return False
    return _major(device.index if device.index is not None else torch.cuda.current_device()) >= 9


def overlapped(device: torch.device) -> bool:
    """Whether the decoding step's kernels on `device` launch overlapped: `DECODE_OVERLAP`
    on a device that supports it."""
    return DECODE_OVERLAP and overlap_supported(device)


def pow2(n: int) -> int:
    """The next power of two >= n. Host code uses this, not `triton.next_power_of_2`:
    that is a `constexpr_function`, about 3.5 us a call."""
    return 1 << max(0, n - 1).bit_length()


def scan_settings() -> Launch:
    """The OSDN scan's settings (`scan_warps`, `scan_prefetch`: one entry for every plan),
    with any `overridden` ones."""
    overrides = _OVERRIDES.get()
    return replace(HALF, **overrides) if overrides else HALF
