"""What a reused Ray worker resets between trials (`search/worker_state.py`), on a real GPU
(skipped without CUDA; it runs in a fresh process: the first trial of a new worker meets a
process that has not touched CUDA yet), and the driver's log when a worker retires (CPU)."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import pytest

from archspec.search.worker_state import TUNE_CONTROLLER_LOGGER, WorkerRetired, quiet_retirements

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



class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _logged(error: BaseException) -> list[logging.LogRecord]:
    """What Ray Tune's controller logger lets through when it reports `error` (as Ray 2.60
    reports a failed trial task: `logger.error(..., exc_info=error)`). The handler sits on
    that logger itself: importing Ray stops its loggers' records from reaching the root."""
    logger, seen = logging.getLogger(TUNE_CONTROLLER_LOGGER), _Records()
    logger.addHandler(seen)
    try:
        logger.error("Trial task failed for trial trainable_0", exc_info=error)
    finally:
        logger.removeHandler(seen)
    return seen.records


def test_a_retired_worker_logs_no_traceback_and_other_failures_still_do():
    quiet_retirements()
    quiet_retirements()  # installed once
    logger = logging.getLogger(TUNE_CONTROLLER_LOGGER)
    assert sum(type(f).__name__ == "QuietRetirements" for f in logger.filters) == 1
    assert _logged(WorkerRetired("trial 3 left this worker's CUDA context unusable")) == []
    kept = _logged(RuntimeError("a fault in the trial function"))
    assert len(kept) == 1 and kept[0].exc_info[1].args == ("a fault in the trial function",)


def test_the_error_ray_raises_at_the_driver_is_recognised():
    exceptions = pytest.importorskip("ray.exceptions")
    quiet_retirements()

    def as_ray_raises_it(cause: BaseException) -> BaseException:
        return exceptions.RayTaskError("ImplicitFunc.train", "Traceback ...", cause).as_instanceof_cause()

    assert _logged(as_ray_raises_it(WorkerRetired("trial 46 ... the worker is retired"))) == []
    assert len(_logged(as_ray_raises_it(ValueError("bad")))) == 1
