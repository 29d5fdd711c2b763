"""The offline sm_90 compile report (`kernels/triton/compile_report.py`), run as a user would.

It is the only view of registers and spills before device time is spent, so it must
compile what the GPU launcher compiles: pointers and integers divisible by 16 are
specialized as such, which is what lets a row load become one 16-byte vector load per
thread. Without that every load compiled to 2-byte scalar loads and the report's register
and spill figures were not the GPU's. A separate process: the report rebinds
the kernels' launchers for the whole process.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _report(plans: str, dump: Path) -> str:
    """The report's output for `plans`, its PTX dumped into `dump` (compiled for sm_90, not
    interpreted)."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-m", "archspec.kernels.triton.compile_report", "--plans", plans,
                           "--dump", str(dump)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=280, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_report_compiles_deltanet_with_vector_loads(tmp_path: Path) -> None:
    stdout = _report("deltanet", tmp_path)
    rows = re.findall(r"^deltanet\s+(\w+)\s+regs\s+(\d+)\s+stack\s+(\d+)", stdout, re.M)
    kernels = {name for name, _, _ in rows}
    assert {"inverse_kernel", "prepare_kernel", "state_forward_kernel", "output_kernel",
            "state_backward_kernel", "chunk_backward_kernel"} <= kernels, stdout
    assert all(0 < int(regs) <= 255 for _, regs, _ in rows)
    # the read-out's bf16 rows of q, Y and the states: 16-byte vector loads (4 x b32), not
    # one 2-byte load per element
    ptx = (tmp_path / "output_kernel.ptx").read_text()
    assert re.search(r"ld\.global(?:\.\w+)*\.v4\.b32", ptx), "no 16-byte vector loads"
    assert not re.search(r"ld\.global(?:\.\w+)*\.b16", ptx), "2-byte scalar loads"


def test_report_compiles_the_decoding_kernels_overlapped(tmp_path: Path) -> None:
    """The decoding step's kernels as the H200 launches them, with programmatic dependent
    launch: each compiles for sm_90 with its wait for the kernel before (`griddepcontrol`)."""
    stdout = _report("decode", tmp_path)
    rows = re.findall(r"^decode\s+(\S+)\s+regs\s+(\d+)\s+stack\s+(\d+)", stdout, re.M)
    assert {name for name, _, _ in rows} == {
        "decode_step_kernel", "stream_step_kernel", "row_linear_kernel[none]", "row_linear_kernel[norm]",
        "row_linear_kernel[head_norm]", "row_linear_kernel[swiglu]"}, stdout
    assert all(0 < int(regs) <= 255 and int(stack) == 0 for _, regs, stack in rows), stdout
    for kernel in ("decode_step_kernel", "stream_step_kernel", "row_linear_kernel"):
        ptx = (tmp_path / f"{kernel}.ptx").read_text()
        assert "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx, kernel
        if kernel != "row_linear_kernel":
            # The step and the streams read only what the kernel before may write (the state
            # a step called back to back just wrote, the conv tails, the token's vectors):
            # no load may come ahead of the wait. (On the H200 a state loaded ahead of it
            # raced the previous step's writes: outputs O(1) off in 4 of 106 plans.)
            ahead = ptx[:ptx.index("griddepcontrol.wait")]
            assert not re.search(r"ld\.global", ahead), f"{kernel} loads before its griddepcontrol.wait"


def test_report_compiles_every_decay_form() -> None:
    """The gates' log decay, forward and backward, and the decoding step that forms it,
    compile for sm_90 in each decay form (mamba2, rwkv7, gla), without spilling."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-m", "archspec.kernels.triton.compile_report", "--plans", "gates"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=280, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = re.findall(r"^gates\s+(\S+)\s+regs\s+(\d+)\s+stack\s+(\d+)", proc.stdout, re.M)
    assert {name for name, _, _ in rows} == {
        f"{kernel}[{form}]" for kernel in ("log_decay_forward_kernel", "log_decay_backward_kernel", "decode_step_kernel")
        for form in ("mamba2", "rwkv7", "gla")}, proc.stdout
    assert all(0 < int(regs) <= 255 and int(stack) == 0 for _, regs, stack in rows), proc.stdout


def test_the_training_steps_fused_kernels_read_and_write_in_vectors() -> None:
    """A KDA training step's fused pieces (norms, gated read-out, SwiGLU, short convs with
    their head norm, the channel gate's log decay, the loss) at the whole-model benchmark's
    widths, compiled for sm_90: no kernel reads or writes its rows one 2-byte element at a
    time, but the loss's one target logit a row. (The loss kernel once left the vocabulary
    size unspecialized: the compiler could not vectorize its masked row loads, 33 scalar
    2-byte loads and 16 stores in its PTX, and the step was bound by issue, 2.08 ms a
    166M-model step on the H100 and the H200 alike.)"""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-m", "archspec.kernels.triton.compile_report", "--plans", "fused",
                           "--specs", "kda"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=280, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = re.findall(r"^kda\s+(\w+)\s+regs\s+(\d+)\s+stack\s+(\d+)\s+shared\s+\d+\s+half-scalar\s+(\d+)", proc.stdout, re.M)
    assert {name for name, *_ in rows} == {
        "rms_norm_forward_kernel", "rms_norm_backward_kernel", "swiglu_forward_kernel", "swiglu_backward_kernel",
        "short_conv_forward_kernel", "short_conv_dz_kernel", "short_conv_dx_kernel", "log_decay_forward_kernel",
        "log_decay_backward_kernel", "softmax_ce_grad_kernel"}, proc.stdout
    scalar = {name: int(n) for name, _, _, n in rows if int(n) > (1 if name == "softmax_ce_grad_kernel" else 0)}
    assert not scalar, f"2-byte scalar global accesses: {scalar}\n{proc.stdout}"
