"""What a reused Ray worker resets between trials (`search/worker_state.py`), on a real GPU
(skipped without CUDA). Runs in a fresh process: the first trial of a new worker meets a
process that has not touched CUDA yet."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

FRESH_WORKER = textwrap.dedent("""
    import torch
    from archspec.search.worker_state import begin_trial, end_trial

    begin_trial("cuda:0")  # a new worker: no CUDA context yet, nothing to reset, no error
    assert not torch.cuda.is_initialized()
    first = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda:0")  # the first trial's 256 MiB
    del first
    assert end_trial("cuda:0") is None
    assert torch.cuda.memory_reserved() == 0  # released: the next trial's share is whole
    begin_trial("cuda:0")
    second = torch.empty(2**20, dtype=torch.uint8, device="cuda:0")
    # The next trial's peak is its own 1 MiB, not the first trial's 256 MiB.
    assert torch.cuda.max_memory_allocated() == torch.cuda.memory_allocated() == 2**20
    print("ok")
""")


@pytest.mark.gpu
def test_a_reused_worker_starts_each_trial_clean():
    done = subprocess.run([sys.executable, "-c", FRESH_WORKER], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]

