"""How much of a GPU a trial gets, and a trial that runs out of it.

Several trials share a GPU when each reserves a fraction of it (`resources.gpu: 0.125`
packs eight). With `resources.gpu: auto` each trial's share is sized from the memory its
training step needs, from the plan alone (`blocks/memory.py`, a lower bound):

    share = ceil16((AUTO_FACTOR x estimate + AUTO_OVERHEAD_BYTES) / gpu_memory)

the largest over the trial's tasks, rounded up to a sixteenth of the GPU, at least one
sixteenth and at most the whole GPU. `AUTO_FACTOR` covers what the lower bound leaves
out (it is within 3x of what autograd keeps: tests/blocks/test_memory.py); the overhead
covers the CUDA context, cuBLAS and Triton workspaces and evaluation's activations.

In the worker a share below one GPU is enforced: PyTorch's allocator is capped at the
share (`torch.cuda.set_per_process_memory_fraction`), so a trial that outgrows it raises
`OutOfMemoryError` in its own process instead of starving its neighbours, and a trial
whose estimate alone exceeds its share is refused before it trains. Both are recorded as
failed with the reason `out of memory` and the peak bytes the trial reached.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from archspec.errors import ArchspecError, Location

AUTO_FACTOR = 3
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


def auto_share(needs: Iterable[int], gpu_bytes: int) -> float:
    """The share of a GPU of `gpu_bytes` that `gpu: auto` gives a trial whose tasks need
    `needs` bytes each (estimates); see the module docstring."""
    need = int(max(needs, default=0)) * AUTO_FACTOR + AUTO_OVERHEAD_BYTES
    sixteenths = -(-need * AUTO_STEPS // int(gpu_bytes))  # whole numbers: no rounding at an exact sixteenth
    return min(1.0, max(1, sixteenths) * AUTO_STEP)


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
