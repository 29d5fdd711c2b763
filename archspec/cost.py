"""`estimate`: what a spec costs, before anything is built or trained.

A thin wrapper over the analytic model in `archspec.blocks.cost` (which mirrors the
modules term by term and is tested against them): it accepts a spec as well as a plan
and bundles the numbers that `archspec compile` prints and a search optimizes: the
parameters, and the FLOPs per token and decoding-state bytes both at the reference
length and at a long context, where attention layers' quadratic work and KV cache show.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from archspec.blocks import cost as block_cost
from archspec.blocks.plan import ModelPlan
from archspec.kernels import resolve_backend
from archspec.lowering import lower
from archspec.spec.models import Spec

# FLOPs per token depend on the length through the chunked recurrence (a short sequence
# pays for a padded chunk). Costs that compare designs use this one reference length, so
# that the padding of a task's short training sequences cannot reorder them (at T = 8 a
# padded n_h = 2 chunk costs more per token than an n_h = 3 one).
DEFAULT_SEQ_LEN = 2048
# The long context at which a design's cost is also stated: attention layers' FLOPs per
# token grow with the context and their KV cache with every token, recurrent ones do not.
LONG_CONTEXT = 32768


@dataclass(frozen=True)
class CostReport:
    params: int  # exact parameter count of the built module
    flops_per_token: float  # analytic forward FLOPs per token of a `seq_len`-token sequence, on `backend`
    state_bytes: int  # decoding state of one sequence after `seq_len` tokens, all layers
    seq_len: int
    backend: str = "torch"  # the recurrence's path the FLOPs are those of: torch (CPU) or triton (GPU)
    long_context: int = LONG_CONTEXT
    flops_per_token_long: float = 0.0  # the same at `long_context` tokens
    state_bytes_long: int = 0

    def metrics(self) -> dict[str, float]:
        """The cost metrics a trainer or a search trial reports, by their metric names."""
        return {
            "params": float(self.params),
            "flops_per_token": float(self.flops_per_token),
            "state_bytes": float(self.state_bytes),
            f"flops_per_token@{self.long_context}": float(self.flops_per_token_long),
            f"state_bytes@{self.long_context}": float(self.state_bytes_long),
        }


def backend_on(device: str | torch.device) -> str:
    """The recurrence's path on a device, as `backend="auto"` picks it: the Triton kernel on
    a GPU, the chunked PyTorch path elsewhere."""
    return resolve_backend("auto", torch.device(device))


def cost_metric_names(long_context: int = LONG_CONTEXT) -> tuple[str, ...]:
    """The names `CostReport.metrics` reports (what a search constraint may bound)."""
    return ("params", "flops_per_token", "state_bytes", f"flops_per_token@{long_context}", f"state_bytes@{long_context}")


def estimate(
    spec_or_plan: ModelPlan | Spec | Mapping[str, Any] | str | os.PathLike[str],
    *,
    seq_len: int = DEFAULT_SEQ_LEN,
    device: str | torch.device = "cpu",
    long_context: int = LONG_CONTEXT,
) -> CostReport:
    """Parameters, forward FLOPs per token and decoding-state bytes of a spec or plan, at
    `seq_len` and at `long_context` tokens; the FLOPs are those of the recurrence's path on
    `device` (the chunk sizes differ: `blocks/cost.py`)."""
    plan = spec_or_plan if isinstance(spec_or_plan, ModelPlan) else lower(spec_or_plan)
    backend = backend_on(device)
    return CostReport(
        params=block_cost.count_params(plan),
        flops_per_token=block_cost.flops_per_token(plan, seq_len, backend),
        state_bytes=block_cost.state_bytes(plan, seq_len),
        seq_len=seq_len,
        backend=backend,
        long_context=long_context,
        flops_per_token_long=block_cost.flops_per_token(plan, long_context, backend),
        state_bytes_long=block_cost.state_bytes(plan, long_context),
    )
