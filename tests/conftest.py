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


if os.environ.get("TRITON_INTERPRET") == "1":
    from archspec.triton_interpreter import patch_language_once_per_launch

    patch_language_once_per_launch()


@pytest.fixture(autouse=True)
def one_torch_thread():
    """The tests run small tensors: one intra-op thread is faster than several (no thread
    start-up per op, no contention between test processes on a 2-core CI machine)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def pytest_collection_modifyitems(config, items):
    # The suite runs in several processes (pytest-xdist, `--dist loadgroup`: README's test
    # command). Tests that start Ray go to one of them, one after another: two local Ray
    # clusters at once would share the machine's cores and ports, and the searches that
    # wait on their trials (kill and resume) would race each other's load.
    serial = pytest.mark.xdist_group("ray")
    skip = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("ray") is not None:
            item.add_marker(serial)
        if skip is not None and "gpu" in item.keywords:
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

    # Stopped after the tests: killed if Ctrl-C has not stopped it in 5 s (after the
    # suite's searches it never had within 30 s, which only delayed the end)
    with local_ray_head(cpus=4, gpus=4, pythonpath=Path(__file__).resolve().parents[1], start_timeout_s=60,
                        stop_timeout_s=5) as address:
        yield address
