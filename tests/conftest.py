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


@pytest.fixture(scope="session")
def ray_head_4_gpus():
    """A Ray head on loopback declaring 4 GPUs and 4 CPUs (`ray start --head --num-gpus 4`,
    the README's several-GPU command; there are no GPUs: trials that reserve one train on
    the CPU), shared by the tests that place trials on GPUs; its workers import `tests`.
    Yields its address. Skipped without Ray."""
    pytest.importorskip("ray")
    from pathlib import Path

    from archspec.search.ray_head import local_ray_head

    with local_ray_head(cpus=4, gpus=4, pythonpath=Path(__file__).resolve().parents[1], start_timeout_s=60,
                        stop_timeout_s=30) as address:
        yield address
