"""The blocks tests run tiny tensors: one intra-op thread is faster than two (no thread
start-up per op, no contention with other test processes on a 2-core machine)."""

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
