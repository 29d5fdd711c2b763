"""The kinds of `..kinds` as `tl.constexpr`s, for the kernels' specializing branches, and
the accumulation dtype every kernel takes from its inputs' (`accumulation`).

A kernel takes `GATE`, `MODE`, `FORM` (a gate's decay form) and `CHANNEL_PASS` as constexpr arguments (each value
compiles its own specialization) and compares them with these names, never with bare
integers: `if GATE == CHANNEL_GATE:`.
"""

from __future__ import annotations

from enum import IntEnum

import torch
import triton.language as tl

from ..kinds import DecayForm, Gate, Mode


def accumulation(dtype: torch.dtype) -> tuple[torch.dtype, tl.dtype]:
    """The arithmetic of a kernel whose inputs (or accumulator) are `dtype`, as a torch and a
    Triton dtype: float64 for float64, float32 for everything else."""
    return (torch.float64, tl.float64) if dtype == torch.float64 else (torch.float32, tl.float32)


NO_GATE = tl.constexpr(int(Gate.NONE))
SCALAR_GATE = tl.constexpr(int(Gate.SCALAR))
CHANNEL_GATE = tl.constexpr(int(Gate.CHANNEL))

MAMBA2_DECAY = tl.constexpr(int(DecayForm.MAMBA2))
RWKV7_DECAY = tl.constexpr(int(DecayForm.RWKV7))
GLA_DECAY = tl.constexpr(int(DecayForm.GLA))

DIAGONAL = tl.constexpr(int(Mode.DIAGONAL))
HOUSEHOLDER = tl.constexpr(int(Mode.HOUSEHOLDER))
RWKV7 = tl.constexpr(int(Mode.RWKV7))


class ChannelPass(IntEnum):
    """Which chunks a launch of a chunk-parallel kernel takes. A channel gate's kernels run
    twice: first the chunks that fit `decay.py`'s path 1 (`chunk_fits`: they decay by at
    most twice its bound in every channel), compiled without the slower sub-chunk paths
    (fewer registers), then the others. As one launch every chunk paid the registers of
    the slowest path."""

    ALL_CHUNKS = 0  # no channel gate: one launch
    WITHIN_BOUND = 1
    BEYOND_BOUND = 2


ALL_CHUNKS = tl.constexpr(int(ChannelPass.ALL_CHUNKS))
WITHIN_BOUND = tl.constexpr(int(ChannelPass.WITHIN_BOUND))
BEYOND_BOUND = tl.constexpr(int(ChannelPass.BEYOND_BOUND))


def channel_passes(gate: Gate) -> tuple[ChannelPass, ...]:
    """The launches of a chunk-parallel kernel for this gate kind, in order."""
    if gate == Gate.CHANNEL:
        return (ChannelPass.WITHIN_BOUND, ChannelPass.BEYOND_BOUND)
    return (ChannelPass.ALL_CHUNKS,)
