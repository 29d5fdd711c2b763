"""Random inputs for every path of `RECURRENCE.md`, shared by all backend tests.

A `Case` names one combination (gate x transition x n_h x write key x beta range x
initial state); `make_inputs` draws inputs the way the layers produce them (unit-norm
removal keys, beta = scale * sigmoid, log-gates <= 0, erase = a * k), so that tests run
in the regime the kernels are used in.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Case:
    gate: str = "none"  # none | scalar | channel
    transition: str = "householder"  # diagonal | householder | rwkv7
    n_h: int = 1
    write_key: str = "tied"  # tied | preconditioned | untied
    beta_scale: float = 1.0  # 1.0 -> [0,1], 2.0 -> [0,2]
    initial_state: bool = False

    @property
    def id(self) -> str:
        init = "-s0" if self.initial_state else ""
        return f"{self.transition}-nh{self.n_h}-{self.gate}-{self.write_key}-b{self.beta_scale:g}{init}"


def all_cases(max_n_h: int = 3) -> list[Case]:
    """Every valid combination of the paths (diagonal has n_h = 1 and no beta)."""
    cases = []
    for gate in ("none", "scalar", "channel"):
        cases.append(Case(gate=gate, transition="diagonal", write_key="tied"))
        cases.append(Case(gate=gate, transition="diagonal", write_key="untied", initial_state=True))
        for n_h, wk, bs in itertools.product(range(1, max_n_h + 1), ("tied", "preconditioned"), (1.0, 2.0)):
            if wk == "preconditioned" and bs == 2.0:
                continue  # refused by the stability rule with d_max = 2
            cases.append(Case(gate=gate, transition="householder", n_h=n_h, write_key=wk, beta_scale=bs))
        for n_h, bs in itertools.product(range(1, max_n_h + 1), (1.0, 2.0)):
            cases.append(Case(gate=gate, transition="rwkv7", n_h=n_h, write_key="untied", beta_scale=bs))
    cases.append(Case(gate="scalar", transition="householder", n_h=2, beta_scale=2.0, initial_state=True))
    cases.append(Case(gate="channel", transition="rwkv7", n_h=2, write_key="untied", initial_state=True))
    return cases


def make_inputs(
    case: Case,
    B: int = 2,
    T: int = 16,
    H: int = 2,
    K: int = 8,
    V: int = 8,
    *,
    dtype: torch.dtype = torch.float64,
    device: str | torch.device = "cpu",
    seed: int = 0,
    requires_grad: bool = True,
    gate_strength: float = 1.0,
) -> dict:
    """Keyword arguments for `linear_recurrence` (without `backend`), leaf tensors."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    TN = T * case.n_h
    q = randn(B, T, H, K)
    k = F.normalize(randn(B, TN, H, K), dim=-1)
    v = randn(B, TN, H, V)
    args: dict = {"q": q, "k": k, "v": v, "n_h": case.n_h}
    if case.gate == "scalar":
        args["g"] = -gate_strength * F.softplus(randn(B, T, H)) * 0.5
    elif case.gate == "channel":
        args["g"] = -gate_strength * F.softplus(randn(B, T, H, K)) * 0.5
    if case.transition != "diagonal":
        args["beta"] = case.beta_scale * torch.sigmoid(randn(B, TN, H))
    if case.transition == "rwkv7":
        a = case.beta_scale * torch.sigmoid(randn(B, TN, H, K))
        args["erase"] = a * k
        args.pop("beta")  # RWKV-7 writes with b = 1; beta-with-erase is tested separately
    if case.write_key == "preconditioned":
        d = 0.5 + 1.5 * torch.rand(B, TN, H, K, generator=gen, dtype=torch.float64)
        args["write_key"] = d * k
    elif case.write_key == "untied":
        args["write_key"] = F.normalize(randn(B, TN, H, K), dim=-1)
    if case.initial_state:
        args["initial_state"] = randn(B, H, K, V)
    out = {}
    for name, val in args.items():
        if isinstance(val, torch.Tensor):
            val = val.to(device=device, dtype=dtype if name != "initial_state" else torch.float64 if dtype == torch.float64 else torch.float32)
            val = val.detach().requires_grad_(requires_grad)
        out[name] = val
    return out


def tensor_args(inputs: dict) -> dict[str, torch.Tensor]:
    """The differentiable inputs of a case (everything that should receive a gradient)."""
    return {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor) and v.requires_grad}
