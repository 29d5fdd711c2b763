"""The launch settings' guards against what the H200 refused or miscompiled
(`kernels/triton/launch.py`). These hazards show only on a GPU, so the rules that avoid
them are pinned here, where CI runs: a change to a default that lifts one fails here
first, and must then pass `benchmarks/triton_gpu_check.py` on the GPU."""

from __future__ import annotations

import pytest
import torch
from archspec.kernels.triton import launch
from archspec.kernels.triton.recurrence import _plan_of


def plan(dtype=torch.bfloat16, mode=1, gate=0, n_h=1):
    # the plan the GPU launcher builds (interpret=False keeps half-precision operands)
    return _plan_of((4, 4096, 16, 128), 128, dtype, mode, gate, mode == 1, n_h, 4, None, None, False)


KERNELS = ("inverse", "prepare", "output", "output_backward", "backward", "channels")
PLANS = [(mode, gate, n_h) for mode in (0, 1, 2) for gate in (0, 1, 2) for n_h in (1, 2, 8)]


@pytest.mark.parametrize(("mode", "gate", "n_h"), PLANS)
def test_float32_never_pipelines_deeper(mode, gate, n_h):
    """float32 tiles take twice the shared memory: the gated state pass asked for 257 KB at
    2 stages (the H200 has 227 KB per block), so every float32 kernel runs at 1."""
    p = plan(torch.float32, mode, gate, n_h)
    assert {launch.chunk_stages(p, k) for k in KERNELS} == {1}
    assert launch.state_forward_stages(p) == launch.state_backward_stages(p) == 1
    assert launch.state_forward_bv(p) == (p.BVS if gate == 2 else 32)
    assert launch.inverse_warps(p, 0) == (4 if gate == 2 else 2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_settings_the_gpu_checked(dtype):
    # the deep forward state pass: delta rules and diagonal recurrences, not RWKV-7
    # (272 KB of shared memory with a scalar gate) nor channel gates
    assert launch.state_forward_stages(plan(dtype, 1, 1)) == 4 and launch.state_forward_bv(plan(dtype, 1, 1)) == 64
    assert launch.state_forward_stages(plan(dtype, 2, 1)) == 2 and launch.state_forward_bv(plan(dtype, 2, 1)) == 32
    assert launch.state_forward_stages(plan(dtype, 1, 2)) == 2
    # 3 backward stages for the scalar-gated delta rule only (RWKV-7's: 247 KB)
    assert launch.state_backward_stages(plan(dtype, 1, 1)) == 3
    assert launch.state_backward_stages(plan(dtype, 2, 1)) == 2
    # chunk_channels_kernel at 2 stages miscompiled for GLA-channel and for RWKV-7 at n_h 8
    assert launch.chunk_stages(plan(dtype, 0, 2), "channels") == 1
    assert launch.chunk_stages(plan(dtype, 2, 2, 8), "channels") == 1
    assert launch.chunk_stages(plan(dtype, 2, 2, 1), "channels") == 1
    assert launch.chunk_stages(plan(dtype, 1, 2, 8), "channels") == 1
    assert launch.chunk_stages(plan(dtype, 1, 2, 4), "channels") == 2
    # the one-kernel backward and chunk_pairs_kernel stay at 1 (slower at 2)
    assert {launch.chunk_stages(plan(dtype, m, g), "backward") for m in (0, 1, 2) for g in (0, 1, 2)} == {1}


def test_environment_overrides_every_default(monkeypatch):
    monkeypatch.setattr(launch, "STAGES", "3")
    monkeypatch.setattr(launch, "STATE_STAGES", "1")
    p = plan()
    assert {launch.chunk_stages(p, k) for k in KERNELS} == {3}
    assert launch.state_forward_stages(p) == launch.state_backward_stages(p) == 1


@pytest.mark.parametrize(("mode", "gate", "n_h"), PLANS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_backward_runs_at_4_warps_only_where_the_gpu_checked_it(dtype, mode, gate, n_h):
    """The last backward kernels at 4 warps: only the ungated delta rule's one kernel in
    half precision (checked right, and faster, on the H200 in session 9). KDA's channel
    kernels gave gradients 7e-2 off and GLA-channel's an illegal memory access at 4: a
    channel gate keeps 8, and so does a scalar gate (slower at 4) and float32 (untimed)."""
    p = plan(dtype, mode, gate, n_h)
    four = dtype != torch.float32 and mode == 1 and gate == 0
    assert launch.backward_warps(p) == (4 if four else p.warps)
    if gate == 2:
        assert launch.backward_warps(p) == 8


def test_the_read_out_is_one_program_per_chunk_unless_asked(monkeypatch):
    """Not split over V (session 9: DeltaNet's read-out 0.140 -> 0.113 ms whole);
    ARCHSPEC_TRITON_OUTPUT_SPLIT=1 splits it, for every plan."""
    assert not any(launch.output_split(plan(torch.bfloat16, m, g)) for m in (0, 1, 2) for g in (0, 1, 2))
    monkeypatch.setattr(launch, "OUTPUT_SPLIT", "1")
    monkeypatch.setattr(launch, "BACKWARD_WARPS", "16")
    assert launch.output_split(plan()) and launch.backward_warps(plan(gate=2)) == 16
