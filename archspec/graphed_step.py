"""The training step (forward, loss, backward) captured once as a CUDA graph and replayed.

At the benchmark's size (166-225M parameters, 16,384 tokens a step) the eager step is
bound by the host: issuing its ~250 Triton launches and ~260 other kernels took the host
24-48 ms for the forward + loss and 26-64 ms for the backward, while the device was busy
43 ms (DeltaNet) to 59 ms (KDA) of it (`benchmarks/models.py`, host columns and profile,
H200). A replayed graph issues the whole step in one launch. Measured on an H100 at
B=8, T=2048 (`benchmarks/models.py --graphed`): DeltaNet 262k -> 354k tokens/s (1.35x),
KDA 195k -> 262k (1.35x), GLA 264k -> 313k (1.18x), Gated DeltaNet 228k -> 267k (1.17x).
This is PyTorch's whole-network capture (`torch.cuda.graph`), for a step whose batch
shape never changes; `archspec.training.TrainingStep` uses it where it can and the eager
step elsewhere.

What capture needs from the step, and how it gets it here:

- Nothing read on the host between the first kernel and the last. The ids and labels are
  checked and the scored labels counted before each replay (`checked_scored_labels`, one
  read, as the eager step does before its first layer), and the count goes in as a device
  tensor (`LanguageModel.forward(scored_labels=...)`), which the loss reads on the device.
  The first warm-up step runs under `torch.cuda.set_sync_debug_mode("error")`, so a module
  that does read on the host is refused (`CaptureRefused`, naming the operation) before
  any capture begins.
- Fixed addresses. Each batch is copied into the same input tensors; the gradients are
  the tensors the captured backward wrote, handed back to the parameters after each replay
  (an optimizer's `zero_grad(set_to_none=True)` drops them, harmlessly).
- Kernels compiled and caches warm before capture: three eager steps on a side stream.
- Not packed documents: their chunk tables are formed on the host from each batch's
  `cu_seqlens`, so each batch would need its own graph. A packed batch is refused with a
  clear error; the eager step takes it.

The optimizer stays outside the graph (fused AdamW is one launch a parameter group), and
each step is one micro-batch: the captured backward writes the gradients, it does not add
to them. The graph keeps the step's activations in its own memory pool between replays, so
the step's memory stays reserved instead of being returned after each backward
(`pool_bytes` says how much).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from archspec.blocks.loss import checked_scored_labels
from archspec.errors import first_line

Tensor = torch.Tensor

WARMUP_STEPS = 3  # eager steps before capture: Triton compiles, autotuned kernels pick, caches fill


class CaptureRefused(ValueError):
    """The model's step cannot be captured (it reads on the host, or capture failed); the
    eager step still trains it."""


class GraphedStep:
    """`step(ids, labels) -> loss`: one training step of `model` (an archspec
    `LanguageModel` on CUDA, in training mode) on `[batch, seq_len]` ids and labels, replayed
    from a graph captured at the first call. After it each parameter's `.grad` holds this
    batch's gradient, as after `loss.backward()` from zero gradients; the returned loss is
    the graph's own output tensor, overwritten by the next replay (clone it to keep it)."""

    def __init__(self, model: nn.Module, batch: int, seq_len: int):
        from archspec.blocks import LanguageModel

        if not isinstance(model, LanguageModel):
            raise TypeError(f"GraphedStep takes an archspec LanguageModel, got {type(model).__name__}")
        device = next(model.parameters()).device
        if device.type != "cuda":
            raise ValueError(f"GraphedStep needs the model on a CUDA device (CUDA graphs), but it is on {device}")
        if batch < 1 or seq_len < 1:
            raise ValueError(f"GraphedStep: batch and seq_len must be >= 1, got {batch} x {seq_len}")
        self.model, self.device, self.shape = model, device, (batch, seq_len)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.ids = torch.zeros(batch, seq_len, dtype=torch.long, device=device)
        self.labels = torch.zeros(batch, seq_len, dtype=torch.long, device=device)
        self.scored = torch.zeros((), dtype=torch.long, device=device)
        self.storage = self._storage()
        self.graph: torch.cuda.CUDAGraph | None = None
        # (reserved, allocated) bytes of the graph's private memory pool as the capture left
        # it (0, 0 before): the step's activations and gradients, reserved between replays.
        # Measured as what the capture added to the device's reserved and allocated memory:
        # the allocator's unused cache is returned just before it, and while capturing every
        # allocation of the step comes from the pool.
        self.pool_bytes = (0, 0)
        self.loss: Tensor | None = None
        self.grads: list[Tensor | None] = []

    def __call__(self, ids: Tensor, labels: Tensor, cu_seqlens: Tensor | None = None) -> Tensor:
        if cu_seqlens is not None:
            raise ValueError("GraphedStep: packed documents (cu_seqlens) are formed on the host per batch and "
                             "cannot be replayed from one graph; train them with the eager step")
        if tuple(ids.shape) != self.shape or tuple(labels.shape) != self.shape:
            raise ValueError(f"GraphedStep was made for batches of {list(self.shape)}, got ids {list(ids.shape)} "
                             f"and labels {list(labels.shape)}")
        if not self.model.training:
            raise ValueError("GraphedStep trains: put the model in training mode (model.train())")
        if self._storage() != self.storage:  # the graph reads the weights where they were
            raise ValueError("GraphedStep: the model's parameters were moved, cast or replaced since it was made; "
                             "make a new GraphedStep")
        count = checked_scored_labels(ids, labels, self.model.plan.vocab_size)  # the one host read
        self.ids.copy_(ids, non_blocking=True)
        self.labels.copy_(labels, non_blocking=True)
        self.scored.fill_(count)
        if self.graph is None:
            self._capture()
        else:
            self.graph.replay()
        for p, g in zip(self.params, self.grads):
            p.grad = g
        assert self.loss is not None
        return self.loss

    def _storage(self) -> tuple[int, ...]:
        return tuple(p.data_ptr() for p in self.model.parameters())

    def _forward_backward(self) -> Tensor:
        # The trainer's autocast (`training.autocast_for`) without its cache of weight casts:
        # a cast cached while capturing would outlive the capture (PyTorch's rule for graphs).
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            loss = self.model(self.ids, labels=self.labels, scored_labels=self.scored)
        loss.backward()
        return loss

    def _capture(self) -> None:
        # Warm-up on a side stream, as torch.cuda.graph requires; gradients of those steps
        # are discarded (set to None before capture, so the captured backward allocates
        # and writes, never accumulates). The first runs with host synchronisation made an
        # error: a read on the host would break the capture (or, worse, be baked into it).
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for i in range(WARMUP_STEPS):
                self.model.zero_grad(set_to_none=True)
                if i == 0:
                    self._without_host_reads()
                else:
                    self._forward_backward()
        torch.cuda.current_stream(self.device).wait_stream(side)
        self.model.zero_grad(set_to_none=True)
        # The warm-up's activations went back to the allocator's cache, which the graph's
        # private pool cannot use: return them, so the step is not held twice.
        torch.cuda.empty_cache()
        reserved, allocated = torch.cuda.memory_reserved(self.device), torch.cuda.memory_allocated(self.device)
        self.graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(self.graph):
                self.loss = self._forward_backward().detach()
        except RuntimeError as exc:
            self.graph, self.loss = None, None
            self.model.zero_grad(set_to_none=True)
            raise CaptureRefused(f"GraphedStep: capturing the step failed: {first_line(exc)}") from exc
        self.pool_bytes = (torch.cuda.memory_reserved(self.device) - reserved,
                           torch.cuda.memory_allocated(self.device) - allocated)
        self.grads = [p.grad for p in self.params]
        self.graph.replay()  # capture only records: this batch's step runs now

    def _without_host_reads(self) -> None:
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            self._forward_backward()
        except RuntimeError as exc:
            if "synchroniz" not in str(exc).lower():
                raise
            self.model.zero_grad(set_to_none=True)
            raise CaptureRefused("GraphedStep: the step reads a device value on the host, which a CUDA graph "
                                 f"cannot replay ({first_line(exc)})") from exc
        finally:
            torch.cuda.set_sync_debug_mode(previous)
