"""Test-wide set-up.

Without CUDA the Triton kernels run under the interpreter, which must be switched on
before any module that defines `@triton.jit` functions is imported: hence here, first.
Tests marked `gpu` are skipped without CUDA.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def one_torch_thread():
    """The tests run small tensors: one intra-op thread is faster than several (no thread
    start-up per op, no contention between test processes on a 2-core CI machine)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
