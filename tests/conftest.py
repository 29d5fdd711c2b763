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


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
