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
    import signal
    import socket
    import subprocess
    import sys
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    temp = Path("/tmp") / f"ah4-{os.getpid()}-{port}"  # short: Ray's socket paths are limited
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
           "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    head = subprocess.Popen(
        [str(Path(sys.executable).with_name("ray")), "start", "--head", "--block", "--node-ip-address", "127.0.0.1",
         "--port", str(port), "--num-cpus", "4", "--num-gpus", "4", "--include-dashboard", "false", "--temp-dir", str(temp)],
        env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.time() < deadline and head.poll() is None, "the Ray head did not start"
                time.sleep(0.3)
        yield f"127.0.0.1:{port}"
    finally:
        head.send_signal(signal.SIGINT)  # `ray start --block` stops its processes on Ctrl-C
        try:
            head.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()
