"""How much of a GPU a trial gets, and a trial that runs out of it.

Several trials share a GPU when each reserves a fraction of it (`resources.gpu: 0.125`
packs eight). With `resources.gpu: auto` each trial's share is sized from the memory its
training step needs, from the plan alone (`blocks/memory.py`, a lower bound):

    share = ceil16((factor x estimate + AUTO_OVERHEAD_BYTES) / gpu_memory)

the largest over the trial's tasks, rounded up to a sixteenth of the GPU, at least one
sixteenth and at most the whole GPU. The factor covers what the lower bound leaves out:
`AUTO_FACTOR` (the estimate is within 3x of what autograd keeps: tests/blocks/test_memory.py)
until a trial of the search has measured its training step's peak on the GPU (the
trainer's throughput pass records `peak_mem_bytes`), then the largest ratio of a measured
peak to its trial's estimate so far, times `MEASURED_HEADROOM` (`calibrated_factor`): the
shares follow what this search's models really take. The overhead covers the CUDA
context, cuBLAS and Triton workspaces and evaluation's activations.

In the worker a share below one GPU is enforced: PyTorch's allocator is capped at the
share (`torch.cuda.set_per_process_memory_fraction`), so a trial that outgrows it raises
`OutOfMemoryError` in its own process instead of starving its neighbours, and a trial
whose estimate alone exceeds its share is refused before it trains. Both are recorded as
failed with the reason `out of memory` and the peak bytes the trial reached.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

from archspec.errors import ArchspecError, Location

AUTO_FACTOR = 3
# Over the largest measured/estimated ratio so far: models of other shapes scatter around it.
MEASURED_HEADROOM = 1.25
AUTO_OVERHEAD_BYTES = 1 << 30
AUTO_STEPS = 16  # shares are whole sixteenths of a GPU
AUTO_STEP = 1 / AUTO_STEPS
GIB = 1 << 30
OUT_OF_MEMORY = "out of memory"  # how a failed trial's reason begins when memory ran out


def gpu_memory_bytes(resources: Any) -> int:
    """One GPU's memory: `resources.gpu_memory_gib`, or the driver's first CUDA device's."""
    if resources.gpu_memory_gib is not None:
        return int(resources.gpu_memory_gib * GIB)
    import torch

    if not torch.cuda.is_available():
        raise ArchspecError(
            "`resources.gpu: auto` cannot size the trials' shares here",
            [(Location(origin="resources"), "resources.gpu_memory_gib",
              "this machine has no CUDA device to read a GPU's memory from; give the GPUs' memory in GiB "
              "(e.g. gpu_memory_gib: 140 for an H200) or a fixed share (gpu: 0.25)")],
        )
    return int(torch.cuda.get_device_properties(0).total_memory)


def training_bytes(spec: Any, task: Any, train_options: dict[str, Any]) -> int:
    """The memory estimate (a lower bound) of one training step of `spec` on `task`, at
    the batch the trainer will use and the task's training length, in bfloat16 autocast."""
    from archspec.blocks.memory import estimate_memory
    from archspec.search.trainer import plan_for_task

    plan, _ = plan_for_task(spec, task)
    batch = int(train_options.get("batch_size") or task.preset.batch_size)
    return estimate_memory(plan, batch=batch, seq_len=task.train_len, training=True, activation_bytes=2).total


def auto_share(needs: Iterable[int], gpu_bytes: int, factor: float = AUTO_FACTOR) -> float:
    """The share of a GPU of `gpu_bytes` that `gpu: auto` gives a trial whose tasks need
    `needs` bytes each (estimates), `factor` times that; see the module docstring."""
    need = math.ceil(int(max(needs, default=0)) * factor) + AUTO_OVERHEAD_BYTES
    sixteenths = -(-need * AUTO_STEPS // int(gpu_bytes))  # whole numbers: no rounding at an exact sixteenth
    return min(1.0, max(1, sixteenths) * AUTO_STEP)


def calibrated_factor(measurements: Iterable[tuple[float, int]]) -> float:
    """The factor `gpu: auto` multiplies an estimate by, given (measured peak, estimate)
    pairs of finished trials: `AUTO_FACTOR` without any, else the largest ratio times
    `MEASURED_HEADROOM`, at least 1 (the estimate is a lower bound)."""
    ratios = [peak / need for peak, need in measurements if peak > 0 and need > 0]
    return max(1.0, max(ratios) * MEASURED_HEADROOM) if ratios else float(AUTO_FACTOR)


class MeasuredMemory:
    """The training-step peaks that a search's finished trials measured on the GPU, each
    beside its trial's estimate, read from the run's records as trials finish (a trial's
    estimate is computed once). A trial that ran out of memory is left out: its peak is
    where its cap cut it, not what it needed."""

    def __init__(self, read_trials: Callable[[], Iterable[Any]], tasks: list[Any],
                 estimate: Callable[[dict[str, Any], Any], int]) -> None:
        self._read_trials, self._tasks, self._estimate = read_trials, tasks, estimate
        self._pairs: dict[int, list[tuple[float, int]]] = {}  # trial number -> (peak, estimate) per task

    def _peak_key(self, task: Any) -> str:
        return "peak_mem_bytes" if len(self._tasks) == 1 else f"{task.name}/peak_mem_bytes"

    def measurements(self) -> list[tuple[float, int]]:
        for record in self._read_trials():
            if record.status is None or record.number in self._pairs:  # running, or read already
                continue
            pairs: list[tuple[float, int]] = []
            if not (record.reason or "").startswith(OUT_OF_MEMORY):
                for task in self._tasks:
                    peak = record.metrics.get(self._peak_key(task))
                    if isinstance(peak, (int, float)) and math.isfinite(peak) and peak > 0:
                        try:
                            pairs.append((float(peak), self._estimate(record.overrides, task)))
                        except ArchspecError:  # a record whose point no longer composes: nothing to learn from
                            pass
            self._pairs[record.number] = pairs
        return [pair for pairs in self._pairs.values() for pair in pairs]


def share_problem(needs: Iterable[int], share: float, gpu_bytes: int) -> str | None:
    """Why a trial cannot train in `share` of a GPU of `gpu_bytes` (its estimate alone,
    a lower bound, is larger), or None."""
    need = max(needs, default=0)
    given = share * gpu_bytes
    if need <= given:
        return None
    from archspec.memory import human_bytes

    return (f"{OUT_OF_MEMORY}: the training step needs at least {human_bytes(need)} (estimate) and the trial was given "
            f"{human_bytes(given)} ({share:g} of a {human_bytes(gpu_bytes)} GPU); raise resources.gpu or use gpu: auto")


def cap_process_memory(share: float) -> None:
    """Cap this process's CUDA allocations at `share` of the GPU (below one GPU only)."""
    import torch

    if share < 1 and torch.cuda.is_available():
        torch.cuda.set_per_process_memory_fraction(share)


def peak_bytes(device: str) -> int | None:
    """The most memory the trial's allocations held on `device` (None off CUDA)."""
    import torch

    if not str(device).startswith("cuda") or not torch.cuda.is_available():
        return None
    return int(torch.cuda.max_memory_allocated())


def out_of_memory_reason(exc: BaseException, peak: int | None) -> str:
    """`out of memory: <the allocator's first sentence> (peak ...)`: one line for the record."""
    from archspec.memory import human_bytes

    first = str(exc).strip().split("\n", 1)[0]
    first = first.split(". ", 2)
    shown = ". ".join(first[:2])[:240]
    peak_text = f"; peak {human_bytes(peak)} allocated" if peak is not None else ""
    return f"{OUT_OF_MEMORY}: {shown}{peak_text}"
