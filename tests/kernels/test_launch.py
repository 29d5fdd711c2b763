"""The launch table (`kernels/triton/launch.py`): its guards against what the H200 refused
or miscompiled, and the one way to change it (`launch.overridden`). These hazards show only
on a GPU, so the entries that avoid them are pinned here, where CI runs: a change to an
entry that lifts a guard fails here first, and must then pass `benchmarks/gpu_check.py` on
the GPU."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from archspec.kernels.kinds import Gate, Mode
from archspec.kernels.triton import launch

FAMILIES = [(mode, gate) for mode in Mode for gate in Gate]
HALF = (torch.bfloat16, torch.float16)
STAGE_FIELDS = ("inverse_stages", "prepare_stages", "output_stages", "backward_stages", "state_forward_stages",
                "state_backward_stages")


@pytest.mark.parametrize(("mode", "gate"), FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_full_precision_never_pipelines_deeper(mode, gate, dtype):
    """float32 tiles take twice the shared memory: the gated state pass asked for 257 KB at
    2 stages (the H200 has 227 KB per block), so every full-precision kernel runs at 1."""
    entry = launch.settings(mode, gate, dtype)
    assert {getattr(entry, f) for f in STAGE_FIELDS} == {1}
    assert entry.backward_warps == 8 and entry.chunk_bv == 32 and entry.min_query_rows == 32


@pytest.mark.parametrize("dtype", HALF)
def test_half_precision_guards(dtype):
    def entry(mode, gate):
        return launch.settings(mode, gate, dtype)

    # the deep forward state pass: delta rules and diagonal recurrences, not RWKV-7 (272 KB
    # of shared memory with a scalar gate) nor channel gates
    assert (entry(Mode.HOUSEHOLDER, Gate.SCALAR).state_forward_stages, entry(Mode.HOUSEHOLDER, Gate.SCALAR).state_forward_bv) == (4, 64)
    assert (entry(Mode.RWKV7, Gate.SCALAR).state_forward_stages, entry(Mode.RWKV7, Gate.SCALAR).state_forward_bv) == (2, 32)
    assert entry(Mode.HOUSEHOLDER, Gate.CHANNEL).state_forward_stages == 2
    # 3 backward state stages for the scalar-gated delta rule only (RWKV-7's: 247 KB)
    assert entry(Mode.HOUSEHOLDER, Gate.SCALAR).state_backward_stages == 3
    assert entry(Mode.RWKV7, Gate.SCALAR).state_backward_stages == 2
    # the backward kernels stay at 1 stage: the one-kernel backward and chunk_pairs_kernel
    # were slower at 2, and chunk_channels_kernel at 2 miscompiled for GLA-channel (d_k 20x
    # off), RWKV-7 at n_h 8 (d_write_key 30x off) and KDA (d_k 4e-2 to 1e-1 off float64)
    assert {entry(m, g).backward_stages for m, g in FAMILIES} == {1}
    # 4 backward warps only for the ungated delta rule: at 4 KDA's channel kernels gave
    # gradients 7e-2 off and GLA-channel's an illegal memory access (miscompiles)
    assert {(m, g) for m, g in FAMILIES if entry(m, g).backward_warps == 4} == {(Mode.HOUSEHOLDER, Gate.NONE)}
    # K slices of 64 in half precision for every channel gate: 32 gave d_k = inf in bfloat16
    # for KDA and RWKV-7, and an illegal memory access for GLA-channel with a float32 gate
    assert {entry(m, Gate.CHANNEL).backward_bk for m in Mode} == {64}
    assert entry(Mode.DIAGONAL, Gate.CHANNEL).backward_maxnreg == 128
    # 64-wide V blocks in the state backward (32-wide miscompiled with 8-warp chunk kernels)
    assert {entry(m, g).state_bv for m, g in FAMILIES} == {64}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dims", [(8, 8), (16, 16), (8, 128), (128, 8)])
def test_narrow_heads_get_blocks_of_32(dtype, head_dims):
    """Blocks 16 wide in K or V raised an illegal memory access in float32 and gave wrong
    bfloat16 values on the H200; narrow heads are masked in 32-wide blocks instead."""
    from archspec.kernels.triton import recurrence

    K, V = head_dims
    for mode in Mode:
        settings = launch.settings(mode, Gate.NONE, dtype)
        plan = recurrence._plan_of((2, 64, 2, K), V, dtype, mode, Gate.NONE, mode != Mode.DIAGONAL, 1, 2, None,
                                   None, False, settings)
        assert min(plan.BK, plan.BV, plan.BVS, plan.state_forward_bv) == recurrence.MIN_BLOCK == 32
        assert plan.BK >= K and plan.BV <= max(32, V)


def test_overrides_apply_inside_the_block_and_nest():
    base = launch.settings(Mode.HOUSEHOLDER, Gate.NONE, torch.bfloat16)
    with launch.overridden(backward_warps=2, state_forward_stages=1):
        inner = launch.settings(Mode.HOUSEHOLDER, Gate.NONE, torch.bfloat16)
        assert (inner.backward_warps, inner.state_forward_stages) == (2, 1)
        assert launch.settings(Mode.RWKV7, Gate.CHANNEL, torch.float32).backward_warps == 2  # every family
        with launch.overridden(backward_warps=16, scan_prefetch=3):
            nested = launch.settings(Mode.HOUSEHOLDER, Gate.NONE, torch.bfloat16)
            assert (nested.backward_warps, nested.state_forward_stages) == (16, 1)
            assert launch.scan_settings().scan_prefetch == 3
        assert launch.settings(Mode.HOUSEHOLDER, Gate.NONE, torch.bfloat16).backward_warps == 2
    assert launch.settings(Mode.HOUSEHOLDER, Gate.NONE, torch.bfloat16) == base
    assert launch.scan_settings().scan_prefetch == launch.HALF.scan_prefetch


@pytest.mark.parametrize("settings", [{"backward_warp": 4}, {"backward_warps": -1}, {"backward_warps": 2.5},
                                      {"backward_warps": True}])
def test_overrides_refuse_unknown_names_and_bad_values(settings):
    with pytest.raises(ValueError, match="launch settings"), launch.overridden(**settings):
        pass


def test_no_environment_variable_changes_a_kernel():
    """`kernels/` reads no environment variable (whether Triton runs its interpreter comes
    from Triton's own `triton.knobs`; `TRITON_INTERPRET` is the one name allowed). The SASS
    dump of `compile_report` is an argument, not a variable."""
    root = Path(__file__).resolve().parents[2] / "kernels"
    reads = []
    for path in sorted(root.rglob("*.py")):
        for line in path.read_text().splitlines():
            for name in re.findall(r"environ(?:\.get)?\(?\[?[\"']([A-Z_]+)", line):
                reads.append((path.name, name))
            if "getenv" in line:
                reads.append((path.name, line.strip()))
    assert {name for _, name in reads} <= {"TRITON_INTERPRET"}, reads


def test_the_decoding_kernels_overlap_only_on_cuda_outside_the_interpreter():
    """Programmatic dependent launch needs sm_90 and the GPU launcher: never on CPU tensors
    (the interpreter has no `griddepcontrol`)."""
    assert not launch.overlapped(torch.device("cpu"))
