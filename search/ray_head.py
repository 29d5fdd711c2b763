"""A Ray head on loopback for one process's lifetime: what the several-GPU benchmark and
the placement tests run trials against (`ray start --head --block`), and its free port."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

POLL_S = 0.3


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def local_ray_head(*, cpus: int, gpus: int, pythonpath: Path, visible_gpus: bool = False,
                   start_timeout_s: float = 120.0, stop_timeout_s: float = 60.0) -> Iterator[str]:
    """`ray start --head --block` on a free loopback port declaring `cpus` CPUs and `gpus`
    GPUs (the first `gpus` devices made visible to it when `visible_gpus`: real ones);
    its workers import from `pythonpath`. Yields its address; raises RuntimeError if it
    does not accept connections within `start_timeout_s`. Stopped with Ctrl-C, which makes
    `--block` stop every process it started (SIGTERM takes about 30 s), killed after
    `stop_timeout_s`."""
    port = free_port()
    base = Path("/tmp") if Path("/tmp").is_dir() else Path(tempfile.gettempdir())
    temp = base / f"rh-{os.getpid()}-{port}"  # short: Ray's socket paths are limited
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
           "PYTHONPATH": os.pathsep.join([str(pythonpath), os.environ.get("PYTHONPATH", "")])}
    if visible_gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(gpus))
    head = subprocess.Popen(
        [str(Path(sys.executable).with_name("ray")), "start", "--head", "--block", "--node-ip-address", "127.0.0.1",
         "--port", str(port), "--num-cpus", str(cpus), "--num-gpus", str(gpus), "--include-dashboard", "false",
         "--temp-dir", str(temp)],
        env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + start_timeout_s
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.time() > deadline or head.poll() is not None:
                    raise RuntimeError(f"the Ray head (--num-gpus {gpus}) did not start") from None
                time.sleep(POLL_S)
        yield f"127.0.0.1:{port}"
    finally:
        head.send_signal(signal.SIGINT)
        try:
            head.wait(timeout=stop_timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()
