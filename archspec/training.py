"""The training step, in one place for the trainer, `archspec bench`, the search's cost
metrics and `benchmarks/models.py`: what they time and what they train are the same path.

- Mixed precision: float32 master weights, bfloat16 autocast on CUDA (`autocast_for`);
  on the CPU plain float32.
- The loss: an archspec `LanguageModel` takes `labels` and returns the mean next-token
  loss without making the logits (the fused linear cross-entropy); any other module is
  trained through its logits and `F.cross_entropy`.
- The optimizer: AdamW with weight decay on matrices only, the fused CUDA implementation
  on CUDA (one kernel launch for all parameters), the default elsewhere.
- The step (`TrainingStep`): forward, loss and backward replayed from a CUDA graph
  (`archspec.graphed_step`) where the model allows it, the eager step elsewhere. At the
  benchmark's size the eager step is bound by the host's launches; the graph took 1.17x to
  1.35x the tokens/s of the same kernels issued one by one (H100, `benchmarks/models.py`).
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


class TrainingStep:
    """`step(inputs, labels, cu_seqlens=None, scale=None) -> loss`: one forward + loss +
    backward of `model` (the loss of `training_loss`, detached); afterwards each
    parameter's `.grad` holds this batch's gradient, as after `backward` from none (zero
    or drop the gradients before each call, as `optimizer.zero_grad` does). `scale`
    multiplies the loss before its backward (a data-parallel rank's share of the global
    batch) and the returned loss.

    With `graphed` None (the default) the step is captured as a CUDA graph at its first
    batch and replayed for later batches (`GraphedStep`) when all of these hold: the model
    is an archspec `LanguageModel` on CUDA, it has no activation checkpointing, and the
    step is not scaled. A shorter batch of as many rows (a task that draws its lengths,
    `formal`) is padded at its end to the captured length, with token 0 and unscored
    labels: in a causal model those positions change no earlier output, and their loss
    gradient is exactly zero, so the loss and every gradient are the shorter batch's (up
    to the order of float sums). The graph is captured at the first batch's length or
    `pad_to` (the trainer passes the task's longest training sequence), whichever is
    longer; a longer batch captures again at its length, dropping the old graph. Packed
    batches, a batch of other rows, and a model whose step cannot be captured
    (`CaptureRefused`: it reads on the host) run the eager step; `eager_reason` says why
    the last step did. `graphed` False always runs the eager step; True makes a
    refusal an error. A replay returns the graph's own loss tensor, which the next replay
    overwrites (clone it to keep it)."""

    def __init__(self, model: nn.Module, *, device: torch.device | str, graphed: bool | None = None,
                 pad_to: int = 0):
        self.model, self.device, self.want, self.pad_to = model, torch.device(device), graphed, pad_to
        self.graph = None  # a GraphedStep, made at the first batch that can be replayed
        self.refused: str | None = "the eager step was asked for" if graphed is False else None  # for good
        self.eager_reason: str | None = self.refused or self._not_graphable()
        self.graphed = False  # whether the last step was a replay
        if graphed and self.eager_reason is not None:
            raise ValueError(f"cannot capture the training step as a CUDA graph: {self.eager_reason}")

    def _not_graphable(self) -> str | None:
        """Why this model's step cannot be captured now (checked at every step: a model can
        be moved or get activation checkpointing between steps)."""
        from archspec.blocks import LanguageModel

        if self.device.type != "cuda":
            return f"CUDA graphs need a CUDA device, this step runs on {self.device}"
        if not isinstance(self.model, LanguageModel):
            return f"only an archspec LanguageModel's step is captured, not a {type(self.model).__name__}"
        if any(getattr(m, "gradient_checkpointing", False) for m in self.model.modules()):
            return "activation checkpointing recomputes blocks with their random state, which capture does not take"
        return None

    def _batch_not_graphable(self, shape: tuple[int, ...], cu_seqlens: Tensor | None,
                             scale: Tensor | float | None) -> str | None:
        if scale is not None:
            return "a scaled loss (a data-parallel rank's share) runs eagerly"
        if cu_seqlens is not None:
            return "packed documents form their chunk tables on the host for each batch"
        if self.graph is not None and self.graph.shape[0] != shape[0]:
            return f"the graph was captured for batches of {self.graph.shape[0]} rows, this one has {shape[0]}"
        return None

    def __call__(self, inputs: Tensor, labels: Tensor, cu_seqlens: Tensor | None = None,
                 scale: Tensor | float | None = None) -> Tensor:
        from archspec.graphed_step import CaptureRefused, GraphedStep

        shape = tuple(inputs.shape)
        why = self.refused or self._not_graphable() or self._batch_not_graphable(shape, cu_seqlens, scale)
        if why is None:
            try:
                if self.graph is not None and self.graph.shape[1] < shape[1]:
                    self.graph = None  # a longer batch: its graph replaces this one (and its memory pool)
                    torch.cuda.empty_cache()
                if self.graph is None:
                    self.graph = GraphedStep(self.model, shape[0], max(shape[1], self.pad_to))
                loss = self.graph(*padded_to(self.graph.shape[1], inputs, labels))
                self.eager_reason, self.graphed = None, True
                return loss
            except CaptureRefused as exc:
                if self.want:
                    raise
                self.graph = None  # eager from now on; the graph's memory pool goes with it
                self.refused = why = str(exc)
        self.eager_reason, self.graphed = why, False
        loss = training_loss(self.model, inputs, labels, device=self.device, cu_seqlens=cu_seqlens)
        if scale is not None:
            loss = loss * scale
        loss.backward()
        return loss.detach()


def padded_to(length: int, inputs: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """`inputs` and `labels` `[B, T]` extended to `[B, length]` at their end with token 0
    and unscored labels (`IGNORE_INDEX`): a causal model's loss and gradients are unchanged."""
    missing = length - inputs.shape[1]
    if missing == 0:
        return inputs, labels
    if missing < 0:
        raise ValueError(f"cannot pad a batch of {inputs.shape[1]} tokens to {length}")
    return F.pad(inputs, (0, missing), value=0), F.pad(labels, (0, missing), value=IGNORE_INDEX)
