"""The training step, in one place for the trainer, `archspec bench`, the search's cost
metrics and `benchmarks/models.py`: what they time and what they train are the same path.

- Mixed precision: float32 master weights, bfloat16 autocast on CUDA (`autocast_for`);
  on the CPU plain float32.
- The loss: an archspec `LanguageModel` takes `labels` and returns the mean next-token
  loss without making the logits (the fused linear cross-entropy); any other module is
  trained through its logits and `F.cross_entropy`.
- The optimizer: AdamW with weight decay on matrices only, the fused CUDA implementation
  on CUDA (one kernel launch for all parameters), the default elsewhere.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
import torch.nn as nn
import torch.nn.functional as F

from archspec.blocks.loss import IGNORE_INDEX

Tensor = torch.Tensor

DEFAULT_BETAS = (0.9, 0.95)


def autocast_for(device: torch.device | str) -> contextlib.AbstractContextManager:
    """bfloat16 autocast on CUDA (float32 weights, bfloat16 matmuls); nothing elsewhere."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def make_optimizer(
    model: nn.Module, *, lr: float, weight_decay: float = 0.01, betas: tuple[float, float] = DEFAULT_BETAS,
    device: torch.device | str | None = None,
) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (not on norms, biases or gate scalars); fused
    on CUDA. `device` defaults to where the parameters are."""
    params = [p for p in model.parameters() if p.requires_grad]
    if device is None:
        device = params[0].device if params else torch.device("cpu")
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = torch.device(device).type == "cuda"
    return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=fused or None)


def takes_labels(model: nn.Module) -> bool:
    """Whether `model(ids, labels=...)` returns the loss (archspec's `LanguageModel`, also
    inside DistributedDataParallel, which passes the keywords on)."""
    from torch.nn.parallel import DistributedDataParallel

    from archspec.blocks import LanguageModel

    return isinstance(model.module if isinstance(model, DistributedDataParallel) else model, LanguageModel)


def training_loss(
    model: nn.Module, inputs: Tensor, labels: Tensor, *, device: torch.device | str, cu_seqlens: Tensor | None = None
) -> Tensor:
    """The mean next-token loss of `inputs` `[B, T]` against `labels` `[B, T]` (already
    shifted; `IGNORE_INDEX` where unscored) under the device's autocast."""
    with autocast_for(device):
        if takes_labels(model):
            return model(inputs, labels=labels, cu_seqlens=cu_seqlens)
        if cu_seqlens is not None and "cu_seqlens" not in inspect.signature(model.forward).parameters:
            raise ValueError(f"{type(model).__name__} does not take cu_seqlens")
        logits = model(inputs) if cu_seqlens is None else model(inputs, cu_seqlens=cu_seqlens)
    return F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), ignore_index=IGNORE_INDEX)
