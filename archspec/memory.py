"""Refuse, before anything is allocated, a module that cannot fit in memory.

`validate` checks a spec's numbers one by one; `heads: 1e9` is a valid number of heads
whose module would need terabytes. Building it would take all memory (or die inside
PyTorch), so `archspec compile`, `archspec.compile`, `archspec train`, `archspec bench`
and every search trial first compare `blocks.memory.estimate_memory` (a lower bound:
weights, and for training their gradients, AdamW's moments and the activations of one
step) with the memory free on the device, and refuse with both numbers.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from archspec.blocks.memory import MemoryEstimate, estimate_memory
from archspec.blocks.plan import ModelPlan
from archspec.errors import ArchspecError

_MEMINFO = Path("/proc/meminfo")
_CGROUP = Path("/sys/fs/cgroup")  # cgroup v2: memory.max and memory.current of this container


def free_bytes(device: str | torch.device = "cpu") -> int | None:
    """Memory free for new allocations on `device`, or None where it cannot be told.

    CUDA: the driver's free memory plus what PyTorch's caching allocator holds unused.
    CPU: `MemAvailable` of /proc/meminfo, or less if this process's cgroup (a container)
    has a lower limit left.
    """
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return None
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    if device.type != "cpu":
        return None
    candidates = [b for b in (_meminfo_available(), _cgroup_left()) if b is not None]
    return min(candidates) if candidates else None


def _meminfo_available() -> int | None:
    try:
        for line in _MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def _cgroup_left() -> int | None:
    try:
        limit = (_CGROUP / "memory.max").read_text().strip()
        used = int((_CGROUP / "memory.current").read_text())
    except (OSError, ValueError):
        return None
    return None if limit == "max" else max(0, int(limit) - used)


def human_bytes(count: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if abs(count) < 1024 or unit == "EiB":
            return f"{count:,.0f} {unit}" if unit == "bytes" else f"{count:,.1f} {unit}"
        count /= 1024
    return f"{count:,.1f} EiB"


def describe(estimate: MemoryEstimate) -> str:
    parts = [f"{human_bytes(estimate.weights)} of weights ({estimate.params:,} parameters)"]
    if estimate.optimizer:
        parts.append(f"{human_bytes(estimate.optimizer)} of AdamW state")
    if estimate.gradients or estimate.activations:
        parts.append(f"the larger of {human_bytes(estimate.gradients)} of gradients and "
                     f"{human_bytes(estimate.activations)} of activations")
    return ", ".join(parts)


def check_fits(
    plan: ModelPlan,
    device: str | torch.device = "cpu",
    *,
    batch: int = 0,
    seq_len: int = 0,
    training: bool = False,
    what: str = "the module",
    free: int | None = None,
    checkpoint_every: int = 0,
) -> MemoryEstimate:
    """Raise `ArchspecError` when `plan` surely does not fit on `device`; return the estimate.

    `checkpoint_every`: the training step checkpoints every n-th block (0: none).
    `free` overrides the measured free memory (tests). Where free memory cannot be told
    nothing is refused. A model built on the CPU and moved to CUDA needs its weights on
    the CPU first: callers check both.
    """
    device = torch.device(device)
    activation_bytes = 2 if (training and device.type == "cuda") else 4  # the trainer's bfloat16 autocast on CUDA
    estimate = estimate_memory(plan, batch=batch, seq_len=seq_len, training=training, activation_bytes=activation_bytes,
                               checkpoint_every=checkpoint_every)
    available = free_bytes(device) if free is None else free
    if available is not None and estimate.total > available:
        where = "this machine's memory" if device.type == "cpu" else str(device)
        step = f" for a training step of {batch} x {seq_len} tokens" if training else ""
        raise ArchspecError(
            f"{what} cannot fit in memory on {device}",
            [(None, None, f"it needs at least {human_bytes(estimate.total)}{step} ({describe(estimate)}); "
              f"{where} has {human_bytes(available)} free. Make the model smaller (heads, head_dim, d_model, "
              "layers, vocab_size)" + (" or the batch and sequence shorter" if training else ""))],
        )
    return estimate
