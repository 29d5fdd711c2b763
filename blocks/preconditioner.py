"""OSDN's online diagonal preconditioner as a module: the write keys `w = d * k`.

`RECURRENCE.md` ("OSDN") defines the scan; `archspec.kernels.osdn_write_keys` runs it.
This module owns OSDN's parameters and decoding state:

- APF (adaptive preconditioner forgetting): a retain gate `r = sigmoid(w_r . x + b_r)` per
  token and head, `H * (d_model + 1)` parameters. `b_r` starts at `logit(0.999)`, the
  retain initialisation the OSDN paper reports for its 1.3B run, so `d` forgets slowly
  until training says otherwise.
- `init: learned`: `d_1 = clip(1 + delta, d_min, d_max)` with a per-head `delta` [H, K]
  that starts at zero (the paper's zero-initialised learnable initial scale), so training
  begins exactly at `init: ones`; the clip keeps `d_1` inside the bounds that the
  stability rule was checked with.
- The decoding state is `d` `[B, H, K]`, carried between calls like the matrix state.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from archspec.kernels import osdn_write_keys

from .plan import PreconditionerPlan

Tensor = torch.Tensor

APF_RETAIN_INIT = 0.999


class OSDNPreconditioner(nn.Module):
    def __init__(self, plan: PreconditionerPlan, d_model: int, heads: int, head_dim: int):
        super().__init__()
        self.plan = plan
        self.heads, self.head_dim = heads, head_dim
        self.retain_proj = nn.Linear(d_model, heads, bias=True) if plan.apf else None
        if self.retain_proj is not None:
            nn.init.constant_(self.retain_proj.bias, math.log(APF_RETAIN_INIT / (1 - APF_RETAIN_INIT)))
        self.d0_delta = nn.Parameter(torch.zeros(heads, head_dim)) if plan.init == "learned" else None

    def initial_d(self) -> Tensor | None:
        """`d_1` `[H, K]`, or None for the kernel's default of ones."""
        if self.d0_delta is None:
            return None
        return torch.clamp(1.0 + self.d0_delta, self.plan.d_min, self.plan.d_max)

    def start_state(self, batch_size: int, device: torch.device, dtype: torch.dtype) -> Tensor:
        """`d` `[B, H, K]` of a sequence that has not started."""
        d0 = self.initial_d()
        if d0 is None:
            return torch.ones(batch_size, self.heads, self.head_dim, device=device, dtype=dtype)
        return d0.to(dtype).expand(batch_size, -1, -1).clone()

    def forward(
        self, x: Tensor, k: Tensor, beta: Tensor, d: Tensor | None = None, *, backend: str = "auto",
        cu_seqlens: Tensor | None = None, n_h: int | None = None,
    ) -> tuple[Tensor, Tensor, dict]:
        """Write keys `[B, T*n_h, H, K]`, the final `d` `[B, H, K]`, and the scan's inputs.

        `x` `[B, T, d_model]` feeds the APF retain gate; `k` are the unit-norm keys and
        `beta` the write strengths of the sub-steps; `d` continues a previous call. With
        `cu_seqlens` (token offsets, B = 1) `d` restarts at each document (`d` and the
        final `d` then have one row per document) and `n_h` says how many sub-steps a token has.
        """
        inputs = self.scan_inputs(x, k, beta, d)
        write_key, d_final = osdn_write_keys(**inputs, cu_seqlens=cu_seqlens, n_h=n_h, backend=backend)
        return write_key, d_final, inputs

    def scan_inputs(self, x: Tensor, k: Tensor, beta: Tensor, d: Tensor | None = None) -> dict:
        """`osdn_write_keys`' arguments (as `forward` takes them), without running the scan."""
        return dict(
            k=k,
            beta=beta,
            eta=self.plan.eta,
            d_min=self.plan.d_min,
            d_max=self.plan.d_max,
            retain=torch.sigmoid(self.retain_proj(x)) if self.retain_proj is not None else None,
            beta_aware=self.plan.beta_aware,
            d0=self.initial_d() if d is None else d,
            eps=self.plan.eps,
        )
