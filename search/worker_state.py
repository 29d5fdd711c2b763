"""One Ray worker trains trial after trial: what a trial must not inherit from the one before.

Ray Tune starts a worker process per trial unless it may reuse one (`reuse_actors`), and
a fresh worker costs seconds a trial cannot spare on a GPU: the process starts, imports
torch and archspec, creates its CUDA context and loads the Triton kernels it runs. On the
H200 that came to about a quarter of a 30-second trial (`benchmarks/search_gpu.py`). A
reused worker keeps all of that, and must not keep what belongs to one trial:

- the allocator's peak (a trial's `peak_mem_bytes` and out-of-memory reason are its own):
  reset when the trial begins;
- the memory the last trial's tensors left in PyTorch's cache, which would count against
  the next trial's share of the GPU: released before the trial reports its end, so that the
  worker is clean when Ray hands it the next trial;
- a CUDA context that an error left unusable (an illegal address is sticky: every later
  call in that process fails): such a worker is retired, never handed another trial.

The memory cap of a shared GPU is set again by every trial (`gpu_share.cap_process_memory`),
and the CPU threads too (`trial._limit_threads`); Ray reuses a worker only for a trial of
the same resources, so its GPUs stay the trial's.
"""

from __future__ import annotations

import gc
import logging


def _on_cuda(device: str | None) -> bool:
    import torch

    return bool(device) and str(device).startswith("cuda") and torch.cuda.is_available()


def begin_trial(device: str | None) -> None:
    """Reset what a trial measures of the device (its peak allocation)."""
    import torch

    # A fresh worker has no CUDA context yet (nothing to reset; PyTorch refuses to before one exists).
    if _on_cuda(device) and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats(device)


def end_trial(device: str | None) -> str | None:
    """Release the trial's cached device memory; returns why this worker must not train
    another trial (its CUDA context is broken), or None when it may."""
    import torch

    gc.collect()  # a trial's model and optimizer may sit in reference cycles (closures, hooks)
    if not _on_cuda(device):
        return None
    try:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    except Exception as exc:  # noqa: BLE001 (a sticky CUDA error surfaces as any of several types)
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else 'no message'}"
    return None


class WorkerRetired(RuntimeError):
    """Raised by a trial's worker after its result is recorded, so that Ray ends the worker
    rather than hand it another trial."""


# The logger of Ray Tune's controller, which reports every failed trial task with its traceback.
TUNE_CONTROLLER_LOGGER = "ray.tune.execution.tune_controller"


class QuietRetirements(logging.Filter):
    """Drops the controller's traceback of a worker that retired itself: its trial is
    already recorded failed with the reason (the driver prints that line), and the error is
    the way out Ray offers, not a fault. Any other failed trial task still logs."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        # Ray re-raises a worker's error as a RayTaskError that is also an instance of its cause.
        return not (isinstance(error, WorkerRetired) or isinstance(getattr(error, "cause", None), WorkerRetired))


def quiet_retirements() -> None:
    """Install `QuietRetirements` on Ray Tune's controller logger (once per process)."""
    logger = logging.getLogger(TUNE_CONTROLLER_LOGGER)
    if not any(isinstance(f, QuietRetirements) for f in logger.filters):
        logger.addFilter(QuietRetirements())
