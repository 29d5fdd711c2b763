"""`estimate`: what a spec costs, before anything is built or trained.

A thin wrapper over the analytic model in `archspec.blocks.cost` (which mirrors the
modules term by term and is tested against them): it accepts a spec as well as a plan
and bundles the three numbers that `archspec compile` prints and a search optimizes.
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


@dataclass(frozen=True)
class CostReport:
    params: int  # exact parameter count of the built module
    flops_per_token: float  # analytic forward FLOPs per token at `seq_len`, on `backend`
    state_bytes: int  # recurrent decoding state of one sequence, all layers
    seq_len: int
    backend: str = "torch"  # the recurrence's path the FLOPs are those of: torch (CPU) or triton (GPU)

    def metrics(self) -> dict[str, float]:
        """The cost metrics a trainer or a search trial reports, by their metric names."""
        return {
            "params": float(self.params),
            "flops_per_token": float(self.flops_per_token),
            "state_bytes": float(self.state_bytes),
        }


def backend_on(device: str | torch.device) -> str:
    """The recurrence's path on a device, as `backend="auto"` picks it: the Triton kernel on
    a GPU, the chunked PyTorch path elsewhere."""
    return resolve_backend("auto", torch.device(device))


def estimate(
    spec_or_plan: ModelPlan | Spec | Mapping[str, Any] | str | os.PathLike[str],
    *,
    seq_len: int = DEFAULT_SEQ_LEN,
    device: str | torch.device = "cpu",
) -> CostReport:
    """Parameters, forward FLOPs per token and state bytes of a spec or plan; the FLOPs are
    those of the recurrence's path on `device` (the chunk sizes differ: `blocks/cost.py`)."""
    plan = spec_or_plan if isinstance(spec_or_plan, ModelPlan) else lower(spec_or_plan)
    backend = backend_on(device)
    return CostReport(
        params=block_cost.count_params(plan),
        flops_per_token=block_cost.flops_per_token(plan, seq_len, backend),
        state_bytes=block_cost.state_bytes(plan),
        seq_len=seq_len,
        backend=backend,
    )
